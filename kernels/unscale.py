"""Fused unscale + inf/NaN check over a flat buffer or over many tensors in one launch.

One kernel, specialised by constexpr flags:

* ``USE_TABLE=False``: program ``p`` covers elements ``[p * BLOCK, (p + 1) * BLOCK)`` of one
  contiguous buffer (a gradient bucket or a single large gradient).
* ``USE_TABLE=True``: program ``p`` reads row ``p`` of a chunk table, ``(grad, offset,
  length)``, and that grad's byte address from a list of starts (the base grad's first), so
  any number of same-dtype tensors share one launch. The table depends on the grads' sizes
  alone; grads at new addresses need only new starts.
* ``WRITE=False``: check only (read, no write), for optimizers that unscale inside their own
  kernel.
* ``FP64=True``: float64 grads, multiplied in float64 (``double(g) * double(inv_scale)``, as
  torch's op); every other dtype is multiplied in float32.
* ``NORM=2`` / ``NORM=-1`` (read pass of ``clip_grad_norm_``): each program also stores the
  sum of squares / the max ``|x|`` of its unscaled (dtype-rounded) values into a partial
  buffer, accumulated in float32 (float64 for float64 grads).
* ``CLIP=True`` (write pass): stores ``dtype(dtype(g * inv_scale) * clip_coef)``.
* ``STATS=True`` (a watched scaler's read pass): each program also stores four statistics of
  its unscaled (dtype-rounded) values: the sum of squares (float32, float64 for float64
  grads), the max ``|x|`` over the values that are not NaN, and the inf and NaN counts;
  :func:`.stats.launch_finish_stats` sums them per tensor.

found_inf is set to exactly 1.0 when an input element or its unscaled product (rounded to the
gradient's dtype) is non-finite, by a single masked store from each program that saw one.
"""

from __future__ import annotations

from typing import Protocol

import torch
import triton
import triton.language as tl

from .bits import bf16_bits_to_fp32, fp32_to_bf16_bits
from .launcher import launch

GPU_BLOCK = 4096
GPU_NUM_WARPS = 8
# float64: the same block over twice the threads, 8 doubles a thread. With 8 warps its variants
# took up to 66 registers per thread (sm_90) and triton 3.8's clip pass spilled; with 16, 40.
GPU_NUM_WARPS_FP64 = 16
# A watched read pass (STATS): one number of warps per dtype. float64's 32 were set when
# the pass also finished each tensor (with 16 it spilled in its masked path, sm_90). ROCm's
# wavefronts are 64 threads, its blocks at most 1,024: float64 there takes 16.
GPU_NUM_WARPS_STATS = 16
GPU_NUM_WARPS_STATS_FP64 = 32
HIP_NUM_WARPS_STATS_FP64 = 16
INTERPRETER_BLOCK = 1 << 16  # each interpreted program costs milliseconds: few, large blocks
_GPU_OPTIONS = {"num_warps": GPU_NUM_WARPS, "enable_fp_fusion": False}
_GPU_OPTIONS_FP64 = {**_GPU_OPTIONS, "num_warps": GPU_NUM_WARPS_FP64}
_GPU_OPTIONS_STATS = {**_GPU_OPTIONS, "num_warps": GPU_NUM_WARPS_STATS}
_GPU_OPTIONS_STATS_FP64 = {**_GPU_OPTIONS, "num_warps": HIP_NUM_WARPS_STATS_FP64
                           if torch.version.hip else GPU_NUM_WARPS_STATS_FP64}
_INTERPRETER_OPTIONS: dict = {}


@triton.jit
def _as_stored(y, out_ty, BF16_BITS: tl.constexpr, FP64: tl.constexpr):
    """``y`` rounded to the gradient's dtype: (what is stored, its value in compute precision)."""
    if BF16_BITS:
        out = fp32_to_bf16_bits(y)
        value = bf16_bits_to_fp32(out)
    elif FP64:
        out = y
        value = y
    else:
        out = y.to(out_ty)
        value = out.to(tl.float32)
    return out, value


@triton.jit
def _inv_scale(inv_scale_ptr, INV_FROM_SCALE: tl.constexpr, FP64: tl.constexpr):
    """The multiplier: the pointed-to inv_scale, or (``INV_FROM_SCALE``) the pointed-to scale's
    reciprocal formed as torch forms it, ``fp32(1 / fp64(scale))``."""
    if INV_FROM_SCALE:
        inv = (1.0 / tl.load(inv_scale_ptr).to(tl.float64)).to(tl.float32)
    else:
        inv = tl.load(inv_scale_ptr)
    if FP64:
        inv = inv.to(tl.float64)
    return inv


@triton.jit
def _block_pass(ptrs, mask, inv, coef, stats_ptr, HAS_MASK: tl.constexpr, WRITE: tl.constexpr,
                BF16_BITS: tl.constexpr, FP64: tl.constexpr, ROUND: tl.constexpr,
                NORM: tl.constexpr, CLIP: tl.constexpr, STATS: tl.constexpr):
    """One block: (saw a non-finite value, the block's norm partial); with ``STATS`` its
    statistics stored at ``stats_ptr``. ``HAS_MASK=False``: a full block, loaded and stored
    without a mask (16-byte vector accesses when aligned)."""
    if HAS_MASK:
        raw = tl.load(ptrs, mask=mask, other=0)
    else:
        raw = tl.load(ptrs)
    if BF16_BITS:
        x = bf16_bits_to_fp32(raw)
    elif FP64:
        x = raw
    else:
        x = raw.to(tl.float32)
    y = x * inv
    if ROUND:  # the unscaled gradient as stored (rounded to its dtype)
        out, value = _as_stored(y, ptrs.dtype.element_ty, BF16_BITS, FP64)
        unscaled = value
        if CLIP:  # dtype(dtype(g * inv_scale) * clip_coef), as unscale_ + clip_grad_norm_
            out, value = _as_stored(value * coef, ptrs.dtype.element_ty, BF16_BITS, FP64)
        if WRITE:
            if HAS_MASK:
                tl.store(ptrs, out, mask=mask)
            else:
                tl.store(ptrs, out)
    else:  # read-only check: the product itself
        value = y
    nonfinite = (value != value) | (tl.abs(value) == float("inf"))
    if HAS_MASK:
        nonfinite = nonfinite & mask
        value = tl.where(mask, value, 0.0)
    saw = tl.max(nonfinite.to(tl.int32), axis=0)
    if STATS:  # of the unscaled gradient as stored, before a clip (a check's rounded here)
        if ROUND:
            stored = unscaled
        else:
            _, stored = _as_stored(y, ptrs.dtype.element_ty, BF16_BITS, FP64)
        if HAS_MASK:
            stored = tl.where(mask, stored, 0.0)
        is_nan = stored != stored
        tl.store(stats_ptr, tl.sum(stored * stored, axis=0))
        tl.store(stats_ptr + 1, tl.max(tl.where(is_nan, 0.0, tl.abs(stored)), axis=0))
        tl.store(stats_ptr + 2, tl.sum((tl.abs(stored) == float("inf")).to(tl.int32), axis=0))
        tl.store(stats_ptr + 3, tl.sum(is_nan.to(tl.int32), axis=0))
    if NORM == 2:  # this block's sum of squares
        partial = tl.sum(value * value, axis=0)
    elif NORM == -1:  # this block's max |x|, NaN if it saw a NaN
        saw_nan = tl.max((value != value).to(tl.int32), axis=0)
        partial = tl.where(saw_nan > 0, float("nan"), tl.max(tl.abs(value), axis=0))
    else:
        partial = saw
    return saw, partial


@triton.jit
def unscale_kernel(
    grad_ptr,  # *Pointer* to the first gradient element (a bucket's, or the table's base grad)
    table_ptr,  # *Pointer* to the int64 chunk table, rows (grad, offset, length), in elements
    starts_ptr,  # *Pointer* to the int64 byte address of each grad of the table, grad_ptr's first
    inv_scale_ptr,  # *Pointer* to the fp32 multiplier, or to the scale (INV_FROM_SCALE)
    found_inf_ptr,  # *Pointer* to the fp32 overflow flag: set to 1.0, never cleared
    coef_ptr,  # *Pointer* to the fp32 clip coefficient (CLIP)
    partial_ptr,  # *Pointer* to one norm partial per program (NORM != 0)
    stats_ptr,  # *Pointer* to four float64 statistics per program (STATS)
    n_elements,  # Elements of the flat buffer (USE_TABLE=False)
    BLOCK: tl.constexpr,  # Elements per program
    USE_TABLE: tl.constexpr,  # Program p covers chunk p of the table, not block p of a buffer
    WRITE: tl.constexpr,  # Store the unscaled values (False: the read-only check)
    BF16_BITS: tl.constexpr,  # bf16 through exact bit helpers (the interpreter's casts are not)
    VEC: tl.constexpr,  # Elements per 16 bytes: full blocks starting at a multiple run unmasked
    FP64: tl.constexpr,  # float64 grads, multiplied in float64
    ROUND: tl.constexpr,  # Check the product as stored (rounded to the grad's dtype)
    NORM: tl.constexpr,  # 2: sum of squares, -1: max |x| of the unscaled values, 0: none
    CLIP: tl.constexpr,  # Also multiply by the clip coefficient before storing
    INV_FROM_SCALE: tl.constexpr,  # Form inv_scale on the device as fp32(1 / fp64(scale))
    STATS: tl.constexpr,  # Also store the program's statistics (a watched scaler's pass)
):
    pid = tl.program_id(0).to(tl.int64)
    idx = tl.arange(0, BLOCK)
    if USE_TABLE:
        row = table_ptr + 3 * pid
        # exact: grads of one dtype lie a whole number of elements apart (16 // VEC bytes)
        start = (tl.load(starts_ptr + tl.load(row)) - tl.load(starts_ptr)) // (16 // VEC) + \
            tl.load(row + 1)
        length = tl.load(row + 2)
    else:
        start = pid * BLOCK
        length = n_elements - start
    inv = _inv_scale(inv_scale_ptr, INV_FROM_SCALE, FP64)
    coef = inv
    if CLIP:
        coef = tl.load(coef_ptr).to(inv.dtype)
    # A full block whose start is a multiple of 16 bytes (relative to a 16-byte aligned base,
    # which triton's launcher specialises on) runs mask-free with vector loads and stores.
    if (length >= BLOCK) & (start % VEC == 0):
        aligned = tl.multiple_of(start, VEC)
        saw, partial = _block_pass(grad_ptr + aligned + idx, idx < BLOCK, inv, coef,
                                   stats_ptr + 4 * pid, False, WRITE, BF16_BITS, FP64, ROUND,
                                   NORM, CLIP, STATS)
    else:  # masked; the bound compared in 32 bits: 40 registers, not 80 (sm_90, triton 3.6)
        in_chunk = idx < tl.minimum(length, BLOCK).to(tl.int32)
        saw, partial = _block_pass(grad_ptr + start + idx, in_chunk, inv, coef,
                                   stats_ptr + 4 * pid, True, WRITE, BF16_BITS, FP64, ROUND,
                                   NORM, CLIP, STATS)
    tl.store(found_inf_ptr, 1.0, mask=saw > 0)
    if NORM != 0:
        tl.store(partial_ptr + pid, partial)


_INTERPRETED = type(unscale_kernel).__name__ == "InterpretedFunction"


def is_interpreting() -> bool:
    """True when triton runs kernels through its CPU interpreter (``TRITON_INTERPRET=1`` was
    set when this module was imported, which is when triton decides)."""
    return _INTERPRETED


#: Elements per program of :func:`launch_unscale`: the block plans are cut in.
BLOCK = INTERPRETER_BLOCK if _INTERPRETED else GPU_BLOCK


def block() -> int:
    """:data:`BLOCK`."""
    return BLOCK


class LaunchPlan(Protocol):
    """What :func:`launch_unscale` reads of a plan (built by the caller's planning).

    Attributes:
        base: the tensor whose address, dtype and device the launch takes (a flat buffer,
            or the first grad of a chunk table); None for a plan without elements.
        table: the int64 ``[grid, 3]`` chunk table, rows ``(grad, offset, length)`` in
            elements, the grad an index into ``starts``; None for a flat launch.
        starts: with a table, the int64 byte address of each of its grads, ``base``'s first.
        n: elements of the flat launch (0 with a table).
        grid: programs to launch (0: nothing to launch).
        copies: ``(grad, contiguous copy)`` pairs launched over as copies, written back.
        fp64: the grads are float64 (the norm partials' precision, also without elements).
        refusal: why a write over this plan must be refused, or None.
    """

    base: torch.Tensor | None
    table: torch.Tensor | None
    starts: torch.Tensor | None
    n: int
    grid: int
    copies: list
    fp64: bool
    refusal: str | None


#: Chunk tables and their starts that a captured CUDA graph reads: a graph keeps raw
#: addresses, so these live as long as the process, whatever planning's store drops.
_tables_for_graphs: dict[tuple[int, int], tuple] = {}


def launch_unscale(
    plan: LaunchPlan,
    found_inf: torch.Tensor,
    inv_scale: torch.Tensor,
    *,
    write: bool = True,
    norm: int = 0,
    clip_coef: torch.Tensor | None = None,
    inv_from_scale: bool = False,
    stats: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Unscale (``write=True``) or only check (``write=False``) the grads of ``plan``.

    Args:
        plan: one launch over same-device, same-dtype grads (:class:`LaunchPlan`): a flat
            buffer or a chunk table; gapped grads through contiguous copies, written back
            after the launch.
        found_inf: 0-d fp32 flag on the grads' device, set to 1.0 on a non-finite value.
        inv_scale: 0-d fp32 multiplier, or (``inv_from_scale``) the 0-d fp32 scale, whose
            reciprocal the kernel forms as torch does (``fp32(1 / fp64(scale))``).
        write: store the unscaled values (False: the read-only check).
        norm: 2 or -1 (``clip_grad_norm_``'s read pass, ``write=False``): also return the
            sum of squares (max ``|x|``) of the unscaled grads.
        clip_coef: (write pass) store ``dtype(dtype(g * inv_scale) * clip_coef)``.
        inv_from_scale: see ``inv_scale``.
        stats: a watched read pass's float64 ``[plan.grid, 4]`` (contiguous): each
            program's sum of squares, max ``|x|`` of the values that are not NaN, inf count
            and NaN count, of the unscaled (dtype-rounded) grads.

    Returns:
        With ``norm``, a 0-d float32 (float64 for float64 grads) device tensor; else None.

    Raises:
        RuntimeError: a write over a plan that refuses it (``plan.refusal``: grads sharing
            memory), before anything is written.

    .. note:: Asynchronous: no host sync.
    """
    if write and plan.refusal is not None:
        raise RuntimeError(plan.refusal)
    if not plan.grid:  # no elements
        return None if not norm else found_inf.new_zeros((), dtype=_partial_dtype(plan.fp64))
    base = plan.base
    assert base is not None  # a plan with elements has its base
    fp64 = base.dtype == torch.float64
    partials = found_inf.new_empty(plan.grid, dtype=_partial_dtype(fp64)) if norm else found_inf
    if plan.table is not None and base.is_cuda and torch.cuda.is_current_stream_capturing():
        _tables_for_graphs[id(plan.table), id(plan.starts)] = (plan.table, plan.starts)
    interpreting = _INTERPRETED
    # bf16 goes to the interpreter as its int16 bits (the interpreter's bf16 casts are inexact)
    bf16_bits = interpreting and base.dtype == torch.bfloat16
    launch(unscale_kernel, plan.grid, (
        base.view(torch.int16) if bf16_bits else base,
        *((found_inf, found_inf) if plan.table is None else (plan.table, plan.starts)),
        inv_scale, found_inf, found_inf if clip_coef is None else clip_coef, partials,
        found_inf if stats is None else stats,
    ), (plan.n,), dict(
        BLOCK=BLOCK, USE_TABLE=plan.table is not None,
        WRITE=write, BF16_BITS=bf16_bits, VEC=16 // base.element_size(), FP64=fp64,
        ROUND=write or norm != 0, NORM=norm, CLIP=clip_coef is not None,
        INV_FROM_SCALE=inv_from_scale, STATS=stats is not None,
    ), _INTERPRETER_OPTIONS if interpreting else
        (_GPU_OPTIONS_STATS_FP64 if fp64 else _GPU_OPTIONS_STATS) if stats is not None else
        _GPU_OPTIONS_FP64 if fp64 else _GPU_OPTIONS)
    if write:
        for g, c in plan.copies:
            g.copy_(c)
    if norm:
        return partials.sum() if norm == 2 else partials.max()
    return None


def _partial_dtype(fp64: bool) -> torch.dtype:
    return torch.float64 if fp64 else torch.float32
