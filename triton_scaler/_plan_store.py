"""The one bounded store of launch planning: what the unscale launches of one grad list need
again when the same grads (or new grads the allocator puts at the same blocks) come back.

A key is a tuple whose first item names what it keeps:

* ``("sizes", numels, block)``: a chunk table's rows, which depend on the sizes alone
  (uploaded once per device);
* ``("table", device, dtype, block, addresses, numels)``: a chunk table's rows with the
  grads' starts, uploaded;
* ``("ops", device, addresses)``: :mod:`.ops`' launches over a grad list;
* ``("grads", backend, addresses)``: :class:`GradScaler`'s launches over an optimizer's grads
  outside gradient buckets, one per (device, dtype) group;
* ``("stats", device, grid, ranges)``: the finishing table of a ``watch_stats`` launch whose
  grads' programs are ``ranges``, and its number of groups.

``ops`` and ``grads`` hold :class:`StoredLaunches`: plan templates (no grad) and what tells that new
grads at those addresses are laid out as the grads they were made for. Each kind keeps its
:data:`CAPACITY` most recently used entries, oldest first, so that a lookup compares a key
with entries of its own kind only. Keys are compared with ``==``, never hashed: a hash reads
every one of 10,000 addresses at each lookup, while a comparison with other addresses stops
at the first that differs.

Safe when several threads launch (each its own model and scaler): a kind's list is changed
by whole-list assignments from a copy (an entry another thread stores meanwhile may be lost:
a miss, not an error). Host work only.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch

try:  # one C++ call checking many tensors' types, dtypes, devices, shapes and strides
    from torch._C._dynamo.guards import TensorGuards
except ImportError:  # pragma: no cover - a torch built without dynamo: Python passes
    TensorGuards = None  # type: ignore[assignment, misc]

#: Entries kept of each kind: a training loop needs one of each per grad list (the size
#: pattern shared by lists of the same sizes), an allocator cycling its blocks a few.
CAPACITY = 16

#: Each kind's entries ``(key, value)``, oldest first.
_entries: dict[str, list[tuple[tuple, Any]]] = {}

_NUMEL = torch.Tensor.numel
_DTYPE = operator.attrgetter("dtype")
_IS_CONTIGUOUS = torch.Tensor.is_contiguous


def lookup(key: tuple) -> Any:
    """The value stored under ``key`` (compared with ``==``), made the newest entry of its
    kind; None when there is none."""
    entries = _entries.get(key[0])
    if not entries:
        return None
    snapshot = entries[:]
    for entry in reversed(snapshot):
        if entry[0] == key:
            if entry is not snapshot[-1]:
                entries[:] = [e for e in snapshot if e is not entry] + [entry]
            return entry[1]
    return None


def keep(key: tuple, value: Any) -> Any:
    """Store ``value`` under ``key`` as the newest entry of its kind (replacing one of an
    equal key), dropping that kind's oldest beyond :data:`CAPACITY`; returns ``value``."""
    entries = _entries.setdefault(key[0], [])
    kept = [entry for entry in entries[:] if not entry[0] == key]
    kept.append((key, value))
    del kept[:max(0, len(kept) - CAPACITY)]
    entries[:] = kept
    return value


def drop(key: tuple) -> None:
    """Forget the entry stored under ``key``, if any."""
    entries = _entries.get(key[0])
    if not entries:
        return
    snapshot = entries[:]
    kept = [entry for entry in snapshot if not entry[0] == key]
    if len(kept) != len(snapshot):
        entries[:] = kept


def count(kind: str) -> int:
    """Entries of one kind (the first item of their keys) in the store."""
    return len(_entries.get(kind, ()))


def clear() -> None:
    """Forget everything stored."""
    _entries.clear()


class StoredLaunches:
    """The launches over a grad list (``(index of the launch's base grad in the list, plan
    template)``, the template an :class:`~._plans.UnscalePlan`, one per group, in order; None
    for a group on the reference path) and what tells that new grads at the same addresses
    are laid out as the grads they were made for. Holds no grad."""

    __slots__ = ("launches", "numels", "dtypes", "guard")

    def __init__(self, launches: Sequence[tuple[int, Any]],
                 numels: tuple[int, ...] | None, dtypes: tuple[torch.dtype, ...] | None,
                 guard: TensorGuards | None = None) -> None:
        self.launches = launches
        # the grads' sizes and dtypes, for a reuse checked by Python passes; None: reused
        # only through a guard
        self.numels, self.dtypes = numels, dtypes
        # a TensorGuards over grads the plans fit: those they were made for, or (built
        # lazily) those of their first reuse
        self.guard = guard

    def fit(self, grads: list[torch.Tensor]) -> bool:
        """``grads``, at the addresses the launches were planned for, are laid out as the grads
        they were planned for. One C++ call (``TensorGuards``: type, dtype, device, shape and
        strides of each grad) when there is a guard. Without one, where sizes and dtypes are
        kept, passes reading sizes, dtypes and contiguity, which only contiguous grads pass
        (each launch's caller checks its base grad's device), and the guard built from those
        grads; else False."""
        if self.guard is not None:
            return self.guard.check(*grads)
        if self.numels is None or tuple(map(_NUMEL, grads)) != self.numels or \
                tuple(map(_DTYPE, grads)) != self.dtypes or not all(map(_IS_CONTIGUOUS, grads)):
            return False
        self.guard = tensor_guards(grads)
        return True


def tensor_guards(grads: list[torch.Tensor]) -> TensorGuards | None:
    """torch's ``TensorGuards`` over ``grads``, or None (a torch without it, or whose private
    API changed: its keywords are required, without them torch 2.11 - 2.13 crash)."""
    if TensorGuards is None:
        return None
    try:
        return TensorGuards(*grads, dynamic_dims_sizes=None, dynamic_dims_strides=None)
    except TypeError:
        return None
