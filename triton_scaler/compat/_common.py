"""Helpers shared by the adapters: the default device, the gradient lists, host flags and
values as the device holds them."""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable

import torch

from .. import ops
from .._backend import Backend
from ..policy import ScalePolicy


def default_device(device: str | torch.device | None) -> torch.device:
    """The given device, else CUDA when available, else CPU."""
    if device is not None:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def grads_of(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The dense gradients of ``params`` (sparse ones as their values), skipping ``None``."""
    grads = []
    for p in params:
        g = p.grad
        if g is not None:
            grads.append(g._values() if g.is_sparse else g)
    return grads


def bool_flags(device: torch.device) -> torch.Tensor:
    """``[0.0, 1.0]`` (float32) on ``device``, made once per scaler: a host bool ``b`` becomes
    the device flag ``flags[int(b)]``, a view, with no host-to-device copy per step (on CUDA a
    copy from a Python value synchronises)."""
    return torch.tensor([0.0, 1.0], dtype=torch.float32, device=device)


def overflow_flag(overflow: bool | torch.Tensor, flags: torch.Tensor) -> torch.Tensor:
    """``overflow`` as the 0-d float32 flag on ``flags``' device (``flags``: :func:`bool_flags`):
    a host bool picks one of ``flags`` (a view, no copy); a one-element tensor (any non-zero
    value an overflow) is converted there. No host read."""
    if isinstance(overflow, bool):
        return flags[int(overflow)]
    return torch.as_tensor(overflow, device=flags.device).to(torch.float32).reshape(())


def fp32_value(value: float) -> float:
    """``value`` rounded to float32 (to nearest, ties to even), as a float32 tensor holds it;
    ``±inf`` past float32's range. Pure Python: no tensor, no host read."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


def update_scale(scale: torch.Tensor, growth_tracker: torch.Tensor, found_inf: torch.Tensor,
                 policy: ScalePolicy, backend: Backend,
                 hysteresis_tracker: torch.Tensor | None = None) -> None:
    """:func:`triton_scaler.ops.update_scale_` with ``policy``'s settings. No host sync."""
    ops.update_scale_(scale, growth_tracker, found_inf, policy.growth_factor,
                      policy.backoff_factor, policy.growth_interval,
                      hysteresis_tracker=hysteresis_tracker, hysteresis=policy.hysteresis,
                      consecutive_hysteresis=policy.consecutive_hysteresis,
                      min_scale=policy.min_scale, max_scale=policy.max_scale, backend=backend)
