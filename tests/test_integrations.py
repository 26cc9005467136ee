"""The fused clip where users clip without calling the scaler: Accelerate, Lightning Fabric and
the Lightning Trainer, each against its own plain route (unscale through the scaler, then
torch's clip_grad_norm_), on CPU. Skipped where the library is not installed
(``pip install -e ".[integrations]"``)."""

import math

import pytest
import torch

from triton_scaler import GradScaler
from triton_scaler import integrations as ti


def _data(steps=6):
    gen = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 6, generator=gen), step in (2,)) for step in range(steps)]


def _counted(scaler, calls):
    """The scaler, with its fused clip counted (to show the fused route was taken)."""
    original = scaler.clip_grad_norm_
    scaler.clip_grad_norm_ = lambda *a, **k: calls.append(1) or original(*a, **k)
    return scaler


def _assert_same_runs(plain, fused):
    """(norms, params, final scale) of the library's plain route and of the fused one."""
    assert plain[2] == fused[2]
    for a, b in zip(plain[0], fused[0]):
        assert a == pytest.approx(b, rel=1e-5) or not (math.isfinite(a) or math.isfinite(b))
    for a, b in zip(plain[1], fused[1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.ReLU(), torch.nn.Linear(12, 2))


def test_accelerate_clip_grad_norm_equals_its_plain_route(backend):
    pytest.importorskip("accelerate")
    from accelerate import Accelerator

    def run(fused):
        accelerator = Accelerator(mixed_precision="fp16", cpu=True)
        accelerator.native_amp = True  # fp16 autocast on CPU: install our scaler by hand
        accelerator.scaler = _counted(GradScaler("cpu", init_scale=2.0**10, backend=backend),
                                      calls)
        net = _model()
        model, opt = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=0.01))
        norms = []
        for x, overflow in _data():
            loss = model(x).square().mean() * (math.inf if overflow else 100.0)
            accelerator.backward(loss)
            clip = ti.accelerate_clip_grad_norm_ if fused else accelerator.clip_grad_norm_
            norms.append(clip(model.parameters(), 0.1).item() if not fused
                         else clip(accelerator, model.parameters(), 0.1).item())
            opt.step()
            opt.zero_grad()
        return norms, [p.detach().clone() for p in model.parameters()], \
            accelerator.scaler.get_scale()

    calls = []
    plain, fused = run(False), run(True)
    assert len(calls) == 6  # only the fused run calls scaler.clip_grad_norm_
    _assert_same_runs(plain, fused)


def test_fabric_clip_gradients_equals_its_plain_route(backend):
    pytest.importorskip("lightning")
    from lightning.fabric import Fabric
    from lightning.fabric.plugins.precision.amp import MixedPrecision

    def run(fused):
        scaler = _counted(GradScaler("cpu", init_scale=2.0**10, backend=backend), calls)
        fabric = Fabric(accelerator="cpu", devices=1,
                        plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
        net = _model()
        model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.01))
        norms = []
        for x, overflow in _data():
            loss = model(x).float().square().mean() * (math.inf if overflow else 100.0)
            fabric.backward(loss)
            if fused:
                total = ti.fabric_clip_gradients(fabric, model, opt, 0.1,
                                                 error_if_nonfinite=False)
            else:
                total = fabric.clip_gradients(model, opt, max_norm=0.1, error_if_nonfinite=False)
            norms.append(total.item())
            opt.step()
            opt.zero_grad()
        return norms, [p.detach().clone() for p in model.parameters()], scaler.get_scale()

    calls = []
    plain, fused = run(False), run(True)
    assert len(calls) == 6  # only the fused run calls scaler.clip_grad_norm_
    _assert_same_runs(plain, fused)


@pytest.mark.parametrize("case", ["clip by norm", "manual clip_gradients",
                                  "configure_gradient_clipping by value"])
def test_lightning_trainer_plugin_equals_its_plain_route(backend, tmp_path, case):
    """The Trainer's clip by norm takes the fused clip; a manual-optimization
    ``clip_gradients`` and a ``configure_gradient_clipping`` that clips by value take
    Lightning's own (its unscale first, where Lightning's route unscales first)."""
    pytest.importorskip("lightning")
    import lightning.pytorch as pl
    from lightning.pytorch.plugins.precision import MixedPrecision

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _model()
            self.automatic_optimization = case != "manual clip_gradients"

        def training_step(self, batch, index):
            x, overflow = batch
            loss = self.net(x).float().square().mean() * (math.inf if overflow else 100.0)
            if self.automatic_optimization:
                return loss
            opt = self.optimizers()
            self.manual_backward(loss)
            self.clip_gradients(opt, gradient_clip_val=0.1, gradient_clip_algorithm="norm")
            opt.step()
            opt.zero_grad()

        def configure_gradient_clipping(self, optimizer, gradient_clip_val=None,
                                        gradient_clip_algorithm=None):
            by_value = case == "configure_gradient_clipping by value"
            self.clip_gradients(optimizer, gradient_clip_val=0.1 if by_value else None,
                                gradient_clip_algorithm="value" if by_value else None)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    data = [(x, overflow) for x, overflow in _data()]

    def run(plugin):
        module = Module()
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, plugins=[plugin],
                             gradient_clip_val=None if case.startswith("manual") else 0.1,
                             logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False,
                             default_root_dir=tmp_path)
        trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(
            data, batch_size=None))
        return [p.detach().clone() for p in module.parameters()], plugin.scaler.get_scale()

    plain = run(MixedPrecision("16-mixed", "cpu", scaler=GradScaler(
        "cpu", init_scale=2.0**10, backend=backend)))
    calls = []
    fused = run(ti.lightning_precision_plugin("cpu", _counted(
        GradScaler("cpu", init_scale=2.0**10, backend=backend), calls)))
    assert len(calls) == (6 if case == "clip by norm" else 0)
    assert plain[1] == fused[1] == 2.0**9  # one overflow: one backoff, step skipped
    for a, b in zip(plain[0], fused[0]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
