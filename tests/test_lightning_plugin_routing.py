"""Which route ``lightning_precision_plugin`` takes, without Lightning: a stand-in for
Lightning 2.5's ``MixedPrecision`` (its ``optimizer_step``, ``_after_closure`` and clip methods,
statement for statement, the hooks reduced to the module's own) is put in ``sys.modules`` for
the plugin to subclass. Every run of the plugin is compared with the stand-in's own route (the
same scaler class, unscale then torch's clip): bit for bit on the reference backend, to float32
rounding on Triton. ``tests/test_integrations.py`` runs the real Trainer where Lightning is
installed."""

import enum
import math
import sys
import types
from types import SimpleNamespace

import pytest
import torch

from triton_scaler import GradScaler
from triton_scaler import integrations as ti


class MixedPrecision:
    """Lightning 2.5's ``MixedPrecision("16-mixed", ...)`` as the plugin meets it."""

    def __init__(self, precision, device, scaler=None):
        self.precision, self.device, self.scaler = precision, device, scaler

    def optimizer_step(self, optimizer, model, closure, **kwargs):
        closure_result = closure()
        skip_unscaling = closure_result is None and model.automatic_optimization
        if not getattr(optimizer, "_step_supports_amp_scaling", False) and not skip_unscaling:
            self.scaler.unscale_(optimizer)
        self._after_closure(model, optimizer)
        if not skip_unscaling:
            step_output = self.scaler.step(optimizer, **kwargs)
            self.scaler.update()
            return step_output
        return closure_result

    def _after_closure(self, model, optimizer):
        trainer = model._trainer
        for callback in getattr(trainer, "callbacks", ()):
            callback.on_before_optimizer_step(trainer, model, optimizer)
        model.on_before_optimizer_step(optimizer)
        if model.automatic_optimization:  # Precision._clip_gradients
            model.configure_gradient_clipping(optimizer, trainer.gradient_clip_val,
                                              trainer.gradient_clip_algorithm)

    def clip_gradients(self, optimizer, clip_val=0.0, gradient_clip_algorithm="norm"):
        if clip_val > 0 and getattr(optimizer, "_step_supports_amp_scaling", False):
            raise RuntimeError("does not allow for gradient clipping")
        if clip_val <= 0:
            return
        if gradient_clip_algorithm == "value":
            self.clip_grad_by_value(optimizer, clip_val)
        elif gradient_clip_algorithm == "norm":
            self.clip_grad_by_norm(optimizer, clip_val)

    def clip_grad_by_value(self, optimizer, clip_val):
        torch.nn.utils.clip_grad_value_(_params(optimizer), clip_value=clip_val)

    def clip_grad_by_norm(self, optimizer, clip_val):
        torch.nn.utils.clip_grad_norm_(_params(optimizer), clip_val)

    def on_load_checkpoint(self, checkpoint):  # Precision's: nothing
        pass

    def state_dict(self):
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state_dict):
        if self.scaler is not None:
            self.scaler.load_state_dict(state_dict)


def _params(optimizer):
    return [p for group in optimizer.param_groups for p in group["params"]]


@pytest.fixture(autouse=True)
def _lightning_stand_in(monkeypatch):
    names = ["lightning", "lightning.pytorch", "lightning.pytorch.plugins",
             "lightning.pytorch.plugins.precision"]
    for name in names:
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    sys.modules[names[-1]].MixedPrecision = MixedPrecision


class _LightningHooks:
    """A LightningModule's hooks as Lightning defines them (their module says so: the plugin
    tells Lightning's defaults from a user's hooks by it)."""

    def on_before_optimizer_step(self, optimizer):
        pass

    def configure_gradient_clipping(self, optimizer, clip_val, algorithm):
        self._trainer.precision_plugin.clip_gradients(optimizer, clip_val or 0.0,
                                                      algorithm or "norm")


for _hook in vars(_LightningHooks).values():
    if callable(_hook):
        _hook.__module__ = "lightning.pytorch.core.hooks"


class Module(_LightningHooks):
    """A LightningModule as the precision plugin sees it: its trainer, its optimization mode,
    the two hooks, Lightning's unless the user's are given."""

    def __init__(self, trainer, automatic=True, before_step=None, clipping=None):
        self._trainer, self.automatic_optimization = trainer, automatic
        if before_step is not None:
            self.on_before_optimizer_step = lambda optimizer: before_step(
                self._trainer.precision_plugin, optimizer, self.step)
        if clipping is not None:
            self.configure_gradient_clipping = lambda optimizer, clip_val, algorithm: clipping(
                self._trainer.precision_plugin, optimizer)


class GradClipAlgorithmType(str, enum.Enum):
    """As Lightning's: equal to its value, ``str`` its name (``GradClipAlgorithmType.NORM``)."""
    NORM = "norm"
    VALUE = "value"


NONE_STEP = 1


def _fit(plugin_kind, backend, clip_val=0.5, algorithm=None, manual=False, none_step=True,
         callbacks=(), **hooks):
    """Four steps through ``plugin_kind``'s ``optimizer_step``, the second's ``training_step``
    returning None where ``none_step``, the third overflowing: params, final scale, fused
    clips taken."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 9), torch.nn.ReLU(), torch.nn.Linear(9, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler, fused_clips = GradScaler("cpu", init_scale=2.0**10, backend=backend), []
    original = scaler.clip_grad_norm_
    scaler.clip_grad_norm_ = lambda *a, **k: fused_clips.append(k["sharded"]) or original(
        *a, **k)
    plugin = (ti.lightning_precision_plugin("cpu", scaler) if plugin_kind == "plugin"
              else MixedPrecision("16-mixed", "cpu", scaler))
    trainer = SimpleNamespace(gradient_clip_val=clip_val, gradient_clip_algorithm=algorithm,
                              precision_plugin=plugin, callbacks=list(callbacks))
    module = Module(trainer, automatic=not manual, **hooks)
    gen = torch.Generator().manual_seed(1)
    for step in range(4):
        module.step = step
        x = torch.randn(7, 5, generator=gen)

        def closure(step=step, x=x):
            opt.zero_grad()
            if step == NONE_STEP and none_step and not manual:
                return None  # training_step returned None: no backward
            loss = model(x).square().mean() * (math.inf if step == 2 else 100.0)
            scaler.scale(loss).backward()
            return loss

        if manual:  # manual_backward, self.clip_gradients, opt.step()
            closure()
            plugin.clip_gradients(opt, 0.5, "norm")
            plugin.optimizer_step(opt, module, lambda: None)
        else:
            plugin.optimizer_step(opt, module, closure)
        assert "unscale_" not in vars(scaler)  # the deferral never outlives the step
    assert set(fused_clips) <= {False}  # the rank's own grads: whole on every DDP rank
    return [p.detach().clone() for p in model.parameters()], scaler.get_scale(), len(fused_clips)


def _assert_same(fused, plain, backend):
    assert fused[1] == plain[1] == 2.0**9  # one overflow: one backoff
    tolerance = 0 if backend == "reference" else 1e-6
    for a, b in zip(fused[0], plain[0]):
        torch.testing.assert_close(a, b, rtol=tolerance, atol=0)


@pytest.mark.parametrize("algorithm", [None, "norm", GradClipAlgorithmType.NORM])
def test_clipping_by_norm_takes_the_fused_clip_with_lightnings_result(backend, algorithm):
    fused = _fit("plugin", backend, algorithm=algorithm)
    assert fused[2] == 3  # the steps with a backward; at the None step Lightning's own clip
    _assert_same(fused, _fit("lightning", backend, algorithm=algorithm), backend)


@pytest.mark.parametrize("case", ["no clip value", "clip value 0", "by value", "manual"])
def test_lightnings_own_route_where_the_trainer_does_not_clip_by_norm(backend, case):
    """Manual optimization's ``clip_gradients`` clips the grads as they are, as Lightning's
    (no unscale was deferred: a fused clip would unscale, and Lightning's step again)."""
    settings = {"no clip value": dict(clip_val=None), "clip value 0": dict(clip_val=0.0),
                "by value": dict(algorithm=GradClipAlgorithmType.VALUE, none_step=False),
                "manual": dict(clip_val=None, manual=True)}[case]
    seen = {"plugin": [], "lightning": []}
    fused = _fit("plugin", backend, before_step=grads_seen(seen["plugin"]), **settings)
    assert fused[2] == 0
    _assert_same(fused, _fit("lightning", backend, before_step=grads_seen(seen["lightning"]),
                             **settings), backend)
    for mine, lightnings in zip(*seen.values(), strict=True):  # on_before_optimizer_step's
        for a, b in zip(mine, lightnings, strict=True):  # grads: unscaled, as Lightning's
            if a is None or b is None:
                assert a is b
            else:
                torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def grads_seen(seen):
    def before_step(plugin, optimizer, step):
        seen.append([p.grad if p.grad is None else p.grad.clone() for p in _params(optimizer)])
    return before_step


def clip_by_value(plugin, optimizer):  # configure_gradient_clipping's own choice
    plugin.clip_gradients(optimizer, 0.01, "value")


def clip_by_norm_twice(plugin, optimizer):
    plugin.clip_gradients(optimizer, 0.5, "norm")
    plugin.clip_gradients(optimizer, 0.2, "norm")


@pytest.mark.parametrize("hooks", [
    dict(clipping=lambda plugin, optimizer: None),
    dict(clipping=clip_by_value, none_step=False),
    dict(clipping=clip_by_norm_twice)],
    ids=["no clip", "clip by value", "clip twice"])
def test_a_users_configure_gradient_clipping_takes_lightnings_route(backend, hooks):
    """A ``configure_gradient_clipping`` of the user's (it may read the grads) that does not
    clip, clips by value or twice by norm: Lightning's route (unscaled first), its result."""
    fused = _fit("plugin", backend, **hooks)
    assert fused[2] == 0
    _assert_same(fused, _fit("lightning", backend, **hooks), backend)


def unscale_at(steps):
    def before_step(plugin, optimizer, step):
        if step in steps:
            plugin.scaler.unscale_(optimizer)  # done, not deferred: Lightning did not unscale
            assert plugin.scaler._per_optimizer_states[id(optimizer)]["stage"].name \
                == "UNSCALED"
    return before_step


@pytest.mark.parametrize("plugin_kind", ["plugin", "lightning"])
@pytest.mark.parametrize("steps", [{0}, {NONE_STEP}], ids=["after Lightning's", "left over"])
def test_a_second_unscale_raises_torchs_error_as_lightnings(plugin_kind, steps):
    """A user's ``unscale_`` in ``on_before_optimizer_step`` comes after Lightning's (deferred
    or not); one at a step whose ``training_step`` returned None is left for the next step,
    whose own unscale then raises."""
    with pytest.raises(RuntimeError, match="unscale_\\(\\) has already been called"):
        _fit(plugin_kind, "reference", before_step=unscale_at(steps))


def test_a_user_unscale_of_another_optimizer_in_the_hook_is_its_own():
    """An ``unscale_`` of some other optimizer while Lightning's is deferred unscales that one
    (and the deferred one first): the step's result stays Lightning's."""
    other = torch.optim.SGD([torch.nn.Parameter(torch.ones(3))], lr=0.1)

    def before_step(plugin, optimizer, step):
        if step != NONE_STEP:  # (no update would follow to end the other's iteration)
            plugin.scaler.unscale_(other)
            assert plugin.scaler._per_optimizer_states[id(optimizer)]["stage"].name \
                == "UNSCALED"

    fused = _fit("plugin", "reference", before_step=before_step)
    assert fused[2] == 0  # the deferred unscale was done for the user's call
    _assert_same(fused, _fit("lightning", "reference", before_step=before_step), "reference")


def test_a_fused_optimizer_keeps_lightnings_route():
    """An optimizer that unscales in its own step (``_step_supports_amp_scaling``) is not
    fused: Lightning's own ``clip_gradients`` refuses it, as with torch's scaler."""
    plugin = ti.lightning_precision_plugin("cpu", GradScaler("cpu", backend="reference"))
    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    opt._step_supports_amp_scaling = True
    module = Module(SimpleNamespace(gradient_clip_val=0.5, gradient_clip_algorithm=None,
                                    precision_plugin=plugin))
    with pytest.raises(RuntimeError, match="does not allow for gradient clipping"):
        plugin.optimizer_step(opt, module, lambda: torch.zeros(()))


def test_the_deferral_ends_when_a_hook_raises():
    plugin = ti.lightning_precision_plugin("cpu", GradScaler("cpu", backend="reference"))
    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)

    def before_step(plugin, optimizer, step):
        raise KeyError("a hook's error")

    module = Module(SimpleNamespace(gradient_clip_val=0.5, gradient_clip_algorithm=None,
                                    precision_plugin=plugin), before_step=before_step)
    module.step = 0
    plugin.scaler.scale(torch.ones(()))
    with pytest.raises(KeyError, match="a hook's error"):
        plugin.optimizer_step(opt, module, lambda: torch.zeros(()))
    assert "unscale_" not in vars(plugin.scaler) and plugin._deferred is None


def test_the_default_scaler_is_ours():
    plugin = ti.lightning_precision_plugin("cpu")
    assert type(plugin.scaler) is GradScaler and plugin.scaler._device == "cpu"
    assert isinstance(plugin, MixedPrecision) and plugin.precision == "16-mixed"


class _Callback:
    """A Lightning callback with the user's ``on_before_optimizer_step``."""

    def __init__(self, seen):
        self.seen = seen

    def on_before_optimizer_step(self, trainer, module, optimizer):
        self.seen.append([p.grad if p.grad is None else p.grad.clone()
                          for p in _params(optimizer)])


@pytest.mark.parametrize("where", ["module", "callback"])
def test_hooks_before_the_step_see_unscaled_grads_while_clipping_by_norm(backend, where):
    """Clipping by norm with an ``on_before_optimizer_step`` of the module or of a callback:
    Lightning's route, the hook seeing the grads unscaled exactly as under Lightning's
    plugin, and Lightning's parameters."""
    seen = {"plugin": [], "lightning": []}
    runs = {}
    for kind in seen:
        hooks = (dict(before_step=grads_seen(seen[kind])) if where == "module"
                 else dict(callbacks=[_Callback(seen[kind])]))
        runs[kind] = _fit(kind, backend, **hooks)
    assert runs["plugin"][2] == 0
    _assert_same(runs["plugin"], runs["lightning"], backend)
    assert len(seen["plugin"]) == len(seen["lightning"]) == 4
    for mine, lightnings in zip(*seen.values(), strict=True):
        for a, b in zip(mine, lightnings, strict=True):
            if a is None or b is None:
                assert a is b
            else:
                torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def _saved(plugin):
    """Lightning's checkpoint of a precision plugin's state (``dump_checkpoint``)."""
    state = plugin.state_dict()
    return {type(plugin).__qualname__: state} if state else {}


def _restore(plugin, checkpoint):
    """Lightning's ``restore_precision_plugin_state``."""
    plugin.on_load_checkpoint(checkpoint)
    if type(plugin).__qualname__ in checkpoint:
        plugin.load_state_dict(checkpoint[type(plugin).__qualname__])


def _plugin(kind, init_scale):
    scaler = GradScaler("cpu", init_scale=init_scale)
    return (ti.lightning_precision_plugin("cpu", scaler) if kind == "plugin"
            else MixedPrecision("16-mixed", "cpu", scaler))


@pytest.mark.parametrize("saved_by", ["plugin", "lightning"])
@pytest.mark.parametrize("resumed_by", ["plugin", "lightning"])
def test_a_run_resumes_at_its_saved_scale_with_either_plugin(saved_by, resumed_by):
    """A checkpoint saved with the plugin or Lightning's MixedPrecision resumes at its saved
    scale (256, not the new run's 1024) with either."""
    checkpoint = _saved(_plugin(saved_by, 256.0))
    resumed = _plugin(resumed_by, 1024.0)
    _restore(resumed, checkpoint)
    assert resumed.scaler.get_scale() == 256.0


def test_a_checkpoint_under_the_plugins_former_key_resumes_at_its_scale():
    """State saved under the plugin's former key (its own qualified name) still loads."""
    old = {"lightning_precision_plugin.<locals>.FusedClipMixedPrecision":
           GradScaler("cpu", init_scale=256.0).state_dict()}
    resumed = _plugin("plugin", 1024.0)
    _restore(resumed, old)
    assert resumed.scaler.get_scale() == 256.0
