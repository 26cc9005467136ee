"""``GradScaler.clip_grad_norm_``: unscale and clip in one read pass and one read + write pass.

Same result as ``scaler.unscale_(optimizer)`` followed by ``torch.nn.utils.clip_grad_norm_``
over the optimizer's grads: the total norm is that of the unscaled grads (accumulated in float32,
float64 once any grad is float64, also for bf16 / fp16 grads; returned as float32),
``clip_coef = clamp(max_norm / (total_norm + 1e-6), max=1)`` is formed on the device from
the norm before that rounding, and each grad ends as
``dtype(dtype(g * inv_scale) * clip_coef)``. Triton backend: a read pass (found_inf and
per-program partial sums) and a write pass; reference backend: torch's ops.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, cast

import torch

from ._backend import resolve_backend
from ._bucket import buckets_of
from ._dispatch import unscale_group
from ._distributed import MeshLayout, agree_over_meshes, mesh_layout
from ._grads import GradGroup, PerDevice
from ._norms import combine_partials, grad_norm, reference_total_norm


def _real_or_str(name: str, value: object) -> numbers.Real | str:
    """``value`` when it is a real number (not a bool) or a string; ``TypeError`` naming it."""
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, str)):
        raise TypeError(f"{name} must be a number; got {type(value).__name__} {value!r}")
    return value


def check_clip_arguments(max_norm: object, norm_type: object) -> tuple[float, float]:
    """``(max_norm, norm_type)`` as floats; ``TypeError`` / ``ValueError`` naming them."""
    max_value = _real_or_str("max_norm", max_norm)
    norm: float | numbers.Real | str = _real_or_str("norm_type", norm_type)
    if isinstance(norm, str) and norm.lower() == "inf":
        norm = math.inf
    if isinstance(max_value, str) or isinstance(norm, str):
        raise TypeError(f"max_norm must be a number and norm_type a number or 'inf'; got "
                        f"max_norm={max_norm!r}, norm_type={norm_type!r}")
    if not float(max_value) >= 0.0:
        raise ValueError(f"max_norm must be a number >= 0 (inf: no clipping); got {max_norm!r}")
    if not float(norm) > 0.0:
        raise ValueError(f"norm_type must be > 0 (2.0, inf, or any p > 0); got {norm_type!r}")
    return float(max_value), float(norm)


def _norm_entries(params) -> list[tuple[torch.Tensor, MeshLayout | None]]:
    """``(grad, mesh layout)`` of each parameter with a grad, for :func:`reference_total_norm`:
    a DTensor grad's local tensor and its mesh; ``None`` for a plain grad."""
    meshes: dict = {}  # the DTensor grads' meshes, looked up once per call
    return [mesh_layout(param.grad, meshes) if type(param.grad) is not torch.Tensor
            else (param.grad, None) for param in params]


def _on_triton(group, backend: str) -> bool:
    """One :class:`GradGroup` runs on the Triton kernels (else torch's ops: with ``"auto"``,
    a group on the CPU beside CUDA ones)."""
    return resolve_backend(backend, group.device) == "triton"


def _group_partial(group, found_inf, scale, norm_type: float, on_triton: bool) -> torch.Tensor:
    """The Triton read pass of one :class:`GradGroup` (found_inf and its sum of squares, or
    max ``|x|``, of the unscaled grads); off Triton (a group on another device than the
    Triton groups) the same from an in-place unscale and torch's norms."""
    if on_triton:
        return cast(torch.Tensor, unscale_group(
            group, found_inf, scale, "triton", False, from_scale=True,
            norm=2 if norm_type == 2.0 else -1))
    unscale_group(group, found_inf, scale, "reference", True, from_scale=True)
    norms = [grad_norm(g, norm_type) for g in group.grads if g.numel() or norm_type == 2.0]
    if not norms:
        return torch.zeros((), device=found_inf.device)
    total = torch.linalg.vector_norm(torch.stack(norms), norm_type)
    return total if norm_type == math.inf else total.square()


def _apply_coef(group, found_inf, scale, coef, write_pass: bool,
                stats: tuple | None) -> None:
    """``dtype(dtype(g * inv_scale) * coef)``: the Triton write pass (``write_pass``; with a
    watch's ``stats``), else a multiplication of grads already unscaled."""
    if write_pass:
        unscale_group(group, found_inf, scale, "triton", True, from_scale=True, clip_coef=coef,
                      stats=stats)
    else:
        torch._foreach_mul_(group.grads, coef)


def clip_unscaled(params, max_norm: float, norm_type: float, shard_group: Any,
                   device: torch.device, error_if_nonfinite: bool) -> torch.Tensor:
    """Clip grads that are not scaled (a disabled scaler, or after ``unscale_``) by the total
    norm of :func:`reference_total_norm`: any ``p``, plain grads sharded over ``shard_group``."""
    entries = _norm_entries(params)
    total = reference_total_norm(entries, norm_type, shard_group, device)
    if error_if_nonfinite and not bool(total.isfinite().item()):  # the documented read
        raise_nonfinite(norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # float64 with float64 grads
    with torch.no_grad():
        for grad, _ in entries:
            grad.mul_(coef.to(grad.device))
    return total.float()


def raise_nonfinite(norm_type: float) -> None:
    raise RuntimeError(
        f"The total norm of order {norm_type} for gradients from `parameters` is "
        "non-finite, so it cannot be clipped. To disable this error and scale the "
        "gradients by the non-finite norm anyway, set `error_if_nonfinite=False`")


def fused_clip(optimizer: torch.optim.Optimizer, groups: list[GradGroup], mesh_groups: dict,
               found_for: PerDevice, scale: torch.Tensor, backend: str, max_norm: float,
               norm_type: float, shard_group: Any, error_if_nonfinite: bool,
               watched: tuple[list, list] | None = None) -> tuple[torch.Tensor, bool]:
    """Unscale and clip ``groups`` (the optimizer's grads, collected) by their total norm:
    on the Triton backend a read pass (found_inf, a norm partial per group) and a write pass
    (``dtype(dtype(g * inv_scale) * clip_coef)``); where no group runs on Triton, torch's
    unscale and torch's norm arithmetic. Returns the total norm (float32) and whether it was
    non-finite with ``error_if_nonfinite`` (one host read; the grads are then unscaled only,
    as torch raises after ``unscale_`` and before the clip). ``watched``: a watch's launches
    (``GradWatch._fused_pass``): per group, the group whose write pass also stores the
    statistics of ``dtype(g * inv_scale)``, and where (or None). No host sync otherwise."""
    device = scale.device
    scale_for = PerDevice(scale)
    # torch's arithmetic where no group runs on the Triton kernels
    on_triton = [_on_triton(g, backend) for g in groups]
    if True not in on_triton:
        for group in groups:
            dev = group.device
            unscale_group(group, found_for.get(dev), scale_for.get(dev), backend, True,
                          from_scale=True)
        # read again: collecting gave a bucketed parameter that received no gradient since
        # GradBuckets.zero_ grad None (its view is not a grad now)
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        total = reference_total_norm(_norm_entries(params), norm_type, shard_group, device)
    else:
        partials = [(_group_partial(g, found_for.get(g.device), scale_for.get(g.device),
                                    norm_type, triton), g.mesh_groups)
                    for g, triton in zip(groups, on_triton)]
        total = combine_partials(partials, norm_type, shard_group, device)
    nonfinite = error_if_nonfinite and not bool(total.isfinite().item())
    # the coefficient is formed from the norm before its float32 rounding: float64 with any
    # float64 grad, as torch's
    coef = torch.ones_like(total) if nonfinite else \
        torch.clamp(max_norm / (total + 1e-6), max=1.0)
    launched, stats = (groups, [None] * len(groups)) if watched is None else watched
    for group, write_pass, group_stats in zip(launched, on_triton, stats):
        dev = group.device
        _apply_coef(group, found_for.get(dev), scale_for.get(dev), coef.to(dev), write_pass,
                    group_stats)
    for bucket in buckets_of(optimizer):
        bucket.buffer_rewritten()
    if mesh_groups:
        agree_over_meshes(found_for.per_device, mesh_groups)
    return total.float(), nonfinite
