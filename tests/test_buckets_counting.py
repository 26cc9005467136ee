"""The bucket check's bookkeeping: its counts of buffer writes against autograd's
accumulations around ``scaler.scale()`` (which forgets the writes no accumulation balanced
before a backward; held views with ``zero_grad(set_to_none=False)``:
test_buckets_held_views.py), its record of grads that were not their views, of grads it set
to None and of those that received a gradient, the views of grads left None zeroed (once,
and again after they were grads), the detached-grads warning, and the user's grad object
kept in ``on_detach="warn"``."""

import math
import warnings

import pytest
import torch
from _bucket_loops import bucketed, outcome, run_both
from _util import assert_all_same

from triton_scaler import GradBuckets, GradScaler, _bucket


@pytest.mark.parametrize("first_used", [True, False])
def test_a_written_view_of_an_unused_parameter_survives_another_scalers_scale(monkeypatch,
                                                                              backend,
                                                                              first_used):
    """Under DDP (``find_unused_parameters=True``) the reduced gradient of a parameter this
    rank did not use is written into its view after the backward. A second scaler's
    ``scale()`` (a second model's loss) between that backward and this scaler's step forgets
    the write for the O(1) check, not for finding such views: the parameter steps with that
    gradient, as under torch's scaler, where DDP's grad is a tensor of its own. Also when
    this rank used none of the bucket's parameters (the loss: one outside the optimizer)."""
    monkeypatch.setattr(_bucket, "_distributed", lambda: True)  # (no process group needed)
    results = []
    for ours in (False, True):
        params = [torch.nn.Parameter(torch.full((n,), 1.0)) for n in (5, 3, 2)]
        opt = torch.optim.SGD(params[:2], lr=0.5)
        if ours:
            GradBuckets(opt).zero_()
        make = (lambda: GradScaler("cpu", init_scale=4.0, backend=backend)) if ours else \
            (lambda: torch.amp.GradScaler("cpu", init_scale=4.0))
        scaler, other = make(), make()
        scaler.scale(params[0 if first_used else 2].sum()).backward()
        with torch.no_grad():  # DDP's reduced gradient, scaled
            if ours:
                params[1].grad.fill_(8.0)
            else:
                params[1].grad = torch.full((3,), 8.0)
        other.scale(torch.ones(()))
        scaler.step(opt)
        scaler.update()
        results.append([p.detach().clone() for p in params])
    assert_all_same(results[1], results[0])
    assert results[0][1].tolist() == [0.0] * 3  # 1 - 0.5 * 8 / 4


@pytest.mark.filterwarnings("ignore:.*no longer views into their GradBucket")
@pytest.mark.parametrize("how", ["None", "outside"])
def test_a_grad_that_was_not_its_view_at_the_last_check_is_looked_at_again(backend, how):
    """A middle parameter's grad is not its view at a check (``"None"``: set to None before
    a backward it takes no part in; ``"outside"``: made anew by that backward and left out
    of the bucket, ``on_detach="warn"``) while the user holds its old view. After
    ``zero_grad(set_to_none=False)`` the next backward gives it a grad outside the bucket
    and the grads are halved in place before ``unscale_``, which makes up the version bumps
    that grad did not make: only the record that it was not its view tells the scaler to
    unscale and check it."""
    build = bucketed(lambda: [torch.nn.Parameter(torch.randn(n)) for n in (41, 37, 37)],
                     on_detach="warn" if how == "outside" else "reattach")

    def loop(params, opt, scaler, zero_grad):
        held, outcomes = None, []
        for step in range(3):
            if step == 1:
                held = params[1].grad  # noqa: F841 (kept alive on purpose)
                params[1].grad = None
            used = [0, 2] if step == 1 and how == "None" else [0, 1, 2]
            scaler.scale(sum((params[i] ** 2).sum() for i in used)).backward()
            if step == 2:
                for p in params:
                    p.grad.div_(2.0)
            scaler.unscale_(opt)
            outcomes.append([None if p.grad is None else p.grad.abs().max().item()
                             for p in params])
            scaler.step(opt)
            scaler.update()
            zero_grad() if step == 0 else opt.zero_grad(set_to_none=False)
        return outcomes

    run_both(backend, build, loop)


@pytest.mark.filterwarnings("ignore:.*no longer views into their GradBucket")
def test_warn_mode_keeps_the_users_grad_object(backend):
    """``on_detach="warn"``: a grad assigned after the backward stays the user's own tensor
    object (unscaled in place on the per-tensor path), not a copy of it, and what the
    backward left in its view (inf) is zeroed: no overflow."""
    params = [torch.nn.Parameter(torch.randn(n)) for n in (5, 3, 6)]
    opt = torch.optim.SGD(params, lr=0.1)
    GradBuckets(opt, on_detach="warn").zero_()
    scaler = GradScaler("cpu", init_scale=4.0, backend=backend)
    scaler.scale(params[0].sum() + (params[1] * math.inf).sum() + params[2].sum()).backward()
    assigned = params[1].grad = torch.full((3,), 8.0)
    scaler.step(opt)
    scaler.update()
    assert params[1].grad is assigned and assigned.tolist() == [2.0] * 3
    assert scaler.get_scale() == 4.0 and scaler.skipped_steps == 0


def test_the_view_of_a_grad_left_none_is_zeroed_once(monkeypatch):
    """A parameter without gradient: its view is zeroed at the first check that finds its
    grad None (``unscale_``), not again at the step's or at the next iterations' checks while
    nothing wrote into it (``zero_grad(set_to_none=False)`` leaves None grads alone)."""
    params = [torch.nn.Parameter(torch.randn(n)) for n in (5, 3, 6)]
    opt = torch.optim.SGD(params, lr=0.1)
    GradBuckets(opt).zero_()
    scaler = GradScaler("cpu")
    zeroings = []
    real = torch._foreach_zero_
    monkeypatch.setattr(torch, "_foreach_zero_", lambda ts: (zeroings.append(len(ts)), real(ts)))
    for _ in range(3):
        scaler.scale(params[0].sum() + params[2].sum()).backward()
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=False)
    assert zeroings == [1] and params[1].grad is None


@pytest.mark.filterwarnings("ignore:.*no longer views into their GradBucket")
@pytest.mark.parametrize("zero", ["buckets.zero_()", "zero_grad(set_to_none=False)"])
@pytest.mark.parametrize("dropped_at", [(0, 1, 2, 3), (0, 2)])
def test_a_grad_the_user_sets_to_none_after_the_backward_never_counts(backend, dropped_at,
                                                                      zero):
    """The user drops one parameter's grad after the backward (``p.grad = None``, a hand-made
    freeze) at every step, or at the first and third: torch's scaler neither checks nor
    steps it. With buckets each backward still accumulates into its view, which must be
    zeroed at each check that finds the grad None, not only at the first after it went None
    nor only while it was not copied back in between (``zero_grad(set_to_none=False)``: the
    grad autograd makes at the second step goes back into its view): the inf it holds at the
    third step is no overflow."""
    build = bucketed(lambda: [torch.nn.Parameter(torch.randn(n)) for n in (5, 3, 6)])

    def loop(params, opt, scaler, zero_grad):
        outcomes = []
        for step in range(4):
            inf = math.inf if step == 2 else 1.0
            scaler.scale(params[0].sum() + (params[1] * inf).sum() + params[2].sum()).backward()
            if step in dropped_at:
                params[1].grad = None
            outcomes += [outcome(lambda: scaler.step(opt)), scaler.get_scale()]
            scaler.update()
            zero_grad() if zero == "buckets.zero_()" else opt.zero_grad(set_to_none=False)
        return outcomes + [scaler.get_scale()]

    assert run_both(backend, build, loop) == ["ok", 8.0, "ok", 8.0, "ok", 16.0, "ok", 16.0,
                                               32.0]


@pytest.mark.parametrize("on_detach", ["reattach", "warn"])
def test_the_detached_grads_warning_counts_a_grad_the_scaler_had_set_to_none(on_detach):
    """A parameter without gradient in one step (the scaler sets its grad None), then
    ``buckets.zero_()`` (every grad its view again) and ``optimizer.zero_grad()`` before the
    next backward: the user detached both grads, and the warning says so (the scaler's record
    of the grad it had set to None ends at ``zero_``: that grad is the user's again)."""
    params = [torch.nn.Parameter(torch.randn(n)) for n in (5, 3)]
    opt = torch.optim.SGD(params, lr=0.1)
    buckets = GradBuckets(opt, on_detach=on_detach)
    scaler = GradScaler("cpu")
    for step in range(2):
        buckets.zero_()
        if step == 1:
            opt.zero_grad()  # set_to_none=True
        scaler.scale(sum(p.sum() for p in params[:step + 1])).backward()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            scaler.step(opt)
        scaler.update()
    assert [str(w.message)[:48] for w in caught] == \
        ["2 gradient(s) are no longer views into their Gra"]


@pytest.mark.parametrize("route", ["unscale_", "clip"])
def test_a_grad_assigned_after_a_step_without_gradient_is_a_gradient_at_the_step(backend,
                                                                                route):
    """With ``zero_grad(set_to_none=False)``: a parameter gets no gradient at the first step
    (the scaler sets its grad None), then a grad assigned without autograd at the next two.
    The first is copied back into its view quietly (the scaler made the None) and is still
    this iteration's gradient at the step's second check (no hook recorded it); the second
    is the user's own detaching: copied back too, with a warning."""
    build = bucketed(lambda: [torch.nn.Parameter(torch.full((n,), 2.0)) for n in (5, 3)],
                      lambda ps: torch.optim.AdamW(ps, lr=0.1, weight_decay=0.5))
    warned = []

    def loop(params, opt, scaler, zero_grad):
        outcomes = []
        for step in range(3):
            opt.zero_grad(set_to_none=False)
            scaler.scale(params[0].sum()).backward()
            if step:
                params[1].grad = torch.full((3,), 0.5)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                if route == "unscale_":
                    scaler.unscale_(opt)
                elif isinstance(scaler, GradScaler):
                    scaler.clip_grad_norm_(opt, 1.0)
                else:
                    scaler.unscale_(opt)
                    torch.nn.utils.clip_grad_norm_([p for p in params if p.grad is not None],
                                                   1.0)
                scaler.step(opt)
            scaler.update()
            in_bucket = params[1].grad is not None and \
                params[1].grad.untyped_storage().data_ptr() == buffer_address(params)
            warned.append(([str(w.message)[:30] for w in caught], in_bucket))
            outcomes.append([p.grad is None for p in params])
        return outcomes

    def buffer_address(params):
        return params[0].grad.untyped_storage().data_ptr()  # ours: the bucket's buffer

    assert run_both(backend, build, loop) == [[False, True], [False, False], [False, False]]
    assert warned[:3] == [([], False), ([], True),  # ours (torch's: no warning, no bucket)
                          (["1 gradient(s) are no longer vi"], True)]
