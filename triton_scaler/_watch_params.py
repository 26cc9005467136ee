"""What a watch (:class:`triton_scaler.telemetry.GradWatch`) takes and reads apart from its
device state: the parameters it watches (:func:`named_parameters_of`), and its sharded rows
reduced over their process groups (:func:`reduced_over_shards`)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from ._distributed import is_dtensor, reduce_rows


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

