"""The small least-recently-used caches of launch plans and chunk tables (``kernels.plan``,
``kernels.launcher``, :mod:`._ops_plans`): an ``OrderedDict``, oldest entry first. Safe when
several threads launch (each its own model and scaler): a lookup whose entry another thread
evicts between the read and the move to the end still returns it, and a store never pops an
empty cache. Host work only."""

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
