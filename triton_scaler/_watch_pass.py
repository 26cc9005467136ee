"""What a watch (:class:`triton_scaler.telemetry.GradWatch`) adds to the scaler's passes:
where each Triton launch stores its programs' statistics and which watched rows they finish
into (:func:`plan_pass`, kept per optimizer as a :class:`FusedPass`); the parameters a watch
takes (:func:`named_parameters_of`); and its sharded rows reduced over their process groups
(:func:`reduced_over_shards`)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from ._backend import triton_kernels
from ._distributed import is_dtensor, reduce_rows
from ._grads import GradGroup
from ._plans import finish_buffers, finish_table, plan_unscale, program_ranges


def plan_pass(index: dict[int, int], groups: list, rows: torch.Tensor) -> FusedPass:
    """How a watch reads the launches over ``groups`` (the optimizer's grads, collected): per
    group, what its launch stores and finishes (a Triton launch on ``rows``' device over grads
    whose programs run one grad after another, or a gradient bucket's stand-in): the
    ``stats`` of ``launch_unscale``, whose watched tensors (``index``: id(parameter) -> row)
    finish into ``rows``."""
    device = rows.device
    stats: list[tuple[torch.Tensor, ...] | None] = []
    numels: list[tuple[int, ...] | None] = []
    stand_ins: list = []
    covered: set[int] = set()
    empty: list[int] = []
    for group in groups:
        plan, indices = group.plan, group.indices
        ranges = None
        stand_in = None
        if plan is not None and indices is not None and group.device == device:
            block = triton_kernels().unscale.BLOCK
            if group.bucket is None:
                if plan.reusable:
                    ranges = program_ranges(plan, group.grads, block)
            else:
                stand_in, ranges = _bucket_stand_in(group, block)
                if stand_in is not None:
                    group, plan = stand_in, stand_in.plan
        stand_ins.append(stand_in if ranges is not None else None)
        numels.append(tuple(map(_NUMEL, group.grads)) if ranges is not None and
                      stand_in is None else None)
        if ranges is None:
            stats.append(None)
            continue
        tensors = []
        for k, (begin, end) in enumerate(ranges):
            row = index.get(id(group.params[indices[k]]))
            if row is not None:
                covered.add(row)
                if begin == end:
                    empty.append(row)
                else:
                    tensors.append((begin, end, row))
        stats.append(finish_buffers(plan.grid, *finish_table(plan.grid, tensors, device),
                                    len(tensors), rows) if tensors else None)
    return FusedPass(groups, numels, stand_ins if any(x is not None for x in stand_ins) else [],
                     stats, covered, empty)


_NUMEL = torch.Tensor.numel


class FusedPass:
    """One optimizer's launches as a watch reads them (:meth:`GradWatch._fused_pass`)."""

    __slots__ = ("plans", "indices", "numels", "grids", "stand_ins", "stats", "covered",
                 "empty", "fallback")

    def __init__(self, groups: list, numels: list, stand_ins: list, stats: list,
                 covered: set[int], empty: list[int]) -> None:
        # what tells a later call's groups launch the same programs over the same parameters:
        # the same plans (objects), or for a group whose launch stores statistics new plans
        # (grads at new addresses) over grads of the same sizes (``numels``)
        # (a plan that holds a grad, its base, is not kept: the grads must be freed)
        self.plans = [_kept(group) for group in groups]
        self.indices = [group.indices for group in groups]
        self.numels = numels
        self.grids = [None if group.plan is None else (group.plan.grid, group.plan.table is None)
                      for group in groups]
        # per group (empty: none), what launches in a gradient bucket's place: its
        # parameters' views (the same elements and results, one run of programs each)
        self.stand_ins = stand_ins
        self.stats = stats  # per group, its launch's ``stats`` (None: none)
        self.covered = covered  # the watch's rows of these grads
        self.empty = empty  # those of empty grads (no program: the watch fills them once)
        #: (row, parameter) of the watched grads no launch covers (set by the watch)
        self.fallback: list[tuple[int, torch.Tensor]] = []

    def fits(self, groups: list) -> bool:
        """``groups`` launch the same programs over the same parameters: these plans, or
        plans of as many programs, each run over grads of the same sizes as these."""
        if len(groups) != len(self.plans):
            return False
        for k, (group, plan, indices) in enumerate(zip(groups, self.plans, self.indices)):
            if group.indices is not indices:
                return False
            new = group.plan
            if new is plan:
                continue
            numels = self.numels[k]
            if numels is None or new is None or not new.reusable or \
                    (new.grid, new.table is None) != self.grids[k] or \
                    (group.numels or tuple(map(_NUMEL, group.grads))) != numels:
                return False
            self.plans[k] = _kept(group)
        return True


def _kept(group: Any) -> Any:
    """What a :class:`FusedPass` keeps of a group's plan: the plan itself when it holds no
    grad (a bucket's, over its buffer), else a marker that no plan matches
    (the next call compares sizes)."""
    plan = group.plan
    return plan if plan is None or plan.base is None or group.bucket is not None else _NO_PLAN


_NO_PLAN = object()


def _bucket_stand_in(group: Any, block: int) -> tuple[Any, list[tuple[int, int]] | None]:
    """What launches in a gradient bucket's group's place for a watch: the same elements in
    one run of programs per parameter (a chunk table over its parameters' views, launched
    from the buffer itself: no tensor over the buffer is kept, which would count as a grad
    held elsewhere), and each parameter's programs; ``(None, None)`` where that cannot be."""
    bucket = group.bucket
    views = [bucket.view(i) for i in group.indices]
    plan = plan_unscale(views)
    first = next((v for v in views if v.numel()), None)
    if not plan.reusable or first is None or first.data_ptr() != bucket.buffer.data_ptr():
        return None, None
    ranges = program_ranges(plan, views, block)
    if ranges is None:
        return None, None
    plan.base = None  # the launch's base is the buffer itself (``GradGroup.base``)
    return GradGroup(group.device, [bucket.buffer], params=group.params, indices=group.indices,
                     plan=plan, base=bucket.buffer), ranges


def named_parameters_of(model: Any) -> list[tuple[str, torch.Tensor]]:
    """``model``'s named parameters that take gradients: an ``nn.Module``, or ``(name,
    parameter)`` pairs. ``TypeError`` naming ``model`` for anything else."""
    pairs: list[tuple[str, torch.Tensor]]
    if isinstance(model, torch.nn.Module):
        pairs = list(model.named_parameters())
    elif isinstance(model, Iterable) and not isinstance(model, (str, bytes, torch.Tensor)):
        pairs = list(model)
        for i, pair in enumerate(pairs):
            if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str)
                    and isinstance(pair[1], torch.Tensor)):
                raise TypeError(
                    f"model must be an nn.Module or (name, parameter) pairs, e.g. "
                    f"model.named_parameters(); item {i} is a {type(pair).__name__} "
                    "(parameters without names: pass model.named_parameters(), not "
                    "model.parameters())")
    else:
        raise TypeError(f"model must be an nn.Module or (name, parameter) pairs, e.g. "
                        f"model.named_parameters(); got {type(model).__name__}")
    pairs = [(name, p) for name, p in pairs if p.requires_grad]
    for name, p in pairs:
        if type(p) not in (torch.Tensor, torch.nn.Parameter) and not is_dtensor(p):
            raise NotImplementedError(
                f"model's parameter {name!r} is a {type(p).__name__}: a watch takes plain "
                "parameters and DTensor ones (FSDP2, tensor parallel); for FSDP1 wrap with "
                "use_orig_params=True and watch the wrapped model's named_parameters()")
    if not pairs:
        raise ValueError("model has no parameters that take gradients: nothing to watch")
    names = [name for name, _ in pairs]
    if len(set(names)) != len(names):
        raise ValueError("model names a parameter twice; names must be unique")
    return pairs


def reduced_over_shards(stats: torch.Tensor, overflow: torch.Tensor,
                        sharded: dict[int, tuple[Any, ...]], process_group: Any
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """A watch's rows of sharded grads as the whole gradient's: squares and counts summed
    over the shards, amax their largest (two collectives per process group, made by every
    rank's ``report()``); the others as recorded. ``sharded``: the rows of DTensor grads and
    the groups they are sharded over; ``process_group`` (a ShardedGradScaler's, or None):
    every other row is a shard over it."""
    by_groups: dict[tuple[int, ...], tuple[tuple[Any, ...], list[int]]] = {}
    if process_group is not None:
        rows = [i for i in range(stats.shape[0]) if i not in sharded]
        by_groups[(id(process_group),)] = ((process_group,), rows)
    for i, groups in sharded.items():
        by_groups.setdefault(tuple(map(id, groups)), (groups, []))[1].append(i)
    if not by_groups:
        return stats, overflow
    stats, overflow = stats.clone(), overflow.clone()
    for groups, rows in by_groups.values():
        index = torch.tensor(rows, dtype=torch.int64, device=stats.device)
        sub = stats.index_select(0, index)
        seen = sub[:, 4:5] > 0  # a shard without a grad adds nothing
        sums = torch.cat([torch.where(seen, sub[:, 1:5], 0.0),
                          overflow.index_select(0, index)], 1)
        maxima = torch.where(seen[:, 0], sub[:, 0], 0.0).nan_to_num(nan=0.0)
        reduce_rows(sums, maxima, groups)
        anywhere = sums[:, 3:4] > 0
        nan = math.nan
        amax = torch.where(sums[:, 2] > 0, nan, maxima)
        whole = torch.cat([amax[:, None], sums[:, 0:3], anywhere.double()], 1)
        stats.index_copy_(0, index, torch.where(anywhere, whole,
                                                torch.tensor([nan, nan, 0.0, 0.0, 0.0],
                                                             dtype=stats.dtype,
                                                             device=stats.device)))
        overflow.index_copy_(0, index, sums[:, 4:6])
    return stats, overflow

