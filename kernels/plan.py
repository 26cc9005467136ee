"""Host side of an unscale launch: which memory it covers and how it is cut into chunks.

* :func:`chunk_table`: the ``(start, length)`` rows of a many-tensor launch, relative to its
  first tensor, cached on the tensors' addresses and sizes (and kept for good once a CUDA
  graph has captured a launch that reads it);
* :class:`UnscalePlan` / :func:`build_plan`: the base tensor, the table or flat size, the grid,
  and the contiguous copies that non-dense grads need.

No Triton code here; ``unscale.py`` holds the kernel and :func:`launch_unscale`.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
import triton

from triton_scaler._lru import recent, remember
from triton_scaler._memory import extent, is_dense, overlaps, share_elements

_TABLE_CACHE_SIZE = 32
_PATTERN_CACHE_SIZE = 8

_tables: OrderedDict[tuple, tuple[torch.Tensor, bool]] = OrderedDict()


def chunk_table(grads: list[torch.Tensor], numels: tuple[int, ...], block: int,
                addresses: tuple[int, ...] | None = None) -> tuple[torch.Tensor, bool]:
    """The chunk table of contiguous, non-empty, same-dtype ``grads`` on one device, whose
    sizes are ``numels``: an int64 ``[n_chunks, 2]`` device tensor of ``(start, length)`` rows,
    start in elements from ``grads[0]``. Every chunk but a tensor's last is ``block`` long.
    Also whether two grads share part of their memory (one starts inside another; grads that
    start at the same address count once): their chunks would overlap.

    Cached on the grads' addresses and sizes (the last 32 layouts), so a training loop whose
    grads keep their storage builds it once; a hit costs one pass over the grads' addresses.
    Grads at new addresses with sizes seen before (:func:`_chunks`) cost six small ops, and
    the shared-memory check five more (a sort of the starts).
    """
    first = grads[0]
    if addresses is None:
        addresses = tuple(map(torch.Tensor.data_ptr, grads))
    key = (first.device, first.dtype, block, addresses, numels)
    entry = recent(_tables, key)
    if entry is not None:
        return entry
    unique_addresses, numels = _without_aliases(addresses, numels)
    owner, offset, length, sizes = _chunks(numels, block)
    rel = torch.tensor(unique_addresses, dtype=torch.int64, device="cpu").sub_(unique_addresses[0])
    rel = rel.div_(first.element_size(), rounding_mode="floor")
    overlapping = _ranges_overlap(rel, sizes)
    table = torch.stack([rel[owner].add_(offset), length], 1)
    if first.is_cuda:  # pinned + non_blocking: the upload does not wait for the stream
        host = table.pin_memory()
        table = host.to(first.device, non_blocking=True)
        if torch.cuda.is_current_stream_capturing():  # the graph replays this upload
            _captured[id(host)] = host
    return remember(_tables, key, (table, overlapping), _TABLE_CACHE_SIZE)


def _ranges_overlap(starts: torch.Tensor, lengths: torch.Tensor) -> bool:
    """Whether two of the ranges ``[start, start + length)`` (CPU int64, distinct starts)
    overlap: some range, in the order of their starts, ends after the next one starts. CPU
    tensors, answered by ``torch.equal`` (no device sync, no tensor read on the host)."""
    if starts.numel() < 2:
        return False
    starts, order = starts.sort()
    ends = lengths[order].add_(starts)[:-1]
    return not torch.equal(torch.minimum(ends, starts[1:]), ends)


_chunk_patterns: OrderedDict[tuple, tuple] = OrderedDict()


def _chunks(numels: tuple[int, ...], block: int) -> tuple[torch.Tensor, ...]:
    """The part of a chunk table that depends on the sizes alone, per chunk: its tensor's
    index, its offset in that tensor and its length; and the sizes (CPU int64). Cached on
    the sizes (the last ``_PATTERN_CACHE_SIZE``), so grads at new addresses with the sizes
    of earlier ones (a training step whose allocator handed out other blocks) only add their
    tensors' offsets: six small ops (and the shared-memory check's five)."""
    key = (numels, block)
    chunks = recent(_chunk_patterns, key)
    if chunks is not None:
        return chunks
    sizes = torch.tensor(numels, dtype=torch.int64, device="cpu")
    n_chunks = (sizes + block - 1) // block
    owner = torch.repeat_interleave(torch.arange(len(numels), device="cpu"), n_chunks)
    first_chunk = torch.cumsum(n_chunks, 0) - n_chunks
    offset = (torch.arange(owner.numel(), device="cpu") - first_chunk[owner]) * block
    return remember(_chunk_patterns, key,
                    (owner, offset, torch.clamp(sizes[owner] - offset, max=block), sizes),
                    _PATTERN_CACHE_SIZE)


#: Tables (and the pinned host buffers of their uploads) that a captured CUDA graph uses: a
#: graph keeps raw addresses, so these live as long as the process, whatever the cache evicts.
_captured: dict[int, torch.Tensor] = {}


def _flat_memory(t: torch.Tensor) -> torch.Tensor | None:
    """A 1-D contiguous view of ``t``'s memory when ``t`` is dense and non-overlapping in
    some dimension order (channels_last, a transpose), else None."""
    return t.as_strided((t.numel(),), (1,)) if is_dense(t) else None


def _copied_grad_shares_memory(grads: list[torch.Tensor], copied: list[torch.Tensor]) -> bool:
    """Whether a grad unscaled through a copy (gapped, or overlapping itself) shares memory
    with another grad of the launch: its copy lies elsewhere, so the chunk table's range test
    does not see it. Spans swept in address order (Python: a plan with copies already passes
    over its grads one by one); offsets counted only for spans that meet."""
    copied_ids = set(map(id, copied))
    spans = sorted((g.data_ptr(), g.data_ptr() + extent(g) * g.element_size(), i)
                   for i, g in enumerate(grads))
    reaching: list[tuple[int, int]] = []  # (end, index) of the spans begun so far
    for start, end, i in spans:
        reaching = [(e, j) for e, j in reaching if e > start]
        for _, j in reaching:
            if (id(grads[i]) in copied_ids or id(grads[j]) in copied_ids) and \
                    share_elements(grads[i], grads[j]):
                return True
        reaching.append((end, i))
    return False


def refuse_overlapping_writes(plan: UnscalePlan) -> None:
    """Raise where a write over ``plan`` would not give torch's op's result: two grads that
    share part of their memory (one starts inside another), which torch's op multiplies once
    per grad and the kernel's programs in no fixed order; a grad whose own elements share
    memory (expanded, or ``as_strided`` with overlapping strides; only grads with copies
    can), which its contiguous copy would multiply once per location, where torch's op does
    once per element (and raises for an expanded one). A write pass calls this before its
    first launch; a read-only check may read such memory."""
    if plan.overlapping:
        raise RuntimeError(
            "unsupported operation: two gradients share part of their memory (one starts "
            "inside another; grads that start at the same address are unscaled once); "
            "torch's op multiplies the shared memory once per gradient, the Triton kernel's "
            "programs in no fixed order: clone() one of them before unscaling")
    for g, _ in plan.copies:
        if overlaps(tuple(g.shape), g.stride()):
            raise RuntimeError(
                "unsupported operation: more than one element of a gradient refers to a single "
                f"memory location (shape {tuple(g.shape)}, strides {g.stride()}); clone() it "
                "before unscaling. torch's op multiplies such memory once per element that "
                "refers to it; the Triton backend refuses it rather than give another result")


def _without_aliases(addresses: tuple[int, ...], numels: tuple[int, ...]):
    """Drop grads that start at the address of an earlier one (``p2.grad = p1.grad``): each
    memory location is unscaled once. Non-empty grads only (the caller drops empty ones)."""
    if len(set(addresses)) == len(addresses):
        return addresses, numels
    seen: dict[int, int] = {}
    for address, n in zip(addresses, numels):
        seen[address] = max(n, seen.get(address, 0))
    return tuple(seen), tuple(seen.values())


class UnscalePlan:
    """The host side of one launch over same-device, same-dtype grads: the base tensor (the
    ``base_index``-th grad; the launch takes its address, dtype and device), the chunk table
    (or the flat size) and the contiguous copies that non-dense grads need. Built by
    :func:`plan_unscale`. A ``reusable`` plan (no copies) holds no grads once :meth:`template`
    strips its base, and :meth:`rebased` puts the base of a new grads list at the same
    addresses, laid out as these (``contiguous``: all of them contiguous), back."""

    __slots__ = ("base", "base_index", "table", "n", "grid", "copies", "contiguous",
                 "overlapping")

    def __init__(self, base, base_index, table, n, grid, copies, contiguous,
                 overlapping=False):
        self.base, self.base_index, self.table, self.n = base, base_index, table, n
        self.grid, self.copies, self.contiguous = grid, copies, contiguous
        self.overlapping = overlapping  # two grads share part of their memory

    @property
    def reusable(self) -> bool:
        return not self.copies and not self.overlapping

    def template(self) -> UnscalePlan:
        return self.rebased(None)

    def rebased(self, base: torch.Tensor | None) -> UnscalePlan:
        """This template over a new grads list at the same addresses and laid out as the
        grads it was made for, whose ``base_index``-th grad is ``base`` (None for a plan
        without elements)."""
        return UnscalePlan(base if self.grid else None, self.base_index,
                           self.table, self.n, self.grid, [], self.contiguous)


def build_plan(grads: list[torch.Tensor], numels: tuple[int, ...] | None,
               addresses: tuple[int, ...] | None, block: int) -> UnscalePlan:
    """The host work of a launch over ``grads`` in chunks of ``block`` elements. ``numels`` /
    ``addresses``: the grads' sizes / data pointers when the caller already has them."""
    if numels is None:
        numels = tuple(map(torch.Tensor.numel, grads))  # C-level passes: cheap per grad
    base_index = 0
    if 0 in numels:
        base_index = next((i for i, n in enumerate(numels) if n), 0)
        kept = [(g, n) for g, n in zip(grads, numels) if n]
        grads, numels, addresses = [g for g, _ in kept], tuple(n for _, n in kept), None
    if not grads:
        return UnscalePlan(None, 0, None, 0, 0, [], True)
    copies = []
    dense = grads
    contiguous = all(map(torch.Tensor.is_contiguous, grads))
    if not contiguous:  # channels_last, transposed, gapped: Python work per such grad
        dense, addresses = [], None
        for g in grads:
            flat = g if g.is_contiguous() else _flat_memory(g)
            if flat is None:  # overlapping or with gaps: a correct, slower fallback
                flat = g.contiguous()
                copies.append((g, flat))
            dense.append(flat)
        numels = tuple(map(torch.Tensor.numel, dense))
    if len(dense) == 1:
        return UnscalePlan(dense[0], base_index, None, numels[0],
                           triton.cdiv(numels[0], block), copies, contiguous)
    table, overlapping = chunk_table(dense, numels, block, addresses)
    overlapping = overlapping or bool(copies) and \
        _copied_grad_shares_memory(grads, [g for g, _ in copies])
    return UnscalePlan(dense[0], base_index, table, 0, table.shape[0], copies, contiguous,
                       overlapping)
