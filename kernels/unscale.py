"""Fused unscale + inf/NaN check over a flat buffer or over many tensors in one launch.

One kernel, specialised by constexpr flags:

* ``USE_TABLE=False``: program ``p`` covers elements ``[p * BLOCK, (p + 1) * BLOCK)`` of one
  contiguous buffer (a gradient bucket or a single large gradient).
* ``USE_TABLE=True``: program ``p`` reads row ``p`` of a chunk table, ``(start, length)`` in
  elements relative to the base pointer, so any number of same-dtype tensors share one launch.
* ``WRITE=False``: check only (read, no write), for optimizers that unscale inside their own
  kernel.

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
def unscale_kernel(
    grad_ptr,
    table_ptr,
    n_elements,
    inv_scale_ptr,
    found_inf_ptr,
    BLOCK: tl.constexpr,
    USE_TABLE: tl.constexpr,
    WRITE: tl.constexpr,
    BF16_BITS: tl.constexpr,
    ALIGN: tl.constexpr,
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
    else:
        x = raw.to(tl.float32)
    y = x * tl.load(inv_scale_ptr)
    if WRITE:
        if BF16_BITS:
            out = fp32_to_bf16_bits(y)
            checked = bf16_bits_to_fp32(out)
        else:
            out = y.to(grad_ptr.dtype.element_ty)
            checked = out.to(tl.float32)
        tl.store(ptrs, out, mask=mask)
    else:
        checked = y
    nonfinite = (checked != checked) | (tl.abs(checked) == float("inf"))
    saw = tl.max((nonfinite & mask).to(tl.int32), axis=0)
    tl.store(found_inf_ptr, 1.0, mask=saw > 0)


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
    ptrs = torch.tensor(key[3], dtype=torch.int64)
    sizes = torch.tensor(numels, dtype=torch.int64)
    rel = (ptrs - ptrs[0]) // elsize
    n_chunks = (sizes + block - 1) // block
    owner = torch.repeat_interleave(torch.arange(len(grads)), n_chunks)
    first_chunk = torch.cumsum(n_chunks, 0) - n_chunks
    offset = (torch.arange(owner.numel()) - first_chunk[owner]) * block
    table = torch.stack([rel[owner] + offset, torch.clamp(sizes[owner] - offset, max=block)], 1)
    vec = 16 // elsize
    aligned = all(p % 16 == 0 for p in key[3]) and all(n % vec == 0 for n in numels)
    if first.is_cuda:  # pinned + non_blocking: the upload does not wait for the stream
        table = table.pin_memory().to(first.device, non_blocking=True)
    result = (table, vec if aligned else 1)
    _tables[key] = result
    if len(_tables) > _TABLE_CACHE_SIZE:
        _tables.popitem(last=False)
    return result


def launch_unscale(
    grads: list[torch.Tensor],
    found_inf: torch.Tensor,
    inv_scale: torch.Tensor,
    *,
    write: bool = True,
) -> None:
    """Unscale (``write=True``) or only check (``write=False``) same-device, same-dtype grads.

    One launch for a single contiguous tensor (flat path) or for all contiguous tensors of the
    list (chunk-table path). Non-contiguous grads are processed through contiguous copies that
    are written back. ``found_inf`` and ``inv_scale`` are 0-d fp32 tensors on the grads' device.
    Asynchronous: no host synchronisation.
    """
    numels = tuple(map(torch.Tensor.numel, grads))  # C-level passes: cheap per grad
    if 0 in numels:
        grads = [g for g, n in zip(grads, numels) if n]
        numels = tuple(n for n in numels if n)
    if not grads:
        return
    copies = []
    dense = grads
    if not all(map(torch.Tensor.is_contiguous, grads)):  # rare: a correct, slower fallback
        copies = [(g, g.contiguous()) for g in grads if not g.is_contiguous()]
        dense = [g for g in grads if g.is_contiguous()] + [c for _, c in copies]
        numels = tuple(map(torch.Tensor.numel, dense))
    block = _block()
    bf16_bits = dense[0].dtype == torch.bfloat16 and is_interpreting()
    options = {} if is_interpreting() else {"num_warps": GPU_NUM_WARPS, "enable_fp_fusion": False}
    if len(dense) == 1:
        n = dense[0].numel()
        unscale_kernel[(triton.cdiv(n, block),)](
            _as_kernel_view(dense[0]), found_inf, n, inv_scale, found_inf,
            BLOCK=block, USE_TABLE=False, WRITE=write, BF16_BITS=bf16_bits, ALIGN=1, **options,
        )
    else:
        table, align = chunk_table(dense, numels, block)
        unscale_kernel[(table.shape[0],)](
            _as_kernel_view(dense[0]), table, 0, inv_scale, found_inf,
            BLOCK=block, USE_TABLE=True, WRITE=write, BF16_BITS=bf16_bits, ALIGN=align, **options,
        )
    if write:
        for g, c in copies:
            g.copy_(c)
