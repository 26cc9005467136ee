"""The fused clip where users clip without calling the scaler: Accelerate, Lightning Fabric and
the Lightning Trainer, each against its own plain route (unscale through the scaler, then
torch's clip_grad_norm_), on CPU. Skipped where the library is not installed
(``pip install -e ".[integrations]"``)."""

import math
from types import SimpleNamespace

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
                                  "configure_gradient_clipping by value",
                                  "clip by norm, module hook", "clip by norm, callback hook"])
def test_lightning_trainer_plugin_equals_its_plain_route(backend, tmp_path, case):
    """Against Lightning's ``MixedPrecision`` with torch's scaler: the Trainer's clip by norm
    takes the fused clip; a manual-optimization ``clip_gradients``, a
    ``configure_gradient_clipping`` of the user's, and an ``on_before_optimizer_step`` of the
    module or of a callback take Lightning's own route (unscale first), and the hooks see the
    grads unscaled, as under Lightning's plugin."""
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

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class ClipsByValue(Module):
        def configure_gradient_clipping(self, optimizer, gradient_clip_val=None,
                                        gradient_clip_algorithm=None):
            self.clip_gradients(optimizer, gradient_clip_val=0.1,
                                gradient_clip_algorithm="value")

    class ReadsGrads(Module):
        def on_before_optimizer_step(self, optimizer):
            seen.append(max(p.grad.abs().max().item() for p in self.parameters()))

    class ReadsGradsCallback(pl.Callback):
        def on_before_optimizer_step(self, trainer, module, optimizer):
            seen.append(max(p.grad.abs().max().item() for p in module.parameters()))

    module_class = {"configure_gradient_clipping by value": ClipsByValue,
                    "clip by norm, module hook": ReadsGrads}.get(case, Module)
    callbacks = [ReadsGradsCallback()] if case == "clip by norm, callback hook" else []
    data = [(x, overflow) for x, overflow in _data()]

    def run(plugin):
        module = module_class()
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, plugins=[plugin],
                             callbacks=callbacks,
                             gradient_clip_val=None if case.startswith("manual") else 0.1,
                             logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False,
                             default_root_dir=tmp_path)
        trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(
            data, batch_size=None))
        return [p.detach().clone() for p in module.parameters()], plugin.scaler.get_scale()

    seen = []
    plain = run(MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler(
        "cpu", init_scale=2.0**10)))
    seen_plain, seen[:] = list(seen), []
    calls = []
    fused = run(ti.lightning_precision_plugin("cpu", _counted(
        GradScaler("cpu", init_scale=2.0**10, backend=backend), calls)))
    assert len(calls) == (6 if case == "clip by norm" else 0)
    assert len(seen) == len(seen_plain) == (6 if "hook" in case else 0)
    torch.testing.assert_close(torch.tensor(seen), torch.tensor(seen_plain), rtol=0, atol=0,
                               equal_nan=True)  # unscaled, as under Lightning's plugin
    assert plain[1] == fused[1] == 2.0**9  # one overflow: one backoff, step skipped
    for a, b in zip(plain[0], fused[0]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_accelerate_helper_warns_why_it_takes_accelerates_own_clip(backend):
    """Without native AMP (fp16 on CPU, as Accelerate sets it up) Accelerate's own clip sees
    the scaled grads: the helper still returns Accelerate's result, and says why."""
    pytest.importorskip("accelerate")
    from accelerate import Accelerator

    accelerator = Accelerator(mixed_precision="fp16", cpu=True)
    assert not accelerator.native_amp
    accelerator.scaler = GradScaler("cpu", init_scale=2.0**10, backend=backend)
    net = _model()
    model, _ = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=0.01))
    grads = [torch.full_like(p, 2.0) for p in model.parameters()]
    for p, g in zip(model.parameters(), grads):
        p.grad = g.clone()
    with pytest.warns(UserWarning, match=r"takes Accelerate's own clip_grad_norm_, not the fused "
                                         r"clip: accelerator\.native_amp is False"):
        norm = ti.accelerate_clip_grad_norm_(accelerator, model.parameters(), 1e9)
    copies = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for copy, g in zip(copies, grads):
        copy.grad = g
    expected = torch.nn.utils.clip_grad_norm_(copies, 1e9)
    assert torch.equal(norm, expected)  # Accelerate's: the grads as they are, nothing unscaled


def test_install_in_accelerator_refuses_what_it_cannot_serve():
    pytest.importorskip("accelerate")
    from accelerate import Accelerator

    with pytest.raises(ValueError, match=r"needs Accelerator\(mixed_precision='fp16'\)"):
        ti.install_in_accelerator(SimpleNamespace(mixed_precision="bf16", _optimizers=[]))
    accelerator = Accelerator(mixed_precision="fp16", cpu=True)
    net = _model()
    accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=0.01))
    with pytest.raises(RuntimeError, match=r"must come before accelerator\.prepare\(\)"):
        ti.install_in_accelerator(accelerator)


class _TrainerNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = _model()

    def forward(self, x, labels=None):
        out = self.body(x)
        return {"loss": (out.float() - labels).square().mean(), "logits": out}


class _TrainerData(torch.utils.data.Dataset):
    """48 samples; sample 20 overflows fp16 in the forward (its batch's step is skipped)."""

    def __init__(self):
        gen = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(48, 6, generator=gen), torch.randn(48, 2, generator=gen)
        self.x[20] = 7e4

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


def _trainer_run(tmp_path, make_scaler, fused_clip):
    """docs/integrations.md's Trainer recipe: six fp16 steps with clipping, on CPU."""
    from transformers import Trainer, TrainingArguments

    class ScalerTrainer(Trainer):
        def create_accelerator_and_postprocess(self):
            super().create_accelerator_and_postprocess()
            ti.install_in_accelerator(self.accelerator, make_scaler(), fused_clip=fused_clip)

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, fp16=True, max_steps=6,
                             per_device_train_batch_size=8, learning_rate=0.05,
                             max_grad_norm=0.5, report_to=[], save_strategy="no",
                             logging_strategy="no", seed=0, disable_tqdm=True)
    torch.manual_seed(0)
    model = _TrainerNet()
    trainer = ScalerTrainer(model=model, args=args, train_dataset=_TrainerData())
    trainer.train()
    return [p.detach().clone() for p in model.parameters()], trainer.accelerator.scaler


def test_the_transformers_trainer_recipe_trains_as_with_torchs_scaler(tmp_path):
    """The Trainer with ``fp16=True`` and triton_scaler installed (the fused clip on) trains
    as with torch's scaler installed the same way (Accelerate's own clip), bit for bit on the
    reference backend: same parameters, same scale after the planted overflow."""
    pytest.importorskip("accelerate")
    pytest.importorskip("transformers.trainer")  # (fails to import while the repository's
    # kernels/ shadows Hugging Face's `kernels` package, if that is installed)
    calls = []
    expected, torchs = _trainer_run(tmp_path, lambda: torch.amp.GradScaler(
        "cpu", init_scale=2.0**10), fused_clip=False)
    actual, ours = _trainer_run(tmp_path, lambda: _counted(GradScaler(
        "cpu", init_scale=2.0**10, backend="reference"), calls), fused_clip=True)
    assert len(calls) == 6  # every step's clip fused
    assert ours.get_scale() == torchs.get_scale() == 2.0**9  # one overflow, one backoff
    for a, b in zip(actual, expected):
        assert torch.equal(a, b)
