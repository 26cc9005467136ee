"""MindSpore's loss scalers (``mindspore.amp``) and loss-scale managers on triton_scaler's ops.

``DynamicLossScaler.adjust`` is MindSpore's branch-free rule, which is torch's rule with a floor
of 1: ``counter = ((counter + 1) % window) * finite``; growth by ``scale_factor`` when the old
counter is ``window - 1`` and the grown scale is finite; backoff ``max(scale / factor, 1)``.
It runs as one :func:`triton_scaler.ops.update_scale_` call (backoff as a multiplication by
``1 / scale_factor``: identical for power-of-two factors).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import overload

import torch

from .. import ops, reference
from .._backend import Backend, check_backend
from ..grad_scaler import GradScaler
from ..policy import INT32_MAX, ScalePolicy, as_bool, as_int, check_scale_value
from ._common import bool_flags, default_device, overflow_flag, update_scale

TensorOrTuple = torch.Tensor | Sequence[torch.Tensor]


def _dynamic_policy(scale_factor: object, scale_window: object) -> ScalePolicy:
    """MindSpore's rule as a policy: growth by ``scale_factor`` (an int >= 2), backoff by its
    reciprocal, floored at 1; errors name MindSpore's arguments."""
    factor = as_int("scale_factor", scale_factor, 2, INT32_MAX, "an int >= 2")
    return ScalePolicy.create(
        dict(growth_factor=float(factor), backoff_factor=1.0 / factor,
             growth_interval=scale_window, min_scale=1.0),
        name=lambda field: {"growth_interval": "scale_window"}.get(field, field))


def _overflow_flag(grads_finite: object, flags: torch.Tensor) -> torch.Tensor:
    """The 0-d float32 overflow flag on ``flags``' device (:func:`bool_flags`) of MindSpore's
    ``grads_finite``: a bool or a one-element bool tensor, nothing else (``~1 == -2``)."""
    if isinstance(grads_finite, bool):
        return overflow_flag(not grads_finite, flags)
    if isinstance(grads_finite, torch.Tensor) and grads_finite.dtype == torch.bool \
            and grads_finite.numel() == 1:
        return overflow_flag(~grads_finite, flags)
    raise TypeError("grads_finite must be a bool or a one-element bool tensor (e.g. from "
                    f"all_finite); got {type(grads_finite).__name__} {grads_finite!r}")


def all_finite(inputs: TensorOrTuple, *, backend: Backend = "auto") -> torch.Tensor:
    """0-d bool tensor: every element of ``inputs`` (a tensor or tensors) is finite. No sync."""
    tensors = [inputs] if isinstance(inputs, torch.Tensor) else list(inputs)
    return ops.all_finite(tensors, backend=backend)


class StaticLossScaler:
    """A fixed loss scale: ``scale`` multiplies, ``unscale`` divides; ``adjust`` does nothing."""

    def __init__(self, scale_value: float, *, device: str | torch.device | None = None,
                 backend: Backend = "auto") -> None:
        value = check_scale_value("scale_value", scale_value)
        check_backend(backend)
        self._backend = backend
        self.scale_value = torch.full((), value, dtype=torch.float32,
                                      device=default_device(device))

    def _map(self, inputs: TensorOrTuple, fn):
        if isinstance(inputs, torch.Tensor):
            return fn(inputs)
        return tuple(fn(x) for x in inputs)

    @overload  # a tensor gives a tensor, a sequence of tensors a tuple
    def scale(self, inputs: torch.Tensor) -> torch.Tensor: ...
    @overload
    def scale(self, inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]: ...

    def scale(self, inputs: TensorOrTuple) -> TensorOrTuple:
        """``inputs * scale_value`` (out of place)."""
        return self._map(inputs, lambda x: x * self.scale_value.to(x.device))

    @overload
    def unscale(self, inputs: torch.Tensor) -> torch.Tensor: ...
    @overload
    def unscale(self, inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]: ...

    def unscale(self, inputs: TensorOrTuple) -> TensorOrTuple:
        """``inputs`` divided by ``scale_value`` (out of place): one fused unscale over all
        inputs, ``dtype(fp32(x) * (1 / scale))``, on the device."""
        outputs = self._map(inputs, lambda x: x.clone())
        tensors = [outputs] if isinstance(outputs, torch.Tensor) else list(outputs)
        if tensors:
            device = tensors[0].device
            inv = reference.inv_scale_of(self.scale_value.to(device))
            found = torch.zeros((), dtype=torch.float32, device=device)
            ops.non_finite_check_and_unscale_(tensors, found, inv, backend=self._backend)
        return outputs

    def adjust(self, grads_finite: torch.Tensor) -> bool:
        return False


class DynamicLossScaler(StaticLossScaler):
    """MindSpore ``DynamicLossScaler(scale_value, scale_factor, scale_window)``."""

    def __init__(self, scale_value: float, scale_factor: int, scale_window: int, *,
                 device: str | torch.device | None = None, backend: Backend = "auto") -> None:
        self._policy = _dynamic_policy(scale_factor, scale_window)
        super().__init__(scale_value, device=device, backend=backend)
        self.scale_factor = int(self._policy.growth_factor)
        self.scale_window = self._policy.growth_interval
        self.counter = torch.zeros((), dtype=torch.int32, device=self.scale_value.device)
        self._bool_flags = bool_flags(self.scale_value.device)

    def adjust(self, grads_finite: torch.Tensor) -> bool:
        """Update ``scale_value`` from ``grads_finite`` (a bool or a one-element bool tensor),
        on the device. ``TypeError`` for any other flag, as MindSpore."""
        found = _overflow_flag(grads_finite, self._bool_flags)
        update_scale(self.scale_value, self.counter, found, self._policy, self._backend)
        return True


class FixedLossScaleManager:
    """MindSpore ``FixedLossScaleManager``: a static scale; with ``drop_overflow_update=False``
    the optimizer step is taken even on overflow (as MindSpore does)."""

    def __init__(self, loss_scale: float = 128.0, drop_overflow_update: bool = True) -> None:
        scale = check_scale_value("loss_scale", loss_scale)
        if scale < 1.0:
            raise ValueError(f"loss_scale must be a finite number >= 1; got {loss_scale!r}")
        self._loss_scale = scale
        self._drop_overflow_update = as_bool("drop_overflow_update", drop_overflow_update)

    def get_loss_scale(self) -> float:
        return self._loss_scale

    def get_drop_overflow_update(self) -> bool:
        return self._drop_overflow_update

    def get_grad_scaler(self, device: str | torch.device | None = None,
                        backend: Backend = "auto") -> GradScaler:
        """A static :class:`triton_scaler.GradScaler` with this scale (``backend`` as the
        scaler's)."""
        return GradScaler(default_device(device).type, init_scale=self._loss_scale,
                          dynamic=False, skip_on_overflow=self._drop_overflow_update,
                          backend=backend)


class DynamicLossScaleManager:
    """MindSpore ``DynamicLossScaleManager(init_loss_scale, scale_factor, scale_window)``."""

    def __init__(self, init_loss_scale: float = 2.0**24, scale_factor: int = 2,
                 scale_window: int = 2000) -> None:
        self._policy = _dynamic_policy(scale_factor, scale_window)
        self._init_loss_scale = check_scale_value("init_loss_scale", init_loss_scale,
                                                  self._policy)
        self.scale_factor = int(self._policy.growth_factor)
        self.scale_window = self._policy.growth_interval

    def get_loss_scale(self) -> float:
        return self._init_loss_scale

    def get_drop_overflow_update(self) -> bool:
        return True

    def get_grad_scaler(self, device: str | torch.device | None = None,
                        backend: Backend = "auto") -> GradScaler:
        """A :class:`triton_scaler.GradScaler` following MindSpore's dynamic rule
        (``backend`` as the scaler's)."""
        policy = self._policy
        return GradScaler(default_device(device).type, init_scale=self._init_loss_scale,
                          growth_factor=policy.growth_factor,
                          backoff_factor=policy.backoff_factor,
                          growth_interval=policy.growth_interval, min_scale=policy.min_scale,
                          backend=backend)
