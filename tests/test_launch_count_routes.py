"""Launches by route: the reference backend launches no kernel; a fused step after
``unscale_`` checks nothing again; seven optimizers read their flags from views of the
scaler's flag buffer in every iteration (no device op in ``step``); gradient buckets plan
their launch once, and the parameters outside them are laid out once per parameter layout."""

import math

import pytest
import torch
from _launch_counting import (
    _launches,
    _Ops,
    _setup,
    _uncounted,
    count_calls,
    os_interpreter_missing,
)
from _util import assert_all_same

from triton_scaler import GradBuckets, GradScaler, _grads, _plans, ops


@pytest.mark.parametrize("buckets", [False, True])
def test_the_reference_backend_launches_no_kernel(monkeypatch, buckets):
    """backend="reference" (CPU users, the tests' oracle) runs torch's ops only: its unscale,
    step and update launch no Triton kernel, nor does ``ops.update_scale_`` on it."""
    params, opt = _setup(5, buckets)
    scaler = GradScaler("cpu", backend="reference", init_scale=4.0, hysteresis=2)
    with _launches(monkeypatch) as counts:
        for overflow in (False, True, False):
            opt.zero_grad(set_to_none=False)
            loss = sum((p ** 2).sum() for p in params) * (math.inf if overflow else 1.0)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        ops.update_scale_(torch.full((), 2.0), torch.zeros((), dtype=torch.int32),
                          torch.ones(()), 2.0, 0.5, 1, backend="reference")
    assert not counts, counts
    assert scaler.skipped_steps == 1


@pytest.mark.parametrize("call", ["unscale_", "clip_grad_norm_"])
def test_a_fused_step_after_unscale_checks_nothing_again(monkeypatch, call):
    """The common fused recipe, ``unscale_`` (or the clip) then a fused optimizer's step:
    the step launches nothing: torch's scaler checks only an optimizer not yet unscaled
    (a second check would read every grad again)."""
    if os_interpreter_missing():
        pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1")
    params, opt = _setup(6, False, fused=True, dtypes=(torch.float32, torch.bfloat16))
    scaler = GradScaler("cpu", backend="triton", init_scale=4.0)
    with _launches(monkeypatch) as counts:
        for _ in range(2):
            opt.zero_grad()
            scaler.scale(sum((p.float() ** 2).sum() for p in params)).backward()
            getattr(scaler, call)(opt, *([1e9] if call == "clip_grad_norm_" else []))
            counts.clear()
            scaler.step(opt)
            assert not counts, counts
            scaler.update()
    assert scaler._scale.item() == 4.0 and not scaler.last_step_skipped.item()


def test_seven_optimizers_step_on_views_of_the_flag_buffer_every_iteration(backend):
    """The scaler's 8 found_inf slots serve 7 optimizers of their own (the last collects the
    rest), taken again each iteration: in the third iteration too, ``step`` of each of 7
    optimizers reads (scale, its flag) from the buffer with no device op (no stack)."""
    params = [torch.nn.Parameter(torch.full((3,), float(i + 1))) for i in range(7)]
    opts = [torch.optim.SGD([p], lr=0.1) for p in params]
    for opt in opts:
        opt.step = _uncounted(opt.step)
    scaler = GradScaler("cpu", backend=backend)
    for _ in range(3):
        scaler.scale(sum((p * p).sum() for p in params)).backward()
        for opt in opts:
            scaler.unscale_(opt)
        with _Ops() as mode:
            for opt in opts:
                scaler.step(opt)
        scaler.update()
        for opt in opts:
            opt.zero_grad()
        assert not mode.ops, mode.ops


@pytest.mark.parametrize("dtypes", [(torch.float32,), (torch.float32, torch.bfloat16)])
@pytest.mark.filterwarnings("ignore:.*no longer views into their GradBucket")
def test_gradient_buckets_plan_their_launch_once(monkeypatch, dtypes):
    """One bucket holding every parameter, or two (float32, bfloat16), over six steps,
    overflows among them: each bucket's launch is planned at the first step and reused (no
    per-grad grouping either, also at the step whose grads ``zero_grad(set_to_none=True)``
    detached: copied back, the bucket holds them all again), and each step launches once
    per bucket: their buffers are unscaled as one flat tensor each, not through their
    parameters' views."""
    if os_interpreter_missing():
        pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1")
    params, opt = _setup(6, True, dtypes=dtypes)
    scaler = GradScaler("cpu", backend="triton", init_scale=4.0)
    counts = count_calls(monkeypatch, _plans, "plan_unscale", key="plans")
    count_calls(monkeypatch, _grads, "_groups_slow", counts, "per_grad")
    with _launches(monkeypatch) as launches:
        for step in range(6):
            opt.zero_grad(set_to_none=step == 3)
            loss = sum((p.float() ** 2).sum() for p in params)
            scaler.scale(loss * (math.inf if step in (1, 4) else 1.0)).backward()
            scaler.step(opt)
            scaler.update()
    assert counts["plans"] == len(dtypes) and counts["per_grad"] == 0, counts
    assert launches["unscale"] == len(dtypes) * 6, launches
    assert scaler.skipped_steps == 2


def _train_partly_bucketed(scaler, ours, steps=6, replace_at=3):
    """SGD over four parameters: the buckets hold the first two; the third was frozen when
    they were built, the fourth joins in a new group. The third is replaced in place in its
    group's list at ``replace_at``; overflows at steps 1 and 4."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n)) for n in (5, 9, 3, 4)]
    params[2].requires_grad_(False)
    opt = torch.optim.SGD(params[:3], lr=0.1, momentum=0.9)
    if ours:
        GradBuckets(opt)
    params[2].requires_grad_(True)
    opt.add_param_group({"params": [params[3]]})
    for step in range(steps):
        if step == replace_at:
            params[2] = opt.param_groups[0]["params"][2] = torch.nn.Parameter(torch.randn(3))
        opt.zero_grad(set_to_none=False)
        loss = sum((p * (i + 1.0)).square().sum() for i, p in enumerate(params))
        scaler.scale(loss * (math.inf if step in (1, 4) else 1.0)).backward()
        scaler.step(opt)
        scaler.update()
    return [torch.tensor(scaler.get_scale())] + [p.detach().clone() for p in params]


def test_parameters_outside_the_buckets_are_laid_out_once_per_parameter_layout(
        monkeypatch, backend):
    """With parameters both in gradient buckets and outside them, the scaler's view of the
    optimizer (which grads are outside, grouped how) is built at the first step and again
    only when a parameter outside the buckets is replaced in place in its list (checked by
    identity each step), never per step; a bucket's launch is planned then only, the outside
    grads' at each step (from the grads it reads), and no step groups grads one by one."""
    counts = count_calls(monkeypatch, _grads, "_Layout", key="layouts")
    count_calls(monkeypatch, _plans, "plan_unscale", counts, "plans")
    count_calls(monkeypatch, _grads, "_groups_slow", counts, "per_grad")
    actual = _train_partly_bucketed(GradScaler("cpu", backend=backend, init_scale=4.0), True)
    expected = _train_partly_bucketed(torch.amp.GradScaler("cpu", init_scale=4.0), False)
    assert_all_same(actual, expected)
    plans = 2 + 6 if backend == "triton" else 0  # the bucket's per layout, then per step
    assert (counts["layouts"], counts["plans"], counts["per_grad"]) == (2, plans, 0), counts
