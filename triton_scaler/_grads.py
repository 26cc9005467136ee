"""The gradients :class:`triton_scaler.GradScaler` works on, grouped as torch groups them.

The grouping is cached per optimizer. A step whose optimizer, buckets and grads are those of
the last step costs: nothing per parameter when GradBuckets hold every grad; otherwise one
C-level pass reading the grads and one over their addresses (no per-grad Python, no hashing
of the grads' pointers when they are the same objects at the same addresses as last time).
"""

from __future__ import annotations

import operator
from collections import defaultdict
from weakref import WeakKeyDictionary

import torch
from torch.amp.grad_scaler import _MultiDeviceReplicator

from . import ops
from ._backend import resolve_backend
from ._distributed import local_grad
from .buckets import buckets_of

_GRAD = operator.attrgetter("grad")
_DTYPE_DEVICE = operator.attrgetter("dtype", "device")
_DATA_PTR = torch.Tensor.data_ptr


class PerDevice(_MultiDeviceReplicator):
    """torch's per-device replicas of a 0-d tensor, without the copy on its own device: the
    scaler's found_inf flag is written in place, and the scale read in place (no launch)."""

    def get(self, device: torch.device) -> torch.Tensor:
        if device == self.master.device:
            return self._per_device_tensors.setdefault(device, self.master)
        return super().get(device)


class GradGroup:
    """Grads of one device and dtype, unscaled by one launch; ``plan`` (Triton backend, when
    known) is that launch's host work. Unpacks as ``(device, grads)``. Lives for one call: it
    holds the grads, which must be freed by ``zero_grad(set_to_none=True)``."""

    __slots__ = ("device", "grads", "numels", "addresses", "plan")

    def __init__(self, device, grads, numels=None, addresses=None, plan=None) -> None:
        self.device, self.grads, self.numels, self.addresses = device, grads, numels, addresses
        self.plan = plan

    def __iter__(self):
        return iter((self.device, self.grads))


class _Layout:
    """What an optimizer's parameters look like: built once per parameter layout."""

    def __init__(self, optimizer: torch.optim.Optimizer, signature: tuple) -> None:
        self.signature = signature
        self.buckets = list(buckets_of(optimizer))
        self.bucket_groups = [GradGroup(b.device, [b.buffer], (b.buffer.numel(),))
                              for b in self.buckets]  # the buffers live as long as the buckets
        in_buckets = frozenset().union(*(b.param_ids for b in self.buckets))
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        self.outside = [p for p in self.params if id(p) not in in_buckets]
        by_key: dict[tuple, list[int]] = defaultdict(list)
        for i, p in enumerate(self.outside):
            by_key[p.device, p.dtype].append(i)
        # (device, dtype, picks the group's grads out of the list, their sizes)
        self.plain_groups = [
            (device, dtype, _picker(indices, len(self.outside)),
             tuple(self.outside[i].numel() for i in indices))
            for (device, dtype), indices in by_key.items()]
        # per plain group: (the grads' addresses at the last step, its launch plan without
        # grads) -- no grad is held, so zero_grad(set_to_none=True) frees them
        self.plans: dict[int, tuple] = {}


def _picker(indices: list[int], total: int):
    if len(indices) == total:
        return list
    if len(indices) == 1:
        return lambda grads, i=indices[0]: [grads[i]]
    getter = operator.itemgetter(*indices)
    return lambda grads: list(getter(grads))


_layouts: WeakKeyDictionary = WeakKeyDictionary()


def _layout_of(optimizer: torch.optim.Optimizer) -> _Layout:
    signature = (tuple((id(g["params"]), len(g["params"])) for g in optimizer.param_groups),
                 len(buckets_of(optimizer)))
    layout = _layouts.get(optimizer)
    if layout is None or layout.signature != signature:
        layout = _layouts[optimizer] = _Layout(optimizer, signature)
    return layout


def grad_groups(optimizer: torch.optim.Optimizer, allow_fp16: bool, backend: str):
    """``([GradGroup], mesh groups by device)``: each gradient bucket's buffer as its own
    group, then the other grads grouped by (device, dtype) as torch. DTensor grads (FSDP2) are
    their local shards; their mesh is returned for agreement."""
    layout = _layout_of(optimizer)
    fp16 = torch.float16
    flat: list[GradGroup] = []
    helds = []
    for bucket, group in zip(layout.buckets, layout.bucket_groups):
        if bucket.dtype == fp16 and not allow_fp16:
            raise ValueError("Attempting to unscale FP16 gradients.")
        helds.append((bucket.attach_grads(), bucket.param_ids))
        flat.append(group)
    if any(held is not ids for held, ids in helds):  # some grads are outside their bucket
        covered = frozenset().union(*(held for held, _ in helds))
        outside = [p for p in layout.params if id(p) not in covered]
        groups, mesh_groups = _groups_slow(outside, allow_fp16, backend)
        return flat + groups, mesh_groups
    if not layout.outside:
        return flat, {}
    groups = _groups_fast(layout, allow_fp16, backend)
    if groups is None:
        groups, mesh_groups = _groups_slow(layout.outside, allow_fp16, backend)
        return flat + groups, mesh_groups
    return flat + groups, {}


def _groups_fast(layout: _Layout, allow_fp16: bool, backend: str) -> list[GradGroup] | None:
    """The groups of ``layout.outside``'s grads with C-level passes only (the grads, their
    types, their addresses), or None when a grad is None, not a plain dense tensor, or not of
    its parameter's dtype and device. Grads at the addresses of the last step reuse its
    launch plan: same parameters, same memory (torch keeps a grad's dtype and size its
    parameter's)."""
    grads = list(map(_GRAD, layout.outside))
    if set(map(type, grads)) != {torch.Tensor}:
        return None
    groups = []
    try:
        for k, (device, dtype, pick, numels) in enumerate(layout.plain_groups):
            members = pick(grads)
            if dtype == torch.float16 and not allow_fp16:
                raise ValueError("Attempting to unscale FP16 gradients.")
            addresses = tuple(map(_DATA_PTR, members))
            cached = layout.plans.get(k)
            if cached is not None and cached[0] == addresses:
                groups.append(GradGroup(device, members, numels, addresses,
                                        cached[1].rebased(members)))
                continue
            if dtype not in ops.FLOAT_DTYPES or \
                    set(map(_DTYPE_DEVICE, members)) != {(dtype, device)}:
                return None
            plan = None
            if resolve_backend(backend, device) == "triton":
                from triton_scaler.kernels import plan_unscale

                plan = plan_unscale(members, numels, addresses)
                if plan.reusable:
                    layout.plans[k] = (addresses, plan.template())
            groups.append(GradGroup(device, members, numels, addresses, plan))
    except RuntimeError:  # sparse (no data pointer): the per-grad path
        return None
    return groups


def _groups_slow(params, allow_fp16: bool, backend: str):
    """Per-parameter grouping (any grads: None, sparse, DTensor, mixed)."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    fp16, plain = torch.float16, torch.Tensor
    mesh_groups: dict[torch.device, tuple] = {}
    for param in params:
        grad = param.grad
        if grad is None:
            continue
        if type(grad) is not plain:  # DTensor (FSDP2): its local shard
            grad, on_mesh = local_grad(grad, resolve_backend(backend, grad.device))
            if on_mesh:
                mesh_groups.setdefault(grad.device, on_mesh)
        dtype = grad.dtype
        if dtype == fp16 and not allow_fp16:
            raise ValueError("Attempting to unscale FP16 gradients.")
        if grad.is_sparse:
            if dtype is fp16:
                param.grad = grad = grad.coalesce()
            grad = grad._values()
        groups[grad.device, dtype].append(grad)
    for device, dtype in groups:
        if dtype not in ops.FLOAT_DTYPES:
            ops.check_grad_dtype(f"a gradient on {device}", dtype)
    return [GradGroup(device, grads) for (device, _), grads in groups.items()], mesh_groups
