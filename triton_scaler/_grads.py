"""The gradients :class:`triton_scaler.GradScaler` works on, grouped as torch groups them.

The grouping is cached per optimizer (:func:`_layout_of`) and checked, each step, against the
optimizer's live parameter lists (the same list objects, of the same lengths); an identity
pass over the parameters only when GradBuckets hold some of them and not the others. Each
step then reads the grads of those parameters in C-level passes (their types, sizes, dtypes,
devices and addresses) and plans each Triton launch from them (:mod:`._plans`, whose rows
are kept per size pattern): no per-address state, so grads at new addresses cost what grads
at the same addresses cost.
"""

from __future__ import annotations

import itertools
import operator
from collections import defaultdict
from weakref import WeakKeyDictionary

import torch

from . import _plans
from ._backend import resolve_backend
from ._bucket import _REGISTRY_ATTR, buckets_of
from ._compile import is_traced
from ._distributed import add_groups, local_grad
from ._op_args import FLOAT_DTYPES, check_grad_dtype
from ._plans import UnscalePlan

_GRAD = operator.attrgetter("grad")
_PARAMS = operator.itemgetter("params")
_DTYPE = operator.attrgetter("dtype")
_DEVICE_INDEX = torch.Tensor.get_device
_DATA_PTR = torch.Tensor.data_ptr
_NUMEL = torch.Tensor.numel
_IS_CONTIGUOUS = torch.Tensor.is_contiguous

class PerDevice:
    """torch's ``_MultiDeviceReplicator`` (a 0-d tensor's copy per device, made once), code
    that dynamo traces: the tensor itself on its own device (the scaler's found_inf flag is
    written in place, the scale read in place), unless ``copies`` (torch's
    ``_unscale_grads_`` returns copies of found_inf on every device)."""

    def __init__(self, master: torch.Tensor, copies: bool = False) -> None:
        self.master = master
        self.copies = copies
        self.per_device: dict[torch.device, torch.Tensor] = {}

    def get(self, device: torch.device) -> torch.Tensor:
        value = self.per_device.get(device)
        if value is None:
            master = self.master
            value = master if device == master.device and not self.copies else \
                master.to(device=device, non_blocking=True, copy=True)
            self.per_device[device] = value
        return value


class GradGroup:
    """Grads of one device and dtype, unscaled by one launch; ``plan`` (Triton backend, when
    known) is that launch's host work. Lives for one call: it holds the grads, which
    ``zero_grad(set_to_none=True)`` must free."""

    __slots__ = ("device", "grads", "numels", "addresses", "plan", "reference", "padding",
                 "mesh_groups", "bucket")

    def __init__(self, device, grads, numels=None, addresses=None, plan=None, padding=None,
                 mesh_groups=None, reference=False, bucket=None) -> None:
        self.device, self.grads, self.numels, self.addresses = device, grads, numels, addresses
        self.plan = plan
        self.reference = reference  # known to run on the reference path (no plan)
        self.padding = padding  # a bucket's (GradBucket.padding)
        # DTensor grads: the groups they are sharded over (() when replicated: whole on every
        # rank); None for plain grads (a clip's shards over its shard_group, when given)
        self.mesh_groups = mesh_groups
        self.bucket = bucket  # a bucket's group: its one grad is the bucket's buffer

    def launch_target(self, contiguous: bool | None = None) -> UnscalePlan:
        """What :func:`triton_scaler.kernels.launch_unscale` takes for this group: the plan,
        built now when not known yet (Triton backend only; ``contiguous``: whether every
        grad is, when the caller knows)."""
        if self.plan is None:
            self.plan = _plans.plan_unscale(self.grads, self.numels, self.addresses, contiguous)
        return self.plan


class _Layout:
    """What an optimizer's parameters look like: built once per parameter layout."""

    def __init__(self, optimizer: torch.optim.Optimizer, signature: tuple, backend: str) -> None:
        self.signature: tuple | None = signature  # param_lists(); None: rebuild
        self.backend = backend
        self.buckets = list(buckets_of(optimizer))
        self.n_buckets = len(self.buckets)
        # (the buffers live as long as the buckets)
        self.bucket_groups = [GradGroup(b.device, [b.buffer], (b.buffer.numel(),),
                                        padding=b.padding, bucket=b) for b in self.buckets]
        params = list(_live_params(optimizer))
        live = frozenset(map(id, params))
        # a bucket holding a parameter the optimizer no longer has (replaced by a new list)
        # launches nothing: that grad must not count; its parameters go per tensor
        self.bucket_live = [b.param_ids <= live for b in self.buckets]
        in_buckets = frozenset().union(*(b.param_ids for b, ok in zip(self.buckets,
                                                                      self.bucket_live) if ok))
        outside = [p for p in params if id(p) not in in_buckets]
        self.n_outside = len(outside)
        # Without buckets no parameter is kept: each step reads the grads of the optimizer's
        # own lists (the same lists, of the same lengths: ``signature``), so a parameter
        # swapped into them is seen through its grad, whose address, dtype, device, shape
        # and strides every step checks. With buckets, the parameters outside them, checked
        # by identity (:meth:`is_current`).
        self.params = params if self.buckets else None
        self.outside = outside if self.buckets else None
        by_key: dict[tuple, list[int]] = defaultdict(list)
        for i, p in enumerate(outside):
            by_key[p.device, p.dtype].append(i)
        # (device, its index as Tensor.get_device gives it, dtype, picks the group's items out
        # of a list over the outside parameters, whether all of them, whether the group runs
        # on Triton)
        self.plain_groups = [(device, _index(device), dtype, _picker(indices, len(outside)),
                              len(indices) == len(outside),
                              resolve_backend(backend, device) == "triton")
                             for (device, dtype), indices in by_key.items()]
        self.has_fp16 = any(dtype == torch.float16 for _, dtype in by_key)

    def is_current(self, optimizer: torch.optim.Optimizer) -> bool:
        """The optimizer still holds these parameter objects. One C-level identity pass when
        some parameters are outside gradient buckets and some in them; none otherwise
        (without buckets the layout holds no parameter; GradBuckets fixes its parameters
        when built: rebuild the buckets after replacing a parameter)."""
        return not self.outside or all(map(operator.is_, _live_params(optimizer),
                                           self.params or ()))

    def outside_params(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        """The parameters outside gradient buckets, in the optimizer's order: without
        buckets the optimizer's own list (one group) or their concatenation (read only)."""
        if self.outside is not None:
            return self.outside
        groups = optimizer.param_groups
        return groups[0]["params"] if len(groups) == 1 else list(_live_params(optimizer))


def _live_params(optimizer: torch.optim.Optimizer):
    return itertools.chain.from_iterable(map(_PARAMS, optimizer.param_groups))


def _picker(indices: list[int], total: int):
    if len(indices) == total:
        return list
    if len(indices) == 1:
        return lambda items, i=indices[0]: [items[i]]
    getter = operator.itemgetter(*indices)
    return lambda items: list(getter(items))


def param_lists(param_groups: list[dict]) -> tuple[tuple[list, ...], tuple[int, ...]]:
    """The groups' parameter lists themselves and their lengths: what
    :func:`same_param_lists` compares. Holding the lists (not their ids) keeps a replaced
    list from being freed and its id reused by a newer one."""
    return tuple(g["params"] for g in param_groups), tuple(len(g["params"]) for g in param_groups)


def same_param_lists(known: tuple | None, param_groups: list[dict]) -> bool:
    """The groups hold the same list objects as ``known`` (from :func:`param_lists`), of the
    same lengths: O(number of groups)."""
    if known is None or len(known[0]) != len(param_groups):
        return False
    for group, params, n in zip(param_groups, known[0], known[1]):
        if group["params"] is not params or len(params) != n:
            return False
    return True


_layouts: WeakKeyDictionary = WeakKeyDictionary()


def _layout_of(optimizer: torch.optim.Optimizer, backend: str) -> _Layout:
    """The optimizer's :class:`_Layout`: a cache keyed by the optimizer (weakly) and the
    backend, kept while the optimizer holds the same parameter lists of the same lengths, the
    same number of gradient buckets and (:meth:`_Layout.is_current`) the same parameters;
    built again otherwise, or when a step found a grad of another dtype or device than its
    group's (``signature`` None)."""
    groups = optimizer.param_groups
    try:
        layout = _layouts.get(optimizer)
    except TypeError:  # an optimizer-like object that takes no weak reference (__slots__
        return _Layout(optimizer, param_lists(groups), backend)  # without __weakref__)
    if layout is None or layout.backend != backend or \
            not same_param_lists(layout.signature, groups) or \
            layout.n_buckets != len(getattr(optimizer, _REGISTRY_ATTR, ())) or \
            not layout.is_current(optimizer):
        layout = _layouts[optimizer] = _Layout(optimizer, param_lists(groups), backend)
    return layout


def collect_grads(optimizer: torch.optim.Optimizer, allow_fp16: bool, backend: str,
                  write: bool) -> tuple[list[GradGroup], dict[torch.device, list]]:
    """The collect seam of the scaler's calls: the optimizer's grads as :class:`GradGroup`
    (one launch each) and, by device, the process groups their DTensor grads are sharded over.

    Eager code (:func:`grad_groups`): each gradient bucket's buffer as one group (the buckets'
    records give ``grad = None`` where no gradient came), the other grads by (device, dtype),
    each Triton group planned; before a write over several groups, every refusal (grads
    sharing memory) is raised before anything is written. Traced code: a
    plain loop over the grads (a bucket's grads are its views), grouped by (device, dtype)
    in order of first appearance, as torch groups them (:func:`_groups_slow`; no addresses,
    no host records)."""
    if is_traced():
        return _groups_slow([p for g in optimizer.param_groups for p in g["params"]],
                            allow_fp16, backend)
    groups, mesh_groups = grad_groups(optimizer, allow_fp16, backend)
    if write:
        for group in groups:
            plan = group.plan
            if not group.reference and (plan is None or plan.refusal is not None):
                _plans.refuse_group_writes(groups, backend)
                break
    return groups, mesh_groups


def grad_groups(optimizer: torch.optim.Optimizer, allow_fp16: bool, backend: str
                ) -> tuple[list[GradGroup], dict[torch.device, list]]:
    """``([GradGroup], mesh groups by device)``: each gradient bucket's buffer as its own
    group, then the other grads grouped by (device, dtype) as torch. DTensor grads (FSDP2) are
    their local shards; their mesh is returned for agreement."""
    layout = _layout_of(optimizer, backend)
    fp16 = torch.float16
    flat: list[GradGroup] = []
    helds = []
    for bucket, group, live in zip(layout.buckets, layout.bucket_groups, layout.bucket_live):
        held = bucket.attach_grads()  # also gives grad None where no gradient came
        if not live:
            held = frozenset()
        helds.append((held, bucket.param_ids))
        if held:  # no grad in the bucket: no launch and no found_inf entry, as in torch
            if bucket.dtype == fp16 and not allow_fp16:
                raise ValueError("Attempting to unscale FP16 gradients.")
            flat.append(group)
    if helds and any(held is not ids for held, ids in helds):  # grads outside their bucket
        covered = frozenset().union(*(held for held, _ in helds))
        outside = [p for p in _live_params(optimizer) if id(p) not in covered]
        groups, mesh_groups = _groups_slow(outside, allow_fp16, backend)
        return flat + groups, mesh_groups
    if not layout.n_outside:
        return flat, {}
    params = layout.outside_params(optimizer)
    groups = None
    if allow_fp16 or not layout.has_fp16:
        groups = _groups_fast(layout, params, backend)
    if groups is None:  # also: fp16 grads may be there, which must raise as torch's
        groups, mesh_groups = _groups_slow(params, allow_fp16, backend)
        return flat + groups, mesh_groups
    return flat + groups, {}


def _groups_fast(layout: _Layout, params: list[torch.Tensor],
                 backend: str) -> list[GradGroup] | None:
    """The groups of ``params``' grads, each Triton group planned, with C-level passes over
    the grads (types, sizes, dtypes, device indices, addresses, contiguity), or None (the
    per-grad path) when a grad is None, sparse or not a plain tensor. A grad of another dtype
    or device than its group's parameters (converted in place: ``param.data = ...``,
    ``module.half()``) takes the per-grad path too, and the layout is built again at the
    next step."""
    grads = list(map(_GRAD, params))
    if set(map(type, grads)) != {torch.Tensor}:
        return None
    try:
        addresses = tuple(map(_DATA_PTR, grads))
    except RuntimeError:  # a sparse grad (no data pointer)
        return None
    numels, dtypes = tuple(map(_NUMEL, grads)), tuple(map(_DTYPE, grads))
    groups: list[GradGroup] = []
    for device, index, dtype, pick, whole, triton in layout.plain_groups:
        members = pick(grads)
        if dtype not in FLOAT_DTYPES or set(pick(dtypes)) != {dtype} or \
                set(map(_DEVICE_INDEX, members)) != {index} or members[0].device != device:
            layout.signature = None  # parameters converted in place: rebuild next step
            return None
        group = GradGroup(device, members, numels if whole else tuple(pick(numels)),
                          addresses if whole else tuple(pick(addresses)), reference=not triton)
        if triton:
            group.plan = _plans.plan_unscale(members, group.numels, group.addresses,
                                             all(map(_IS_CONTIGUOUS, members)))
        groups.append(group)
    return groups


def _index(device: torch.device) -> int:
    """``Tensor.get_device()`` of a tensor on ``device``: -1 on the CPU."""
    return -1 if device.type == "cpu" else (device.index or 0)


def _groups_slow(params, allow_fp16: bool, backend: str):
    """Per-parameter grouping (any grads: None, sparse, DTensor, mixed). DTensor grads are
    grouped also by the mesh groups they are sharded over (a clip's norm is reduced per
    group); found_inf is agreed over the union of those groups, per device."""
    groups: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    fp16, plain = torch.float16, torch.Tensor
    meshes: dict = {}  # the DTensor grads' meshes, looked up once per call
    for param in params:
        grad = param.grad
        if grad is None:
            continue
        on_mesh = None
        if type(grad) is not plain:  # DTensor (FSDP2): its local shard
            grad, on_mesh = local_grad(grad, backend, meshes)
        dtype = grad.dtype
        if dtype == fp16 and not allow_fp16:
            raise ValueError("Attempting to unscale FP16 gradients.")
        if grad.is_sparse:
            if dtype is fp16:
                param.grad = grad = grad.coalesce()
            grad = grad._values()
        groups[grad.device, dtype, on_mesh].append(grad)  # None: plain, (): replicated
    mesh_groups: dict[torch.device, list] = {}
    for device, dtype, on_mesh in groups:
        if dtype not in FLOAT_DTYPES:
            check_grad_dtype(f"a gradient on {device}", dtype)
        if on_mesh:
            add_groups(mesh_groups.setdefault(device, []), on_mesh)
    return ([GradGroup(device, grads, mesh_groups=on_mesh)
             for (device, _, on_mesh), grads in groups.items()], mesh_groups)
