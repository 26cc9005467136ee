"""The fused ``GradScaler.clip_grad_norm_`` where users clip without calling the scaler:
Accelerate (``accelerator.clip_grad_norm_``), Lightning Fabric (``fabric.clip_gradients``) and
the Lightning Trainer (``gradient_clip_val``). Each of these unscales through the scaler and
then calls torch's ``clip_grad_norm_`` (five passes over the grads); the helpers here take the
fused route (three passes) when it gives the same result, and the library's own route
otherwise. Those routes are single-process or DDP (FSDP and DeepSpeed take their own precision
plugins), whose grads are whole on every rank: the fused clip runs with ``sharded=False``, the
norm of the rank's own grads, as the library's. Accelerate and Lightning are imported only by
the functions that need them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ._warn import warn_at_caller
from .grad_scaler import GradScaler


def _inner_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside Accelerate's / Lightning's wrappers."""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer  # AcceleratedOptimizer, LightningOptimizer, ...
    return optimizer


def _covers_exactly(optimizer: torch.optim.Optimizer, parameters: list) -> bool:
    """Whether the optimizer's params with grads are exactly ``parameters``' with grads."""
    mine = {id(p) for g in optimizer.param_groups for p in g["params"] if p.grad is not None}
    return mine == {id(p) for p in parameters if p.grad is not None}


def accelerate_clip_grad_norm_(accelerator: Any, parameters: Any, max_norm: float,
                               norm_type: float = 2.0) -> torch.Tensor:
    """Drop-in for ``accelerator.clip_grad_norm_(parameters, max_norm, norm_type)``.

    Fused (``scaler.clip_grad_norm_``) when ``accelerator.scaler`` is an enabled
    :class:`triton_scaler.GradScaler`, Accelerate runs its native AMP (``native_amp``), the run
    is not FSDP / DeepSpeed / XLA / Megatron, and one prepared optimizer holds exactly
    ``parameters``' grads. Otherwise Accelerate's own method, with a warning naming why (once
    per call site, Python's default): where ``native_amp`` is off, Accelerate's method does
    not unscale, so it clips the scaled grads and returns their scaled norm. Install the
    scaler before ``prepare``: ``accelerator.scaler = triton_scaler.GradScaler("cuda")`` (or
    :func:`install_in_accelerator`).

    Returns:
        The total norm, as Accelerate's method returns it.
    """
    parameters = list(parameters)
    reason = _accelerate_fallback_reason(accelerator)
    if reason is None:
        optimizer = _inner_optimizer(accelerator._optimizers[0])
        if _covers_exactly(optimizer, parameters):
            scaler = accelerator.scaler
            return scaler.clip_grad_norm_(optimizer, max_norm, norm_type, sharded=False)
        reason = "the prepared optimizer does not hold exactly these parameters' grads"
    warn_at_caller(f"accelerate_clip_grad_norm_ takes Accelerate's own clip_grad_norm_, not the "
                   f"fused clip: {reason}", UserWarning)
    # the class's method: an instance attribute may be this helper (install_in_accelerator)
    return type(accelerator).clip_grad_norm_(accelerator, parameters, max_norm, norm_type)


def _accelerate_fallback_reason(accelerator: Any) -> str | None:
    """Why the fused clip cannot stand in for Accelerate's, or None when it can."""
    scaler = getattr(accelerator, "scaler", None)
    if not isinstance(scaler, GradScaler):
        return (f"accelerator.scaler is {type(scaler).__name__ if scaler is not None else None}, "
                "not a triton_scaler.GradScaler (set it before prepare())")
    if not scaler.is_enabled():
        return "the scaler is disabled"
    if not getattr(accelerator, "native_amp", False):
        return ("accelerator.native_amp is False (e.g. fp16 on CPU): Accelerate then neither "
                "unscales nor expects a scaler, so its clip sees the grads still scaled")
    kind = getattr(accelerator.distributed_type, "value", "")
    if kind not in ("NO", "MULTI_GPU", "MULTI_CPU"):
        return f"the run is {kind} (its engine clips its own gradients)"
    if len(accelerator._optimizers) != 1:
        return f"{len(accelerator._optimizers)} optimizers were prepared, not one"
    return None


def install_in_accelerator(accelerator: Any, scaler: Any = None,
                           fused_clip: bool = True) -> Any:
    """Make an fp16 ``accelerator`` scale with a :class:`triton_scaler.GradScaler`; call it
    before ``accelerator.prepare`` (the prepared optimizers take the scaler then). This is the
    hook for ``transformers.Trainer`` too (docs/integrations.md).

    Accelerate runs its native AMP with the installed scaler: on CUDA it already does; on CPU,
    where Accelerate makes no scaler for fp16 and runs without autocast, this turns on fp16
    autocast there, as on CUDA.

    Args:
        accelerator: an ``accelerate.Accelerator`` with ``mixed_precision="fp16"``.
        scaler: the scaler to install; by default a :class:`triton_scaler.GradScaler` on the
            accelerator's device type with the settings of the scaler Accelerate made
            (``GradScalerKwargs``), or torch's defaults where it made none.
        fused_clip: route ``accelerator.clip_grad_norm_`` (and so ``transformers.Trainer``'s
            clip) through :func:`accelerate_clip_grad_norm_`.

    Returns:
        The installed scaler.

    Raises:
        ValueError: the accelerator is not fp16 (bf16 and fp32 need no loss scaling).
        RuntimeError: ``prepare`` has already wrapped optimizers (they hold the old scaler).
    """
    if str(getattr(accelerator, "mixed_precision", "no")) != "fp16":
        raise ValueError("install_in_accelerator needs Accelerator(mixed_precision='fp16'); got "
                         f"{getattr(accelerator, 'mixed_precision', None)!r} (bf16 and fp32 "
                         "need no loss scaling)")
    if getattr(accelerator, "_optimizers", None):
        raise RuntimeError("install_in_accelerator must come before accelerator.prepare(): the "
                           "prepared optimizers hold the scaler they were given")
    if scaler is None:
        made = getattr(accelerator, "scaler", None)
        settings = {}
        if made is not None:
            settings = dict(init_scale=made.get_scale(), growth_factor=made.get_growth_factor(),
                            backoff_factor=made.get_backoff_factor(),
                            growth_interval=made.get_growth_interval())
        scaler = GradScaler(accelerator.device.type, **settings)
    accelerator.scaler = scaler
    accelerator.native_amp = True
    if fused_clip:
        def clip_grad_norm_(parameters: Any, max_norm: float, norm_type: float = 2.0
                            ) -> torch.Tensor:
            return accelerate_clip_grad_norm_(accelerator, parameters, max_norm, norm_type)
        accelerator.clip_grad_norm_ = clip_grad_norm_
    return scaler


def fabric_clip_gradients(fabric: Any, module: Any, optimizer: Any, max_norm: float,
                          norm_type: float = 2.0, error_if_nonfinite: bool = True
                          ) -> torch.Tensor:
    """Drop-in for ``fabric.clip_gradients(module, optimizer, max_norm=..., norm_type=...)``:
    fused when Fabric's precision plugin holds a :class:`triton_scaler.GradScaler` (pass
    ``plugins=[MixedPrecision("16-mixed", "cuda", scaler=triton_scaler.GradScaler("cuda"))]``)
    and the optimizer holds exactly the module's grads; Fabric's own route otherwise."""
    scaler = getattr(getattr(fabric, "_precision", None), "scaler", None)
    inner = _inner_optimizer(optimizer)
    parameters = list(module.parameters())
    if isinstance(scaler, GradScaler) and scaler.is_enabled() and _covers_exactly(inner,
                                                                                  parameters):
        return scaler.clip_grad_norm_(inner, max_norm, norm_type, error_if_nonfinite,
                                       sharded=False)
    return fabric.clip_gradients(module, optimizer, max_norm=max_norm, norm_type=norm_type,
                                 error_if_nonfinite=error_if_nonfinite)


_LIGHTNING_PACKAGES = ("lightning.", "pytorch_lightning.")


def _users_hook(owner: Any, name: str) -> bool:
    """Whether ``owner.name`` is the user's code, not Lightning's default (an override in a
    subclass, or a function set on the instance)."""
    hook = getattr(owner, name, None)
    function = getattr(hook, "__func__", hook)
    return hook is not None and not str(getattr(function, "__module__", "")).startswith(
        _LIGHTNING_PACKAGES)


def _hooks_see_grads_before_the_clip(trainer: Any, model: Any) -> bool:
    """Whether user code runs between Lightning's closure and its clip (and so would see the
    grads still scaled if the unscale moved into the clip): ``on_before_optimizer_step`` of
    the module or of a callback, or the module's own ``configure_gradient_clipping``."""
    if _users_hook(model, "on_before_optimizer_step") or \
            _users_hook(model, "configure_gradient_clipping"):
        return True
    return any(_users_hook(callback, "on_before_optimizer_step")
               for callback in getattr(trainer, "callbacks", None) or ())


#: Where this plugin's state was saved before it took Lightning's key (its own qualified name)
_OLD_PLUGIN_KEY = "lightning_precision_plugin.<locals>.FusedClipMixedPrecision"


def lightning_precision_plugin(device: str = "cuda", scaler: GradScaler | None = None) -> Any:
    """A Lightning Trainer precision plugin (``"16-mixed"``) that unscales with
    :class:`triton_scaler.GradScaler` and, when the Trainer clips by norm
    (``gradient_clip_val`` with the default ``"norm"`` algorithm), unscales and clips in one
    fused call. Use ``Trainer(plugins=[lightning_precision_plugin("cuda")],
    gradient_clip_val=1.0)``. Hooks see what they see under Lightning's ``MixedPrecision``:
    the clip is fused only where no hook of the user's runs between the closure and the clip
    (``on_before_optimizer_step`` of the module or of a callback, the module's own
    ``configure_gradient_clipping``); with such a hook, without clipping by norm, and for
    ``clip_gradients`` called in manual optimization, the plugin behaves exactly as Lightning's
    ``MixedPrecision`` (unscale, hooks, torch's clip). Lightning refuses
    ``precision="16-mixed"`` on CPU; this plugin with ``device="cpu"`` runs fp16 autocast
    there with the scaler. Its state is saved under ``MixedPrecision``'s key: a checkpoint
    resumes at its saved scale with this plugin or Lightning's own."""
    import importlib

    # typed as Any: the plugin overrides Lightning's methods by their runtime signatures
    mixed_precision: Any = importlib.import_module(
        "lightning.pytorch.plugins.precision").MixedPrecision

    class FusedClipMixedPrecision(mixed_precision):
        #: The optimizer whose unscale Lightning asked for after the closure and the clip by
        #: norm takes over; None outside that window (Lightning's ``_after_closure``).
        _deferred: Any = None

        def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any],
                           **kwargs: Any) -> Any:
            trainer = getattr(model, "_trainer", None)
            algorithm = str(getattr(trainer, "gradient_clip_algorithm", "norm") or "norm")
            fused = (trainer is not None and bool(trainer.gradient_clip_val)
                     and algorithm.lower().endswith("norm")
                     and not getattr(optimizer, "_step_supports_amp_scaling", False)
                     and not _hooks_see_grads_before_the_clip(trainer, model))
            if not fused:
                return super().optimizer_step(optimizer, model, closure, **kwargs)

            def closure_then_defer():
                result = closure()
                if result is not None:  # Lightning's next call is its unscale_
                    self.scaler.unscale_ = self._unscale_later
                return result

            try:  # Lightning's own step, with its unscale moved into the clip
                return super().optimizer_step(optimizer, model, closure_then_defer, **kwargs)
            finally:
                self.scaler.__dict__.pop("unscale_", None)
                self._deferred = None

        def _end_deferral(self) -> Any:
            """The optimizer whose unscale was deferred, or None; the deferral ends."""
            self.scaler.__dict__.pop("unscale_", None)
            deferred, self._deferred = self._deferred, None
            return deferred

        def _unscale_deferred_now(self) -> None:
            deferred = self._end_deferral()
            if deferred is not None:
                self.scaler.unscale_(deferred)

        def _unscale_later(self, optimizer: Any) -> None:
            """``scaler.unscale_`` from the closure's end until the deferral ends: Lightning's
            own call is deferred; any other sees Lightning's state (the deferred unscale done
            first: torch's error for a second unscale of one optimizer, as Lightning's)."""
            if self._deferred is None:
                self._deferred = optimizer
                return
            self._unscale_deferred_now()
            self.scaler.unscale_(optimizer)

        def _after_closure(self, model: Any, optimizer: Any) -> None:
            super()._after_closure(model, optimizer)  # the hooks, then the clip
            self._unscale_deferred_now()  # no clip by norm took it: before the step

        def clip_grad_by_norm(self, optimizer: Any, clip_val: float) -> None:
            if self._end_deferral() is None:  # no unscale deferred: Lightning's own clip
                return super().clip_grad_by_norm(optimizer, clip_val)
            self.scaler.clip_grad_norm_(_inner_optimizer(optimizer), float(clip_val),
                                        sharded=False)

        def clip_grad_by_value(self, optimizer: Any, clip_val: float) -> None:
            self._unscale_deferred_now()  # unscaled first, as Lightning's
            return super().clip_grad_by_value(optimizer, clip_val)

        def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
            super().on_load_checkpoint(checkpoint)
            if type(self).__qualname__ not in checkpoint and _OLD_PLUGIN_KEY in checkpoint:
                self.load_state_dict(checkpoint[_OLD_PLUGIN_KEY])

    # Lightning saves and restores a precision plugin's state under its class's qualified
    # name: Lightning's own, so that a run resumes at its saved scale with either plugin
    FusedClipMixedPrecision.__qualname__ = mixed_precision.__qualname__
    return FusedClipMixedPrecision("16-mixed", device, scaler or GradScaler(device))
