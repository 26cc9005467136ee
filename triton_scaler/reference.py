"""Pure-PyTorch reference path: device-agnostic, bit-exact with torch's ops, no host sync.

These functions are the oracle the Triton kernels are tested against, and the CPU fallback.
They call torch's own fused ops wherever the result is identical, so the CPU path is as fast
as ``torch.amp.GradScaler("cpu")``.
"""

from __future__ import annotations

import ctypes

import torch


def _may_overflow(inv_scale: torch.Tensor) -> bool:
    """Whether ``finite * inv_scale`` can be non-finite, i.e. ``inv_scale`` is not in [0, 1].

    On CPU the value is read straight from memory (there is no device to synchronise with);
    elsewhere the answer is conservatively True, which costs one extra read of the grads.
    """
    if inv_scale.device.type != "cpu":
        return True
    value = ctypes.c_float.from_address(inv_scale.contiguous().data_ptr()).value
    return not 0.0 <= value <= 1.0


def non_finite_check_and_unscale_(
    grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor
) -> None:
    """``grads[i] = dtype(fp32(grads[i]) * inv_scale)``; ``found_inf = 1.0`` if an input or a
    product is non-finite. Grads share found_inf's device; any float dtype mix."""
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
    if _may_overflow(inv_scale):
        # torch checks only the inputs; a scale below 1 (or 0) can overflow the products.
        check_(grads, found_inf)


def check_(grads: list[torch.Tensor], found_inf: torch.Tensor,
           inv_scale: torch.Tensor | None = None) -> None:
    """Set ``found_inf = 1.0`` if any element of ``grads`` (or ``inv_scale``) is non-finite.
    The grads' values are not changed."""
    if grads:
        one = torch.ones((), dtype=torch.float32, device=found_inf.device)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, one)
    if inv_scale is not None:
        found_inf.copy_(torch.where(inv_scale.isfinite(), found_inf, 1.0))


def update_scale_(
    scale: torch.Tensor,
    growth_tracker: torch.Tensor,
    found_inf: torch.Tensor,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    hysteresis_tracker: torch.Tensor | None,
    hysteresis: int,
    consecutive_hysteresis: bool,
    min_scale: float,
    max_scale: float,
) -> None:
    """torch's ``_amp_update_scale_`` plus hysteresis and a floor / cap, with tensor ops only."""
    if hysteresis_tracker is None and min_scale == 0.0 and max_scale == float("inf"):
        torch._amp_update_scale_(scale, growth_tracker, found_inf,
                                 growth_factor, backoff_factor, growth_interval)
        return
    scale64 = scale.double()
    found = found_inf != 0
    successful = growth_tracker + 1
    at_interval = successful == growth_interval
    backed = scale64 * backoff_factor
    backed = torch.where(backed < min_scale, min_scale, backed).float()
    grown = scale64 * growth_factor
    grown = torch.where(grown > max_scale, max_scale, grown).float()
    back_off = found
    if hysteresis_tracker is not None:
        decremented = hysteresis_tracker - 1
        back_off = found & (decremented <= 0)
        refill = torch.ones_like(at_interval) if consecutive_hysteresis else at_interval
        refilled = torch.where(refill, hysteresis, hysteresis_tracker)
        hysteresis_tracker.copy_(torch.where(found, decremented, refilled))
    new_scale = torch.where(found, torch.where(back_off, backed, scale),
                            torch.where(at_interval & grown.isfinite(), grown, scale))
    scale.copy_(new_scale)
    growth_tracker.copy_(torch.where(found | at_interval, 0, successful))
