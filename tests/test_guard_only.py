"""GradScaler(scaling=False), the guard-only mode for bf16 runs: the loss as it is, grads only
read by the checks, a non-finite grad skips the step (scale 1.0, nothing backs off), the clip,
the spike guard and the watch as with scaling."""

import math

import pytest
import torch
from _util import assert_all_same

from triton_scaler import GradScaler, SpikeGuard


def _model(dtype):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 3)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("route", ["unscale", "step", "fused"])
def test_checks_read_the_grads_and_a_non_finite_one_skips(backend, dtype, route):
    """scale() returns its argument; unscale_ and the step's check leave every grad's values
    and version counter as they were; an inf in one grad skips the step and counts, the scale
    stays 1.0; clean steps are taken."""
    model = _model(dtype)
    fused = route == "fused"
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9, fused=fused or None)
    scaler = GradScaler("cpu", scaling=False, backend=backend)
    for step in range(4):
        loss = model(torch.randn(4, 8, dtype=dtype)).float().square().mean()
        assert scaler.scale(loss) is loss
        loss.backward()
        if step == 2:
            model[2].weight.grad[-1, -1] = math.inf
        grads = [p.grad for p in model.parameters()]
        values = [g.clone() for g in grads]
        versions = [g._version for g in grads]
        before = [p.detach().clone() for p in model.parameters()]
        if route == "unscale":
            scaler.unscale_(opt)
            assert [g._version for g in grads] == versions
            assert_all_same(grads, values)
        scaler.step(opt)
        if route != "unscale":  # the step's own check (the fused optimizer reads the grads)
            assert_all_same(grads, values)
        scaler.update()
        taken = any(not torch.equal(p, b) for p, b in zip(model.parameters(), before))
        assert taken == (step != 2) and bool(scaler.last_step_skipped) == (step == 2)
        assert scaler.get_scale() == 1.0
        opt.zero_grad()
    assert scaler.skipped_steps == 1
    assert scaler.state_dict()["scale"] == 1.0
    torch.amp.GradScaler("cpu").load_state_dict(scaler.state_dict())


def test_the_clip_and_the_guard_work_without_scale(backend):
    """Without scale() ever called, the clip returns the norm of the bf16 grads (accumulated
    in fp32), clips as torch's clip, and a skipping guard skips a spike (counted, scale
    1.0), which the watch reports."""
    model, reference = _model(torch.bfloat16), _model(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = SpikeGuard(warmup_steps=3, action="skip")
    scaler = GradScaler("cpu", scaling=False, backend=backend, spike_guard=guard)
    watch = scaler.watch(model, max_consecutive_skips=1)
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    for m in (model, reference):
        m(x).float().square().mean().backward()
    norm = scaler.clip_grad_norm_(opt, 0.1)
    expected = torch.linalg.vector_norm(torch.stack([
        torch.linalg.vector_norm(p.grad, dtype=torch.float32) for p in reference.parameters()]))
    torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.1)
    torch.testing.assert_close(norm, expected, rtol=1e-6, atol=0)  # accumulated in fp32
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-2, atol=0)
    scaler.step(opt)
    scaler.update()
    for step in range(1, 6):
        opt.zero_grad()
        (model(x).float().square().mean() * (100.0 if step == 5 else 1.0)).backward()
        scaler.clip_grad_norm_(opt, math.inf)
        scaler.step(opt)
        scaler.update()
    assert guard.statistics()["spikes"] == 1 and scaler.skipped_steps == 1
    assert bool(scaler.last_step_skipped) and scaler.get_scale() == 1.0
    report = watch.report()
    assert report.spikes == 1 and report.skipped_steps == 1 and report.scale == 1.0
    assert report.consecutive_skips == 1 and report.last_overflow is None


@pytest.mark.parametrize("setting", [dict(init_scale=2.0**10), dict(growth_factor=4.0),
                                     dict(backoff_factor=0.25), dict(growth_interval=10),
                                     dict(dynamic=False), dict(hysteresis=2),
                                     dict(min_scale=1.0)])
def test_scale_settings_are_refused_by_name(setting):
    """scaling=False with a scale setting raises ValueError naming it; enabled=False still
    turns everything off; a checkpoint with another scale does not load."""
    name = next(iter(setting))
    with pytest.raises(ValueError, match=name):
        GradScaler("cpu", scaling=False, **setting)


def test_disabled_and_foreign_checkpoints():
    """enabled=False turns the guard-only mode off too; a checkpoint with a scale other than
    1.0 is refused, named; scaling must be a bool."""
    off = GradScaler("cpu", scaling=False, enabled=False)
    loss = torch.ones(())
    assert off.scale(loss) is loss and off.state_dict() == {}
    with pytest.raises(ValueError, match="scale"):
        GradScaler("cpu", scaling=False).load_state_dict(torch.amp.GradScaler("cpu").state_dict())
    with pytest.raises(TypeError, match="scaling"):
        GradScaler("cpu", scaling=0)
