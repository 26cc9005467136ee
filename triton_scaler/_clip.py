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
from typing import TYPE_CHECKING, Any, cast

import torch
from torch.amp.grad_scaler import OptState

from . import reference
from ._backend import resolve_backend
from ._distributed import MeshLayout, agree_over_meshes, mesh_layout
from ._grads import PerDevice, grad_groups
from ._norms import combine_partials, grad_norm, reference_total_norm
from ._plans import refuse_group_writes
from ._state import ScalerStateMixin
from ._traced import clip_grad_norm_ as _traced_clip
from ._traced import traced_under_compile
from .buckets import attach_bucket_grads, buckets_of
from .ops import unscale_group_


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
        return cast(torch.Tensor, unscale_group_(
            group.grads, found_inf, scale, "triton", False, from_scale=True, group=group,
            norm=2 if norm_type == 2.0 else -1))
    reference.non_finite_check_and_unscale_(group.grads, found_inf, reference.inv_scale_of(scale))
    norms = [grad_norm(g, norm_type) for g in group.grads if g.numel() or norm_type == 2.0]
    if not norms:
        return torch.zeros((), device=found_inf.device)
    total = torch.linalg.vector_norm(torch.stack(norms), norm_type)
    return total if norm_type == math.inf else total.square()


def _apply_coef(group, found_inf, scale, coef, write_pass: bool) -> None:
    """``dtype(dtype(g * inv_scale) * coef)``: the Triton write pass (``write_pass``), else a
    multiplication of grads already unscaled."""
    if write_pass:
        unscale_group_(group.grads, found_inf, scale, "triton", True, from_scale=True,
                       group=group, clip_coef=coef)
    else:
        torch._foreach_mul_(group.grads, coef)


def _clip_unscaled(params, max_norm: float, norm_type: float, shard_group: Any,
                   device: torch.device, error_if_nonfinite: bool) -> torch.Tensor:
    """Clip grads that are not scaled (a disabled scaler, or after ``unscale_``) by the total
    norm of :func:`reference_total_norm`: any ``p``, plain grads sharded over ``shard_group``."""
    entries = _norm_entries(params)
    total = reference_total_norm(entries, norm_type, shard_group, device)
    if error_if_nonfinite and not bool(total.isfinite().item()):  # the documented read
        _raise_nonfinite(norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # float64 with float64 grads
    with torch.no_grad():
        for grad, _ in entries:
            grad.mul_(coef.to(grad.device))
    return total.float()


def _raise_nonfinite(norm_type: float) -> None:
    raise RuntimeError(
        f"The total norm of order {norm_type} for gradients from `parameters` is "
        "non-finite, so it cannot be clipped. To disable this error and scale the "
        "gradients by the non-finite norm anyway, set `error_if_nonfinite=False`")


class ClipMixin(ScalerStateMixin):
    """:class:`GradScaler`'s ``clip_grad_norm_``: the unscale and the clip in two passes."""

    if TYPE_CHECKING:  # GradScaler's own, which the clip calls
        _unscales_fp16: bool

        def _overrides_unscale_grads(self) -> bool: ...

        def _ready_to_unscale(self, optimizer: torch.optim.Optimizer, funcname: str) -> dict: ...

        def _agree_found_inf(self, state: dict[str, Any]) -> torch.Tensor: ...

        def _note_written_padding(self, optimizer: torch.optim.Optimizer,
                                  groups: list) -> None: ...

    @traced_under_compile(_traced_clip)
    def clip_grad_norm_(self, optimizer: torch.optim.Optimizer, max_norm: float,
                        norm_type: float | str = 2.0, error_if_nonfinite: bool = False, *,
                        sharded: bool | None = None) -> torch.Tensor:
        """Unscale the optimizer's grads and clip them by their total norm, in one read pass
        and one read + write pass (torch's ``unscale_`` + ``clip_grad_norm_`` make five).

        Counts as this iteration's :meth:`unscale_` for ``optimizer`` (``step`` skips on
        overflow; a later ``unscale_`` raises, as torch). Returns the total norm of the
        unscaled grads as a 0-d float32 tensor on the scale's device, accumulated in float32
        (also for bf16 / fp16 grads; float64 with float64 grads, whose clip coefficient is
        formed from the float64 norm, as torch's). ``norm_type`` 2 and ``inf`` (or
        ``"inf"``) run fused; other ``p > 0`` run as ``unscale_`` + a clip, as does a
        subclass that overrides ``_unscale_grads_``. No host sync, except
        ``error_if_nonfinite=True`` (one read). A disabled scaler clips with torch's
        ``clip_grad_norm_``. No grads: as torch, a 0 norm and nothing recorded (``step`` then
        raises). Sparse grads raise, as in torch.

        Whose norm (every rank calls this; the reductions are collective): DTensor grads
        (FSDP2, tensor parallel) give the global norm over their mesh, as torch's clip.
        Plain grads: ``sharded=False`` (or no ``process_group``), the norm of this rank's
        grads, as torch's clip (DDP, whose grads are already reduced); ``sharded=True``, they
        are shards of one gradient over the scaler's ``process_group`` (FSDP1 with a sharded
        strategy, ZeRO-style sharding) and the norm is summed over it, as
        ``FullyShardedDataParallel.clip_grad_norm_``. With a ``process_group`` and plain
        grads, ``sharded`` must be given.

        Args:
            optimizer: the optimizer whose grads to unscale and clip.
            max_norm: the largest total norm, finite and >= 0.
            norm_type: p of the p-norm, > 0, or ``inf`` / ``"inf"``.
            error_if_nonfinite: raise when the total norm is non-finite, as torch's clip.
            sharded: whether plain grads are shards over the scaler's ``process_group``.

        Returns:
            The total norm of the unscaled grads, a 0-d float32 tensor on the scale's device.

        Raises:
            RuntimeError: a non-finite norm with ``error_if_nonfinite=True``; torch's errors
                for a second unscale in one iteration.
            ValueError, TypeError: a bad argument, named; ``sharded`` missing where needed.
            NotImplementedError: sparse grads.

        .. note:: Does not synchronise with the host, except ``error_if_nonfinite=True``
            (one read).
        """
        max_norm, norm_type = check_clip_arguments(max_norm, norm_type)
        if not isinstance(error_if_nonfinite, bool):
            raise TypeError(f"error_if_nonfinite must be a bool; got {error_if_nonfinite!r}")
        if not self._enabled:  # GradBuckets: grad None where no gradient came (as unscale_)
            attach_bucket_grads(optimizer)
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        shard_group = self._shard_group(params, sharded)
        if any(p.grad.is_sparse for p in params):
            raise NotImplementedError(
                "clip_grad_norm_ takes dense gradients only; a parameter has a sparse one "
                "(torch.nn.utils.clip_grad_norm_ does not take them either)")
        if not self._enabled and shard_group is None:
            return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type,
                                                  error_if_nonfinite).float()
        if not self._enabled:
            device = params[0].grad.device if params else torch.device("cpu")
            return _clip_unscaled(params, max_norm, norm_type, shard_group, device,
                                  error_if_nonfinite)
        if norm_type not in (2.0, math.inf) or (not params and shard_group is None) or \
                self._overrides_unscale_grads():  # a subclass's own unscale: through it
            self.unscale_(optimizer)  # no grads: as torch, unscale_ records none, norm 0
            device = self._scale.device
            if shard_group is None:
                total = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type,
                                                       error_if_nonfinite)
                return total.float().to(device)
            return _clip_unscaled(params, max_norm, norm_type, shard_group, device,
                                  error_if_nonfinite)
        state = self._ready_to_unscale(optimizer, "unscale_")  # torch's unscale_ errors
        total, found_per_device, nonfinite = self._fused_clip(
            optimizer, max_norm, norm_type, self._found_inf_flag(state), shard_group,
            error_if_nonfinite)
        state["found_inf_per_device"] = found_per_device
        state["stage"] = OptState.UNSCALED
        if found_per_device:  # none when no grad remained (GradBuckets: none received)
            self._agree_found_inf(state)
        if nonfinite:  # as torch: unscaled (recorded as unscale_), not clipped
            _raise_nonfinite(norm_type)
        return total

    def _shard_group(self, params: list, sharded: bool | None) -> Any:
        """The group over which plain grads are shards (None: they are whole); raises when
        ``sharded`` is not a bool or None, or is needed and missing."""
        if sharded is not None and not isinstance(sharded, bool):
            raise TypeError(f"sharded must be True, False or None; got {sharded!r}")
        group = self._process_group
        if sharded and group is None:
            raise ValueError("sharded=True sums the norm over the scaler's process_group, and "
                             "this GradScaler has none: pass GradScaler(..., process_group=pg)")
        if sharded is None and group is not None and \
                any(type(p.grad) is torch.Tensor for p in params):
            raise ValueError(
                "clip_grad_norm_ with a process_group and plain (not DTensor) grads: pass "
                "sharded=True when each rank's grads are shards of one gradient (FSDP1 with a "
                "sharded strategy, ZeRO-style sharding: the norm is summed over process_group) "
                "or sharded=False when every rank holds the whole gradient (DDP: the norm is "
                "this rank's, as torch.nn.utils.clip_grad_norm_)")
        return group if sharded else None

    def _fused_clip(self, optimizer, max_norm: float, norm_type: float, found_inf,
                    shard_group: Any, error_if_nonfinite: bool):
        device = self._scale.device
        found_for = PerDevice(found_inf)
        scale_for = PerDevice(self._scale)
        with torch.no_grad():
            groups, mesh_groups = grad_groups(optimizer, self._unscales_fp16, self._backend)
            # torch's arithmetic where no group runs on the Triton kernels
            on_triton = [_on_triton(g, self._backend) for g in groups]
            if not any(on_triton):
                for group in groups:
                    dev = group.device
                    reference.non_finite_check_and_unscale_(
                        group.grads, found_for.get(dev), reference.inv_scale_of(scale_for.get(dev)))
                # read again: grad_groups gave a bucketed parameter that received no
                # gradient since GradBuckets.zero_ grad None (its view is not a grad now)
                params = [p for g in optimizer.param_groups for p in g["params"]
                          if p.grad is not None]
                total = reference_total_norm(_norm_entries(params), norm_type, shard_group,
                                             device)
            else:
                refuse_group_writes(groups, self._backend)  # before the read pass
                partials = [(_group_partial(g, found_for.get(g.device), scale_for.get(g.device),
                                            norm_type, triton), g.mesh_groups)
                            for g, triton in zip(groups, on_triton)]
                total = combine_partials(partials, norm_type, shard_group, device)
            if not groups and self._process_group is not None:
                found_for.get(device)  # no grads here: join the agreement with 0
            # error_if_nonfinite: one read; a non-finite norm unscales only, as torch raises
            # after unscale_ and before the clip. The coefficient is formed from the norm
            # before its float32 rounding: float64 with any float64 grad, as torch's.
            nonfinite = error_if_nonfinite and not bool(total.isfinite().item())
            coef = torch.ones_like(total) if nonfinite else \
                torch.clamp(max_norm / (total + 1e-6), max=1.0)
            for group, write_pass in zip(groups, on_triton):
                dev = group.device
                _apply_coef(group, found_for.get(dev), scale_for.get(dev), coef.to(dev),
                            write_pass)
            # a bucket's padding times a NaN coefficient (a non-finite norm: an overflow) or
            # an infinite inv_scale is NaN: zeroed again in update() after an overflow
            self._note_written_padding(optimizer, groups)
            for bucket in buckets_of(optimizer):
                bucket.buffer_rewritten()
            if mesh_groups:
                agree_over_meshes(found_for._per_device_tensors, mesh_groups)
        return total.float(), found_for._per_device_tensors, nonfinite
