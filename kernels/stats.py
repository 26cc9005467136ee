"""A watched scaler's device work, run inside the other kernels: :func:`finish_tensor`, run by
the unscale kernel's programs (``STATS=True``: four values per program), finishes each watched
tensor's row from its programs' values in the same launch; :func:`record_watch`, run by the
update kernel (``WATCH``), records each ``update()``'s overflow and the run of skipped steps.
"""

from __future__ import annotations

import triton
import triton.language as tl

#: program statistics read at a time by a tensor's last program (:func:`_pairwise_sum`'s 128)
ROWS_BLOCK = tl.constexpr(128)


@triton.jit
def _pairwise_sum(x):
    """The sum of 128 values as a fixed tree of pairwise additions: the same
    bits whatever the launch's warps and layout (``tl.sum``'s order depends on them)."""
    x = tl.sum(tl.reshape(x, (64, 2)), axis=1)
    x = tl.sum(tl.reshape(x, (32, 2)), axis=1)
    x = tl.sum(tl.reshape(x, (16, 2)), axis=1)
    x = tl.sum(tl.reshape(x, (8, 2)), axis=1)
    x = tl.sum(tl.reshape(x, (4, 2)), axis=1)
    x = tl.sum(tl.reshape(x, (2, 2)), axis=1)
    return tl.sum(x, axis=0)


@triton.jit
def finish_tensor(
    stats_ptr,  # *Pointer* to the launch's float64 statistics, 4 per program
    finish_ptr,  # *Pointer* to int64: each program's watched tensor (-1: none), then per
    #              tensor (begin, end, row): its programs and its row of out
    counters_ptr,  # *Pointer* to int32 per tensor: its programs done (0 between launches)
    out_ptr,  # *Pointer* to float64 rows of 5: amax, sum of squares, inf and NaN counts, 1
    pid,  # This program, whose statistics are stored
):
    """Run by each program of a ``STATS`` launch after storing its statistics: the last of a
    watched tensor's programs to get here (counted with an acquire-release atomic after a
    barrier, so every earlier program's statistics are visible to it) sums theirs, in
    program order, into the tensor's row, and resets the count. Deterministic: the same
    bits whichever program is last."""
    t = tl.load(finish_ptr + pid)
    if t >= 0:
        entry = finish_ptr + tl.num_programs(0) + 3 * t
        begin = tl.load(entry)
        end = tl.load(entry + 1)
        tl.debug_barrier()  # this program's statistics are stored before its release
        done = tl.atomic_add(counters_ptr + t, 1, sem="acq_rel")
        if done == end - begin - 1:
            sumsq = tl.zeros((), tl.float64)
            amax = tl.zeros((), tl.float64)
            infs = tl.zeros((), tl.float64)
            nans = tl.zeros((), tl.float64)
            for first in range(begin, end, ROWS_BLOCK):
                rows = first + tl.arange(0, ROWS_BLOCK)
                ptrs = stats_ptr + 4 * rows
                mask = rows < end
                sumsq += _pairwise_sum(tl.load(ptrs, mask=mask, other=0.0))
                amax = tl.maximum(amax, tl.max(tl.load(ptrs + 1, mask=mask, other=0.0), axis=0))
                infs += tl.sum(tl.load(ptrs + 2, mask=mask, other=0.0), axis=0)
                nans += tl.sum(tl.load(ptrs + 3, mask=mask, other=0.0), axis=0)
            out = out_ptr + 5 * tl.load(entry + 2)
            tl.store(out, tl.where(nans > 0, float("nan"), amax))
            tl.store(out + 1, sumsq)
            tl.store(out + 2, infs)
            tl.store(out + 3, nans)
            tl.store(out + 4, tl.full((), 1.0, tl.float64))
            tl.store(counters_ptr + t, 0)  # ready for the next launch (a graph's replay)


@triton.jit
def record_watch(
    found,  # this iteration's overflow (the scaler's flags), a scalar
    stats_ptr,  # *Pointer* to the watch's float64 rows of 5 (finish_tensor's out)
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
