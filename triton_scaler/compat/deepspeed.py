"""DeepSpeed's fp16 loss scalers (``deepspeed.runtime.fp16.loss_scaler``) on triton_scaler's ops.

The scale, growth tracker and hysteresis tracker live on the device and are updated by
:func:`triton_scaler.ops.update_scale_` (Megatron-style hysteresis, optionally consecutive);
the adapter adds only DeepSpeed's growth timing (its first growth after an overflow comes on
the ``scale_window + 1``-th clean step) and its raise at the minimum scale.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from .. import ops
from .._backend import Backend, check_backend
from ..policy import ScalePolicy, as_bool, check_scale_value
from ._common import (
    bool_flags,
    default_device,
    fp32_value,
    grads_of,
    overflow_flag,
    update_scale,
)

_DEEPSPEED_NAMES = {"growth_interval": "scale_window", "hysteresis": "delayed_shift"}


class LossScaler:
    """Static loss scale (DeepSpeed ``LossScaler``): overflows are reported, never acted on."""

    dynamic = False

    def __init__(self, scale: float = 1.0, *, device: str | torch.device | None = None,
                 backend: Backend = "auto") -> None:
        self._init_state(check_scale_value("scale", scale), device, backend)

    def _init_state(self, scale: float, device, backend: Backend) -> None:
        check_backend(backend)
        self._device = default_device(device)
        self._backend = backend
        self._scale = torch.full((), scale, dtype=torch.float32, device=self._device)
        self._known_scale: float | None = fp32_value(scale)  # the device value, when known

    @property
    def loss_scale(self) -> float:
        """The current scale as a Python float. DeepSpeed's optimizers read it several times
        a step: only the first read after an update reads the device (one sync)."""
        if self._known_scale is None:
            self._known_scale = float(self._scale.item())
        return self._known_scale

    @property
    def cur_scale(self) -> float:
        """The current scale, as :attr:`loss_scale`. Settable, as DeepSpeed's attribute,
        which its ZeRO optimizers' ``loss_scale`` / ``cur_scale`` setters write: the device
        scale is filled (no sync); a value that is not a finite float32 scale > 0 raises."""
        return self.loss_scale

    @cur_scale.setter
    def cur_scale(self, value: float) -> None:
        scale = check_scale_value("cur_scale", value)
        self._scale.fill_(scale)
        self._known_scale = fp32_value(scale)

    def scale_gradient(self, module: torch.nn.Module, grad_in: tuple[torch.Tensor | None, ...],
                       grad_out: tuple[torch.Tensor | None, ...]
                       ) -> tuple[torch.Tensor | None, ...]:
        """Backward hook form: multiply each incoming grad by the scale (on the device)."""
        return tuple(None if g is None else g * self._scale.to(g.device) for g in grad_in)

    def update_scale(self, overflow: bool | torch.Tensor) -> None:
        """Static: nothing to update."""

    def has_overflow(self, params: Iterable[torch.Tensor]) -> torch.Tensor:
        """0-d bool tensor on the grads' device: True when any grad is non-finite (no sync)."""
        return ~ops.all_finite(grads_of(params), backend=self._backend)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * scale`` on the device (no sync)."""
        return loss * self._scale.to(loss.device)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        self.scale_loss(loss).backward(retain_graph=retain_graph)


class DynamicLossScaler(LossScaler):
    """DeepSpeed ``DynamicLossScaler``: halve on overflow (after ``delayed_shift`` overflows of
    hysteresis), double after ``scale_window`` clean steps, never below ``min_scale``.

    ``update_scale(overflow)`` takes a bool (as DeepSpeed's optimizers pass it; no upload) or
    a 0-d tensor (e.g. from :meth:`has_overflow`, which avoids a host sync).
    ``raise_error_at_min_scale`` reads the state on the host (one sync) at an update that may
    back off, i.e. not at a clean step given as ``False``. ``loss_scale`` / ``cur_scale``
    read the device only at their first read after an update.
    """

    dynamic = True
    scale_factor = 2.0

    def __init__(self, init_scale: float = 2.0**32, scale_window: int = 1000,
                 min_scale: float = 1.0, delayed_shift: int = 1,
                 consecutive_hysteresis: bool = False, raise_error_at_min_scale: bool = True,
                 dtype: torch.dtype = torch.half, *, device: str | torch.device | None = None,
                 backend: Backend = "auto") -> None:
        self._policy = ScalePolicy.create(
            dict(growth_factor=self.scale_factor, backoff_factor=1.0 / self.scale_factor,
                 growth_interval=scale_window, hysteresis=delayed_shift, min_scale=min_scale,
                 consecutive_hysteresis=consecutive_hysteresis),
            name=lambda field: _DEEPSPEED_NAMES.get(field, field))
        self._init_state(check_scale_value("init_scale", init_scale, self._policy), device,
                         backend)
        self.scale_window = self._policy.growth_interval
        self.min_scale = self._policy.min_scale
        self.delayed_shift = self._policy.hysteresis
        self.consecutive_hysteresis = self._policy.consecutive_hysteresis
        self.raise_error_at_min_scale = as_bool("raise_error_at_min_scale",
                                                raise_error_at_min_scale)
        self.dtype = dtype
        # DeepSpeed grows on the (scale_window + 1)-th clean step after an overflow (and at
        # the start): the growth tracker starts one below torch's.
        self._growth_tracker = torch.full((), -1, dtype=torch.int32, device=self._device)
        self._hysteresis = torch.full((), self.delayed_shift, dtype=torch.int32, device=self._device)
        self._bool_flags = bool_flags(self._device)

    @property
    def cur_hysteresis(self) -> int:
        """DeepSpeed's counter, which stops at 1 (the device tracker counts on below)."""
        return max(int(self._hysteresis.item()), 1)

    def update_scale(self, overflow: bool | torch.Tensor) -> None:
        found = overflow_flag(overflow, self._bool_flags)  # DeepSpeed passes a bool: no upload
        # a host read, as DeepSpeed's own check; not for a clean step known on the host
        if self.raise_error_at_min_scale and overflow is not False:
            backs_off = (found != 0) & ((self._hysteresis <= 1) | (self.delayed_shift == 1))
            if (backs_off & (self._scale == self.min_scale)).item():
                raise Exception("Current loss scale already at minimum - cannot decrease scale "
                                "anymore. Exiting run.")
        update_scale(self._scale, self._growth_tracker, found, self._policy, self._backend,
                     self._hysteresis)
        self._known_scale = None
        self._growth_tracker.copy_(torch.where(found != 0, -1, self._growth_tracker))


def CreateLossScaler(dtype: torch.dtype, static_loss_scale: float, dynamic_scaling: bool,
                     dynamic_loss_args: dict | None, **kwargs) -> LossScaler:  # noqa: N802
    """DeepSpeed's factory: dynamic scaling only for fp16; bf16 / fp32 get a static 1.0."""
    if dtype == torch.half and dynamic_scaling:
        if dynamic_loss_args is None:
            raise ValueError("Dynamic loss scaling parameters must be defined.")
        return DynamicLossScaler(dtype=dtype, **dynamic_loss_args, **kwargs)
    return LossScaler(scale=static_loss_scale if dtype == torch.half else 1.0, **kwargs)
