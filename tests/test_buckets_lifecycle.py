"""GradBuckets and the fused route where grads come and go: grads set to None, parameters
replaced, steps without grads (parameters outside the buckets: test_buckets_outside.py).
Each case runs the same loop under torch's scaler without buckets and under ours, and
compares what each call returned or raised, every parameter and the optimizer state.
(Found by tests/test_random_sequences.py.)
"""

import math
import warnings

import pytest
import torch
from _bucket_loops import bucketed as _bucketed
from _bucket_loops import outcome as _outcome
from _bucket_loops import run_both as _run_both
from _util import assert_all_same

from triton_scaler import GradBuckets, GradScaler


def test_unscale_then_zero_then_step_leaves_parameters_without_grads_alone(backend):
    build = _bucketed(lambda: [torch.nn.Parameter(torch.randn(6)),
                               torch.nn.Parameter(torch.randn(2, 3))])

    def loop(params, opt, scaler, zero_grad):
        outcomes = []
        for _ in range(2):  # the second step: momentum would move every parameter
            scaler.scale(sum(p.sum() for p in params)).backward()
            scaler.unscale_(opt)
            if outcomes:
                zero_grad()  # after unscale_: torch's optimizer sees grad None, skips all
            outcomes.append(_outcome(lambda: scaler.step(opt)))
            scaler.update()
        return outcomes

    assert _run_both(backend, build, loop) == ["ok", "ok"]


@pytest.mark.parametrize("call", ["step", "unscale_", "clip_grad_norm_"])
def test_a_disabled_scaler_leaves_parameters_without_a_gradient_alone(backend, call):
    """``GradScaler(enabled=False)`` with GradBuckets: a parameter that received no gradient
    has grad None at the step (and at the clip), as under torch's disabled scaler without
    buckets, and is not stepped on a zero view. (Found by random call sequences with
    ``enabled=False``.)"""
    build = _bucketed(lambda: [torch.nn.Parameter(torch.randn(6)),
                               torch.nn.Parameter(torch.randn(2, 3))],
                      optimizer=lambda ps: torch.optim.Adam(ps, lr=0.1))

    def loop(params, opt, scaler, zero_grad):
        outcomes = []
        for i in range(4):  # every other step, the second parameter gets no gradient
            zero_grad()
            used = params if i % 2 == 0 else params[:1]
            scaler.scale(sum((p * p).sum() for p in used)).backward()
            if call == "unscale_":
                scaler.unscale_(opt)
                outcomes.append([p.grad is None for p in params])
            elif call == "clip_grad_norm_" and isinstance(scaler, GradScaler):
                outcomes.append(scaler.clip_grad_norm_(opt, 1.0).item())
            elif call == "clip_grad_norm_":
                scaler.unscale_(opt)
                outcomes.append(torch.nn.utils.clip_grad_norm_(params, 1.0).item())
            if call == "clip_grad_norm_":  # grad None already at the clip, not only at step
                outcomes.append([p.grad is None for p in params])
            outcomes.append(_outcome(lambda: scaler.step(opt)))
            outcomes.append([p.grad is None for p in params])
            scaler.update()
        return outcomes

    assert _run_both(backend, build, loop, enabled=False)[-2:] == ["ok", [False, True]]


@pytest.mark.parametrize("clip", [False, True], ids=["step", "clip_then_step"])
@pytest.mark.parametrize("zero", ["set_to_none", "buckets"])
def test_a_step_without_grads_raises_as_torch(backend, zero, clip):
    """No grads since the zeroing: ``step`` raises as torch's, also after a clip that saw
    none (ours fused, torch's ``unscale_`` + ``clip_grad_norm_``: a 0 norm, nothing
    recorded)."""
    build = _bucketed(lambda: [torch.nn.Parameter(torch.randn(4)),
                               torch.nn.Parameter(torch.randn(3, dtype=torch.float16))])

    def loop(params, opt, scaler, zero_grad):
        scaler.scale(params[0].sum() + params[1].float().sum()).backward()
        (opt.zero_grad if zero == "set_to_none" else zero_grad)()
        norms = []
        if clip and isinstance(scaler, GradScaler):
            norms.append(scaler.clip_grad_norm_(opt, 1.0).item())
        elif clip:
            scaler.unscale_(opt)
            norms.append(torch.nn.utils.clip_grad_norm_(
                [p for p in params if p.grad is not None], 1.0).item())
        step = _outcome(lambda: scaler.step(opt))  # no grads: not even the fp16 error
        return [*norms, step, _outcome(scaler.update)]

    assert _run_both(backend, build, loop) == [0.0] * clip + [
        "AssertionError: No inf checks were recorded for this optimizer.",
        "AssertionError: No inf checks were recorded prior to update."]


def test_a_parameter_replaced_by_a_new_list_leaves_its_old_grad_out(backend):
    """The replaced parameter's grad (still a view of the bucket) holds an inf: the
    optimizer no longer holds it, so it must not skip the step."""
    build = _bucketed(lambda: [torch.nn.Parameter(torch.randn(5)),
                               torch.nn.Parameter(torch.randn(3))])

    def loop(params, opt, scaler, zero_grad):
        scaler.scale(params[0].sum() + params[1].sum() * math.inf).backward()
        new = torch.nn.Parameter(torch.randn(3))
        opt.param_groups[0]["params"] = [params[0], new]  # before the step
        params[1] = new
        scaler.scale(params[0].sum() + new.sum()).backward()
        step = _outcome(lambda: scaler.step(opt))
        scaler.update()
        return [step, scaler.get_scale(), scaler._get_growth_tracker()]

    assert _run_both(backend, build, loop) == ["ok", 8.0, 1]  # not skipped


def test_buckets_built_after_the_first_steps_are_used_from_the_next(backend):
    """The scaler has stepped the optimizer without buckets; GradBuckets built then must be
    seen at the next step: a parameter that receives no gradient keeps grad None (not its
    zeroed view), so AdamW's weight decay leaves it alone, as under torch's scaler."""
    def build(ours):
        params = [torch.nn.Parameter(torch.randn(5)), torch.nn.Parameter(torch.randn(3))]
        return params, torch.optim.AdamW(params, lr=0.1), None

    def loop(params, opt, scaler, zero_grad):
        nones = []
        for step in range(5):
            if step == 2 and isinstance(scaler, GradScaler):
                zero_grad = GradBuckets(opt).zero_
            used = params if step < 2 else params[:1]  # the second: no gradient from step 2
            loss = sum((p * (i + 1.0)).sum() for i, p in enumerate(used))
            scaler.scale(loss * (math.inf if step == 3 else 1.0)).backward()
            scaler.step(opt)
            scaler.update()
            nones.append([p.grad is None for p in params])
            (zero_grad or opt.zero_grad)()
        return [scaler.get_scale(), nones]

    expected = [8.0, [[False, False]] * 2 + [[False, True]] * 3]
    assert _run_both(backend, build, loop) == expected


@pytest.mark.parametrize("unscale_first", [False, True])
def test_fused_step_without_grads_steps_over_nothing_as_torch(backend, unscale_first):
    def build(ours):
        params = [torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(2))]
        opt = torch.optim.AdamW(params[1:], lr=0.1, fused=True)  # params[1] gets no grad
        return params, opt, opt.zero_grad

    def loop(params, opt, scaler, zero_grad):
        scaler.scale(params[0].sum()).backward()
        if unscale_first:
            scaler.unscale_(opt)
        return [_outcome(lambda: scaler.step(opt)), _outcome(scaler.update)]

    assert _run_both(backend, build, loop) == [
        "ok", "AssertionError: No inf checks were recorded prior to update."]


def test_fused_step_after_an_unscale_that_saw_no_grads_raises(backend):
    """unscale_() found no grads, backward made some since: torch's fused step fails inside
    the optimizer (found_inf is the int 0); ours raises the plain route's error instead of
    stepping with scaled grads."""
    param = torch.nn.Parameter(torch.randn(4))
    opt = torch.optim.AdamW([param], lr=0.1, fused=True)
    scaler = GradScaler("cpu", backend=backend)
    scaler.scale(torch.ones(()))  # initialises the scale
    scaler.unscale_(opt)
    scaler.scale(param.sum()).backward()
    before = param.detach().clone()
    with pytest.raises(AssertionError, match="No inf checks were recorded for this optimizer"):
        scaler.step(opt)
    assert torch.equal(param.detach(), before) and not opt.state


def test_a_parameter_replaced_in_place_is_seen_from_the_next_zero(backend):
    """``group["params"][i] = new`` keeps the list: the buckets see the replacement at the
    next buckets.zero_() (the old parameter received no gradient), as docs/buckets.md says."""
    build = _bucketed(lambda: [torch.nn.Parameter(torch.randn(5)),
                               torch.nn.Parameter(torch.randn(3))])

    def loop(params, opt, scaler, zero_grad):
        outcomes = []
        for step in range(4):
            if step == 1:
                params[1] = opt.param_groups[0]["params"][1] = torch.nn.Parameter(
                    torch.randn(3))
            inf = math.inf if step == 2 else 1.0
            scaler.scale(params[0].sum() + params[1].sum() * inf).backward()
            outcomes.append(_outcome(lambda: scaler.step(opt)))
            scaler.update()
            zero_grad()
        return outcomes + [scaler.get_scale(), params[1].grad]

    assert _run_both(backend, build, loop) == ["ok"] * 4 + [8.0, None]


def test_a_new_param_list_at_a_freed_lists_address_is_seen(backend):
    """Two list replacements in a row: CPython hands the second new list the first list's
    freed memory, so a cache keyed on the list's id would take it for the old one."""
    build = _bucketed(lambda: [torch.nn.Parameter(torch.randn(5)),
                               torch.nn.Parameter(torch.randn(3))])

    def loop(params, opt, scaler, zero_grad):
        scaler.scale(params[0].sum() + params[1].sum()).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=False)  # the buckets' views stay (nothing re-plans)
        group = opt.param_groups[0]
        group["params"] = list(group["params"])  # the first list is freed here (no cache
        params[1] = torch.nn.Parameter(torch.randn(3))  # holding it), the next takes its id
        group["params"] = [params[0], params[1]]
        scaler.scale(params[0].sum() + params[1].sum() * math.inf).backward()
        step = _outcome(lambda: scaler.step(opt))
        scaler.update()
        return [step, scaler.get_scale()]

    assert _run_both(backend, build, loop) == ["ok", 4.0]  # the new grad's inf was seen


@pytest.mark.parametrize("route", ["unscale_", "clip"])
def test_a_grad_assigned_without_autograd_is_a_gradient_at_the_step(backend, route):
    """A grad made outside autograd (assigned, as DDP writes the reduced gradient of a
    parameter this rank did not use) after ``zero_grad()`` is copied back into its view at the
    first check; it is still this iteration's gradient at the step's check, also when it is
    all zero (torch steps it: AdamW's weight decay moves the parameter)."""
    results = []
    for ours in (False, True):
        params = [torch.nn.Parameter(torch.full((3,), 2.0)) for _ in range(2)]
        opt = torch.optim.AdamW(params, lr=0.1, weight_decay=0.5)
        if ours:
            GradBuckets(opt)
        scaler = (GradScaler("cpu", backend=backend) if ours else torch.amp.GradScaler("cpu"))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (ours: the grads left their views, once)
            for _ in range(2):
                opt.zero_grad()
                scaler.scale(params[0].sum()).backward()
                params[1].grad = torch.zeros(3)  # no autograd accumulation
                if route == "unscale_":
                    scaler.unscale_(opt)
                else:
                    scaler.clip_grad_norm_(opt, 1.0) if ours else (
                        scaler.unscale_(opt), torch.nn.utils.clip_grad_norm_(params, 1.0))
                scaler.step(opt)
                scaler.update()
        results.append([p.detach().clone() for p in params])
    assert_all_same(results[1], results[0])
    assert results[0][1][0].item() != 2.0  # torch stepped it


def test_buckets_built_from_a_parameter_list_zero_and_release(backend):
    """GradBuckets over a list of parameters (no optimizer to register on): ``zero_()`` and
    ``release()`` work on the buckets alone, and an optimizer over those parameters steps as
    torch's without buckets (its scaler covers the grads per tensor)."""
    results = []
    for ours in (False, True):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(n)) for n in (5, 3)]
        buckets = GradBuckets(params) if ours else None
        opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
        scaler = GradScaler("cpu", backend=backend) if ours else torch.amp.GradScaler("cpu")
        for _ in range(2):
            buckets.zero_() if ours else opt.zero_grad()
            scaler.scale(sum((p * p).sum() for p in params)).backward()
            scaler.step(opt)
            scaler.update()
        if ours:
            buckets.release()
            assert len(buckets) == 0 and not hasattr(opt, "_triton_scaler_buckets")
        results.append([p.detach().clone() for p in params] + [p.grad for p in params])
    assert_all_same(results[1], results[0])
