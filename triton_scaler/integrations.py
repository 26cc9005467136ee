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

    Fused (``scaler.clip_grad_norm_``) when ``accelerator.scaler`` is a
    :class:`triton_scaler.GradScaler`, the run is not FSDP / DeepSpeed / XLA, and one prepared
    optimizer holds exactly ``parameters``' grads; otherwise Accelerate's own method. Install
    the scaler before ``prepare``: ``accelerator.scaler = triton_scaler.GradScaler("cuda")``.
    """
    parameters = list(parameters)
    scaler = getattr(accelerator, "scaler", None)
    plain_run = getattr(accelerator.distributed_type, "value", "") in ("NO", "MULTI_GPU",
                                                                        "MULTI_CPU")
    if isinstance(scaler, GradScaler) and scaler.is_enabled() and plain_run \
            and getattr(accelerator, "native_amp", False) and len(accelerator._optimizers) == 1:
        optimizer = _inner_optimizer(accelerator._optimizers[0])
        if _covers_exactly(optimizer, parameters):
            return scaler.clip_grad_norm_(optimizer, max_norm, norm_type, sharded=False)
    return accelerator.clip_grad_norm_(parameters, max_norm, norm_type)


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


def lightning_precision_plugin(device: str = "cuda", scaler: GradScaler | None = None) -> Any:
    """A Lightning Trainer precision plugin (``"16-mixed"``) that unscales with
    :class:`triton_scaler.GradScaler` and, when the Trainer clips by norm
    (``gradient_clip_val`` with the default ``"norm"`` algorithm), unscales and clips in one
    fused call. Use ``Trainer(plugins=[lightning_precision_plugin("cuda")],
    gradient_clip_val=1.0)``. With clipping by norm, ``on_before_optimizer_step`` and
    ``configure_gradient_clipping`` see the grads still scaled (the unscale happens inside the
    clip); without it, and for ``clip_gradients`` called in manual optimization, the plugin
    behaves exactly as Lightning's ``MixedPrecision``."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    class FusedClipMixedPrecision(MixedPrecision):
        #: The optimizer whose unscale Lightning asked for after the closure and the clip by
        #: norm takes over; None outside that window (Lightning's ``_after_closure``).
        _deferred: Any = None

        def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any],
                           **kwargs: Any) -> Any:
            trainer = getattr(model, "_trainer", None)
            algorithm = str(getattr(trainer, "gradient_clip_algorithm", "norm") or "norm")
            fused = (trainer is not None and bool(trainer.gradient_clip_val)
                     and algorithm.lower().endswith("norm")
                     and not getattr(optimizer, "_step_supports_amp_scaling", False))
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

    return FusedClipMixedPrecision("16-mixed", device, scaler or GradScaler(device))
