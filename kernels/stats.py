"""A watched scaler's device work: :func:`finish_stats_kernel` sums each watched tensor's
row from the four values per program that a read pass of the unscale kernel stored
(``STATS=True``), one program per tensor, in a launch of its own (:func:`launch_finish_stats`);
:func:`record_watch`, run by the update kernel (``WATCH``), records each ``update()``'s
overflow and the run of skipped steps.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launcher import launch

#: rows summed at a time (:func:`_pairwise_sum`'s 128)
GROUP = tl.constexpr(128)
_FINISH_OPTIONS = {"num_warps": 4, "enable_fp_fusion": False}


@triton.jit
def _pairwise_sum(x):
    """The sum of 128 values as a fixed tree of pairwise additions: the same bits whatever
    the launch's warps and layout (``tl.sum``'s order depends on them)."""
    x = tl.sum(tl.reshape(x, (64, 2)), axis=1)
    x = tl.sum(tl.reshape(x, (32, 2)), axis=1)
    x = tl.sum(tl.reshape(x, (16, 2)), axis=1)
    x = tl.sum(tl.reshape(x, (8, 2)), axis=1)
    x = tl.sum(tl.reshape(x, (4, 2)), axis=1)
    x = tl.sum(tl.reshape(x, (2, 2)), axis=1)
    return tl.sum(x, axis=0)


@triton.jit
def _sum_rows(stats_ptr, begin, end):
    """Rows ``[begin, end)`` of four statistics summed (amax: their largest), ``GROUP`` rows
    at a time in order, each round by :func:`_pairwise_sum`: deterministic."""
    sumsq = tl.zeros((), tl.float64)
    amax = tl.zeros((), tl.float64)
    infs = tl.zeros((), tl.float64)
    nans = tl.zeros((), tl.float64)
    for first in range(begin, end, GROUP):
        rows = first + tl.arange(0, GROUP)
        ptrs = stats_ptr + 4 * rows
        mask = rows < end
        sumsq += _pairwise_sum(tl.load(ptrs, mask=mask, other=0.0))
        amax = tl.maximum(amax, tl.max(tl.load(ptrs + 1, mask=mask, other=0.0), axis=0))
        infs += tl.sum(tl.load(ptrs + 2, mask=mask, other=0.0), axis=0)
        nans += tl.sum(tl.load(ptrs + 3, mask=mask, other=0.0), axis=0)
    return sumsq, amax, infs, nans


@triton.jit
def _store_row(out, sumsq, amax, infs, nans):
    tl.store(out, tl.where(nans > 0, float("nan"), amax))
    tl.store(out + 1, sumsq)
    tl.store(out + 2, infs)
    tl.store(out + 3, nans)
    tl.store(out + 4, tl.full((), 1.0, tl.float64))


@triton.jit
def finish_stats_kernel(
    stats_ptr,  # *Pointer* to float64 statistics, 4 a row: one row per program of a read pass
    ranges_ptr,  # *Pointer* to int64 (begin, end) per tensor: its programs' rows
    out_ptr,  # *Pointer* to float64 rows of 5: amax, sum of squares, inf and NaN counts, 1
):
    """Program ``t`` sums tensor ``t``'s rows of ``stats_ptr`` into row ``t`` of ``out_ptr``
    (amax NaN where a NaN was seen): fixed rounds in a fixed order, the same bits on every
    run and route."""
    t = tl.program_id(0)
    begin = tl.load(ranges_ptr + 2 * t)
    end = tl.load(ranges_ptr + 2 * t + 1)
    sumsq, amax, infs, nans = _sum_rows(stats_ptr, begin, end)
    _store_row(out_ptr + 5 * t, sumsq, amax, infs, nans)


def launch_finish_stats(stats: torch.Tensor, ranges: torch.Tensor, out: torch.Tensor) -> None:
    """Each tensor's row of ``out`` (float64 ``[n, 5]``) from its programs' rows of ``stats``
    (float64 ``[programs, 4]``), ``ranges`` (int64 ``[n, 2]``) on their device: one launch of
    ``n`` programs. Asynchronous: no host sync."""
    launch(finish_stats_kernel, out.shape[0], (stats, ranges, out), (), {}, _FINISH_OPTIONS)


@triton.jit
def record_watch(
    found,  # this iteration's overflow (the scaler's flags), a scalar
    spiked,  # whether a spike guard skipped this iteration's step, a scalar
    stats_ptr,  # *Pointer* to the watch's float64 rows of 5 (finish_tensor's out)
    overflow_ptr,  # *Pointer* to float64 rows of 2: the last overflow's inf and NaN counts
    counters_ptr,  # *Pointer* to 5 float64: last overflow step, its scale, iteration, run of
    #                skipped steps, longest run
    scale_ptr,  # *Pointer* to the fp32 scale of this iteration (before its update)
    n_rows,  # Rows at stats_ptr
    SKIPS: tl.constexpr,  # An overflow skips the step (the run of skipped steps grows; a
    #                       guard's skip grows it too)
    ROWS_BLOCK: tl.constexpr,  # Rows read at a time
):
    """A watched scaler's record of one ``update()`` (run by the update kernel, ``WATCH``):
    an overflow (``found``, or a watched grad with inf or NaN) copies the rows' counts to the
    last overflow's, with its iteration and scale; the run of skipped steps and its longest."""
    offsets = tl.arange(0, ROWS_BLOCK)
    hit = found.to(tl.int32)
    for first in range(0, n_rows, ROWS_BLOCK):  # a watched grad with inf or NaN
        rows = first + offsets
        mask = rows < n_rows
        counts = tl.load(stats_ptr + 5 * rows + 2, mask=mask, other=0.0) + \
            tl.load(stats_ptr + 5 * rows + 3, mask=mask, other=0.0)
        hit = tl.maximum(hit, tl.max((counts > 0).to(tl.int32), axis=0))
    if hit > 0:  # this iteration's counts are the last overflow's
        for first in range(0, n_rows, ROWS_BLOCK):
            rows = first + offsets
            mask = rows < n_rows
            tl.store(overflow_ptr + 2 * rows, tl.load(stats_ptr + 5 * rows + 2, mask=mask),
                     mask=mask)
            tl.store(overflow_ptr + 2 * rows + 1, tl.load(stats_ptr + 5 * rows + 3, mask=mask),
                     mask=mask)
    last_step = tl.load(counters_ptr)
    last_scale = tl.load(counters_ptr + 1)
    iteration = tl.load(counters_ptr + 2)
    run = tl.load(counters_ptr + 3)
    longest = tl.load(counters_ptr + 4)
    seen = hit > 0
    if SKIPS:
        run = tl.where(seen | spiked, run + 1.0, 0.0)
    else:
        run = run * 0.0
    tl.store(counters_ptr, tl.where(seen, iteration, last_step))
    tl.store(counters_ptr + 1, tl.where(seen, tl.load(scale_ptr).to(tl.float64), last_scale))
    tl.store(counters_ptr + 2, iteration + 1.0)
    tl.store(counters_ptr + 3, run)
    tl.store(counters_ptr + 4, tl.maximum(longest, run))
