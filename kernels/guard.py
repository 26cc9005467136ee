"""The spike guard's decision: one single-program kernel per guarded clip.

ZClip's rule (an EMA of the total gradient norm, a z-score, an adaptive threshold) on float64
statistics kept on the device, so that the decision needs no host read. Every operation is
IEEE-rounded (float64 division and square root are, unlike float32's in Triton) and none is
fused (``enable_fp_fusion=False``): the results equal the reference path's torch ops bit for
bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launcher import launch

__all__ = ["SETTINGS_LAYOUT", "STATS_LAYOUT", "launch_spike_guard", "spike_guard_kernel"]

#: The float64 statistics, in place: finite warm-up norms seen, the mean (their running sum
#: during the warm-up), the variance (the sum of squared deviations during the warm-up), this
#: step's max norm and spike (0 / 1: a skipping guard's ``update()`` reads and zeroes it), the
#: spikes so far, the last spike's norm, threshold and step, and the steps so far.
STATS_LAYOUT = ("count", "mean", "var", "limit", "spike", "spikes", "last_norm",
                "last_threshold", "last_step", "steps")
#: The float64 settings (``one_minus_alpha`` formed on the host, as ZClip's ``1 - alpha``).
SETTINGS_LAYOUT = ("alpha", "one_minus_alpha", "z_thresh", "eps", "clip_factor", "max_norm",
                   "warmup_steps")
_GUARD_OPTIONS = {"num_warps": 1, "enable_fp_fusion": False}


@triton.jit
def spike_guard_kernel(
    stats_ptr,  # *Pointer* to the float64 statistics, laid out as STATS_LAYOUT (in place)
    settings_ptr,  # *Pointer* to the float64 settings, laid out as SETTINGS_LAYOUT
    norm_ptr,  # *Pointer* to this step's total norm before clipping (fp32 or fp64)
    ZSCORE: tl.constexpr,  # mode "zscore" (else "percentile")
    CLIP_MEAN: tl.constexpr,  # clip_option "mean" (else "adaptive_scaling")
    SKIP: tl.constexpr,  # action "skip": a spike skips the step (else it is clipped)
):
    alpha = tl.load(settings_ptr + 0)
    beta = tl.load(settings_ptr + 1)
    z_thresh = tl.load(settings_ptr + 2)
    eps = tl.load(settings_ptr + 3)
    clip_factor = tl.load(settings_ptr + 4)
    max_norm = tl.load(settings_ptr + 5)
    warmup = tl.load(settings_ptr + 6)
    count = tl.load(stats_ptr + 0)
    mean = tl.load(stats_ptr + 1)
    var = tl.load(stats_ptr + 2)
    x = tl.load(norm_ptr).to(tl.float64)
    finite = tl.abs(x) < float("inf")  # an overflow step (inf / NaN) changes nothing
    warm = count < warmup
    # warm-up: the running sum (ZClip's mean of the buffer) and Welford's squared deviations
    n = count + 1.0
    before = tl.where(count > 0.0, mean / tl.maximum(count, 1.0), 0.0)
    total = mean + x
    after = total / n
    deviations = var + (x - before) * (x - after)
    done = n == warmup
    warm_mean = tl.where(done, after, total)
    warm_var = tl.where(done, deviations / n, deviations)
    # after the warm-up: ZClip's z-score or percentile threshold
    std = tl.sqrt(var)
    if ZSCORE:
        z = (x - mean) / (std + eps)
        spike = z > z_thresh
        if CLIP_MEAN:
            threshold = mean
        else:
            threshold = (mean + (z_thresh * std) / (z / z_thresh)) * clip_factor
    else:
        threshold = mean + z_thresh * std
        spike = x > threshold
    spike = spike & finite & (count >= warmup)
    value = tl.where(spike, threshold, x)  # what the EMA takes (a clipped spike: its threshold)
    ema_mean = alpha * mean + beta * value
    deviation = value - ema_mean
    ema_var = alpha * var + beta * (deviation * deviation)
    if SKIP:
        feeds = finite & (count >= warmup) & (spike == 0)
        limit = max_norm
    else:
        feeds = finite & (count >= warmup)
        limit = tl.where(spike, tl.minimum(threshold, max_norm), max_norm)
    warming = warm & finite
    tl.store(stats_ptr + 0, tl.where(warming, n, count))
    tl.store(stats_ptr + 1, tl.where(warming, warm_mean, tl.where(feeds, ema_mean, mean)))
    tl.store(stats_ptr + 2, tl.where(warming, warm_var, tl.where(feeds, ema_var, var)))
    tl.store(stats_ptr + 3, limit)
    tl.store(stats_ptr + 4, spike.to(tl.float64))
    steps = tl.load(stats_ptr + 9) + 1.0
    tl.store(stats_ptr + 5, tl.load(stats_ptr + 5) + spike.to(tl.float64))
    tl.store(stats_ptr + 6, tl.where(spike, x, tl.load(stats_ptr + 6)))
    tl.store(stats_ptr + 7, tl.where(spike, threshold, tl.load(stats_ptr + 7)))
    tl.store(stats_ptr + 8, tl.where(spike, steps, tl.load(stats_ptr + 8)))
    tl.store(stats_ptr + 9, steps)


def launch_spike_guard(stats: torch.Tensor, settings: torch.Tensor, norm: torch.Tensor,
                       zscore: bool, clip_mean: bool, skip: bool) -> None:
    """One guard step: ``stats`` (float64, ``STATS_LAYOUT``) updated in place from ``norm``
    (0-d) and ``settings`` (float64, ``SETTINGS_LAYOUT``), all on one device. No host sync."""
    launch(spike_guard_kernel, 1, (stats, settings, norm), (),
           dict(ZSCORE=zscore, CLIP_MEAN=clip_mean, SKIP=skip), _GUARD_OPTIONS)
