"""GradBuckets where the user writes into a grad view or keeps views alive while grads come
and go: the O(1) bucket check must never take a grad outside the bucket for one inside it.
Each case runs the same loop under torch's scaler without buckets and under ours and
compares every call's outcome, every parameter and the optimizer state. (Found by
tests/test_random_clip.py.)"""

import math
import warnings

import pytest
import torch
from _bucket_loops import bucketed, outcome, run_both

from triton_scaler import GradBuckets, GradScaler


@pytest.mark.parametrize("route", ["unscale_", "clip_inf", "clip_2", "fused"])
@pytest.mark.parametrize("written", [math.inf, math.nan, 1e3])
def test_what_is_written_into_the_view_of_a_parameter_without_gradient_does_not_count(
        backend, route, written):
    """With buckets, a parameter that received no gradient still shows its (zero) view as
    ``.grad`` until the scaler sets it to None; torch's grad is None there. A value written
    into that view (gradient-processing code over every ``p.grad``) is no grad: it must not
    flag an overflow, enter the clip's norm or reach the parameter (found by a random sweep
    of clip_grad_norm_ with GradBuckets)."""
    fused = route == "fused"
    build = bucketed(lambda: [torch.nn.Parameter(torch.randn(n)) for n in (5, 4099, 3, 33)],
                      lambda ps: torch.optim.AdamW(ps, lr=0.1, fused=fused))

    def loop(params, opt, scaler, zero_grad):
        outcomes = []
        for step in range(3):
            used = (0, 1, 3) if step == 1 else (0, 1, 2, 3)  # step 1: the third unused
            scaler.scale(sum((params[i] * params[i]).sum() for i in used)).backward()
            if params[2].grad is not None and step == 1:  # ours only: torch's is None
                params[2].grad.view(-1)[-1] = written
            if route == "unscale_":
                scaler.unscale_(opt)
            elif route != "fused":
                norm_type = math.inf if route == "clip_inf" else 2.0
                if isinstance(scaler, GradScaler):
                    norm = scaler.clip_grad_norm_(opt, 1e9, norm_type)
                else:
                    scaler.unscale_(opt)
                    norm = torch.nn.utils.clip_grad_norm_(
                        [p for p in params if p.grad is not None], 1e9, norm_type)
                outcomes.append(float(f"{norm.item():.6g}"))  # the Triton 2-norm's order
            scaler.step(opt)
            scaler.update()
            outcomes.append((scaler.get_scale(), [p.grad is None for p in params]))
            zero_grad()
        return outcomes

    outcomes = [o for o in run_both(backend, build, loop) if isinstance(o, tuple)]
    assert outcomes[1] == (16.0, [False, False, True, False])  # step 1 not skipped


def _held_view_loop(sizes, unused, held, zeros):
    """(build, loop) for run_both: parameter ``unused`` takes no part in step 1; from step
    ``held[0]`` the user keeps parameter ``held[1]``'s grad alive; after step k,
    ``zeros[k]``: "default" (ours ``buckets.zero_()``, torch ``zero_grad()``), "none" or
    "keep" (``optimizer.zero_grad(set_to_none=True / False)``). Each step's outcome: every
    grad's max after ``unscale_`` (None for no grad)."""
    build = bucketed(lambda: [torch.nn.Parameter(torch.randn(n)) for n in sizes])

    def loop(params, opt, scaler, zero_grad):
        kept, outcomes = None, []  # noqa: F841 (kept alive on purpose)
        for step, zero in enumerate(zeros):
            used = [i for i in range(len(params)) if step != 1 or i != unused]
            scaler.scale(sum((params[i] * params[i]).sum() for i in used)).backward()
            if step == held[0]:
                kept = params[held[1]].grad  # noqa: F841 (ours: its view)
            scaler.unscale_(opt)
            outcomes.append([None if p.grad is None else p.grad.abs().max().item()
                             for p in params])
            scaler.step(opt)
            scaler.update()
            if zero == "default":
                zero_grad()
            else:
                opt.zero_grad(set_to_none=zero == "none")
        return outcomes
    return build, loop


def test_a_held_view_does_not_hide_a_grad_the_scaler_set_to_none(backend):
    """The user holds a grad (a loop variable, a list for logging); the parameter then takes
    no part in a step (the scaler sets its grad None), ``zero_grad(set_to_none=False)`` keeps
    None, and the next backward gives it a new grad outside the bucket. The held view keeps
    the storage's count of live views as before: the scaler must still see the new grad and
    unscale it (found by a random sweep of clip_grad_norm_ with GradBuckets)."""
    outcomes = run_both(backend, *_held_view_loop((5, 37), 0, (1, 0),
                                                  ["default", "keep", "keep", "keep"]))
    assert outcomes[1][0] is None and outcomes[2][0] is not None


@pytest.mark.filterwarnings("ignore:.*no longer views into their GradBucket")
@pytest.mark.parametrize("n_params", [1, 3])
def test_grads_replaced_while_a_list_holds_the_old_views_are_seen(backend, n_params):
    """``zero_grad()`` (set_to_none=True) detaches every view while a list made after
    ``unscale_`` (for logging) holds them into the next step: the storage then counts as many
    live views as before, but every grad is new. The scaler must still unscale them (it
    copies them back into the bucket and warns)."""
    build = bucketed(lambda: [torch.nn.Parameter(torch.randn(5 + i)) for i in range(n_params)])

    def loop(params, opt, scaler, zero_grad):
        logged, outcomes = None, []  # noqa: F841 (kept alive on purpose)
        for _ in range(3):
            scaler.scale(sum((p * p).sum() for p in params)).backward()
            scaler.unscale_(opt)
            outcomes.append([p.grad.abs().max().item() for p in params])
            logged = [p.grad for p in params]  # noqa: F841
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        return outcomes

    run_both(backend, build, loop)


@pytest.mark.filterwarnings("ignore:.*no longer views into their GradBucket")
@pytest.mark.parametrize("how", ["data", "set_"])
def test_a_grad_whose_memory_was_replaced_is_copied_back(backend, how):
    """``p.grad.data = t`` or ``p.grad.set_(t)`` on a bucket view leaves a tensor that is
    still a view object of the bucket but holds other memory: its values are the gradient, as
    torch's optimizer uses them (copied back into the bucket, with a warning), not DDP's
    bucket views (the error for those). Found by random sequences with such changes."""
    build = bucketed(lambda: [torch.nn.Parameter(torch.randn(5)),
                              torch.nn.Parameter(torch.randn(2, 3))])

    def loop(params, opt, scaler, zero_grad):
        outcomes = []
        for step in range(3):
            zero_grad()
            scaler.scale(sum((p * p).sum() for p in params)).backward()
            grad = params[step % 2].grad
            if how == "data":
                grad.data = grad.clone() * 3
            else:
                grad.set_(grad.clone() * 3)
            outcomes.append(outcome(lambda: scaler.step(opt)))
            scaler.update()
        return outcomes

    assert run_both(backend, build, loop) == ["ok"] * 3


def test_zero_gives_back_the_view_of_a_grad_the_scaler_set_to_none(backend):
    """A middle parameter takes no part in a step (the scaler sets its grad None) while the
    user holds its old view; ``buckets.zero_()`` must give it its view back, or the next
    backward makes it a new grad outside the bucket that the O(1) check, fooled by the held
    view, would leave scaled (found by the random clip sweep)."""
    outcomes = run_both(backend, *_held_view_loop((41, 37, 37), 1, (0, 1), ["default"] * 3))
    assert outcomes[1][1] is None


@pytest.mark.parametrize("how", ["zero_grad()", "no gradient"])
def test_zero_gives_every_grad_its_view_back(how):
    """``buckets.zero_()`` after grads left their views, while the user holds a middle
    grad's view: ``optimizer.zero_grad()`` (every grad None; the last check saw them all in
    place), or a step in which that middle parameter had no gradient (the scaler set its
    grad None; the storage's count and the first and last grads look as if all were in
    place). Every grad is its view again, so the next backward accumulates into the bucket:
    no detached-grad warning."""
    params = [torch.nn.Parameter(torch.randn(n)) for n in (41, 37, 37)]
    opt = torch.optim.SGD(params, lr=0.1)
    buckets = GradBuckets(opt)
    (bucket,) = buckets.buckets
    scaler = GradScaler("cpu")
    held = params[1].grad  # noqa: F841 (kept alive on purpose)
    used = params if how == "zero_grad()" else params[::2]
    scaler.scale(sum((p * p).sum() for p in used)).backward()
    scaler.step(opt)
    scaler.update()
    if how == "zero_grad()":
        opt.zero_grad()
    buckets.zero_()
    assert [p.grad.data_ptr() for p in params] == [bucket.view(i).data_ptr() for i in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scaler.scale(sum((p * p).sum() for p in params)).backward()
        scaler.step(opt)


@pytest.mark.filterwarnings("ignore:.*no longer views into their GradBucket")
@pytest.mark.parametrize("zero", ["buckets.zero_()", "zero_grad(set_to_none=False)"])
@pytest.mark.parametrize("accumulate", [1, 3])
def test_a_middle_grad_set_to_none_while_its_view_is_held_is_seen(backend, accumulate, zero):
    """The user sets a middle parameter's grad to None before the backward while holding its
    old view: the storage keeps its count of live views and the first and last grads are
    views, but the backward's accumulation made a new grad, which does not bump the buffer's
    version as an accumulation into a view does. The scaler must unscale it, also when the
    grads were zeroed in place by ``zero_grad(set_to_none=False)`` (one version bump each,
    as many as the accumulations into views would make: ``scale()`` forgets them), and with
    gradient accumulation in which it takes part in the first backward only (the shortfall
    that backward left must outlast the next ``scale()``)."""
    build = bucketed(lambda: [torch.nn.Parameter(torch.randn(n)) for n in (41, 37, 37)])

    def loop(params, opt, scaler, zero_grad):
        held, outcomes = None, []
        for step in range(3):
            if step and zero != "buckets.zero_()":
                opt.zero_grad(set_to_none=False)
            if step == 1:
                held = params[1].grad  # noqa: F841 (kept alive on purpose)
                params[1].grad = None
            for k in range(accumulate):
                scaler.scale(sum((p * p).sum() for i, p in enumerate(params)
                                 if k == 0 or i != 1)).backward()
            scaler.unscale_(opt)
            outcomes.append([p.grad.abs().max().item() for p in params])
            scaler.step(opt)
            scaler.update()
            if zero == "buckets.zero_()":
                zero_grad()
        return outcomes

    run_both(backend, build, loop)


@pytest.mark.filterwarnings("ignore:.*no longer views into their GradBucket")
def test_a_grad_left_none_is_seen_when_a_later_backward_makes_it(backend):
    """A held view, ``zero_grad()`` (views detached), a step in which one parameter takes no
    part (its grad stays None), then ``zero_grad(set_to_none=False)`` (the others zeroed in
    place: version bumps as accumulations would make) and a step that gives it a new grad
    outside the bucket: the held view keeps the storage's count, the first and last grads
    are views, so only knowing that its grad was None at the last check finds it (found by
    the random clip sweep)."""
    outcomes = run_both(backend, *_held_view_loop((41, 37, 20, 37), 2, (0, 1),
                                                  ["none", "keep", "keep"]))
    assert outcomes[1][2] is None


def test_a_grad_the_scaler_set_to_none_and_autograd_made_again_is_taken_back_quietly(backend):
    """A parameter without gradient in one step (the scaler sets its grad None, as torch's
    zero_grad() would have left it), then used again with ``zero_grad(set_to_none=False)``
    in between instead of ``buckets.zero_()``: autograd makes it a new grad, which goes back
    into its view without the detached-grad warning (nothing of the user's was detached)."""
    build = bucketed(lambda: [torch.nn.Parameter(torch.randn(n)) for n in (5, 3)])

    def loop(params, opt, scaler, zero_grad):
        outcomes = []
        for step in range(3):
            used = params if step != 1 else params[:1]
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # no warning on either side
                scaler.scale(sum((p * (i + 1.0)).sum() for i, p in enumerate(used))).backward()
                scaler.step(opt)
                scaler.update()
            outcomes.append([scaler.get_scale()] + [p.grad is None for p in params])
            zero_grad() if step == 0 else opt.zero_grad(set_to_none=False)
        return outcomes

    assert [o[1:] for o in run_both(backend, build, loop)] == [[False, False], [False, True],
                                                               [False, False]]
