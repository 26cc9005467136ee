"""GradScaler.clip_grad_norm_'s arguments and grad dtypes at their edges: what it refuses
(naming the argument, grads untouched) and what it takes as torch's unscale_ +
clip_grad_norm_ takes it (max_norm 0, norm_type "inf" / int, float64 grads), with torch's
result, on both backends (Triton through the interpreter)."""

import math

import pytest
import torch
from _util import assert_all_same, assert_same

from triton_scaler import GradScaler

SCALE = 2.0**10


def _pair(backend, dtypes, seed=0, enabled=True):
    """(ours, theirs): parameters with the same scaled grads, one per dtype, each side with
    an SGD and a scaler (ours; torch's) that has scaled a loss."""
    gen = torch.Generator().manual_seed(seed)
    sides = []
    fulls = [torch.randn(n, generator=gen, dtype=torch.float64).to(dtype)
             for n, dtype in zip((7, 4099, 33), dtypes)]
    grads = [(torch.randn(f.shape, generator=gen, dtype=torch.float64) * SCALE).to(f.dtype)
             for f in fulls]
    for scaler in (GradScaler("cpu", init_scale=SCALE, backend=backend, enabled=enabled),
                   torch.amp.GradScaler("cpu", init_scale=SCALE, enabled=enabled)):
        params = [torch.nn.Parameter(f.clone()) for f in fulls]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        scaler.scale(torch.ones(()))
        sides.append((params, torch.optim.SGD(params, lr=0.1), scaler))
    return sides


def _torchs_clip(theirs, max_norm, norm_type, error_if_nonfinite=False):
    params, opt, scaler = theirs
    scaler.unscale_(opt)
    return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(max_norm=-1.0), ValueError, "max_norm must be a number >= 0"),
    (dict(max_norm=math.nan), ValueError, "max_norm must be a number >= 0"),
    (dict(max_norm="1"), TypeError, "max_norm must be a number"),
    (dict(max_norm=None), TypeError, "max_norm must be a number; got NoneType None"),
    (dict(max_norm=True), TypeError, "max_norm must be a number"),
    (dict(max_norm=1.0, norm_type=0.0), ValueError, "norm_type must be > 0"),
    (dict(max_norm=1.0, norm_type=-2), ValueError, "norm_type must be > 0"),
    (dict(max_norm=1.0, norm_type=math.nan), ValueError, "norm_type must be > 0"),
    (dict(max_norm=1.0, norm_type=None), TypeError, "norm_type must be a number; got NoneType"),
    (dict(max_norm=1.0, norm_type="max"), TypeError,
     "max_norm must be a number and norm_type a number or 'inf'; got max_norm=1.0, "
     "norm_type='max'"),
    (dict(max_norm=1.0, error_if_nonfinite="yes"), TypeError, "error_if_nonfinite must be"),
    (dict(max_norm=1.0, sharded=1), TypeError,
     "sharded must be True, False, None or a torch.distributed.ProcessGroup; got 1"),
    (dict(max_norm=1.0, sharded=True), ValueError, "sharded=True sums the norm over the "
     "scaler's process_group, and this GradScaler has none"),
])
def test_bad_arguments(backend, kwargs, error, match):
    (params, opt, scaler), _ = _pair(backend, [torch.float32] * 3)
    before = [p.grad.clone() for p in params]
    with pytest.raises(error, match=match):
        scaler.clip_grad_norm_(opt, **kwargs)
    assert_all_same([p.grad for p in params], before)
    scaler.unscale_(opt)  # nothing was recorded


@pytest.mark.parametrize("max_norm, norm_type", [
    (0.0, 2.0), (0, "inf"), (0.5, "INF"), (0.5, 2), (0.5, math.inf), (1e30, 2.0)])
def test_edge_arguments_clip_as_torch(backend, max_norm, norm_type):
    """max_norm 0 zeroes the grads; "inf" in any case is the inf norm (fused); an int
    norm_type is its float; error_if_nonfinite=True with a finite norm clips as without."""
    ours, theirs = _pair(backend, [torch.float32] * 3)
    expected = _torchs_clip(theirs, max_norm, norm_type, error_if_nonfinite=True)
    total = ours[2].clip_grad_norm_(ours[1], max_norm, norm_type, error_if_nonfinite=True)
    if backend == "reference":  # torch's own norm arithmetic
        assert_same(total, expected)
        assert_all_same([p.grad for p in ours[0]], [p.grad for p in theirs[0]])
    else:  # the kernels' sum of squares may differ from torch's in its last bit
        torch.testing.assert_close(total, expected, rtol=1e-6, atol=0)
        for mine, their in zip(ours[0], theirs[0]):
            torch.testing.assert_close(mine.grad, their.grad, rtol=1e-6, atol=0)
    if max_norm == 0:
        assert all(not p.grad.any() for p in ours[0])


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
@pytest.mark.parametrize("dtypes", [(torch.float64,) * 3,
                                    (torch.float32, torch.float64, torch.float32)],
                         ids=["fp64", "fp32+fp64"])
def test_float64_grads_are_clipped_by_the_float64_norm(backend, norm_type, dtypes):
    """Torch's norm is float64 once any grad is float64, and so is its clip coefficient. The
    returned norm is float32 (documented), but the coefficient is formed from the float64
    norm: one formed from the float32 norm is off by ~1e-8 in the float64 grads."""
    ours, theirs = _pair(backend, dtypes, seed=1)
    expected = _torchs_clip(theirs, 0.5, norm_type)
    total = ours[2].clip_grad_norm_(ours[1], 0.5, norm_type)
    assert expected.dtype == torch.float64 and total.dtype == torch.float32
    if backend == "reference":  # torch's arithmetic, op for op
        assert_same(total, expected.float())
        assert_all_same([p.grad for p in ours[0]], [p.grad for p in theirs[0]])
    else:  # the kernels' sums of squares, float32 for float32 grads, differ from torch's
        # in their last bits: within float64 ulps with float64 grads only, float32 ulps else
        rtol = 1e-13 if set(dtypes) == {torch.float64} else 1e-6
        torch.testing.assert_close(total, expected.float(), rtol=1e-6, atol=0)
        for mine, their in zip(ours[0], theirs[0]):
            torch.testing.assert_close(mine.grad, their.grad, rtol=rtol, atol=0)
    for side in (ours, theirs):
        side[2].step(side[1])
        side[2].update()
    assert ours[2].get_scale() == theirs[2].get_scale() == SCALE


@pytest.mark.parametrize("norm_type", [2.0, math.inf, 3.0])
def test_a_disabled_scaler_clips_as_torchs_clip(backend, norm_type):
    """A disabled scaler's clip is torch's clip_grad_norm_ (a bf16 grad's norm in bf16, not
    accumulated in float32 as the enabled scaler's), its norm returned as float32."""
    ours, theirs = _pair(backend, (torch.bfloat16, torch.float32, torch.float64), seed=2,
                         enabled=False)
    expected = torch.nn.utils.clip_grad_norm_(theirs[0], 0.5, norm_type)
    total = ours[2].clip_grad_norm_(ours[1], 0.5, norm_type)
    assert_same(total, expected.float())
    assert_all_same([p.grad for p in ours[0]], [p.grad for p in theirs[0]])
