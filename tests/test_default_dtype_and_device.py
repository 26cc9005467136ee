"""torch's defaults changed by the user change nothing:

- a float64 default dtype (``torch.set_default_dtype(torch.float64)``, common in scientific
  code): the scalers' scales and overflow flags stay float32, as torch's, and every route runs
  exactly as under the float32 default;
- a default device (``torch.set_default_device("cuda")`` or ``with torch.device("cuda"):``,
  common in LLM code): the host-side work (launch plans, bucket layouts, memory checks, policy
  uploads) stays on the host. Tested with the "meta" device, on which any tensor made there by
  mistake cannot compute."""

import contextlib
import functools
import math

import pytest
import torch
from _util import assert_all_same

from triton_scaler import GradBuckets, GradScaler, ops
from triton_scaler.compat import deepspeed, megatron, mindspore

OVERFLOWS = (False, True, False, False, True, True, False, False, False, False)


@contextlib.contextmanager
def _default_dtype(dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


@pytest.fixture(params=[torch.float32, torch.float64], ids=["float32_default", "float64_default"])
def default_dtype(request):
    with _default_dtype(request.param):
        yield request.param


#: name: (make(backend), update(scaler, overflow: bool), the scale tensor)
COMPAT = {
    "deepspeed": (lambda backend: deepspeed.DynamicLossScaler(
                      2.0**8, 2, delayed_shift=2, raise_error_at_min_scale=False, device="cpu",
                      backend=backend),
                  lambda scaler, overflow: scaler.update_scale(overflow),
                  lambda scaler: scaler._scale),
    "megatron": (lambda backend: megatron.DynamicGradScaler(
                     2.0**8, 1.0, 2.0, 0.5, 2, 2, device="cpu", backend=backend),
                 lambda scaler, overflow: scaler.update(overflow),
                 lambda scaler: scaler.scale),
    "mindspore": (lambda backend: mindspore.DynamicLossScaler(2.0**8, 2, 2, device="cpu",
                                                             backend=backend),
                  lambda scaler, overflow: scaler.adjust(not overflow),
                  lambda scaler: scaler.scale_value),
}


def _compat_trajectory(name, backend):
    make, update, scale_of = COMPAT[name]
    scaler = make(backend)
    trajectory = []
    for overflow in OVERFLOWS:
        update(scaler, overflow)  # a host bool: the scaler's own float32 flags, no upload
        scale = scale_of(scaler)
        trajectory.append((scale.dtype, scale.item()))
    return trajectory


@pytest.mark.parametrize("name", sorted(COMPAT))
def test_compat_scalers_update_from_bools_as_under_float32(backend, name, default_dtype):
    trajectory = _compat_trajectory(name, backend)
    assert {dtype for dtype, _ in trajectory} == {torch.float32}
    assert len({scale for _, scale in trajectory}) > 1  # it backed off and grew
    assert trajectory == _float32_default(_compat_trajectory, name, backend)


def _float32_default(run, *args):
    with _default_dtype(torch.float32):
        return run(*args)


def _train_never_skipping(backend, fused):
    """Six iterations of float32 params, an inf grad in the third, with a scaler that never
    skips (skip_on_overflow=False; the inf element set back to 1 after its step): the
    found_inf handed to a fused optimizer is float32."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n, dtype=torch.float32)) for n in (7, 1, 33)]
    opt = torch.optim.SGD(params, lr=1e-2, fused=fused)
    scaler = GradScaler("cpu", init_scale=2.0**4, growth_interval=2, skip_on_overflow=False,
                        backend=backend)
    scales = []
    for step in range(6):
        scaler.scale(sum((p * p).sum() for p in params)).backward()
        if step == 2:
            params[-1].grad[-1] = float("inf")
        scaler.step(opt)
        if step == 2:
            assert params[-1][-1].item() == -float("inf")  # stepped
            params[-1].data[-1] = 1.0
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
    return scales, [p.detach().clone() for p in params]


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
def test_a_scaler_that_never_skips_steps_as_under_float32(backend, fused, default_dtype):
    scales, params = _train_never_skipping(backend, fused)
    expected_scales, expected_params = _float32_default(_train_never_skipping, backend, fused)
    assert scales == expected_scales == [2.0**4, 2.0**5, 2.0**4, 2.0**4, 2.0**5, 2.0**5]
    assert_all_same(params, expected_params)


@contextlib.contextmanager
def _default_device(device):
    torch.set_default_device(device)
    try:
        yield
    finally:
        torch.set_default_device(None)


@functools.cache
def _adamw_steps_under_a_default_device() -> bool:
    """Whether torch's own AdamW (not fused), with no scaler, steps CPU parameters under the "meta"
    default device: torch 2.11's single-tensor AdamW cannot (it makes its ``step`` counter on
    the default device and reads it with ``.item()``); torch 2.13's can."""
    param = torch.nn.Parameter(torch.ones(3, device="cpu"))
    param.grad = torch.ones(3, device="cpu")
    with _default_device("meta"):
        try:
            torch.optim.AdamW([param], lr=1e-2).step()
        except RuntimeError:
            return False
    return True


def _optimizer(params, fused):
    """AdamW, except where torch's own single-tensor AdamW cannot step under a default
    device (above): there, not fused, SGD with momentum, whose state follows the grads'."""
    if fused or _adamw_steps_under_a_default_device():
        return torch.optim.AdamW(params, lr=1e-2, fused=fused)
    return torch.optim.SGD(params, lr=1e-2, momentum=0.9)


def _train(backend, buckets, fused, clip):
    """Five iterations over CPU params (an odd-sized one, the bucket's padding), an inf grad
    in the third, with hysteresis: (scales, the state_dict, params)."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n, device="cpu")) for n in (7, 1, 33)]
    opt = _optimizer(params, fused)
    if buckets:
        GradBuckets(opt)
    scaler = GradScaler("cpu", init_scale=2.0**4, growth_interval=2, hysteresis=2,
                        backend=backend)
    skipped = scaler.last_step_skipped  # before the first step
    assert (skipped.device, skipped.dtype) == (torch.device("cpu"), torch.bool)
    scales = []
    for step in range(5):
        scaler.scale(sum((p * p).sum() for p in params)).backward()
        if step == 2:
            params[-1].grad[-1] = math.inf
        if clip:
            scaler.clip_grad_norm_(opt, 1.0)
        scaler.step(opt)
        scaler.set_growth_factor(2.0 + step % 2)  # the policy's upload
        scaler.update()
        opt.zero_grad(set_to_none=not buckets)
        scales.append(scaler.get_scale())
    return scales, scaler.state_dict(), [p.detach().clone() for p in params]


@pytest.mark.parametrize("clip", [False, True], ids=["unscale", "clip"])
@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
@pytest.mark.parametrize("buckets", [False, True], ids=["grads", "buckets"])
def test_a_default_device_leaves_the_host_work_on_the_host(backend, buckets, fused, clip):
    expected = _train(backend, buckets, fused, clip)
    with _default_device("meta"):
        actual = _train(backend, buckets, fused, clip)
    assert actual[:2] == expected[:2]
    assert expected[0][2] == expected[0][1]  # the overflow was skipped, held off by hysteresis
    assert (expected[1]["skipped_steps"], expected[1]["_hysteresis_tracker"]) == (1, 2)
    assert_all_same(actual[2], expected[2])


def test_the_ops_under_a_default_device_are_torchs(backend):
    """Interleaved views of one buffer (the memory check's element offsets), an odd-sized
    and an empty grad, a non-finite element: as torch's op."""
    def grads_of(buffer):
        return [buffer[0:40:2], buffer[1:41:2], buffer[41:].view(3, 3)[:, :2], buffer[:0]]

    theirs = torch.arange(50, dtype=torch.float32, device="cpu")
    theirs[48] = math.nan  # the last element of the last non-empty grad
    ours = theirs.clone()
    found_theirs = torch.zeros((), device="cpu")
    torch._amp_foreach_non_finite_check_and_unscale_(grads_of(theirs), found_theirs,
                                                     torch.full((), 0.25, device="cpu"))
    found = torch.zeros((), device="cpu")
    with _default_device("meta"):
        ops.non_finite_check_and_unscale_(grads_of(ours), found,
                                          torch.full((), 0.25, device="cpu"), backend=backend)
        finite = ops.all_finite(grads_of(ours)[:2], backend=backend)
    assert_all_same([ours, found], [theirs, found_theirs])
    assert found.item() == 1.0
    assert finite.device == torch.device("cpu") and finite.item()
