"""Issue 15, by route: the reference backend launches no kernel; a fused step after
``unscale_`` checks nothing again; seven optimizers read their flags from views of the
scaler's flag buffer in every iteration (no device op in ``step``); gradient buckets plan
their launch once."""

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

from triton_scaler import GradScaler, ops


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


def test_gradient_buckets_plan_their_launch_once(monkeypatch):
    """Two buckets (float32, bfloat16) over six steps, overflows among them: each bucket's
    launch is planned at the first step and reused (no per-grad grouping either), and each
    step launches once per bucket: their buffers are unscaled as one flat tensor each, not
    through their parameters' views."""
    if os_interpreter_missing():
        pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1")
    from triton_scaler import _grads, kernels

    params, opt = _setup(6, True, dtypes=(torch.float32, torch.bfloat16))
    scaler = GradScaler("cpu", backend="triton", init_scale=4.0)
    counts = count_calls(monkeypatch, kernels, "plan_unscale", key="plans")
    count_calls(monkeypatch, _grads, "_groups_slow", counts, "per_grad")
    with _launches(monkeypatch) as launches:
        for step in range(6):
            opt.zero_grad(set_to_none=False)
            loss = sum((p.float() ** 2).sum() for p in params)
            scaler.scale(loss * (math.inf if step in (1, 4) else 1.0)).backward()
            scaler.step(opt)
            scaler.update()
    assert counts["plans"] == 2 and counts["per_grad"] == 0, counts
    assert launches["unscale"] == 2 * 6, launches
    assert scaler.skipped_steps == 2
