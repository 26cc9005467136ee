"""SpikeGuard: ZClip's rule on the device, in the scaler's clip (see docs/stability.md)."""

import math

import pytest
import torch
from _util import assert_same

from triton_scaler import GradScaler, SpikeGuard
from triton_scaler.spike_guard import STATS_LAYOUT

zclip = pytest.importorskip("zclip")

SPIKES = {31: 40.0, 37: 8.0, 44: 60.0}  # step -> loss factor (after the warm-up)
OVERFLOWS = (5, 33)  # an inf in the loss: one in the warm-up, one after


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _batch(step):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(6, 8, generator=g), torch.randn(6, 3, generator=g)


def _loss(model, step):
    x, y = _batch(step)
    loss = torch.nn.functional.mse_loss(model(x), y) * SPIKES.get(step, 1.0)
    return loss * math.inf if step in OVERFLOWS else loss


def _zclip_run(steps, max_norm, skip, **settings):
    """The oracle: torch's scaler, then zclip on the unscaled grads (not on overflow steps,
    which torch's scaler skips); a skip guard's spike skips the optimizer step."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=7)
    zc = zclip.ZClip(max_grad_norm=None if max_norm == math.inf else max_norm,
                     skip_update_on_spike=skip, **settings)
    norms, spikes, scales = [], [], []
    for step in range(steps):
        opt.zero_grad()
        scaler.scale(_loss(model, step)).backward()
        scaler.unscale_(opt)
        overflow = sum(v.item() for v in scaler._found_inf_per_device(opt).values()) > 0
        spike = False
        if not overflow:
            norm = zc._compute_grad_norm(model)
            spike = zc.initialized and zc._compute_clip_val(norm) is not None
            norms.append(zc.step(model))
        else:
            norms.append(math.inf)
        spikes.append(spike)
        if skip and spike:
            scaler.update()  # no step: clean for the scale
        else:
            scaler.step(opt)
            scaler.update()
        scales.append(scaler.get_scale())
    return model, norms, spikes, scales, zc


def _guard_run(steps, max_norm, backend, skip, **settings):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = SpikeGuard(action="skip" if skip else "clip", **settings)
    scaler = GradScaler("cpu", init_scale=2.0**10, growth_interval=7, backend=backend,
                        spike_guard=guard)
    norms, skipped, scales = [], [], []
    for step in range(steps):
        opt.zero_grad()
        scaler.scale(_loss(model, step)).backward()
        norms.append(scaler.clip_grad_norm_(opt, max_norm).item())
        scaler.step(opt)
        scaler.update()
        skipped.append(bool(scaler.last_step_skipped))
        scales.append(scaler.get_scale())
    return model, norms, skipped, scales, guard, scaler


@pytest.mark.parametrize("skip", [False, True], ids=["clip", "skip"])
@pytest.mark.parametrize("settings", [
    dict(warmup_steps=25),
    dict(warmup_steps=25, mode="percentile"),
    dict(warmup_steps=25, clip_option="mean", alpha=0.9, z_thresh=2.0),
], ids=["zscore", "percentile", "mean"])
def test_matches_zclip_after_torch_unscale(backend, settings, skip):
    """Norms, spikes, skipped steps, scales and parameters match zclip applied to the
    unscaled grads of torch's scaler loop (overflow steps left out of zclip's statistics):
    the statistics to float rounding (zclip keeps Python floats), the decisions exactly."""
    steps = 50
    ref_model, ref_norms, ref_spikes, ref_scales, zc = _zclip_run(steps, 1.0, skip, **settings)
    model, norms, skipped, scales, guard, _ = _guard_run(steps, 1.0, backend, skip, **settings)
    for step, (ours, theirs) in enumerate(zip(norms, ref_norms)):
        if step in OVERFLOWS:
            assert not math.isfinite(ours)
        else:
            assert ours == pytest.approx(theirs, rel=1e-6), step
    stats = guard.statistics()
    assert stats["spikes"] == sum(ref_spikes) >= 2
    assert stats["count"] == settings["warmup_steps"]
    assert stats["mean"] == pytest.approx(zc.mean, rel=1e-6)
    assert stats["var"] == pytest.approx(zc.var, rel=1e-5)
    if skip:
        assert skipped == [s in OVERFLOWS or spike for s, spike in enumerate(ref_spikes)]
    else:
        assert skipped == [s in OVERFLOWS for s in range(steps)]
    assert scales == ref_scales
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode, clip_option, action", [
    ("zscore", "adaptive_scaling", "clip"), ("zscore", "mean", "skip"),
    ("percentile", "adaptive_scaling", "clip"), ("percentile", "mean", "skip")])
def test_kernel_equals_the_reference_bit_for_bit(interpreter, mode, clip_option, action):
    """The Triton kernel's statistics equal the reference path's after every step, over
    fp32 and fp64 norms with spikes, inf, NaN and a finite max_norm and none."""
    g = torch.Generator().manual_seed(3)
    norms = (1.0 + 0.1 * torch.randn(40, generator=g, dtype=torch.float64)).tolist()
    for i, value in ((3, math.inf), (9, math.nan), (14, 9.0), (20, 30.0), (27, -math.inf)):
        norms[i] = value
    guards = [SpikeGuard(warmup_steps=6, mode=mode, clip_option=clip_option, action=action)
              for _ in range(2)]
    for i, value in enumerate(norms):
        dtype = torch.float64 if i % 3 == 0 else torch.float32
        max_norm = math.inf if i % 4 == 0 else 1.25
        limits = [guard.limit(torch.tensor(value, dtype=dtype), max_norm, backend)
                  for guard, backend in zip(guards, ("reference", "triton"))]
        assert_same(limits[1], limits[0])
        assert guards[1].state_dict() == guards[0].state_dict()
    assert guards[0].statistics()["spikes"] >= 2


def test_stats_layout_matches_the_kernel():
    """The package's names of the statistics are the kernel's order."""
    from triton_scaler.kernels.guard import STATS_LAYOUT as KERNEL_LAYOUT

    assert STATS_LAYOUT == KERNEL_LAYOUT
