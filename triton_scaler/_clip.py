"""``GradScaler.clip_grad_norm_``: unscale and clip in one read pass and one read + write pass.

Same result as ``scaler.unscale_(optimizer)`` followed by ``torch.nn.utils.clip_grad_norm_``
over the optimizer's grads: the total norm is that of the unscaled grads (accumulated in float32,
float64 once any grad is float64, also for bf16 / fp16 grads; returned as float32),
``clip_coef = clamp(max_norm / (total_norm + 1e-6), max=1)`` is formed on the device from
the norm before that rounding, and each grad ends as
``dtype(dtype(g * inv_scale) * clip_coef)``. Triton backend: a read pass (found_inf and
per-program partial sums) and a write pass; reference backend: torch's ops.

The total norm is formed as torch forms it. Which grads are parts of one gradient decides how
a rank's norms combine with the others':

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
import numbers
from typing import Any, cast

import torch

from ._backend import resolve_backend
from ._dispatch import unscale_group
from ._distributed import MeshLayout, agree_over_meshes, mesh_layout
from ._grads import GradGroup, PerDevice

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
                         shard_group: Any, device: torch.device,
                         stages: Any = None) -> torch.Tensor:
    """Total norm of already unscaled grads, in torch's order and arithmetic (module doc).

    ``entries``: ``(grad, mesh layout)`` in the optimizer's order: the local tensor of a DTensor
    grad with its ``_distributed.MeshLayout``, ``None`` for a plain grad.
    ``shard_group``: the plain grads are shards over it (None: they are whole). ``stages``:
    the whole norm is then summed over this group (pipeline stages: ``x ** p``, all-reduce
    SUM, ``x ** (1 / p)``; MAX for the inf norm). Every rank must call this (the reductions
    are collective), also with no grads."""
    total = _local_total_norm(entries, norm_type, shard_group, device)
    return total if stages is None else _all_reduce(total, (stages,), norm_type, powered=False)


def _local_total_norm(entries: list[tuple[torch.Tensor, Any]], norm_type: float,
                      shard_group: Any, device: torch.device) -> torch.Tensor:
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
                     norm_type: float, shard_group: Any, device: torch.device,
                     stages: Any = None) -> torch.Tensor:
    """Total norm from each launch group's sum of squares (max ``|x|`` for the inf norm) and
    the groups its DTensor grads are sharded over (``()``: replicated, whole on every rank;
    None: plain grads, whole, or shards over ``shard_group`` when one is given), reduced
    group by group over the ranks, then summed over ``stages`` when given (every rank calls
    this)."""
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
        totals.append(torch.zeros((), dtype=wide, device=device))
    stacked = torch.stack(totals)
    total = stacked.amax() if inf else stacked.sum()
    if stages is not None:  # the stages' sums of squares (maxima), over the stages
        total = _all_reduce(total, (stages,), norm_type, powered=True)
    return total if inf else total.sqrt()


def _real_or_str(name: str, value: object) -> numbers.Real | str:
    """``value`` when it is a real number (not a bool) or a string; ``TypeError`` naming it."""
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, str)):
        raise TypeError(f"{name} must be a number; got {type(value).__name__} {value!r}")
    return value


def check_clip_arguments(max_norm: object, norm_type: object) -> tuple[float, float]:
    """``(max_norm, norm_type)`` as floats; ``TypeError`` / ``ValueError`` naming them."""
    max_value = _real_or_str("max_norm", max_norm)
    norm: float | numbers.Real | str = _real_or_str("norm_type", norm_type)
    if isinstance(norm, str) and norm.lower() == "inf":
        norm = math.inf
    if isinstance(max_value, str) or isinstance(norm, str):
        raise TypeError(f"max_norm must be a number and norm_type a number or 'inf'; got "
                        f"max_norm={max_norm!r}, norm_type={norm_type!r}")
    if not float(max_value) >= 0.0:
        raise ValueError(f"max_norm must be a number >= 0 (inf: no clipping); got {max_norm!r}")
    if not float(norm) > 0.0:
        raise ValueError(f"norm_type must be > 0 (2.0, inf, or any p > 0); got {norm_type!r}")
    return float(max_value), float(norm)


def _norm_entries(params) -> list[tuple[torch.Tensor, MeshLayout | None]]:
    """``(grad, mesh layout)`` of each parameter with a grad, for :func:`reference_total_norm`:
    a DTensor grad's local tensor and its mesh; ``None`` for a plain grad."""
    meshes: dict = {}  # the DTensor grads' meshes, looked up once per call
    return [mesh_layout(param.grad, meshes) if type(param.grad) is not torch.Tensor
            else (param.grad, None) for param in params]


def _on_triton(group, backend: str) -> bool:
    """One :class:`GradGroup` runs on the Triton kernels (else torch's ops: with ``"auto"``,
    a group on the CPU beside CUDA ones): known when collecting planned it."""
    if group.plan is not None or group.reference:
        return group.plan is not None
    return resolve_backend(backend, group.device) == "triton"


def _group_partial(group, found_inf, scale, norm_type: float, on_triton: bool) -> torch.Tensor:
    """The Triton read pass of one :class:`GradGroup` (found_inf and its sum of squares, or
    max ``|x|``, of the unscaled grads); off Triton (a group on another device than the
    Triton groups) the same from an in-place unscale and torch's norms."""
    if on_triton:
        return cast(torch.Tensor, unscale_group(
            group, found_inf, scale, "triton", False, from_scale=True,
            norm=2 if norm_type == 2.0 else -1))
    unscale_group(group, found_inf, scale, "reference", True, from_scale=True)
    norms = [grad_norm(g, norm_type) for g in group.grads if g.numel() or norm_type == 2.0]
    if not norms:
        return torch.zeros((), device=found_inf.device)
    total = torch.linalg.vector_norm(torch.stack(norms), norm_type)
    return total if norm_type == math.inf else total.square()


def _apply_coef(group, found_inf, scale, coef, write_pass: bool) -> None:
    """``dtype(dtype(g * inv_scale) * coef)``: the Triton write pass (``write_pass``), else a
    multiplication of grads already unscaled."""
    if write_pass:
        unscale_group(group, found_inf, scale, "triton", True, from_scale=True, clip_coef=coef)
    else:
        torch._foreach_mul_(group.grads, coef)


def clip_coefficient(total: torch.Tensor, max_norm: float, guard: Any,
                     backend: str) -> torch.Tensor:
    """torch's ``clamp(max_norm / (total + 1e-6), max=1)``; with a :class:`SpikeGuard`, its
    step from ``total``, and its max norm in ``max_norm``'s place (the same bits when it is
    ``max_norm``: torch divides a number by a tensor as ``reciprocal() * number``)."""
    if guard is None:
        return torch.clamp(max_norm / (total + 1e-6), max=1.0)
    limit = guard.limit(total, max_norm, backend).to(total.dtype)
    return torch.clamp((total + 1e-6).reciprocal() * limit, max=1.0)


def clip_unscaled(params, max_norm: float, norm_type: float, shard_group: Any,
                  device: torch.device, error_if_nonfinite: bool, guard: Any = None,
                  backend: str = "auto", stages: Any = None) -> torch.Tensor:
    """Clip grads that are not scaled (a disabled scaler, or after ``unscale_``) by the total
    norm of :func:`reference_total_norm`: any ``p``, plain grads sharded over ``shard_group``;
    ``guard``: a :class:`SpikeGuard` that decides this step's max norm; ``stages``: the norm
    is summed over this group (pipeline stages)."""
    entries = _norm_entries(params)
    total = reference_total_norm(entries, norm_type, shard_group, device, stages)
    if error_if_nonfinite and not bool(total.isfinite().item()):  # the documented read
        raise_nonfinite(norm_type)
    coef = clip_coefficient(total, max_norm, guard, backend)  # float64 with float64 grads
    with torch.no_grad():
        for grad, _ in entries:
            grad.mul_(coef.to(grad.device))
    return total.float()


def raise_nonfinite(norm_type: float) -> None:
    raise RuntimeError(
        f"The total norm of order {norm_type} for gradients from `parameters` is "
        "non-finite, so it cannot be clipped. To disable this error and scale the "
        "gradients by the non-finite norm anyway, set `error_if_nonfinite=False`")


def fused_clip(optimizer: torch.optim.Optimizer, groups: list[GradGroup], mesh_groups: dict,
               found_for: PerDevice, scale: torch.Tensor, backend: str, max_norm: float,
               norm_type: float, shard_group: Any, error_if_nonfinite: bool, guard: Any = None,
               stages: Any = None) -> tuple[torch.Tensor, bool]:
    """Unscale and clip ``groups`` (the optimizer's grads, collected) by their total norm:
    on the Triton backend a read pass (found_inf, a norm partial per group) and a write pass
    (``dtype(dtype(g * inv_scale) * clip_coef)``); where no group runs on Triton, torch's
    unscale and torch's norm arithmetic. Returns the total norm (float32) and whether it was
    non-finite with ``error_if_nonfinite`` (one host read; the grads are then unscaled only,
    as torch raises after ``unscale_`` and before the clip). ``guard``: a
    :class:`SpikeGuard` that decides the max norm from the total. No host sync otherwise."""
    device = scale.device
    scale_for = PerDevice(scale)
    # torch's arithmetic where no group runs on the Triton kernels
    on_triton = [_on_triton(g, backend) for g in groups]
    if True not in on_triton:
        for group in groups:
            dev = group.device
            unscale_group(group, found_for.get(dev), scale_for.get(dev), backend, True,
                          from_scale=True)
        # read again: collecting gave a bucketed parameter that received no gradient since
        # GradBuckets.zero_ grad None (its view is not a grad now)
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        total = reference_total_norm(_norm_entries(params), norm_type, shard_group, device,
                                     stages)
    else:
        partials = [(_group_partial(g, found_for.get(g.device), scale_for.get(g.device),
                                    norm_type, triton), g.mesh_groups)
                    for g, triton in zip(groups, on_triton)]
        total = combine_partials(partials, norm_type, shard_group, device, stages)
    nonfinite = error_if_nonfinite and not bool(total.isfinite().item())
    # the coefficient is formed from the norm before its float32 rounding: float64 with any
    # float64 grad, as torch's
    coef = clip_coefficient(total, max_norm, guard, backend)
    if nonfinite:
        coef = torch.ones_like(total)
    for group, write_pass in zip(groups, on_triton):
        dev = group.device
        _apply_coef(group, found_for.get(dev), scale_for.get(dev), coef.to(dev), write_pass)
    for group in groups:  # a gradient bucket's buffer, written as a whole
        if group.bucket is not None:
            group.bucket.buffer_rewritten()
    if mesh_groups:
        agree_over_meshes(found_for.per_device, mesh_groups)
    return total.float(), nonfinite
