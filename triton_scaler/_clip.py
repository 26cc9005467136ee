"""``GradScaler.clip_grad_norm_``: unscale and clip in one read pass and one read + write pass.

Same result as ``scaler.unscale_(optimizer)`` followed by ``torch.nn.utils.clip_grad_norm_``
over the optimizer's grads: the total norm is that of the unscaled grads (accumulated in float32,
float64 for float64 grads, also for bf16 / fp16 grads), ``clip_coef = clamp(max_norm /
(total_norm + 1e-6), max=1)`` is formed on the device, and each grad ends as
``dtype(dtype(g * inv_scale) * clip_coef)``. Triton backend: a read pass (found_inf and
per-program partial sums) and a write pass; reference backend: torch's ops.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch
from torch.amp.grad_scaler import OptState

from . import reference
from ._backend import resolve_backend
from ._distributed import agree_over_meshes
from ._grads import PerDevice, grad_groups
from .buckets import buckets_of


def check_clip_arguments(max_norm: object, norm_type: object) -> tuple[float, float]:
    """``(max_norm, norm_type)`` as floats; ``TypeError`` / ``ValueError`` naming them."""
    for name, value in (("max_norm", max_norm), ("norm_type", norm_type)):
        if isinstance(value, bool) or not isinstance(value, (numbers.Real, str)):
            raise TypeError(f"{name} must be a number; got {type(value).__name__} {value!r}")
    norm = math.inf if isinstance(norm_type, str) and norm_type.lower() == "inf" else norm_type
    if isinstance(max_norm, str) or isinstance(norm, str):
        raise TypeError(f"max_norm must be a number and norm_type a number or 'inf'; got "
                        f"max_norm={max_norm!r}, norm_type={norm_type!r}")
    if not float(max_norm) >= 0.0:
        raise ValueError(f"max_norm must be a number >= 0 (inf: no clipping); got {max_norm!r}")
    if not float(norm) > 0.0:
        raise ValueError(f"norm_type must be > 0 (2.0, inf, or any p > 0); got {norm_type!r}")
    return float(max_norm), float(norm)


def _group_norms(group, found_inf, scale, norm_type: float, backend: str) -> list:
    """Unscale (reference: in place now; Triton: a read pass) and return norms of the
    unscaled grads of one :class:`GradGroup`, in float32 (float64 for float64 grads): per
    tensor on the reference path (torch's ``_foreach_norm``, as torch's clip), one for the
    whole group on the Triton path (from the kernel's per-program partial sums). ``scale``:
    the 0-d fp32 scale on the group's device (the kernel forms its reciprocal as torch)."""
    if resolve_backend(backend, found_inf.device) == "triton":
        from triton_scaler.kernels import launch_unscale

        partial = launch_unscale(group.launch_target(), found_inf, scale, write=False,
                                 norm=2 if norm_type == 2.0 else -1, inv_from_scale=True)
        return [partial.sqrt() if norm_type == 2.0 else partial]
    grads = group.grads
    reference.non_finite_check_and_unscale_(grads, found_inf, reference.inv_scale_of(scale))
    if norm_type != 2.0:  # the inf norm of an empty tensor is an error in torch
        grads = [g for g in grads if g.numel()]
    wide = torch.float64 if grads and grads[0].dtype == torch.float64 else torch.float32
    return list(torch._foreach_norm(grads, norm_type, dtype=wide)) if grads else []


def _reference_total_norm(optimizer, groups, found_for, scale_for, norm_type: float,
                          backend: str, device: torch.device) -> torch.Tensor | None:
    """Reference backend, plain dense grads: unscale every group in place, then the total
    norm formed exactly as torch's ``clip_grad_norm_`` forms it from the optimizer's grads
    (one norm per grad, grouped by device and dtype in order of first appearance, then the
    norm of the norms), each grad's norm in float32 (float64 for float64 grads): bit-identical
    to torch's for float32 grads, GradBuckets or not. None: not this case (the Triton backend,
    DTensor / sparse grads, no grad)."""
    if not groups or any(resolve_backend(backend, g.device) != "reference" for g in groups):
        return None
    grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    if any(type(g) is not torch.Tensor or g.is_sparse for g in grads):
        return None
    for group in groups:
        dev = group.device
        reference.non_finite_check_and_unscale_(group.grads, found_for.get(dev),
                                                reference.inv_scale_of(scale_for.get(dev)))
    by_key: dict[tuple, list[torch.Tensor]] = {}
    for g in grads:
        if g.numel() or norm_type != math.inf:  # the inf norm of an empty tensor is an error
            by_key.setdefault((g.device, g.dtype), []).append(g)
    norms = [torch.linalg.vector_norm(g, norm_type, dtype=torch.float32)
             if g.dtype in (torch.float16, torch.bfloat16) else torch.linalg.vector_norm(g, norm_type)
             for gs in by_key.values() for g in gs]
    if not norms:
        return torch.zeros((), device=device)
    wide = torch.float64 if any(n.dtype == torch.float64 for n in norms) else torch.float32
    return torch.linalg.vector_norm(torch.stack([n.to(device, wide) for n in norms]), norm_type)


def _apply_coef(group, found_inf, scale, coef, backend: str) -> None:
    """Write pass: ``dtype(dtype(g * inv_scale) * coef)`` (reference: grads already unscaled)."""
    if resolve_backend(backend, coef.device) == "triton":
        from triton_scaler.kernels import launch_unscale

        launch_unscale(group.launch_target(), found_inf, scale, write=True, clip_coef=coef,
                       inv_from_scale=True)
    else:
        torch._foreach_mul_(group.grads, coef)
    if group.padding is not None:  # a bucket: 0 * a NaN coefficient must not stay there
        group.grads[0].index_fill_(0, group.padding, 0)


class ClipMixin:
    """``clip_grad_norm_`` of :class:`triton_scaler.GradScaler`."""

    def clip_grad_norm_(self, optimizer: torch.optim.Optimizer, max_norm: float,
                        norm_type: float = 2.0, error_if_nonfinite: bool = False) -> torch.Tensor:
        """Unscale the optimizer's grads and clip them by their total norm, in one read pass
        and one read + write pass (torch's ``unscale_`` + ``clip_grad_norm_`` make five).

        Counts as this iteration's :meth:`unscale_` for ``optimizer`` (``step`` skips on
        overflow; a later ``unscale_`` raises, as torch). Returns the total norm of the
        unscaled grads as a 0-d float32 tensor on the scale's device, accumulated in float32
        (also for bf16 / fp16 grads). ``norm_type`` 2 and ``inf`` run fused; other ``p > 0`` run
        as ``unscale_`` + torch's ``clip_grad_norm_``. With ``process_group`` (and over a DTensor
        mesh) the norm is the global one: partial sums are all-reduced before the clip
        coefficient is formed. No host sync, except ``error_if_nonfinite=True`` (one read).
        A disabled scaler clips with torch's ``clip_grad_norm_``. No grads: as torch, a 0
        norm and nothing recorded (``step`` then raises).
        """
        max_norm, norm_type = check_clip_arguments(max_norm, norm_type)
        if not isinstance(error_if_nonfinite, bool):
            raise TypeError(f"error_if_nonfinite must be a bool; got {error_if_nonfinite!r}")
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        if not self._enabled or norm_type not in (2.0, math.inf) or not params:
            if self._enabled:  # no grads: as torch, unscale_ records none and the norm is 0
                self.unscale_(optimizer)
            total = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type,
                                                   error_if_nonfinite)
            return total.float() if not self._enabled else total.float().to(self._scale.device)
        state = self._ready_to_unscale(optimizer, "unscale_")  # torch's unscale_ errors
        total, found_per_device = self._fused_clip(optimizer, max_norm, norm_type,
                                                   self._found_inf_flag(state))
        state["found_inf_per_device"] = found_per_device
        state["stage"] = OptState.UNSCALED
        if found_per_device:  # none when no grad remained (GradBuckets: none received)
            self._agree_found_inf(state, start_host_copy=True)
        if error_if_nonfinite and not bool(total.isfinite().item()):  # the documented read
            raise RuntimeError(
                f"The total norm of order {norm_type} for gradients from `parameters` is "
                "non-finite, so it cannot be clipped. To disable this error and scale the "
                "gradients by the non-finite norm anyway, set `error_if_nonfinite=False`")
        return total

    def _fused_clip(self, optimizer, max_norm: float, norm_type: float, found_inf):
        device = self._scale.device
        found_for = PerDevice(found_inf)
        scale_for = PerDevice(self._scale)
        with torch.no_grad():
            groups, mesh_groups = grad_groups(optimizer, False, self._backend)
            total = _reference_total_norm(optimizer, groups, found_for, scale_for, norm_type,
                                          self._backend, device)
            if total is None:
                norms = []  # per group, the stacked norms (one 0-d tensor per Python object)
                for group in groups:
                    dev = group.device
                    group_norms = _group_norms(group, found_for.get(dev), scale_for.get(dev),
                                               norm_type, self._backend)
                    if group_norms:
                        norms.append(torch.stack(group_norms).to(device))
                if not groups and self._process_group is not None:
                    found_for.get(device)  # no grads here: join the agreement with 0
                wide = torch.float64 if any(n.dtype == torch.float64 for n in norms) \
                    else torch.float32
                # torch's clip: the norm of the per-tensor norms
                total = (torch.linalg.vector_norm(torch.cat([n.to(wide) for n in norms]),
                                                  norm_type)
                         if norms else torch.zeros((), dtype=wide, device=device))
            # agreed over the mesh / process group
            total = self._agree_norm(total, mesh_groups, norm_type).float()
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            for group in groups:
                dev = group.device
                _apply_coef(group, found_for.get(dev), scale_for.get(dev), coef.to(dev),
                            self._backend)
            for bucket in buckets_of(optimizer):
                bucket.buffer_rewritten()
            if mesh_groups:
                agree_over_meshes(found_for._per_device_tensors, mesh_groups)
        return total, found_for._per_device_tensors

    def _agree_norm(self, total: torch.Tensor, mesh_groups: dict[Any, tuple],
                    norm_type: float) -> torch.Tensor:
        """The global norm: squares summed (max for inf) over the DTensor mesh and
        ``process_group``, in float64."""
        groups = [g for gs in mesh_groups.values() for g in gs]
        if self._process_group is not None:
            groups.append(self._process_group)
        if not groups:
            return total
        import torch.distributed as dist

        combined = total.double().square() if norm_type == 2.0 else total.double()
        op = dist.ReduceOp.SUM if norm_type == 2.0 else dist.ReduceOp.MAX
        for group in groups:
            dist.all_reduce(combined, op=op, group=group)
        return combined.sqrt() if norm_type == 2.0 else combined
