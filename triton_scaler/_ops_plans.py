"""The launch plans that :mod:`triton_scaler.ops` keeps between calls on grads at the same
addresses: a training loop that calls ``ops.non_finite_check_and_unscale_(grads, ...)`` every
step on grads that keep their storage (or on new grad tensors the caching allocator puts back
at the same blocks), and the DeepSpeed / MindSpore adapters, which call the ops.

A call whose grads lie at the addresses of one of the last ``_CAPACITY`` grad lists, laid out
as those were (torch's ``TensorGuards``: each grad's type, dtype, device, shape and strides,
one C++ call; see :mod:`._stored_plans`), launches that list's plans again: one pass over the
grads' data pointers, their comparison with the stored lists' (no hash) and that check,
where a call without stored plans also passes over their dtypes, devices, layouts, sizes and
contiguity, groups them and plans each launch (no-op launches on CPU, same list each call:
243 against 692 us at 1,000 grads, ``benchmarks/RESULTS.md``). The guard is built from grads
that passed every check, at the second call at those addresses; a one-off list pays nothing
for it. Holds no grad.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch

from ._backend import triton_kernels
from ._lru import forget, newest_equal, store_newest
from ._stored_plans import tensor_guards

if TYPE_CHECKING:
    from torch._C._dynamo.guards import TensorGuards

    from triton_scaler.kernels.plan import UnscalePlan

_CAPACITY = 8  # grad lists remembered (a loop has one or a few: per model, per optimizer)

_DATA_PTR = torch.Tensor.data_ptr


class _StoredLaunches:
    """Each launch of a call: the index of its base grad in the call's list and its plan
    template, and (from the second call at these addresses) the guard its grads must pass."""

    __slots__ = ("launches", "guard")

    def __init__(self, launches: list[tuple[int, UnscalePlan]], guard: TensorGuards | None
                 ) -> None:
        self.launches, self.guard = launches, guard


#: ((device, the grads' addresses), their launches), oldest first
_stored: list[tuple[tuple, _StoredLaunches]] = []


def unscale_planned(grads: list[torch.Tensor], found_inf: torch.Tensor,
                    inv_scale: torch.Tensor, write: bool,
                    group_grads: Callable[[], Iterable[list[torch.Tensor]]]) -> None:
    """``ops``' Triton launches over plain tensors ``grads``: from stored plans when the grads
    are at the addresses of earlier ones and laid out as they were, else through
    ``group_grads()`` (the ops' argument checks and grouping by dtype), storing the plans
    when every launch's can be kept (none needs contiguous copies). No host sync."""
    kernels = triton_kernels()
    try:
        key = (found_inf.device, tuple(map(_DATA_PTR, grads)))
    except (TypeError, RuntimeError):  # a grad without a data pointer (sparse): checked below
        key = None
    stored = newest_equal(_stored, key) if key is not None else None
    if stored is not None and stored.guard is not None and stored.guard.check(*grads):
        for index, template in stored.launches:
            kernels.launch_unscale(template.rebased(grads[index]), found_inf, inv_scale,
                                   write=write)
        return
    # usually one group, ``grads`` itself: its addresses known. Every plan first: grads
    # refused (sharing memory: kernels.refuse_overlapping_writes) leave all unchanged
    plans = [(members, kernels.plan_unscale(members, None,
                                            key[1] if members is grads and key else None))
             for members in group_grads()]
    for _, plan in plans if write else ():
        kernels.refuse_overlapping_writes(plan)
    launches, reusable = [], True
    for members, plan in plans:
        kernels.launch_unscale(plan, found_inf, inv_scale, write=write)
        reusable = reusable and plan.reusable
        if plan.grid:  # a plan without elements launches nothing
            launches.append((_index_in(grads, members, plan.base_index), plan.template()))
    if key is not None and reusable:
        _store(key, launches, grads, seen=stored is not None)


def _index_in(grads: list[torch.Tensor], members: list[torch.Tensor], index: int) -> int:
    """The index in ``grads`` of ``members[index]`` (``members``: the grads of one dtype,
    in their order; usually ``grads`` itself)."""
    if members is grads or len(members) == len(grads):
        return index
    dtype = members[0].dtype
    return [i for i, g in enumerate(grads) if g.dtype == dtype][index]


def _store(key: tuple, launches: list, grads: list[torch.Tensor], seen: bool) -> None:
    """Remember ``launches`` for grads at ``key``'s addresses; their guard from the second
    call there on (``seen``), over ``grads``, which the caller has checked."""
    guard = tensor_guards(grads) if seen else None
    if seen and guard is None:  # a torch without TensorGuards: nothing to check reuse with
        forget(_stored, key)
        return
    store_newest(_stored, key, _StoredLaunches(launches, guard), _CAPACITY)


def clear() -> None:
    """Forget every stored plan."""
    _stored.clear()
