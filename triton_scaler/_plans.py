"""Launch planning of the unscale kernel: which memory a launch covers and how it is cut into
chunks, planned at each call from the grads as they are.

* :func:`plan_unscale`: one launch's :class:`UnscalePlan` (the base tensor, the chunk table
  or flat size, the grid, the contiguous copies non-dense grads need, a write's refusal);
* :func:`chunk_table`: the rows ``(grad, offset, length)`` of a many-tensor launch, which
  depend on the grads' sizes alone and are kept in the one memo of planning (:func:`_rows`,
  keyed by the sizes), and the grads' starts, uploaded at each call.

The kernels (``triton_scaler.kernels``) only launch plans; no Triton code here.
"""

from __future__ import annotations

import operator
from array import array
from collections import OrderedDict
from collections.abc import Sequence

import torch

from . import _backend
from ._backend import resolve_backend, triton_kernels
from ._memory import extent, is_dense, overlaps, share_elements

_DATA_PTR = torch.Tensor.data_ptr
_NUMEL = torch.Tensor.numel
_IS_CONTIGUOUS = torch.Tensor.is_contiguous
_IS_CHANNELS_LAST = operator.methodcaller("is_contiguous", memory_format=torch.channels_last)


class UnscalePlan:
    """One launch of the unscale kernel over same-device, same-dtype grads, as built by
    :func:`triton_scaler._plans.plan_unscale`.

    Attributes:
        base: the tensor whose address, dtype and device the launch takes (the first
            non-empty grad, or its flat view); None for a plan without elements.
        table: the int64 ``[grid, 3]`` chunk table, rows ``(grad, offset, length)`` in
            elements, the grad an index into ``starts``; None for the flat launch over ``n``
            elements of ``base``. It depends on the grads' sizes alone.
        starts: with a table, the int64 byte address of each of its grads, ``base``'s first
            (on the grads' device).
        n: elements of the flat launch (0 with a table).
        grid: programs launched (0: no elements, nothing launched).
        copies: ``(grad, contiguous copy)`` pairs of gapped grads, launched over as copies
            and written back.
        overlapping: two grads share part of their memory.
        fp64: the grads are float64 (the norm partials' precision, also for no elements).
        refusal: why a write over this plan would not give torch's op's result, or None.
        reusable: neither copies nor shared memory (a watch's launch may store statistics
            per grad).
    """

    __slots__ = ("base", "table", "starts", "n", "grid", "copies", "overlapping", "fp64",
                 "refusal", "reusable")

    def __init__(self, base: torch.Tensor | None, table: torch.Tensor | None, n: int,
                 grid: int, copies: list, *, starts: torch.Tensor | None = None,
                 overlapping: bool = False, fp64: bool = False,
                 refusal: str | None = None) -> None:
        self.base, self.table, self.starts, self.n = base, table, starts, n
        self.grid, self.copies = grid, copies
        self.overlapping, self.fp64, self.refusal = overlapping, fp64, refusal
        self.reusable = not copies and not overlapping


#: Grads whose shared-memory check sorts their addresses in Python: up to here that costs
#: less than the tensor ops' check (:func:`_ranges_overlap`, a few tensor ops on the host).
_FEW = 160


def plan_unscale(grads: list[torch.Tensor], numels: tuple[int, ...] | None = None,
                 addresses: tuple[int, ...] | None = None,
                 contiguous: bool | None = None) -> UnscalePlan:
    """The host work of a launch over same-device, same-dtype ``grads`` in the blocks the
    kernel is launched with. ``numels`` / ``addresses`` / ``contiguous``: the grads' sizes /
    data pointers / whether every one is contiguous, when the caller already knows them.
    Empty grads are left out; grads that start at the address of an earlier one (aliases)
    are covered once. No host sync."""
    kernels = _backend.loaded_kernels or triton_kernels()
    return build_plan(grads, numels, addresses, kernels.unscale.BLOCK, contiguous)


def build_plan(grads: list[torch.Tensor], numels: tuple[int, ...] | None,
               addresses: tuple[int, ...] | None, block: int,
               contiguous: bool | None = None) -> UnscalePlan:
    """:func:`plan_unscale` in chunks of ``block`` elements."""
    if numels is None:
        numels = tuple(map(_NUMEL, grads))  # C-level passes: cheap per grad
    fp64 = bool(grads) and grads[0].dtype == torch.float64
    if 0 in numels:
        kept = [(g, n) for g, n in zip(grads, numels) if n]
        grads, numels, addresses = [g for g, _ in kept], tuple(n for _, n in kept), None
    if not grads:
        return UnscalePlan(None, None, 0, 0, [], fp64=fp64)
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []
    dense = grads
    if contiguous is None:
        contiguous = all(map(_IS_CONTIGUOUS, grads))
    if not contiguous and not all(map(_IS_CHANNELS_LAST, grads)) and \
            not all(map(operator.or_, map(_IS_CONTIGUOUS, grads), map(_IS_CHANNELS_LAST, grads))):
        # channels_last grads (C-level passes) and other dense orders (a transpose, checked
        # in Python) launch over their memory as it lies; gapped grads, as copies
        dense = [g if _is_dense(g) else _copied(g, copies) for g in grads]
        if copies:
            addresses = None
    refusal = _copy_refusal(copies)
    base = dense[0] if contiguous else _flat_memory(dense[0])
    if len(dense) == 1:
        return UnscalePlan(base, None, numels[0], -(-numels[0] // block), copies, fp64=fp64,
                           refusal=refusal)
    table, starts, overlapping = chunk_table(dense, numels, block, addresses)
    overlapping = overlapping or bool(copies) and \
        _copied_grad_shares_memory(grads, [g for g, _ in copies])
    return UnscalePlan(base, table, 0, table.shape[0], copies, starts=starts,
                       overlapping=overlapping, fp64=fp64,
                       refusal=_SHARED if overlapping else refusal)


def _is_dense(g: torch.Tensor) -> bool:
    """Whether ``g``'s elements are ``numel`` consecutive ones from its data pointer on
    (contiguous, channels_last: C-level checks; another order, as a transpose: Python)."""
    return g.is_contiguous() or g.dim() == 4 and \
        g.is_contiguous(memory_format=torch.channels_last) or is_dense(g)


def _copied(g: torch.Tensor, copies: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """A contiguous copy of ``g`` (overlapping or with gaps), noted in ``copies``."""
    flat = g.contiguous()
    copies.append((g, flat))
    return flat


_SHARED = ("unsupported operation: two gradients share part of their memory (one starts "
           "inside another; grads that start at the same address are unscaled once); "
           "torch's op multiplies the shared memory once per gradient, the Triton kernel's "
           "programs in no fixed order: clone() one of them before unscaling")


def _copy_refusal(copies: list) -> str | None:
    """Why a write through these copies would not give torch's op's result: a grad whose own
    elements share memory (expanded, or ``as_strided`` with overlapping strides), which its
    contiguous copy would multiply once per location, where torch's op does once per element
    (and raises for an expanded one). None when no copied grad is such."""
    for g, _ in copies:
        if overlaps(tuple(g.shape), g.stride()):
            return ("unsupported operation: more than one element of a gradient refers to a "
                    f"single memory location (shape {tuple(g.shape)}, strides {g.stride()}); "
                    "clone() it before unscaling. torch's op multiplies such memory once per "
                    "element that refers to it; the Triton backend refuses it rather than "
                    "give another result")
    return None


def refuse_overlapping_writes(plan: UnscalePlan) -> None:
    """Raise ``RuntimeError`` where a write over ``plan`` would not give torch's op's result
    (``plan.refusal``): two grads that share part of their memory (one starts inside
    another), which torch's op multiplies once per grad and the kernel's programs in no
    fixed order; a grad whose own elements share memory. A write pass calls this before its
    first launch (the kernel's launch refuses too); a read-only check may read such memory."""
    if plan.refusal is not None:
        raise RuntimeError(plan.refusal)


def refuse_group_writes(groups: Sequence, backend: str) -> None:
    """Before the first of several :class:`GradGroup` is written: every Triton group's plan
    built, and its write refused where :func:`refuse_overlapping_writes` says so, so that a
    refusal leaves every grad as it was. Host work only; the plans are the launches' own. A
    group already planned without a refusal is skipped."""
    for group in groups:
        if group.plan is not None and group.plan.refusal is None:
            continue
        if group.plan is not None or resolve_backend(backend, group.device) == "triton":
            refuse_overlapping_writes(group.launch_target())


def chunk_table(grads: list[torch.Tensor], numels: tuple[int, ...], block: int,
                addresses: tuple[int, ...] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """The chunk table of contiguous, non-empty, same-dtype ``grads`` on one device, whose
    sizes are ``numels``: an int64 ``[n_chunks, 3]`` device tensor of ``(grad, offset,
    length)`` rows (:func:`_rows`, kept per size pattern), and the grads' int64 byte
    addresses (the starts the kernel reads each row's grad from, ``grads[0]``'s first),
    uploaded. Every chunk but a grad's last is ``block`` long. Also whether two grads share
    part of their memory (one starts inside another; grads that start at the same address
    count once, the starts and rows then over each address once): their chunks would
    overlap. Host work per call: the addresses' array and the shared-memory check
    (:func:`_shares_memory`), no tensor op on the CPU for up to :data:`_FEW` grads in
    ascending address order."""
    first = grads[0]
    if addresses is None:
        addresses = tuple(map(_DATA_PTR, grads))
    size = first.element_size()
    pattern = _rows(numels, block)
    starts = torch.frombuffer(array("q", addresses), dtype=torch.int64)
    overlapping = _shares_memory(addresses, starts, pattern, size)
    if overlapping and len(set(addresses)) < len(addresses):  # aliases: each covered once
        addresses, numels = _unique_starts(addresses, numels)
        pattern = _rows(numels, block)
        starts = torch.frombuffer(array("q", addresses), dtype=torch.int64)
        overlapping = _shares_memory(addresses, starts, pattern, size)
    return pattern.rows_on(first.device), upload(starts, first.device), overlapping


def _shares_memory(addresses: tuple[int, ...], starts: torch.Tensor, pattern: _Pattern,
                   size: int) -> bool:
    """Whether two ranges of the grads of ``pattern`` (``size``-byte elements) at
    ``addresses`` (also as the CPU int64 ``starts``) overlap (two that start at one address
    included: the caller drops such aliases first). Grads at the addresses the pattern last
    found apart (a training step's usual case) cost one comparison of the addresses; up to
    :data:`_FEW` others are sorted by address in Python; more by :func:`_ranges_overlap`."""
    if pattern.apart == (size, addresses):
        return False
    n = len(addresses)
    if n <= _FEW:
        ends = tuple(map(operator.add, addresses, pattern.extents(size)))
        if not all(map(operator.le, ends, addresses[1:])):  # not ascending: sorted
            order = sorted(range(n), key=addresses.__getitem__)
            shared = any(map(operator.gt, [ends[i] for i in order[:-1]],
                             [addresses[i] for i in order[1:]]))
            if shared:
                return True
    elif _ranges_overlap(starts, pattern.sizes, size):
        return True
    pattern.apart = (size, addresses)
    return False


def upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU tensor of planning (a chunk table's rows or starts, a watch's program ranges) on
    ``device``: on
    the CPU the tensor itself; on CUDA through pinned memory and ``non_blocking``, so the
    upload does not wait for the stream (a pageable copy would). No host sync."""
    if device.type == "cpu":
        return host
    if device.type != "cuda":
        return host.to(device)
    pinned = host.pin_memory()
    if torch.cuda.is_current_stream_capturing():  # the graph replays this upload
        _pinned_for_graphs[id(pinned)] = pinned
    return pinned.to(device, non_blocking=True)


#: The pinned host buffers of uploads that a captured CUDA graph replays: a graph keeps raw
#: addresses, so these live as long as the process, whatever the store drops.
_pinned_for_graphs: dict[int, torch.Tensor] = {}


def _ranges_overlap(starts: torch.Tensor, lengths: torch.Tensor, size: int = 1) -> bool:
    """Whether two of the ranges ``[start, start + size * length)`` (CPU int64, non-empty;
    two with one start overlap) overlap: some range, in the order of their starts, ends
    after the next one starts. CPU tensors, answered by ``torch.equal`` (no device sync, no
    tensor read on the host)."""
    if starts.numel() < 2:
        return False
    starts, order = starts.sort()
    ends = lengths[order].mul_(size).add_(starts)[:-1]
    return not torch.equal(torch.minimum(ends, starts[1:]), ends)


class _Pattern:
    """The part of a chunk table that depends on the sizes alone: per chunk its grad's index,
    its offset in that grad and its length (CPU int64 ``[n_chunks, 3]``), uploaded once per
    device; the sizes (CPU int64; in bytes per element size, a tuple); and the addresses of
    the last grads of these sizes found not to share memory."""

    __slots__ = ("rows", "runs", "sizes", "numels", "uploaded", "bytes", "apart")

    def __init__(self, numels: tuple[int, ...], block: int) -> None:
        sizes = torch.tensor(numels, dtype=torch.int64, device="cpu")
        n_chunks = (sizes + block - 1) // block
        owner = torch.repeat_interleave(torch.arange(len(numels), device="cpu"), n_chunks)
        first_chunk = torch.cumsum(n_chunks, 0) - n_chunks
        offset = (torch.arange(owner.numel(), device="cpu") - first_chunk[owner]) * block
        self.rows = torch.stack([owner, offset, torch.clamp(sizes[owner] - offset, max=block)],
                                1)
        #: each grad's chunks ``[begin, end)``: its programs in a launch over the table
        self.runs = torch.stack([first_chunk, first_chunk + n_chunks], 1)
        self.sizes, self.numels = sizes, numels
        self.uploaded: dict[tuple[str, torch.device], torch.Tensor] = {}
        self.bytes: dict[int, tuple[int, ...]] = {}
        #: ``(element size, addresses)`` of the last grads of these sizes found not to share
        #: memory (:func:`_shares_memory`)
        self.apart: tuple[int, tuple[int, ...]] | None = None

    def rows_on(self, device: torch.device, name: str = "rows") -> torch.Tensor:
        """The rows (or ``name``: ``"runs"``) on ``device``, uploaded at the first call there
        (:func:`upload`). An upload that a CUDA graph captures is not kept: it runs when the
        graph replays, and a launch outside the graph before that must not read it."""
        key = (name, device)
        rows = self.uploaded.get(key)
        if rows is None:
            rows = upload(getattr(self, name), device)
            if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
                self.uploaded[key] = rows
        return rows

    def extents(self, size: int) -> tuple[int, ...]:
        """The grads' sizes in bytes, for elements of ``size`` bytes."""
        extents = self.bytes.get(size)
        if extents is None:
            extents = self.bytes[size] = tuple(n * size for n in self.numels)
        return extents


#: The memo of :func:`_rows`: each size pattern's rows, the most recently used last.
_patterns: OrderedDict[tuple[tuple[int, ...], int], _Pattern] = OrderedDict()
#: Size patterns :func:`_rows` keeps: a training loop has one per (device, dtype) group.
PATTERNS_KEPT = 16


def _rows(numels: tuple[int, ...], block: int) -> _Pattern:
    """The :class:`_Pattern` of grads of ``numels`` in chunks of ``block``: planning's one
    memo, keyed by ``(numels, block)`` (what the rows depend on, so an entry is never stale;
    the addresses it last found apart are compared whole before they are trusted), the
    :data:`PATTERNS_KEPT` most recently used kept. Grads at new addresses with the sizes
    of earlier ones (a training step, whose allocator may hand out other blocks) reuse it.
    Safe when several threads plan: a lost update is a miss, not an error."""
    key = (numels, block)
    pattern = _patterns.get(key)
    if pattern is None:
        pattern = _patterns[key] = _Pattern(numels, block)
        while len(_patterns) > PATTERNS_KEPT:
            try:
                _patterns.popitem(last=False)
            except KeyError:  # emptied by another thread meanwhile
                break
    else:
        try:
            _patterns.move_to_end(key)
        except KeyError:  # dropped by another thread since the read: still usable
            pass
    return pattern


def clear() -> None:
    """Forget every kept size pattern (the next launches plan their rows again)."""
    _patterns.clear()


def _flat_memory(t: torch.Tensor) -> torch.Tensor:
    """A 1-D contiguous view of the memory of ``t``, dense in some dimension order
    (channels_last, a transpose)."""
    return t if t.is_contiguous() else t.as_strided((t.numel(),), (1,))


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


def _unique_starts(addresses: tuple[int, ...], numels: tuple[int, ...]
                   ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Drop grads that start at the address of an earlier one (``p2.grad = p1.grad``): each
    memory location is unscaled once, as far as the longest of them reaches. Non-empty grads
    only (the caller drops empty ones)."""
    seen: dict[int, int] = {}
    for address, n in zip(addresses, numels):
        seen[address] = max(n, seen.get(address, 0))
    return tuple(seen), tuple(seen.values())


def program_runs(plan: UnscalePlan, grads: list[torch.Tensor]) -> torch.Tensor | None:
    """Each of the non-empty ``grads``' programs ``[begin, end)`` in ``plan`` (a launch over
    them) as an int64 ``[len(grads), 2]`` tensor on their device (a table's kept with its
    size pattern), or None where its programs are not one run per grad in order (grads that
    share memory, covered once). No host sync."""
    device = grads[0].device
    if plan.table is None:
        return upload(torch.tensor([[0, plan.grid]], dtype=torch.int64), device) \
            if len(grads) == 1 else None
    kernels = _backend.loaded_kernels or triton_kernels()
    pattern = _rows(tuple(map(_NUMEL, grads)), kernels.unscale.BLOCK)
    return pattern.rows_on(device, "runs") if pattern.rows.shape[0] == plan.grid else None
