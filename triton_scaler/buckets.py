"""Flat gradient buckets: one contiguous gradient buffer per (device, dtype), every ``.grad`` a
view into it, so the scaler unscales a whole bucket with one kernel launch."""

from __future__ import annotations

import operator
from collections.abc import Iterable
from typing import Literal

import torch

from ._bucket import _REGISTRY_ATTR, GradBucket, _bucketed
from ._grads import param_lists, same_param_lists


class GradBuckets:
    """Contiguous gradient buckets for an optimizer's (or a parameter list's) parameters.

    Args:
        optimizer_or_params: a ``torch.optim.Optimizer`` (the buckets register on it and
            :class:`triton_scaler.GradScaler` then covers each bucket with one launch) or an
            iterable of parameters. Parameters without ``requires_grad`` are left out; a
            parameter listed twice is bucketed once; a parameter already in other buckets is
            rejected with ``ValueError``.
        on_detach: ``"reattach"`` (default) or ``"warn"``, what to do when a grad stops being a
            view, e.g. after ``optimizer.zero_grad()`` with ``set_to_none=True``.

    Use :meth:`zero_` (one fill per bucket) instead of ``optimizer.zero_grad()``. Parameters
    added to the optimizer later are unscaled by the per-tensor path. Buckets hold no state of
    their own: model and optimizer checkpoints are unaffected. Do not hold a grad's old view
    while its parameter gets another grad (assigned after the backward, or set to None before
    it and the grads then written in place): the O(1) check may not see that grad
    (docs/buckets.md).

    One buffer per (device, dtype) of the parameters (CPU or CUDA; float32, float16,
    bfloat16, float64), 16-byte aligned; grads present when it is built are copied in. No method
    synchronises with the host: they issue device ops (allocation, copies, fills) and read
    only host metadata (versions, addresses).
    """

    def __init__(
        self,
        optimizer_or_params: torch.optim.Optimizer | Iterable[torch.nn.Parameter],
        *,
        on_detach: Literal["reattach", "warn"] = "reattach",
    ) -> None:
        if on_detach not in ("reattach", "warn"):
            raise ValueError(f"on_detach must be 'reattach' or 'warn'; got {on_detach!r}")
        optimizer: torch.optim.Optimizer | None = None
        if isinstance(optimizer_or_params, torch.nn.Module):
            raise TypeError(
                "GradBuckets takes an optimizer (or the parameters it steps), not a model: "
                f"pass the optimizer, e.g. GradBuckets(optimizer); got a "
                f"{type(optimizer_or_params).__name__}")
        if isinstance(optimizer_or_params, torch.optim.Optimizer):
            optimizer = optimizer_or_params
            params = [p for g in optimizer.param_groups for p in g["params"]]
        else:
            params = list(optimizer_or_params)
        groups: dict[tuple, list[torch.Tensor]] = {}
        seen: set[int] = set()
        for i, p in enumerate(params):
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"parameter {i} is a {type(p).__name__}, not a tensor")
            if not p.requires_grad or id(p) in seen:
                continue
            if type(p) not in (torch.Tensor, torch.nn.Parameter):
                raise TypeError(
                    f"parameter {i} is a {type(p).__name__}, not a plain tensor: GradBuckets "
                    "needs plain dense parameters on one rank. Sharded engines (FSDP2's DTensor "
                    "parameters, FSDP1's FlatParameter) already keep their gradients in their "
                    "own flat buffers: use GradScaler without GradBuckets there; it unscales "
                    "each rank's local shards with one launch per (device, dtype)")
            if p in _bucketed:
                raise ValueError(f"parameter {i} already belongs to other GradBuckets; build "
                                 "one GradBuckets per optimizer, over disjoint parameters")
            if p.dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
                raise TypeError(f"parameter {i} has dtype {p.dtype}; buckets hold float32, "
                                "float16, bfloat16 or float64 grads (GradScaler's)")
            seen.add(id(p))
            groups.setdefault((p.device, p.dtype), []).append(p)
        self.buckets = [GradBucket(ps, on_detach) for ps in groups.values()]
        for bucket in self.buckets:
            for p in bucket.params:
                _bucketed[p] = True
        self._optimizer = optimizer
        # (the optimizer's param lists, its parameters, those no bucket holds with their
        # places: (group index, index in the group's list, parameter))
        self._outside: tuple[tuple, list, list[tuple[int, int, torch.Tensor]]] | None = None
        if optimizer is not None:
            setattr(optimizer, _REGISTRY_ATTR, getattr(optimizer, _REGISTRY_ATTR, []) + self.buckets)

    def release(self) -> None:
        """Give every grad its own storage again (a copy of its view), unregister the buckets
        from the optimizer and free the parameters for new buckets (e.g. a rebuilt optimizer).

        .. note:: Does not synchronise (device copies only).
        """
        for bucket in self.buckets:
            bucket._release()
        if self._optimizer is not None:
            registered = getattr(self._optimizer, _REGISTRY_ATTR, [])
            setattr(self._optimizer, _REGISTRY_ATTR,
                    [b for b in registered if all(b is not own for own in self.buckets)])
        self.buckets = []

    def zero_(self) -> None:
        """Zero every bucket (one fill each) and re-point every grad at its view: the
        equivalent of torch's default ``optimizer.zero_grad()``. Parameters that then receive
        no gradient before the step get ``grad = None`` and are skipped by the optimizer,
        exactly as in torch's default loop. The optimizer's parameters outside the buckets
        (frozen when they were built, added since) get ``grad = None`` now, as there.

        .. note:: Does not synchronise (one fill per bucket).
        """
        # a parameter that received no gradient may have left the optimizer (replaced in
        # place in its group): look for parameters outside the buckets again
        recheck = any(len(b.received) < len(b.params) for b in self.buckets)
        for bucket in self.buckets:
            bucket.zero_()
        optimizer = self._optimizer
        if optimizer is not None:
            for _, _, p in self._params_outside(optimizer, recheck):  # as torch's zero_grad() leaves
                p.grad = None

    def _params_outside(self, optimizer: torch.optim.Optimizer,
                        recheck: bool) -> list[tuple[int, int, torch.Tensor]]:
        """``(group index, index in its list, parameter)`` of each of the optimizer's
        parameters that no bucket holds (frozen when the buckets were built, or added since:
        a new group or list, a parameter replaced in place); found again when the
        optimizer's parameter lists change, when one of those parameters is no longer at its
        place in its list (replaced in place: one identity check per
        parameter outside the buckets), or on ``recheck`` when one identity pass over the
        parameters sees a bucket's parameter replaced in place."""
        groups = optimizer.param_groups
        known = self._outside
        if known is None or not same_param_lists(known[0], groups) or not all(
                groups[g]["params"][i] is p for g, i, p in known[2]) or (recheck and not all(
                map(operator.is_, (p for g in groups for p in g["params"]), known[1]))):
            inside = frozenset().union(*(b.param_ids for b in self.buckets))
            params = [p for g in groups for p in g["params"]]
            known = self._outside = (param_lists(groups), params, [
                (g, i, p) for g, group in enumerate(groups)
                for i, p in enumerate(group["params"]) if id(p) not in inside])
        return known[2]

    def __len__(self) -> int:
        return len(self.buckets)

    def __iter__(self):
        return iter(self.buckets)
