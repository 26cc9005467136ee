"""The total gradient norm of :meth:`GradScaler.clip_grad_norm_`, formed as torch forms it.

Which grads are parts of one gradient decides how a rank's norms combine with the others':

* plain grads, not sharded (one process, DDP): the local norm, as
  ``torch.nn.utils.clip_grad_norm_`` (each grad's norm, grouped by device and dtype in order
  of first appearance, then the norm of the norms);
* DTensor grads (FSDP2, tensor parallel): each grad's local norm, the norms of one mesh
  reduced together over the mesh dimensions any of them is sharded on (``x ** p``, all-reduce
  SUM, ``x ** (1 / p)``; MAX for the inf norm), as torch's ``_NormPartial`` does under DTensor
  dispatch (a norm replicated on such a dimension is partitioned first), then the norm of the
  norms: a replicated grad is counted once;
* plain grads that are shards over ``shard_group`` (``clip_grad_norm_(sharded=True)``: FSDP1,
  ZeRO-style sharding): their local norm's ``p``-th power is summed over the group, as
  ``FullyShardedDataParallel.clip_grad_norm_`` does (any other grads count once).

:func:`reference_total_norm` is that arithmetic, op for op: bit-identical to torch's (and to
FSDP1's) for float32 grads. :func:`combine_partials` is the Triton backend's: one sum of
squares (or max) per launch group, reduced over the same groups.
"""

from __future__ import annotations

import math
from typing import Any

import torch

_HALF = (torch.float16, torch.bfloat16)


def grad_norm(grad: torch.Tensor, norm_type: float) -> torch.Tensor:
    """One grad's norm: float32 for fp16 / bf16 grads (torch's would be fp16 / bf16)."""
    if grad.dtype in _HALF:
        return torch.linalg.vector_norm(grad, norm_type, dtype=torch.float32)
    return torch.linalg.vector_norm(grad, norm_type)


def _all_reduce(x: torch.Tensor, groups: tuple[Any, ...], norm_type: float,
                powered: bool) -> torch.Tensor:
    """``x`` reduced over each group in turn: MAX for the inf norm; else a SUM of
    ``x ** p`` followed by ``** (1 / p)`` (``powered``: ``x`` is already a sum of powers)."""
    import torch.distributed as dist

    for group in groups:
        if norm_type == math.inf:
            dist.all_reduce(x, op=dist.ReduceOp.MAX, group=group)
        elif powered:
            dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
        else:
            x = x**norm_type
            dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
            x = x ** (1.0 / norm_type)
    return x


def _reduce_on_mesh(norms: list[torch.Tensor], layouts: list, norm_type: float,
                    wide: torch.dtype, device: torch.device) -> torch.Tensor:
    """The norms of the DTensor grads on one mesh (``layouts``: their
    ``_distributed.MeshLayout``), reduced as torch's ``clip_grad_norm_`` reduces their stack
    under DTensor dispatch: the stack is partial on every mesh dimension any of them is
    sharded on; a norm replicated there is first partitioned (``/ size ** (1 / p)``,
    ``_NormPartial``; nothing for the inf norm's MAX), then the stack is reduced dimension by
    dimension, outer first."""
    first = layouts[0]
    dims = [d for d in range(len(first.sizes)) if any(lay.sharded[d] for lay in layouts)]
    parts = []
    for norm, layout in zip(norms, layouts):
        for d in dims:
            if not layout.sharded[d] and norm_type != math.inf:
                norm = norm / math.pow(layout.sizes[d], 1 / norm_type)
        parts.append(norm.to(device, wide))
    return _all_reduce(torch.stack(parts), tuple(first.groups[d] for d in dims), norm_type,
                       powered=False)


def reference_total_norm(entries: list[tuple[torch.Tensor, Any]], norm_type: float,
                         shard_group: Any, device: torch.device) -> torch.Tensor:
    """Total norm of already unscaled grads, in torch's order and arithmetic (module doc).

    ``entries``: ``(grad, mesh layout)`` in the optimizer's order: the local tensor of a DTensor
    grad with its ``_distributed.MeshLayout``, ``None`` for a plain grad.
    ``shard_group``: the plain grads are shards over it (None: they are whole). Every rank
    must call this (the reductions are collective), also with no grads."""
    inf = norm_type == math.inf
    # the norms of plain grads sharded over shard_group, in the parameters' order, as FSDP1's
    # _get_grad_norm stacks them (float32 norms; the inf norm of no elements is an error)
    shards = [torch.linalg.vector_norm(grad, norm_type, dtype=torch.float32)
              for grad, layout in entries if layout is None and shard_group is not None
              and not (inf and not grad.numel())]
    by_key: dict[tuple, list[tuple[torch.Tensor, Any]]] = {}
    for grad, layout in entries:
        if layout is not None or shard_group is None:
            by_key.setdefault((grad.device, grad.dtype), []).append((grad, layout))
    norms: list[torch.Tensor] = []  # per grad, counted once each
    on_mesh: dict[Any, list[tuple[int, Any]]] = {}  # mesh -> (index into norms, layout)
    for (_, dtype), items in by_key.items():
        for grad, layout in items:
            empty = inf and not grad.numel()  # torch's inf norm of no elements is an error
            if layout is not None:  # a rank with no elements still joins, with 0
                norm = grad.new_zeros((), dtype=torch.float32 if dtype in _HALF else dtype) \
                    if empty else grad_norm(grad, norm_type)
                on_mesh.setdefault(layout.mesh, []).append((len(norms), layout))
                norms.append(norm)
            elif not empty:
                norms.append(grad_norm(grad, norm_type))
    wide = torch.float64 if any(n.dtype == torch.float64 for n in norms) else torch.float32
    for placed in on_mesh.values():
        reduced = _reduce_on_mesh([norms[i] for i, _ in placed], [lay for _, lay in placed],
                                  norm_type, wide, device)
        for k, (i, _) in enumerate(placed):
            norms[i] = reduced[k]
    rest = torch.linalg.vector_norm(torch.stack([n.to(device, wide) for n in norms]),
                                    norm_type) if norms else None
    if shard_group is None:
        return rest if rest is not None else torch.zeros((), device=device)
    # FullyShardedDataParallel.clip_grad_norm_, op for op
    local = torch.linalg.vector_norm(torch.stack(shards), norm_type, dtype=torch.float32) \
        .to(device) if shards else torch.zeros((), device=device)
    if inf:
        total = torch.maximum(local, rest) if rest is not None else local
        return _all_reduce(total, (shard_group,), norm_type, powered=True)
    total = _all_reduce(local**norm_type, (shard_group,), norm_type, powered=True)
    if rest is not None:
        total += rest**norm_type
    return total ** (1.0 / norm_type)


def combine_partials(partials: list[tuple[torch.Tensor, tuple[Any, ...] | None]],
                     norm_type: float, shard_group: Any, device: torch.device) -> torch.Tensor:
    """Total norm from each launch group's sum of squares (max ``|x|`` for the inf norm) and
    the groups its DTensor grads are sharded over (``()``: replicated, whole on every rank;
    None: plain grads, whole, or shards over ``shard_group`` when one is given), reduced
    group by group over the ranks (every rank calls this)."""
    wide = torch.float64 if any(p.dtype == torch.float64 for p, _ in partials) \
        else torch.float32
    by_groups: dict[tuple, list[torch.Tensor]] = {}
    if shard_group is not None:
        by_groups[(shard_group,)] = []  # joined even where this rank holds no grad
    for partial, groups in partials:
        key = groups if groups is not None else \
            ((shard_group,) if shard_group is not None else ())
        by_groups.setdefault(key, []).append(partial.to(device, wide))
    inf = norm_type == math.inf
    totals = []
    for groups, items in by_groups.items():
        stacked = torch.stack(items) if items else torch.zeros(1, dtype=wide, device=device)
        total = stacked.amax() if inf else stacked.sum()
        totals.append(_all_reduce(total, groups, norm_type, powered=True) if groups else total)
    if not totals:
        return torch.zeros((), dtype=wide, device=device)
    stacked = torch.stack(totals)
    return stacked.amax() if inf else stacked.sum().sqrt()
