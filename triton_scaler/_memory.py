"""Which memory a gradient covers: the checks behind the refusal of grads that share memory
in ways the Triton kernels cannot unscale as torch's op does (``_plans.py``), and
behind the alias rule of both backends (grads that start at the same address are unscaled
once). Host work on shapes, strides and addresses; offsets counted on the CPU only where
the strides leave the answer open. No device access."""

from __future__ import annotations

import functools

import torch


def extent(t: torch.Tensor) -> int:
    """Elements from ``t``'s first element to one past its last (non-empty ``t``)."""
    return 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))


def is_dense(t: torch.Tensor) -> bool:
    """Whether ``t`` covers ``numel`` consecutive elements (contiguous in some dimension
    order: channels_last, a transpose), without gaps or overlaps."""
    expected = 1
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


@functools.lru_cache(maxsize=64)
def overlaps(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """Whether two elements of a tensor of this shape and these strides share memory: a
    stride test that settles the usual layouts, else every element's offset counted (on the
    CPU, once per layout)."""
    if 0 in shape:
        return False
    reach = 0  # the largest offset the dimensions of smaller stride reach
    for stride, size in sorted((st, sz) for st, sz in zip(strides, shape) if sz != 1):
        if stride <= reach:
            break
        reach += stride * (size - 1)
    else:
        return False
    offsets = _offsets(shape, strides, 0)
    return offsets.unique().numel() < offsets.numel()


def _offsets(shape: tuple[int, ...], strides: tuple[int, ...], shift: int) -> torch.Tensor:
    """Every element's offset, ``shift`` plus its index times the strides, in the tensor's
    order (CPU int64): memory for ``numel`` offsets, not for the span (a column block of a
    large matrix spans the matrix)."""
    offsets = torch.full((), shift, dtype=torch.int64, device="cpu")
    for size, stride in zip(shape, strides):
        offsets = offsets.unsqueeze(-1) + torch.arange(size, device="cpu") * stride
    return offsets.reshape(-1)


def _element_offsets(t: torch.Tensor, base: int) -> torch.Tensor | None:
    """``t``'s elements' offsets in elements from address ``base`` (CPU), or None when ``t``
    does not lie on ``base``'s element grid."""
    shift, rest = divmod(t.data_ptr() - base, t.element_size())
    return None if rest else _offsets(tuple(t.shape), t.stride(), shift)


def share_elements(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether non-empty ``a`` and ``b`` (one dtype) share a memory location: their spans
    first, then their offsets (CPU; answered by ``torch.equal``, no tensor read)."""
    a_start, b_start = a.data_ptr(), b.data_ptr()
    size = a.element_size()
    if a_start + extent(a) * size <= b_start or b_start + extent(b) * size <= a_start:
        return False
    base = min(a_start, b_start)
    a_offsets, b_offsets = _element_offsets(a, base), _element_offsets(b, base)
    if a_offsets is None or b_offsets is None:
        return True  # off each other's element grid: taken as shared
    hits = torch.isin(a_offsets, b_offsets)
    return not torch.equal(hits, torch.zeros_like(hits))


def covers(kept: torch.Tensor, alias: torch.Tensor) -> bool:
    """Whether every memory location of ``alias`` (which starts at ``kept``'s address, with
    no more elements) is one of ``kept``'s: always for two dense tensors; else counted."""
    if is_dense(kept) and is_dense(alias):
        return True
    # both start at kept's address: offsets from it, shift 0
    hits = torch.isin(_offsets(tuple(alias.shape), alias.stride(), 0),
                      _offsets(tuple(kept.shape), kept.stride(), 0))
    return torch.equal(hits, torch.ones_like(hits))
