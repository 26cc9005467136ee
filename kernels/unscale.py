"""Fused unscale + inf/NaN check over a flat buffer or over many tensors in one launch.

One kernel, specialised by constexpr flags:

* ``USE_TABLE=False``: program ``p`` covers elements ``[p * BLOCK, (p + 1) * BLOCK)`` of one
  contiguous buffer (a gradient bucket or a single large gradient).
* ``USE_TABLE=True``: program ``p`` reads row ``p`` of a chunk table, ``(start, length)`` in
  elements relative to the base pointer, so any number of same-dtype tensors share one launch.
* ``WRITE=False``: check only (read, no write), for optimizers that unscale inside their own
  kernel.
* ``FP64=True``: float64 grads, multiplied in float64 (``double(g) * double(inv_scale)``, as
  torch's op); every other dtype is multiplied in float32.
* ``NORM=2`` / ``NORM=-1`` (read pass of ``clip_grad_norm_``): each program also stores the
  sum of squares / the max ``|x|`` of its unscaled (dtype-rounded) values into a partial
  buffer, accumulated in float32 (float64 for float64 grads).
* ``CLIP=True`` (write pass): stores ``dtype(dtype(g * inv_scale) * clip_coef)``.

found_inf is set to exactly 1.0 when an input element or its unscaled product (rounded to the
gradient's dtype) is non-finite, by a single masked store from each program that saw one.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
import triton
import triton.language as tl

from .bits import bf16_bits_to_fp32, fp32_to_bf16_bits

GPU_BLOCK = 4096
GPU_NUM_WARPS = 8
INTERPRETER_BLOCK = 1 << 16  # each interpreted program costs milliseconds: few, large blocks
_TABLE_CACHE_SIZE = 32


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
def unscale_kernel(
    grad_ptr,
    table_ptr,
    n_elements,
    inv_scale_ptr,
    found_inf_ptr,
    coef_ptr,
    partial_ptr,
    BLOCK: tl.constexpr,
    USE_TABLE: tl.constexpr,
    WRITE: tl.constexpr,
    BF16_BITS: tl.constexpr,
    ALIGN: tl.constexpr,
    FP64: tl.constexpr,
    ROUND: tl.constexpr,
    NORM: tl.constexpr,
    CLIP: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    idx = tl.arange(0, BLOCK)
    if USE_TABLE:
        start = tl.multiple_of(tl.load(table_ptr + 2 * pid), ALIGN)
        end = tl.multiple_of(start + tl.load(table_ptr + 2 * pid + 1), ALIGN)
    else:
        start = pid * BLOCK
        end = n_elements
    offsets = start + idx
    mask = offsets < end
    ptrs = grad_ptr + offsets
    raw = tl.load(ptrs, mask=mask, other=0)
    if BF16_BITS:
        x = bf16_bits_to_fp32(raw)
    elif FP64:
        x = raw
    else:
        x = raw.to(tl.float32)
    if FP64:
        y = x * tl.load(inv_scale_ptr).to(tl.float64)
    else:
        y = x * tl.load(inv_scale_ptr)
    if ROUND:  # the unscaled gradient as stored (rounded to its dtype)
        out, value = _as_stored(y, grad_ptr.dtype.element_ty, BF16_BITS, FP64)
        if CLIP:  # dtype(dtype(g * inv_scale) * clip_coef), as unscale_ + clip_grad_norm_
            if FP64:
                coef = tl.load(coef_ptr).to(tl.float64)
            else:
                coef = tl.load(coef_ptr)
            out, value = _as_stored(value * coef, grad_ptr.dtype.element_ty, BF16_BITS, FP64)
        if WRITE:
            tl.store(ptrs, out, mask=mask)
    else:  # read-only check: the product itself
        value = y
    nonfinite = (value != value) | (tl.abs(value) == float("inf"))
    saw = tl.max((nonfinite & mask).to(tl.int32), axis=0)
    tl.store(found_inf_ptr, 1.0, mask=saw > 0)
    if NORM == 2:  # this program's sum of squares
        tl.store(partial_ptr + pid, tl.sum(tl.where(mask, value * value, 0.0), axis=0))
    if NORM == -1:  # this program's max |x|, NaN if it saw a NaN
        peak = tl.max(tl.where(mask, tl.abs(value), 0.0), axis=0)
        saw_nan = tl.max(((value != value) & mask).to(tl.int32), axis=0)
        tl.store(partial_ptr + pid, tl.where(saw_nan > 0, float("nan"), peak))


_INTERPRETED = type(unscale_kernel).__name__ == "InterpretedFunction"


def is_interpreting() -> bool:
    """True when triton runs kernels through its CPU interpreter (``TRITON_INTERPRET=1`` was
    set when this module was imported, which is when triton decides)."""
    return _INTERPRETED


def _block() -> int:
    return INTERPRETER_BLOCK if is_interpreting() else GPU_BLOCK


def _as_kernel_view(t: torch.Tensor) -> torch.Tensor:
    """bf16 is passed as its int16 bits under the interpreter (its bf16 casts are inexact)."""
    if t.dtype == torch.bfloat16 and is_interpreting():
        return t.view(torch.int16)
    return t


_tables: OrderedDict[tuple, tuple[torch.Tensor, int]] = OrderedDict()


def chunk_table(grads: list[torch.Tensor], numels: tuple[int, ...],
                block: int) -> tuple[torch.Tensor, int]:
    """(table, align) for contiguous, non-empty, same-dtype ``grads`` on one device, whose
    sizes are ``numels``.

    ``table`` is an int64 ``[n_chunks, 2]`` device tensor of ``(start, length)`` rows, start in
    elements from ``grads[0]``; ``align`` is the element count of 16 bytes when every chunk
    starts and ends 16-byte aligned, else 1. Cached on the grads' addresses and sizes, so a
    training loop whose grads keep their storage builds it once; a hit costs one pass over the
    grads' addresses.
    """
    first = grads[0]
    key = (first.device, first.dtype, block, tuple(map(torch.Tensor.data_ptr, grads)), numels)
    hit = _tables.get(key)
    if hit is not None:
        _tables.move_to_end(key)
        return hit
    elsize = first.element_size()
    addresses, numels = _without_aliases(key[3], numels)
    ptrs = torch.tensor(addresses, dtype=torch.int64)
    sizes = torch.tensor(numels, dtype=torch.int64)
    rel = (ptrs - ptrs[0]) // elsize
    n_chunks = (sizes + block - 1) // block
    owner = torch.repeat_interleave(torch.arange(len(addresses)), n_chunks)
    first_chunk = torch.cumsum(n_chunks, 0) - n_chunks
    offset = (torch.arange(owner.numel()) - first_chunk[owner]) * block
    table = torch.stack([rel[owner] + offset, torch.clamp(sizes[owner] - offset, max=block)], 1)
    vec = 16 // elsize
    aligned = all(p % 16 == 0 for p in addresses) and all(n % vec == 0 for n in numels)
    if first.is_cuda:  # pinned + non_blocking: the upload does not wait for the stream
        table = table.pin_memory().to(first.device, non_blocking=True)
    result = (table, vec if aligned else 1)
    _tables[key] = result
    if len(_tables) > _TABLE_CACHE_SIZE:
        _tables.popitem(last=False)
    return result


def _flat_memory(t: torch.Tensor) -> torch.Tensor | None:
    """A 1-D contiguous view of ``t``'s memory when ``t`` is dense and non-overlapping in
    some dimension order (channels_last, a transpose), else None."""
    expected = 1
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz != 1):
        if stride != expected:
            return None
        expected *= size
    return t.as_strided((t.numel(),), (1,))


def _without_aliases(addresses: tuple[int, ...], numels: tuple[int, ...]):
    """Drop grads that start at the address of an earlier one (``p2.grad = p1.grad``): each
    memory location is unscaled once. Non-empty grads only (the caller drops empty ones)."""
    if len(set(addresses)) == len(addresses):
        return addresses, numels
    seen: dict[int, int] = {}
    for address, n in zip(addresses, numels):
        seen[address] = max(n, seen.get(address, 0))
    return tuple(seen), tuple(seen.values())


def launch_unscale(
    grads: list[torch.Tensor],
    found_inf: torch.Tensor,
    inv_scale: torch.Tensor,
    *,
    write: bool = True,
    norm: int = 0,
    clip_coef: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Unscale (``write=True``) or only check (``write=False``) same-device, same-dtype grads.

    One launch for a single tensor (flat path) or for all tensors of the list (chunk-table
    path). Dense non-contiguous grads (channels_last, transposed) are covered as the flat memory
    they are; overlapping or gapped ones through contiguous copies that are written back. Grads
    that start at the same address (aliases) are processed once. ``found_inf`` and
    ``inv_scale`` are 0-d fp32 tensors on the grads' device. Asynchronous: no host sync.

    ``clip_grad_norm_``'s passes: ``write=False, norm=2`` (or ``-1`` for the inf norm) also
    returns the sum of squares (max ``|x|``) of the unscaled grads as a 0-d float32 (float64
    for float64 grads) device tensor; ``write=True, clip_coef=c`` stores
    ``dtype(dtype(g * inv_scale) * c)``.
    """
    fp64 = bool(grads) and grads[0].dtype == torch.float64
    numels = tuple(map(torch.Tensor.numel, grads))  # C-level passes: cheap per grad
    if 0 in numels:
        grads = [g for g, n in zip(grads, numels) if n]
        numels = tuple(n for n in numels if n)
    if not grads:
        return None if not norm else found_inf.new_zeros((), dtype=_partial_dtype(fp64))
    copies = []
    dense = grads
    if not all(map(torch.Tensor.is_contiguous, grads)):  # rare: Python work per such grad
        dense = []
        for g in grads:
            flat = g if g.is_contiguous() else _flat_memory(g)
            if flat is None:  # overlapping or with gaps: a correct, slower fallback
                flat = g.contiguous()
                copies.append((g, flat))
            dense.append(flat)
        numels = tuple(map(torch.Tensor.numel, dense))
    block = _block()
    if len(dense) == 1:
        grid, table, n, align = triton.cdiv(numels[0], block), found_inf, numels[0], 1
    else:
        table, align = chunk_table(dense, numels, block)
        grid, n = table.shape[0], 0
    partials = found_inf.new_empty(grid, dtype=_partial_dtype(fp64)) if norm else found_inf
    options = {} if is_interpreting() else {"num_warps": GPU_NUM_WARPS, "enable_fp_fusion": False}
    unscale_kernel[(grid,)](
        _as_kernel_view(dense[0]), table, n, inv_scale, found_inf,
        found_inf if clip_coef is None else clip_coef, partials,
        BLOCK=block, USE_TABLE=len(dense) > 1, WRITE=write,
        BF16_BITS=dense[0].dtype == torch.bfloat16 and is_interpreting(), ALIGN=align,
        FP64=fp64, ROUND=write or norm != 0, NORM=norm, CLIP=clip_coef is not None, **options,
    )
    if write:
        for g, c in copies:
            g.copy_(c)
    if norm:
        return partials.sum() if norm == 2 else partials.max()
    return None


def _partial_dtype(fp64: bool) -> torch.dtype:
    return torch.float64 if fp64 else torch.float32
