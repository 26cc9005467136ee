"""Host synchronisation counts: none in scale / unscale_ / update, at most one in step (plain
optimizers, as torch), none at all on the fused-optimizer route."""

import math

import pytest
import torch
from _loops import make_model

from triton_scaler import GradBuckets, GradScaler
from triton_scaler.diagnostics import count_host_syncs, optimizer_step_uncounted


def _iteration(scaler, model, opt, overflow=False):
    loss = model(torch.randn(4, 12)).square().mean() * (math.inf if overflow else 1.0)
    with count_host_syncs() as c:
        scaled = scaler.scale(loss)
    syncs = {"scale": c.count}
    scaled.backward()
    for name in ("unscale_", "step", "update"):
        with count_host_syncs() as c, optimizer_step_uncounted(opt, c):
            {"unscale_": lambda: scaler.unscale_(opt), "step": lambda: scaler.step(opt),
             "update": scaler.update}[name]()
        syncs[name] = c.count
    opt.zero_grad(set_to_none=False)
    return syncs


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("use_buckets", [False, True])
def test_sync_counts(backend, fused, use_buckets):
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
    if use_buckets:
        GradBuckets(opt)
    scaler = GradScaler("cpu", backend=backend, hysteresis=2, min_scale=1.0)
    for overflow in (False, True, False):
        syncs = _iteration(scaler, model, opt, overflow)
        assert syncs == {"scale": 0, "unscale_": 0, "step": 0 if fused else 1, "update": 0}


def test_fused_route_without_unscale_has_no_sync(backend):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, fused=True)
    scaler = GradScaler("cpu", backend=backend)
    for overflow in (False, True):
        scaler.scale(model(torch.randn(4, 12)).sum() * (math.inf if overflow else 1)).backward()
        with count_host_syncs() as c, optimizer_step_uncounted(opt, c):
            scaler.step(opt)
            scaler.update()
        assert c.count == 0
        opt.zero_grad()


def test_the_counter_can_fail():
    with count_host_syncs() as c:
        torch.ones(()).item()
        bool(torch.ones(()))
        with c.paused():
            torch.ones(()).tolist()
            with c.paused():  # nested
                torch.ones(()).item()
            torch.ones(()).item()
        assert c.count == 2
        torch.ones(()).item()  # counted again once the pause ends
        assert c.count == 3
    t = torch.ones(())
    for name in ("item", "__bool__", "tolist", "cpu", "numpy", "__float__", "__int__"):
        with count_host_syncs() as c:  # each host read counts once
            getattr(t, name)()
        assert c.count == 1, name
    assert t.item() == 1.0 and c.count == 1  # after the context: torch's own, not counted


def test_optimizer_step_uncounted_keeps_an_optimizers_own_step():
    """An instance-level ``step`` (an LR scheduler's or apex's wrapper) is put back after the
    region; without one, the class's ``step`` is seen again."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
    with count_host_syncs() as c, optimizer_step_uncounted(opt, c):
        pass
    assert "step" not in opt.__dict__

    def own_step(*args, **kwargs):
        torch.ones(()).item()

    opt.step = own_step
    with count_host_syncs() as c, optimizer_step_uncounted(opt, c):
        opt.step()
    assert opt.step is own_step and c.count == 0


def test_a_deferred_host_copy_completes_on_the_stream_of_the_copied_tensor(monkeypatch):
    """SkipAwareScheduler's deferred read waits on an event recorded where torch runs a
    device-to-host copy: the current stream of the *source's* device, which is not the
    current device's when the grads and the scale live on ``cuda:1`` while ``cuda:0`` is
    current. No GPU here: the stream and event are stand-ins that record what they get."""
    from triton_scaler import _host_copy

    class Event:
        recorded_on = []

        def record(self, stream=None):
            self.recorded_on.append(stream)

    streams = []

    def current_stream(device=None):
        streams.append(device)
        return f"stream of {device}"

    empty, pinned = torch.empty, []
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    monkeypatch.setattr(torch, "empty",
                        lambda *a, pin_memory=False, **k: pinned.append(pin_memory) or empty(
                            *a, **k))
    copy, blocking = torch.Tensor.copy_, []

    def copy_recorded(self, src, non_blocking=False):
        blocking.append(not non_blocking)
        return copy(self, src)

    monkeypatch.setattr(torch.Tensor, "copy_", copy_recorded)
    src = torch.tensor([65536.0, 1.0], dtype=torch.float64)  # not the default dtype
    host, event = _host_copy.copy_to_host_async(src)
    assert blocking == [False]  # the host does not wait for the copy
    assert Event.recorded_on == [f"stream of {src.device}"] and streams == [src.device]
    assert pinned == [True]  # page-locked: the copy can run without blocking the host
    assert host.dtype == src.dtype and torch.equal(host, src)
    assert host.data_ptr() != src.data_ptr()
