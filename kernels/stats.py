"""A watched scaler's device work besides the unscale kernel's statistics: one small launch
finishes what its programs stored (``STATS=True``: four values per program) into one row per
watched tensor; :func:`record_watch`, run by the update kernel (``WATCH``), records each
``update()``'s overflow and the run of skipped steps.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launcher import launch

ROWS_BLOCK = 128  # program statistics read at a time by one tensor's program
_OPTIONS = {"num_warps": 1, "enable_fp_fusion": False}


@triton.jit
def finish_stats_kernel(
    partials_ptr,  # *Pointer* to the programs' float64 statistics, 4 per program
    bounds_ptr,  # *Pointer* to int64 [begin, end) program ranges, two per watched tensor
    rows_ptr,  # *Pointer* to the int64 row of each watched tensor in out
    out_ptr,  # *Pointer* to float64 rows of 5: amax, sum of squares, inf and NaN counts, 1
    ROWS_BLOCK: tl.constexpr,  # Program statistics read at a time
):
    t = tl.program_id(0)
    begin = tl.load(bounds_ptr + 2 * t)
    end = tl.load(bounds_ptr + 2 * t + 1)
    sumsq = tl.zeros((), tl.float64)
    amax = tl.zeros((), tl.float64)
    infs = tl.zeros((), tl.float64)
    nans = tl.zeros((), tl.float64)
    for first in range(begin, end, ROWS_BLOCK):
        rows = first + tl.arange(0, ROWS_BLOCK)
        ptrs = partials_ptr + 4 * rows
        mask = rows < end
        sumsq += tl.sum(tl.load(ptrs, mask=mask, other=0.0), axis=0)
        amax = tl.maximum(amax, tl.max(tl.load(ptrs + 1, mask=mask, other=0.0), axis=0))
        infs += tl.sum(tl.load(ptrs + 2, mask=mask, other=0.0), axis=0)
        nans += tl.sum(tl.load(ptrs + 3, mask=mask, other=0.0), axis=0)
    out = out_ptr + 5 * tl.load(rows_ptr + t)
    tl.store(out, tl.where(nans > 0, float("nan"), amax))
    tl.store(out + 1, sumsq)
    tl.store(out + 2, infs)
    tl.store(out + 3, nans)
    tl.store(out + 4, tl.full((), 1.0, tl.float64))


def launch_finish_stats(partials: torch.Tensor, bounds: torch.Tensor, rows: torch.Tensor,
                        out: torch.Tensor) -> None:
    """Write each watched tensor's statistics from its programs' (one launch).

    Args:
        partials: float64 ``[programs, 4]``, as the unscale kernel's ``STATS`` pass stores
            them: sum of squares, max ``|x|`` of the values that are not NaN, inf and NaN
            counts.
        bounds: int64 ``[tensors, 2]``: each watched tensor's programs ``[begin, end)``
            (empty for an empty tensor).
        rows: int64 ``[tensors]``: each tensor's row of ``out``.
        out: float64 ``[n, 5]``, rows ``(amax, sum of squares, inf count, NaN count, 1.0)``;
            amax NaN where a NaN was seen.

    .. note:: Asynchronous: no host sync.
    """
    if rows.numel():
        launch(finish_stats_kernel, rows.numel(), (partials, bounds, rows, out), (),
               dict(ROWS_BLOCK=ROWS_BLOCK), _OPTIONS)


@triton.jit
def record_watch(
    found,  # this iteration's overflow (the scaler's flags), a scalar
    stats_ptr,  # *Pointer* to the watch's float64 rows of 5 (finish_stats_kernel's out)
    overflow_ptr,  # *Pointer* to float64 rows of 2: the last overflow's inf and NaN counts
    counters_ptr,  # *Pointer* to 5 float64: last overflow step, its scale, iteration, run of
    #                skipped steps, longest run
    scale_ptr,  # *Pointer* to the fp32 scale of this iteration (before its update)
    n_rows,  # Rows at stats_ptr
    SKIPS: tl.constexpr,  # An overflow skips the step (the run of skipped steps grows)
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
        run = tl.where(seen, run + 1.0, 0.0)
    else:
        run = run * 0.0
    tl.store(counters_ptr, tl.where(seen, iteration, last_step))
    tl.store(counters_ptr + 1, tl.where(seen, tl.load(scale_ptr).to(tl.float64), last_scale))
    tl.store(counters_ptr + 2, iteration + 1.0)
    tl.store(counters_ptr + 3, run)
    tl.store(counters_ptr + 4, tl.maximum(longest, run))
