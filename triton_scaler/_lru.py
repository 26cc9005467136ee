"""The small least-recently-used caches of launch plans and chunk tables, oldest entry first.
Keyed by small tuples (``kernels.plan``, ``kernels.launcher``): an ``OrderedDict``
(:func:`recent`, :func:`remember`). Keyed by the addresses of every grad (the scaler's and
the ops' kept plans, :mod:`._grads`, :mod:`._ops_plans`): a short list of ``(key, value)``
searched with ``==`` (:func:`newest_equal`, :func:`store_newest`, :func:`forget`), because a
hash reads every one of 10,000 addresses at each lookup while a comparison with a key of
other addresses stops at the first that differs.

Safe when several threads launch (each its own model and scaler): a lookup whose entry
another thread evicts between the read and the move to the end still returns it, a store
never pops an empty cache, and a list is changed by whole-list assignments from a copy (an
entry another thread stores meanwhile may be lost: a cache miss, not an error). Host work
only."""

from __future__ import annotations

from collections import OrderedDict
from typing import TypeVar

K = TypeVar("K")
V = TypeVar("V")


def recent(cache: OrderedDict[K, V], key: K) -> V | None:
    """``cache[key]``, made the most recent entry, or None when absent."""
    value = cache.get(key)
    if value is not None:
        try:
            cache.move_to_end(key)
        except KeyError:  # evicted by another thread since the read: the value still holds
            pass
    return value


def remember(cache: OrderedDict[K, V], key: K, value: V, capacity: int) -> V:
    """Store ``value`` under ``key`` as the most recent entry, dropping the oldest beyond
    ``capacity``; returns ``value``."""
    cache.pop(key, None)  # a re-stored key moves to the end
    cache[key] = value
    while len(cache) > capacity:
        try:
            cache.popitem(last=False)
        except KeyError:  # emptied by another thread meanwhile
            break
    return value


def newest_equal(entries: list[tuple[K, V]], key: K) -> V | None:
    """The value of the newest entry whose key ``== key`` (never hashed), made the newest
    entry; None when there is none."""
    snapshot = entries[:]
    for entry in reversed(snapshot):
        if entry[0] == key:
            if entry is not snapshot[-1]:
                entries[:] = [e for e in snapshot if e is not entry] + [entry]
            return entry[1]
    return None


def store_newest(entries: list[tuple[K, V]], key: K, value: V, capacity: int) -> V:
    """Store ``value`` under ``key`` as the newest entry (replacing an entry of an equal key),
    dropping the oldest beyond ``capacity``; returns ``value``."""
    kept = [entry for entry in entries[:] if not entry[0] == key]
    kept.append((key, value))
    del kept[:max(0, len(kept) - capacity)]
    entries[:] = kept
    return value


def forget(entries: list[tuple[K, V]], key: K) -> None:
    """Drop the entries whose key ``== key``."""
    snapshot = entries[:]
    kept = [entry for entry in snapshot if not entry[0] == key]
    if len(kept) != len(snapshot):
        entries[:] = kept
