"""The one bounded store of launch planning: what the unscale launches of one grad list need
again when the same grads (or new grads the allocator puts at the same blocks) come back.

Entries ``(key, value)``, oldest first, at most :data:`CAPACITY`, the least recently used
dropped. A key is a tuple whose first item names what it keeps:

* ``("sizes", numels, block)``: a chunk table's part that depends on the sizes alone;
* ``("table", device, dtype, block, addresses, numels)``: a chunk table, uploaded;
* ``("ops", device, addresses)``: :mod:`.ops`' launches over a grad list;
* ``("grads", backend, addresses)``: :class:`GradScaler`'s launches over an optimizer's grads
  outside gradient buckets, one per (device, dtype) group.

The last two hold :class:`StoredLaunches`: plan templates (no grad) and what tells that new
grads at those addresses are laid out as the grads they were made for. Keys are compared
with ``==``, never hashed: a hash reads every one of 10,000 addresses at each lookup, while a
comparison with a key of another kind or other addresses stops at its first difference.

Safe when several threads launch (each its own model and scaler): the list is changed by
whole-list assignments from a copy (an entry another thread stores meanwhile may be lost: a
miss, not an error). Host work only.
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Any

import torch

try:  # one C++ call checking many tensors' types, dtypes, devices, shapes and strides
    from torch._C._dynamo.guards import TensorGuards
except ImportError:  # pragma: no cover - a torch built without dynamo: Python passes
    TensorGuards = None  # type: ignore[assignment, misc]

if TYPE_CHECKING:
    from ._kernel_args import UnscalePlan

#: Entries kept: a training loop needs two or three per grad list (its launches, a chunk
#: table, the sizes'); an allocator cycling its blocks, a few grad lists.
CAPACITY = 64

_entries: list[tuple[tuple, Any]] = []

_NUMEL = torch.Tensor.numel
_DTYPE = operator.attrgetter("dtype")
_IS_CONTIGUOUS = torch.Tensor.is_contiguous
_DEVICE_INDEX = torch.Tensor.get_device


def lookup(key: tuple) -> Any:
    """The value stored under ``key`` (compared with ``==``), made the newest entry; None
    when there is none."""
    snapshot = _entries[:]
    for entry in reversed(snapshot):
        if entry[0] == key:
            if entry is not snapshot[-1]:
                _entries[:] = [e for e in snapshot if e is not entry] + [entry]
            return entry[1]
    return None


def keep(key: tuple, value: Any) -> Any:
    """Store ``value`` under ``key`` as the newest entry (replacing one of an equal key),
    dropping the oldest beyond :data:`CAPACITY`; returns ``value``."""
    kept = [entry for entry in _entries[:] if not entry[0] == key]
    kept.append((key, value))
    del kept[:max(0, len(kept) - CAPACITY)]
    _entries[:] = kept
    return value


def drop(key: tuple) -> None:
    """Forget the entry stored under ``key``, if any."""
    snapshot = _entries[:]
    kept = [entry for entry in snapshot if not entry[0] == key]
    if len(kept) != len(snapshot):
        _entries[:] = kept


def count(kind: str) -> int:
    """Entries of one kind (the first item of their keys) in the store."""
    return sum(1 for key, _ in _entries[:] if key[0] == kind)


def clear() -> None:
    """Forget everything stored."""
    _entries.clear()


class StoredLaunches:
    """The launches over a grad list (``(index of the launch's base grad in the list, plan
    template)``, one per group, in order) and what tells that new grads at the same addresses
    are laid out as the grads they were made for. Holds no grad."""

    __slots__ = ("launches", "numels", "dtypes", "devices", "guard", "python_check")

    def __init__(self, launches: list[tuple[int, UnscalePlan]], grads: list[torch.Tensor],
                 guard: TensorGuards | None = None, *, python_check: bool = True) -> None:
        self.launches = launches
        self.numels, self.dtypes = tuple(map(_NUMEL, grads)), tuple(map(_DTYPE, grads))
        self.devices = tuple(map(_DEVICE_INDEX, grads))
        # a TensorGuards over grads the plans fit: those they were made for, or (built
        # lazily) those of their first reuse
        self.guard = guard
        # reuse checked by Python passes where there is no guard (else: not reused)
        self.python_check = python_check

    def fit(self, grads: list[torch.Tensor]) -> bool:
        """``grads``, at the addresses the launches were planned for, are laid out as the grads
        they were planned for. One C++ call (``TensorGuards``: type, dtype, device, shape and
        strides of each grad) when there is a guard. Without one, with ``python_check``,
        passes reading sizes, dtypes, contiguity and device indices, which only contiguous
        grads on the same devices pass, and the guard built from those grads; else False."""
        if self.guard is not None:
            return self.guard.check(*grads)
        if not self.python_check:
            return False
        if tuple(map(_NUMEL, grads)) != self.numels or tuple(map(_DTYPE, grads)) != \
                self.dtypes or not all(map(_IS_CONTIGUOUS, grads)) or \
                tuple(map(_DEVICE_INDEX, grads)) != self.devices:
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
