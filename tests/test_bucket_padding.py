"""A gradient bucket's alignment padding after an unscale by an ``inv_scale`` that is not finite.

A scale of 0, NaN or 2**-128 and below (reached by backing off with torch's default
``min_scale=0``, or set with ``update(new_scale=tensor)``) has no finite float32 reciprocal:
the unscale turns the padding's zeros into NaN (0 * inf). The step is skipped either way, but
a padding left NaN would be found again in every later iteration, also after the user resets
the scale: every step skipped from then on, where torch's scaler recovers. Both backends,
against torch's scaler without buckets, compared exactly.

The same for the views of parameters that received no gradient, multiplied by a NaN clip
coefficient."""

import math
import warnings

import pytest
import torch
from _util import assert_all_same

from triton_scaler import GradBuckets, GradScaler

RESET_SCALE = 1024.0


def _train(scaler, *, buckets: bool, route: str, zero: str, bad_scale: float,
           device: str = "cpu"):
    """Six iterations; after the second the scale is set to ``bad_scale``, and after the
    third (an overflow, unscaled by a reciprocal that is not finite) back to ``RESET_SCALE``.
    Returns
    the scale after each iteration and the parameters."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n).to(device)) for n in (7, 33, 130)]
    if device == "cpu":  # a bf16 bucket too (torch's CUDA op takes no bf16 grads)
        params.append(torch.nn.Parameter(torch.randn(5).bfloat16()))
    opt = torch.optim.AdamW(params, lr=1e-2, fused=route == "fused_after_unscale")
    grad_buckets = GradBuckets(opt) if buckets else None
    gen = torch.Generator().manual_seed(1)
    trajectory = []
    for it in range(6):
        loss = sum((p.float() * torch.randn(p.shape, generator=gen).to(device)).sum()
                   for p in params)
        # the iteration with the bad scale also overflows: torch's op checks only its inputs
        # and would step with the products' NaN (triton_scaler skips: docs/buckets.md)
        scaler.scale(loss * (math.inf if it == 2 else 1.0)).backward()
        if route != "plain":
            scaler.unscale_(opt)
        if route == "check_after_unscale":  # an integrator's check after the user's unscale_
            scaler._check_inf_per_device(opt)
        if route != "unscale_without_step" or it != 2:
            scaler.step(opt)
        new_scale = {1: torch.tensor(bad_scale, device=device), 2: RESET_SCALE}.get(it)
        scaler.update(new_scale)
        trajectory.append(scaler.get_scale())
        if zero == "buckets.zero_" and grad_buckets is not None:
            grad_buckets.zero_()
        else:
            opt.zero_grad(set_to_none=zero == "set_to_none=True")
    return trajectory, [p.detach().clone() for p in params]


@pytest.mark.parametrize("bad_scale", [0.0, 2.0**-130, math.nan], ids=["0", "2^-130", "nan"])
@pytest.mark.parametrize("route", ["plain", "fused_after_unscale", "unscale_without_step"])
@pytest.mark.parametrize("zero", ["buckets.zero_", "set_to_none=False", "set_to_none=True"])
def test_training_recovers_as_torchs_after_the_scale_is_reset(backend, bad_scale, route, zero):
    kwargs = dict(init_scale=2.0**12, growth_interval=2)
    expected = _train(torch.amp.GradScaler("cpu", **kwargs), buckets=False, route=route,
                      zero=zero, bad_scale=bad_scale)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # set_to_none=True with buckets warns once
        actual = _train(GradScaler("cpu", backend=backend, **kwargs), buckets=True,
                        route=route, zero=zero, bad_scale=bad_scale)
    after_reset = expected[0][2:]  # torch's: no more overflows, the scale grows
    assert after_reset[0] == RESET_SCALE and after_reset == sorted(after_reset) and \
        after_reset[-1] > RESET_SCALE
    assert actual[0][:1] + actual[0][2:] == expected[0][:1] + expected[0][2:]
    assert math.isnan(bad_scale) or actual[0][1] == expected[0][1]
    assert_all_same(actual[1], expected[1])


def _overriding_unscale_grads(base):
    class OverridingUnscaleGrads(base):
        def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
            return super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
    return OverridingUnscaleGrads


@pytest.mark.parametrize("bad_scale", [0.0, math.nan], ids=["0", "nan"])
@pytest.mark.parametrize("override", [False, True], ids=["ours", "overriding_unscale_grads"])
def test_a_check_after_the_unscale_leaves_the_padding_to_be_rezeroed(backend, bad_scale,
                                                                      override):
    """``_check_inf_per_device`` after ``unscale_`` (through a subclass overriding
    ``_unscale_grads_``: an unscale by 1.0, which leaves a NaN padding NaN) must not drop the
    unscale's record of the padding it wrote: training recovers as torch's."""
    kwargs = dict(init_scale=2.0**12, growth_interval=2)
    wrap = _overriding_unscale_grads if override else (lambda base: base)
    args = dict(route="check_after_unscale", zero="set_to_none=False", bad_scale=bad_scale)
    expected = _train(wrap(torch.amp.GradScaler)("cpu", **kwargs), buckets=False, **args)
    actual = _train(wrap(GradScaler)("cpu", backend=backend, **kwargs), buckets=True, **args)
    assert actual[0][:1] + actual[0][2:] == expected[0][:1] + expected[0][2:]
    assert expected[0][-1] > RESET_SCALE
    assert_all_same(actual[1], expected[1])


@pytest.mark.parametrize("route", ["plain", "fused_after_unscale"])
def test_training_recovers_as_torchs_on_the_gpu(cuda, route):
    kwargs = dict(init_scale=2.0**12, growth_interval=2)
    args = dict(route=route, zero="set_to_none=False", bad_scale=0.0, device="cuda")
    expected = _train(torch.amp.GradScaler("cuda", **kwargs), buckets=False, **args)
    actual = _train(GradScaler("cuda", backend="triton", **kwargs), buckets=True, **args)
    assert actual[0] == expected[0]
    assert_all_same(actual[1], expected[1])


def test_padding_is_rezeroed_only_when_the_step_may_have_written_nan(backend, monkeypatch):
    """No fill in an iteration whose host read saw no overflow (the padding is still zero);
    one per bucket after an overflow, and after an unscale with no host read to tell. The
    same for ``clip_grad_norm_`` (its write pass: an unscale times the clip coefficient)."""
    fills = []
    original = torch.Tensor.index_fill_
    monkeypatch.setattr(torch.Tensor, "index_fill_",
                        lambda self, *a: fills.append(self.numel()) or original(self, *a))
    params = [torch.nn.Parameter(torch.randn(n)) for n in (7, 33)]
    cases = [(clip, fused, overflow, expected) for clip in (False, True)
             for fused, overflow, expected in ((False, False, 0), (False, True, 1),
                                               (True, False, 1))]
    for clip, fused, overflow, expected in cases:
        opt = torch.optim.AdamW(params, lr=1e-2, fused=fused)
        grad_buckets = GradBuckets(opt)
        scaler = GradScaler("cpu", backend=backend)
        fills.clear()
        scaler.scale(sum(p.sum() for p in params) * (math.inf if overflow else 1.0)).backward()
        scaler.clip_grad_norm_(opt, 1.0) if clip else scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        assert len(fills) == expected, (clip, fused, overflow)
        grad_buckets.release()
        grad_buckets.zero_()


@pytest.mark.parametrize("overflow", [False, True])
def test_no_rezeroing_after_a_check_through_an_overriding_subclass(backend, monkeypatch,
                                                                   overflow):
    """A fused optimizer's check through a subclass overriding ``_unscale_grads_`` is an
    unscale by 1.0: the padding stays zero, so ``update()`` makes no fill."""
    fills = []
    original = torch.Tensor.index_fill_
    monkeypatch.setattr(torch.Tensor, "index_fill_",
                        lambda self, *a: fills.append(self.numel()) or original(self, *a))
    params = [torch.nn.Parameter(torch.randn(n)) for n in (7, 33)]
    opt = torch.optim.AdamW(params, lr=1e-2, fused=True)
    GradBuckets(opt)
    scaler = _overriding_unscale_grads(GradScaler)("cpu", backend=backend)
    scaler.scale(sum(p.sum() for p in params) * (math.inf if overflow else 1.0)).backward()
    scaler.step(opt)
    scaler.update()
    assert fills == [] and scaler.last_step_skipped.item() == overflow


@pytest.mark.filterwarnings("ignore:1 gradient\\(s\\) are no longer views")  # set_to_none
@pytest.mark.parametrize("zero", ["set_to_none=False", "set_to_none=True"])
def test_a_nan_norm_leaves_no_nan_in_the_view_of_a_parameter_without_a_gradient(backend, zero):
    """A NaN grad makes the clip coefficient NaN, and the clip's pass over a bucket multiplies
    the views of parameters that received no gradient too (``0 * NaN``). Zeroed with the
    optimizer's ``zero_grad`` (not ``GradBuckets.zero_``, which fills whole buckets), those
    views must not turn the next clean iterations into overflows: training goes on as torch's
    ``unscale_`` + ``clip_grad_norm_`` without buckets."""
    scales, results = [], []
    for ours in (True, False):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(n)) for n in (5, 3)]
        opt = torch.optim.SGD(params, lr=0.1)
        if ours:
            GradBuckets(opt)
            scaler = GradScaler("cpu", init_scale=8.0, backend=backend)
        else:
            scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
        for step in range(3):  # the second parameter never receives a gradient
            scaler.scale(params[0].sum() * (math.nan if step == 0 else 1.0)).backward()
            if ours:
                total = scaler.clip_grad_norm_(opt, 1.0)
            else:
                scaler.unscale_(opt)
                total = torch.nn.utils.clip_grad_norm_(params, 1.0)
            assert total.isnan().item() == (step == 0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=zero == "set_to_none=True")
            assert params[1].grad is None
        scales.append(scaler.get_scale())
        results.append([p.detach() for p in params])
    assert scales == [4.0, 4.0]
    assert_all_same(results[0], results[1])
