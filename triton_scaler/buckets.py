"""Flat gradient buckets: one contiguous gradient buffer per (device, dtype), every ``.grad`` a
view into it, so the scaler unscales a whole bucket with one kernel launch."""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Literal

import torch
from torch.utils.weak import WeakIdKeyDictionary

_ALIGN_BYTES = 16
_REGISTRY_ATTR = "_triton_scaler_buckets"
# Parameters held by live buckets. Kept off the parameters themselves, so a pickled or copied
# model (torch.save, deepcopy) carries no trace of buckets it no longer has.
_bucketed: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _grad_strides(p: torch.Tensor) -> tuple[int, ...]:
    """The strides torch gives ``p``'s gradient: ``p``'s own when it is dense and
    non-overlapping (channels_last, a transpose), else row-major. Fused optimizers read param
    and grad as flat memory, so a grad must have exactly these."""
    return torch.empty_like(p, device="meta").stride()


class GradBucket:
    """One contiguous gradient buffer for parameters of one device and dtype."""

    def __init__(self, params: list[torch.nn.Parameter], on_detach: str) -> None:
        self.params = params
        self.device = params[0].device
        self.dtype = params[0].dtype
        align = _ALIGN_BYTES // params[0].element_size()
        offsets, total = [], 0
        for p in params:
            offsets.append(total)
            total += -(-p.numel() // align) * align  # each view starts 16-byte aligned
        self.buffer = torch.zeros(total, dtype=self.dtype, device=self.device)
        self.views = [self.buffer.as_strided(p.shape, _grad_strides(p), o)
                      for o, p in zip(offsets, params)]
        self.param_ids = frozenset(id(p) for p in params)
        self._on_detach = on_detach
        self._warned = False
        # Parameters whose grad autograd wrote since the last zero_(): the others get
        # ``grad = None`` before the step, as after torch's default zero_grad(), so optimizers
        # skip them (no weight decay, no momentum, no state for unused or frozen parameters).
        self.received: set[int] = set()
        self._unset_by_us: set[int] = set()
        self._zeroed: set[int] = set()  # views zeroed while their grad is None
        self._index = {id(p): i for i, p in enumerate(params)}
        self._hooks = [p.register_post_accumulate_grad_hook(self._mark_received) for p in params]
        with torch.no_grad():
            for p, view in zip(params, self.views):
                if p.grad is not None:
                    view.copy_(p.grad)
                    self.received.add(id(p))
                p.grad = view

    def _mark_received(self, param: torch.Tensor) -> None:
        self.received.add(id(param))

    def attach_grads(self) -> frozenset[int]:
        """Check that every grad is still its view and deal with those that are not; give the
        parameters that received no gradient since :meth:`GradBuckets.zero_` ``grad = None``.

        Returns the ids of the parameters whose grads this bucket's buffer now holds. A grad
        replaced by ``zero_grad(set_to_none=True)`` is copied back into its view
        (``on_detach="reattach"``) or left to the per-tensor path (``"warn"``); both warn once.
        """
        received = self.received
        detached, quiet, unset = [], [], []
        for p, view in zip(self.params, self.views):
            grad = p.grad
            if grad is view:
                if id(p) not in received:  # no gradient this iteration: as torch, grad None
                    p.grad = None
                    self._unset_by_us.add(id(p))
            elif grad is None:  # set to None outside: the view must not keep stale values
                unset.append(p)
            elif id(p) in self._unset_by_us:  # we set it to None; autograd made a new one
                quiet.append((p, view))
            elif grad._is_view():  # a view into someone else's buffer: DDP's buckets
                raise RuntimeError(
                    "a gradient is a view into another buffer, not into its GradBucket: DDP "
                    "with gradient_as_bucket_view=True keeps grads in its own contiguous "
                    "buckets and replaces ours. Do not combine the two: drop GradBuckets (the "
                    "scaler covers DDP's grads with one chunk-table launch per (device, dtype)) "
                    "or build DDP with gradient_as_bucket_view=False")
            else:  # not a view any more (zero_grad(set_to_none=True), or assigned)
                detached.append((p, view))
        held = self.param_ids.difference(id(p) for p in unset) \
            if len(received) == len(self.params) else frozenset(received)
        if unset:
            self._zero_views_of(unset)
        if quiet:  # grads we set to None and autograd re-created: back in, no warning
            self._unset_by_us.difference_update(id(p) for p, _ in quiet)
            self._reattach(quiet)
        if not detached:
            return held
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"{len(detached)} gradient(s) are no longer views into their GradBucket (was "
                "optimizer.zero_grad() called with set_to_none=True?). "
                + ("They are copied back into the bucket each step, which costs a copy; "
                   if self._on_detach == "reattach" else
                   "They take the per-tensor path, off the one-launch fast path; ")
                + "call buckets.zero_() or optimizer.zero_grad(set_to_none=False) instead.",
                stacklevel=5)
        return held - self._reattach(detached, self._on_detach == "reattach")

    def _zero_views_of(self, params: list) -> None:
        """Zero the views of parameters whose grad is None, once until they are written."""
        with torch.no_grad():
            for p in params:
                if id(p) not in self._zeroed:
                    self._zeroed.add(id(p))
                    self.views[self._index[id(p)]].zero_()

    def _reattach(self, detached: list, copy_back: bool = True) -> set[int]:
        """Copy each grad back into its view (or zero the view and leave the grad outside);
        returns the ids of the parameters left outside the bucket."""
        outside = set()
        with torch.no_grad():
            for p, view in detached:
                grad = p.grad
                if grad is not None and copy_back and not grad.is_sparse:
                    view.copy_(grad)
                    p.grad = view
                    self._zeroed.discard(id(p))
                else:
                    view.zero_()  # the bucket launch must not see stale values
                    outside.add(id(p))
        return outside


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
    their own: model and optimizer checkpoints are unaffected.
    """

    def __init__(
        self,
        optimizer_or_params: torch.optim.Optimizer | Iterable[torch.nn.Parameter],
        *,
        on_detach: Literal["reattach", "warn"] = "reattach",
    ) -> None:
        if on_detach not in ("reattach", "warn"):
            raise ValueError(f"on_detach must be 'reattach' or 'warn'; got {on_detach!r}")
        optimizer = optimizer_or_params if isinstance(optimizer_or_params,
                                                      torch.optim.Optimizer) else None
        params = ([p for g in optimizer.param_groups for p in g["params"]] if optimizer
                  else list(optimizer_or_params))
        groups: dict[tuple, list[torch.nn.Parameter]] = {}
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
            if p.dtype not in (torch.float32, torch.float16, torch.bfloat16):
                raise TypeError(f"parameter {i} has dtype {p.dtype}; buckets hold float32, "
                                "float16 or bfloat16 grads")
            seen.add(id(p))
            groups.setdefault((p.device, p.dtype), []).append(p)
        self.buckets = [GradBucket(ps, on_detach) for ps in groups.values()]
        for bucket in self.buckets:
            for p in bucket.params:
                _bucketed[p] = True
        self._optimizer = optimizer
        if optimizer is not None:
            setattr(optimizer, _REGISTRY_ATTR, getattr(optimizer, _REGISTRY_ATTR, []) + self.buckets)

    def release(self) -> None:
        """Give every grad its own storage again (a copy of its view), unregister the buckets
        from the optimizer and free the parameters for new buckets (e.g. a rebuilt optimizer)."""
        with torch.no_grad():
            for bucket in self.buckets:
                for p, view in zip(bucket.params, bucket.views):
                    if p.grad is view:
                        p.grad = view.clone()
                    _bucketed.pop(p, None)
                for hook in bucket._hooks:
                    hook.remove()
        if self._optimizer is not None:
            registered = getattr(self._optimizer, _REGISTRY_ATTR, [])
            setattr(self._optimizer, _REGISTRY_ATTR,
                    [b for b in registered if all(b is not own for own in self.buckets)])
        self.buckets = []

    def zero_(self) -> None:
        """Zero every bucket (one fill each) and re-point every grad at its view: the
        equivalent of torch's default ``optimizer.zero_grad()``. Parameters that then receive
        no gradient before the step get ``grad = None`` and are skipped by the optimizer,
        exactly as in torch's default loop."""
        for bucket in self.buckets:
            for p, view in zip(bucket.params, bucket.views):
                if p.grad is not view:
                    p.grad = view
            bucket.received.clear()
            bucket._unset_by_us.clear()
            bucket._zeroed.clear()
            bucket.buffer.zero_()

    def __len__(self) -> int:
        return len(self.buckets)

    def __iter__(self):
        return iter(self.buckets)


def buckets_of(optimizer: torch.optim.Optimizer) -> list[GradBucket]:
    """The buckets registered on ``optimizer`` (empty when it has none)."""
    return getattr(optimizer, _REGISTRY_ATTR, [])
