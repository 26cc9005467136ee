"""Device-side scale / growth-tracker / hysteresis update: one single-program kernel.

The policy is torch's ``_amp_update_scale_`` extended with Megatron-core hysteresis (optionally
DeepSpeed's consecutive refill) and a floor / cap on the scale. Factors are read from a float64
device buffer (``PARAMS_LAYOUT``), so the factor math is fp64 like torch's and a captured CUDA
graph sees later changes to them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launcher import launch
from .stats import record_watch

__all__ = ["PARAMS_LAYOUT", "launch_update_scale", "update_scale_kernel"]

#: What ``params_ptr`` points to: float64 values in this order (the caller builds the buffer)
PARAMS_LAYOUT = ("growth_factor", "backoff_factor", "growth_interval", "min_scale", "max_scale",
                 "hysteresis")
_OPTIONS = {"num_warps": 1, "enable_fp_fusion": False}


@triton.jit
def update_scale_kernel(
    scale_ptr,  # *Pointer* to the fp32 scale, updated in place
    growth_tracker_ptr,  # *Pointer* to the int32 count of clean steps since the last change
    found_inf_ptr,  # *Pointer* to N_FOUND fp32 overflow flags (one per device or optimizer)
    hysteresis_tracker_ptr,  # *Pointer* to the int32 hysteresis tracker (HAS_HYSTERESIS)
    params_ptr,  # *Pointer* to the float64 settings, laid out as PARAMS_LAYOUT
    skipped_ptr,  # *Pointer* to last_step_skipped, a bool's byte (RECORD_SKIP)
    skipped_count_ptr,  # *Pointer* to the int64 count of skipped steps (RECORD_SKIP)
    stats_ptr,  # *Pointer* to a watch's float64 rows of 5 (WATCH: kernels/stats.py)
    overflow_ptr,  # *Pointer* to the watch's last overflow's counts (WATCH)
    counters_ptr,  # *Pointer* to the watch's 5 float64 counters (WATCH)
    guard_ptr,  # *Pointer* to a spike guard's float64 statistics (GUARD: kernels/guard.py)
    n_rows,  # Rows at stats_ptr (WATCH)
    N_FOUND: tl.constexpr,  # Number of flags; any non-zero one is an overflow
    HAS_HYSTERESIS: tl.constexpr,  # Back off only when the hysteresis tracker runs out
    CONSECUTIVE_HYSTERESIS: tl.constexpr,  # Refill the tracker on every clean step
    DYNAMIC: tl.constexpr,  # Update the scale (False: static scaling, flags only)
    RECORD_SKIP: tl.constexpr,  # Write last_step_skipped and the skipped-step count
    RESET_FOUND: tl.constexpr,  # Zero the flags for the next iteration
    WATCH: tl.constexpr,  # Record the iteration for a watch (before the scale changes)
    GUARD: tl.constexpr,  # A guard's spike skipped the step: recorded, not an overflow
):
    # The iteration's overflow: any of the N_FOUND flags non-zero (NaN counts, as torch's
    # ``found_inf != 0``); RESET_FOUND zeroes them for the next iteration.
    flags = tl.load(found_inf_ptr + tl.arange(0, N_FOUND))
    found = tl.max((flags != 0).to(tl.int32), axis=0) > 0
    if RESET_FOUND:
        tl.store(found_inf_ptr + tl.arange(0, N_FOUND), tl.zeros((N_FOUND,), tl.float32))
    spiked = found & False
    if GUARD:  # the guard's spike flag (STATS_LAYOUT's "spike"), zeroed for the next step
        spiked = tl.load(guard_ptr + 4) != 0
        tl.store(guard_ptr + 4, 0.0)
    if RECORD_SKIP:  # last_step_skipped (uint8 view of a bool) and the skipped-step count
        skipped = found | spiked
        tl.store(skipped_ptr, skipped.to(tl.uint8))
        tl.store(skipped_count_ptr, tl.load(skipped_count_ptr) + skipped.to(tl.int64))
    if WATCH:
        record_watch(found, spiked, stats_ptr, overflow_ptr, counters_ptr, scale_ptr, n_rows,
                     RECORD_SKIP, 128)
    if DYNAMIC:
        _update_scale(scale_ptr, growth_tracker_ptr, hysteresis_tracker_ptr, params_ptr, found,
                      HAS_HYSTERESIS, CONSECUTIVE_HYSTERESIS)


@triton.jit
def _update_scale(scale_ptr, growth_tracker_ptr, hysteresis_tracker_ptr, params_ptr, found,
                  HAS_HYSTERESIS: tl.constexpr, CONSECUTIVE_HYSTERESIS: tl.constexpr):
    growth_factor = tl.load(params_ptr + 0)
    backoff_factor = tl.load(params_ptr + 1)
    growth_interval = tl.load(params_ptr + 2).to(tl.int32)
    min_scale = tl.load(params_ptr + 3)
    max_scale = tl.load(params_ptr + 4)

    scale = tl.load(scale_ptr)
    scale64 = scale.to(tl.float64)
    successful = tl.load(growth_tracker_ptr) + 1
    at_interval = successful == growth_interval

    backed64 = scale64 * backoff_factor
    # min_scale 0 is no floor (torch's rule: a negative scale set through
    # update(new_scale=tensor) keeps backing off as in torch)
    backed = tl.where((backed64 < min_scale) & (min_scale > 0), min_scale,
                      backed64).to(tl.float32)
    grown64 = scale64 * growth_factor
    grown = tl.where(grown64 > max_scale, max_scale, grown64).to(tl.float32)
    grown_finite = tl.abs(grown) < float("inf")

    if HAS_HYSTERESIS:
        hysteresis = tl.load(params_ptr + 5).to(tl.int32)
        tracker = tl.load(hysteresis_tracker_ptr)
        decremented = tracker - 1
        back_off = found & (decremented <= 0)
        if CONSECUTIVE_HYSTERESIS:
            refilled = hysteresis
        else:
            refilled = tl.where(at_interval, hysteresis, tracker)
        tl.store(hysteresis_tracker_ptr, tl.where(found, decremented, refilled))
    else:
        back_off = found

    new_scale = tl.where(found, tl.where(back_off, backed, scale),
                         tl.where(at_interval & grown_finite, grown, scale))
    new_tracker = tl.where(found | at_interval, 0, successful)
    tl.store(scale_ptr, new_scale)
    tl.store(growth_tracker_ptr, new_tracker)


def launch_update_scale(
    scale: torch.Tensor,
    growth_tracker: torch.Tensor,
    found_inf: torch.Tensor,
    params: torch.Tensor,
    hysteresis_tracker: torch.Tensor | None,
    consecutive_hysteresis: bool,
    *,
    dynamic: bool = True,
    skipped: torch.Tensor | None = None,
    skipped_count: torch.Tensor | None = None,
    reset_found: bool = False,
    watch: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    guard: torch.Tensor | None = None,
) -> None:
    """The update of ``scale`` (0-d fp32), ``growth_tracker`` and ``hysteresis_tracker`` (0-d
    int32) in place from ``found_inf`` and ``params`` (fp64, ``PARAMS_LAYOUT``), all on one
    device: one launch.

    ``found_inf`` is a 0-d fp32 flag, or a 1-D fp32 tensor of flags (one per optimizer, a
    power-of-two count) of which any non-zero one is an overflow. The scaler's whole
    ``update()`` in this one launch: ``skipped`` (0-d bool, or its ``uint8`` view) and
    ``skipped_count`` (0-d int64) record the overflow, ``reset_found`` zeroes the flags for
    the next iteration and ``dynamic=False`` leaves the scale as it is. ``watch``: a
    watch's ``(stats, overflow, counters)`` (float64, kernels/stats.py's
    :func:`~.stats.record_watch`), recorded before the scale changes. ``guard``: a skipping
    spike guard's statistics (``guard.STATS_LAYOUT``), whose spike is recorded as a skipped
    step (not an overflow: the scale does not back off) and zeroed. Asynchronous: no host
    synchronisation."""
    has_hysteresis = hysteresis_tracker is not None
    n_found = found_inf.numel()
    if n_found & (n_found - 1) or not found_inf.is_contiguous():
        raise ValueError(f"found_inf must hold a power-of-two count of contiguous flags; "
                         f"got {n_found}")
    record = skipped is not None
    if skipped is not None and skipped.dtype != torch.uint8:
        skipped = skipped.view(torch.uint8)  # the kernel writes the flag's byte
    launch(update_scale_kernel, 1, (
        scale, growth_tracker, found_inf,
        hysteresis_tracker if has_hysteresis else growth_tracker, params,
        skipped if record else found_inf,
        skipped_count if record else growth_tracker,
        *(watch if watch is not None else (params, params, params)),
        params if guard is None else guard,
    ), (0 if watch is None else watch[0].shape[0],), dict(
        N_FOUND=n_found, HAS_HYSTERESIS=has_hysteresis,
        CONSECUTIVE_HYSTERESIS=consecutive_hysteresis, DYNAMIC=dynamic, RECORD_SKIP=record,
        RESET_FOUND=reset_found, WATCH=watch is not None, GUARD=guard is not None,
    ), _OPTIONS)
