"""The per-tensor statistics of a watched scaler's pass: one small launch that finishes what
the unscale kernel's programs stored (``STATS=True``: four values per program) into one row
per watched tensor.
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
