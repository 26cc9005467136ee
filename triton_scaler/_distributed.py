"""Gradients of torch's distributed engines: DTensor (FSDP2, tensor parallel) grads are
unscaled on their local shard, and found_inf is agreed over their device mesh as torch's op
does under DTensor dispatch (``found_inf_reduce_handler``). Imports torch.distributed only
when a tensor subclass is actually seen."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeGuard

import torch

from ._backend import resolve_backend
from ._op_args import PLAIN

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

_DTENSOR: type | None = None  # torch.distributed.tensor.DTensor, once imported


def is_dtensor(t: torch.Tensor) -> TypeGuard[DTensor]:
    """Whether ``t`` is a DTensor (FSDP2's and tensor parallelism's parameters and grads)."""
    return _is_dtensor(t)


def reduce_rows(sums: torch.Tensor, maxima: torch.Tensor, groups: Sequence[Any]) -> None:
    """SUM all-reduce of ``sums`` and MAX all-reduce of ``maxima`` over each process group of
    ``groups`` in turn (over a mesh's dimensions one after another: over all their ranks)."""
    import torch.distributed as dist

    for group in groups:
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
        dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=group)


def _is_dtensor(t: torch.Tensor) -> TypeGuard[DTensor]:
    global _DTENSOR
    if _DTENSOR is None:
        try:
            from torch.distributed.tensor import DTensor
        except ImportError:  # torch built without distributed
            return False
        _DTENSOR = DTensor
    return isinstance(t, _DTENSOR)


def local_grad(grad: torch.Tensor, backend: str, meshes: dict | None = None
               ) -> tuple[torch.Tensor, tuple[Any, ...] | None]:
    """For a grad that is not a plain tensor: the plain tensor holding this rank's elements,
    and the process groups over which found_inf must be agreed. A DTensor gives its local
    tensor and its mesh dimensions that are not ``Replicate`` (as torch; ``meshes``: as
    :func:`mesh_layout`'s). Other subclasses, also as a DTensor's local tensor, pass through
    unchanged on the reference backend (torch's op dispatches them) and raise ``TypeError``
    on the Triton backend, which takes raw pointers and would read the wrong memory.
    ``backend`` may be ``"auto"``: it is resolved for the grad's device only for such other
    subclasses."""
    local, layout = mesh_layout(grad, meshes)
    if type(local) not in PLAIN and resolve_backend(backend, grad.device) != "reference":
        what = (f"a DTensor whose local tensor is a {_type_name(local)}" if layout is not None
                else f"a {_type_name(local)}")
        raise TypeError(
            f"a gradient is {what}, a tensor subclass the Triton backend cannot take (it reads "
            "raw memory); plain tensors and DTensor (FSDP2 / tensor parallel) of plain "
            "tensors are supported. Use backend='reference' to let torch's op dispatch this "
            "subclass")
    return local, layout.agreed_over if layout is not None else None


def _type_name(t: torch.Tensor) -> str:
    return f"{type(t).__module__}.{type(t).__name__}"


@dataclass(frozen=True)
class MeshLayout:
    """Where a DTensor grad lives, per dimension of its device mesh: the dimension's process
    group, its size, and whether the grad is sharded there (not ``Replicate``). Grads on one
    ``mesh`` have their norms reduced together, as torch's ``clip_grad_norm_`` stacks them."""

    mesh: Any
    groups: tuple[Any, ...]
    sizes: tuple[int, ...]
    sharded: tuple[bool, ...]
    #: the groups of the dimensions the grad is sharded on, over which found_inf is agreed
    agreed_over: tuple[Any, ...] = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "agreed_over",
                           tuple(g for g, s in zip(self.groups, self.sharded) if s))


def mesh_layout(grad: torch.Tensor, meshes: dict | None = None
                ) -> tuple[torch.Tensor, MeshLayout | None]:
    """A grad's local tensor and, for a DTensor, its :class:`MeshLayout` (None otherwise).
    ``meshes``: a dict the caller keeps across the grads of one call, so that grads on one
    mesh, sharded alike, share one layout (``DeviceMesh.get_group`` resolves a group by
    name: microseconds per grad)."""
    if not _is_dtensor(grad):
        return grad, None
    mesh = grad.device_mesh
    sharded = tuple(not placement.is_replicate() for placement in grad.placements)
    layout = meshes.get((id(mesh), sharded)) if meshes is not None else None
    if layout is None or layout.mesh is not mesh:
        dims = range(mesh.ndim)
        layout = MeshLayout(mesh, tuple(mesh.get_group(d) for d in dims),
                            tuple(mesh.size(d) for d in dims), sharded)
        if meshes is not None:
            meshes[id(mesh), sharded] = layout
    return grad._local_tensor, layout


def add_groups(known: list, groups: tuple[Any, ...]) -> None:
    """Append to ``known`` the process groups of ``groups`` it does not hold yet (by
    identity): found_inf is agreed over every mesh dimension any grad is sharded on."""
    known.extend(g for g in groups if not any(g is k for k in known))


def agree_over_meshes(found_inf_by_device: dict[torch.device, torch.Tensor],
                      groups_by_device: Mapping[torch.device, Sequence[Any]]) -> None:
    """MAX all-reduce of each device's found_inf over the mesh groups of its DTensor grads."""
    import torch.distributed as dist

    for device, groups in groups_by_device.items():
        found_inf = found_inf_by_device[device]
        for group in groups:
            dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=group)
