"""The spike guard and the guard-only mode on CUDA tensors: the guard kernel compiled for the
GPU against the reference path's ops on the same device, no host sync with a fused optimizer
and GradBuckets, and bf16 grads only read by the guard-only mode's checks. Skipped without
CUDA (tests/run_gpu.sh runs them)."""

import math

import pytest
import torch
from _util import assert_all_same, sync_errors

from triton_scaler import GradBuckets, GradScaler, SpikeGuard

pytestmark = pytest.mark.gpu


def _loop(cuda, backend, *, action="skip", scaling=True, steps=12, spike_at=9, watched=None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                                torch.nn.Linear(256, 8)).to(cuda)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    buckets = GradBuckets(opt)
    guard = SpikeGuard(warmup_steps=5, action=action)
    scaler = GradScaler("cuda", backend=backend, spike_guard=guard, scaling=scaling)
    gen = torch.Generator(device=cuda).manual_seed(1)
    dtype = torch.float16 if scaling else torch.bfloat16
    norms = []
    for step in range(steps):
        x = torch.randn(32, 64, device=cuda, generator=gen)
        with torch.autocast("cuda", dtype=dtype):
            loss = model(x).float().square().mean() * (30.0 if step == spike_at else 1.0)
        scaler.scale(loss).backward()
        context = sync_errors(cuda) if watched is not None and step >= watched else None
        if context is not None:
            with context:
                norms.append(scaler.clip_grad_norm_(opt, 1.0))
                scaler.step(opt)
                scaler.update()
        else:
            norms.append(scaler.clip_grad_norm_(opt, 1.0))
            scaler.step(opt)
            scaler.update()
        buckets.zero_()
    return norms, scaler, guard, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("action", ["clip", "skip"])
def test_backends_decide_alike_on_cuda(cuda, action):
    """Triton and reference backends on CUDA: the same spikes and skips; statistics and
    parameters to rounding (the fused clip's norm sums block by block)."""
    runs = [_loop(cuda, backend, action=action) for backend in ("triton", "reference")]
    (_, s1, g1, p1), (_, s2, g2, p2) = runs
    a, b = g1.statistics(), g2.statistics()
    assert a["spikes"] == b["spikes"] >= 1 and a["last_step"] == b["last_step"]
    assert s1.skipped_steps == s2.skipped_steps == (1 if action == "skip" else 0)
    assert a["mean"] == pytest.approx(b["mean"], rel=1e-5)
    torch.testing.assert_close(p1, p2, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("scaling", [True, False])
def test_a_guarded_fused_step_never_synchronises(cuda, scaling):
    """With fused AdamW and GradBuckets, a guarded clip, step and update make no host sync
    (CUDA's sync debug mode raises on any), the spike step included; guard-only mode too."""
    norms, scaler, guard, _ = _loop(cuda, "triton", scaling=scaling, watched=3)
    assert guard.statistics()["spikes"] >= 1 and scaler.skipped_steps >= 1
    if not scaling:
        assert scaler.get_scale() == 1.0
    assert all(math.isfinite(n.item()) for n in norms)


def test_guard_only_checks_read_bf16_grads_on_cuda(cuda):
    """scaling=False on CUDA: the fused route's check leaves bf16 grads as they were, an inf
    skips the step, the scale stays 1.0."""
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 8).to(cuda, torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = GradScaler("cuda", scaling=False)
    for step in range(3):
        model(torch.randn(4, 64, device=cuda, dtype=torch.bfloat16)).float().sum().backward()
        if step == 1:
            model.weight.grad[0, 0] = math.inf
        grads = [p.grad.clone() for p in model.parameters()]
        before = [p.detach().clone() for p in model.parameters()]
        scaler.step(opt)
        scaler.update()
        assert_all_same([p.grad for p in model.parameters()], grads)
        taken = any(not torch.equal(p, b) for p, b in zip(model.parameters(), before))
        assert taken == (step != 1)
        opt.zero_grad()
    assert scaler.skipped_steps == 1 and scaler.get_scale() == 1.0
