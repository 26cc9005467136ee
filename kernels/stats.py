"""A watched scaler's device work, run inside the other kernels: :func:`finish_tensor`, run by
the unscale kernel's programs (``STATS=True``: four values per program), finishes each watched
tensor's row from its programs' values in the same launch; :func:`record_watch`, run by the
update kernel (``WATCH``), records each ``update()``'s overflow and the run of skipped steps.
"""

from __future__ import annotations

import triton
import triton.language as tl

#: programs whose statistics one program sums: a watched tensor's programs are finished in
#: groups of this many, then its groups' sums (:func:`_pairwise_sum`'s 128)
GROUP = tl.constexpr(128)


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
    at a time in order, each round by :func:`_pairwise_sum`: deterministic. Read from L2
    (``.cg``): rows other programs wrote, never from this multiprocessor's L1."""
    sumsq = tl.zeros((), tl.float64)
    amax = tl.zeros((), tl.float64)
    infs = tl.zeros((), tl.float64)
    nans = tl.zeros((), tl.float64)
    for first in range(begin, end, GROUP):
        rows = first + tl.arange(0, GROUP)
        ptrs = stats_ptr + 4 * rows
        mask = rows < end
        sumsq += _pairwise_sum(tl.load(ptrs, mask=mask, other=0.0, cache_modifier=".cg"))
        amax = tl.maximum(amax, tl.max(tl.load(ptrs + 1, mask=mask, other=0.0,
                                               cache_modifier=".cg"), axis=0))
        infs += tl.sum(tl.load(ptrs + 2, mask=mask, other=0.0, cache_modifier=".cg"), axis=0)
        nans += tl.sum(tl.load(ptrs + 3, mask=mask, other=0.0, cache_modifier=".cg"), axis=0)
    return sumsq, amax, infs, nans


@triton.jit
def _last_to_arrive(counter_ptr, n):
    """Whether this program is the last of ``n`` to count at ``counter_ptr`` (then it resets
    the count for the next launch, a graph's replay included). A barrier first, so that what
    every thread of the program stored is released with the count; the acquire makes what
    the others released visible to the last."""
    tl.debug_barrier()
    last = tl.atomic_add(counter_ptr, 1, sem="acq_rel") == n - 1
    if last:
        tl.store(counter_ptr, 0)
    return last


@triton.jit
def _store_row(out, sumsq, amax, infs, nans):
    tl.store(out, tl.where(nans > 0, float("nan"), amax))
    tl.store(out + 1, sumsq)
    tl.store(out + 2, infs)
    tl.store(out + 3, nans)
    tl.store(out + 4, tl.full((), 1.0, tl.float64))


@triton.jit
def finish_tensor(
    stats_ptr,  # *Pointer* to float64 statistics, 4 a row: one row per program, then one
    #             per group of GROUP programs of a watched tensor
    finish_ptr,  # *Pointer* to int64: each program's watched tensor (-1: none), then per
    #              tensor (begin, end, row, first group, tensor count): its programs, its row
    #              of out, its groups' first row after the programs' and first count, and
    #              its own count
    counters_ptr,  # *Pointer* to int32 counts, one per group and one per tensor (0 between
    #                launches)
    out_ptr,  # *Pointer* to float64 rows of 5: amax, sum of squares, inf and NaN counts, 1
    pid,  # This program, whose statistics are stored
):
    """Run by each program of a ``STATS`` launch after storing its statistics. A watched
    tensor's programs come in groups of ``GROUP``: the last of a group to get here sums the
    group's rows; for a tensor of one group that is its row of ``out``, else a row of its
    own, and the last group to finish sums those into the tensor's row (a 1e8-element
    tensor's 24,415 programs: 191 groups, summed in two rounds). Deterministic: fixed groups
    summed in a fixed order, the same bits whichever program is last."""
    t = tl.load(finish_ptr + pid)
    if t >= 0:
        entry = finish_ptr + tl.num_programs(0) + 5 * t
        begin = tl.load(entry)
        group = (pid - begin) // GROUP
        lo = begin + group * GROUP  # its group: these programs
        hi = tl.minimum(lo + GROUP, tl.load(entry + 1))
        if _last_to_arrive(counters_ptr + tl.load(entry + 3) + group, hi - lo):
            sumsq, amax, infs, nans = _sum_rows(stats_ptr, lo, hi)
            _finish_group(stats_ptr, entry, counters_ptr, out_ptr, group, sumsq, amax, infs,
                          nans)


@triton.jit
def _finish_group(stats_ptr, entry, counters_ptr, out_ptr, group, sumsq, amax, infs, nans):
    """A watched tensor's group summed (by its last program): for a tensor of one group its
    row of ``out``; else the group's row, and by the last group to finish the tensor's row
    from its groups' (table ``entry``: see :func:`finish_tensor`)."""
    groups = (tl.load(entry + 1) - tl.load(entry) + GROUP - 1) // GROUP
    if groups == 1:
        _store_row(out_ptr + 5 * tl.load(entry + 2), sumsq, amax, infs, nans)
    else:
        first = tl.num_programs(0) + tl.load(entry + 3)  # the tensor's groups' rows
        partial = stats_ptr + 4 * (first + group)
        tl.store(partial, sumsq)
        tl.store(partial + 1, amax)
        tl.store(partial + 2, infs)
        tl.store(partial + 3, nans)
        if _last_to_arrive(counters_ptr + tl.load(entry + 4), groups):
            sumsq, amax, infs, nans = _sum_rows(stats_ptr, first, first + groups)
            _store_row(out_ptr + 5 * tl.load(entry + 2), sumsq, amax, infs, nans)


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
