"""Public device ops, with the argument order of torch's private AMP ops.

| torch (private)                                    | triton_scaler.ops                  |
|----------------------------------------------------|------------------------------------|
| ``torch._amp_foreach_non_finite_check_and_unscale_`` | :func:`non_finite_check_and_unscale_` |
| ``torch._amp_update_scale_``                         | :func:`update_scale_`              |

None of these functions synchronises with the host. ``backend`` is ``"auto"`` (Triton for CUDA
tensors when triton is importable, else the pure-PyTorch reference), ``"reference"`` or
``"triton"``. On Triton, calls on grads at the addresses of a recent grad list, laid out as
it was, launch that list's plans again (:func:`._plans.ops_plans`, kept in planning's one
bounded store, :mod:`._plan_store`).

Called from code that ``torch.compile`` compiles, each is traced as its registered torch op
(:mod:`._library`), which runs the same implementation at run time; grads that are tensor
subclasses (DTensor) run eagerly there instead, a graph break.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from . import _plans, reference
from ._backend import Backend, resolve_backend, triton_kernels
from ._distributed import add_groups, agree_over_meshes, local_grad
from ._eager import run_eagerly
from ._library import ops_namespace
from ._op_args import (
    PLAIN,
    as_tensor_list,
    check_flag,
    group_grads,
    nested_grad_error,
)
from .policy import ScalePolicy, cached_policy

if TYPE_CHECKING:
    from ._grads import GradGroup


def unscale_group_(grads: list[torch.Tensor], found_inf: torch.Tensor,
                   inv_scale: torch.Tensor, backend: str, write: bool, *,
                   from_scale: bool = False, group: GradGroup | None = None, norm: int = 0,
                   clip_coef: torch.Tensor | None = None) -> torch.Tensor | None:
    """Unscale (or only check) grads of one device and dtype, with no argument checks: the
    caller (GradScaler, which groups grads as torch does) guarantees them. The one place,
    with the ops' own loop below, that launches the unscale kernel.

    ``from_scale``: ``inv_scale`` is the scale itself, whose reciprocal is formed as torch
    forms it. ``group``: the grads' :class:`GradGroup`, whose ``plan`` (when set) is the
    launch's host work, built by the caller, which guarantees it matches the grads (a group
    with a plan is on the Triton backend). ``clip_grad_norm_``'s passes, on the Triton backend
    only: ``norm`` (2 or -1, ``write=False``) returns the group's sum of squares (max ``|x|``)
    of the unscaled grads; ``clip_coef`` also multiplies them by it before storing. Returns
    None otherwise. No host sync."""
    if (group is not None and group.plan is not None) or \
            resolve_backend(backend, found_inf.device) == "triton":
        plan = group.launch_target() if group is not None else _plans.plan_unscale(grads)
        return triton_kernels().launch_unscale(plan, found_inf, inv_scale, write=write,
                                               norm=norm, clip_coef=clip_coef,
                                               inv_from_scale=from_scale)
    if norm or clip_coef is not None:
        raise ValueError("the clip's fused passes run on the Triton backend only")
    if from_scale:
        inv_scale = reference.inv_scale_of(inv_scale)
    if write:
        reference.non_finite_check_and_unscale_(grads, found_inf, inv_scale)
    else:
        reference.check_(grads, found_inf, inv_scale)
    return None


def bind_scaler_update(scale: torch.Tensor, growth_tracker: torch.Tensor, flags: torch.Tensor,
                       policy: ScalePolicy, *, hysteresis_tracker: torch.Tensor | None,
                       skipped: torch.Tensor, skipped_count: torch.Tensor, backend: str,
                       params: torch.Tensor | None) -> Callable[[], None]:
    """The whole of :meth:`GradScaler.update` on the device, bound once: each call of the
    result is one update. An overflow is any non-zero entry of ``flags`` (1-D fp32, one per
    optimizer); it is recorded in ``skipped`` (0-d bool, or its ``uint8`` view, made once by
    the scaler) and ``skipped_count`` (0-d int64) when ``policy.skip_on_overflow``, the scale
    is updated when ``policy.dynamic``, and ``flags`` is zeroed. The backend is resolved and
    the arguments checked here, once; the scaler keeps the result while these stay the same
    objects. One launch per call on Triton; no host sync."""
    if resolve_backend(backend, scale.device) == "triton":
        return triton_kernels().bind_update_scale(
            scale, growth_tracker, flags,
            policy.kernel_params(scale.device) if params is None else params,
            hysteresis_tracker, policy.consecutive_hysteresis, dynamic=policy.dynamic,
            skipped=skipped if policy.skip_on_overflow else None,
            skipped_count=skipped_count, reset_found=True)

    def reference_update() -> None:
        found = (flags != 0).any()
        if policy.skip_on_overflow:
            skipped.copy_(found)
            skipped_count.add_(found)
        if policy.dynamic:
            reference.update_scale_(scale, growth_tracker, found.float(), policy,
                                    hysteresis_tracker)
        flags.zero_()

    return reference_update


def unscale_or_check(grads, found_inf, inv_scale, backend, write):
    """The public ops' work, arguments checked (the registered ops' implementation)."""
    grads = as_tensor_list(grads)
    check_flag("found_inf", found_inf, torch.float32)
    check_flag("inv_scale", inv_scale, torch.float32)
    if inv_scale.device != found_inf.device:
        raise ValueError(f"inv_scale is on {inv_scale.device} but found_inf is on {found_inf.device}")
    resolved = resolve_backend(backend, found_inf.device)
    mesh_groups: list = []  # every process group any DTensor grad is sharded over
    plain = PLAIN.issuperset(map(type, grads))
    if not plain:  # rare: a DTensor (its local shard) or such
        meshes: dict = {}
        for i, g in enumerate(grads):
            if isinstance(g, torch.Tensor) and type(g) not in PLAIN:
                if g.is_nested:  # jagged (a subclass); strided ones are checked with the rest
                    raise nested_grad_error(i)
                grads[i], groups = local_grad(g, resolved, meshes)
                if groups:
                    add_groups(mesh_groups, groups)
        plain = PLAIN.issuperset(map(type, grads))
    if resolved == "reference" and write:
        try:  # torch's op checks the grads itself: no per-tensor Python work when they are fine
            unscale_group_(grads, found_inf, inv_scale, "reference", write)
        except (RuntimeError, TypeError, ValueError, NotImplementedError):
            group_grads(grads, found_inf.device, plain)  # raises the clearer error, if it finds one
            raise
    elif resolved == "triton":  # plans kept for grads at the same addresses (subclasses
        # were unwrapped or refused above: what is not plain is no tensor, which group_grads refuses)
        kernels = triton_kernels()
        for plan in _plans.ops_plans(grads, found_inf.device, write,
                                     lambda: group_grads(grads, found_inf.device, plain)):
            kernels.launch_unscale(plan, found_inf, inv_scale, write=write)
    else:
        for group in group_grads(grads, found_inf.device, plain):
            unscale_group_(group, found_inf, inv_scale, "reference", write)
    if mesh_groups:  # as torch's op under DTensor dispatch, over the union of the grads'
        # sharded dimensions (torch's: its first grad's; docs/distributed.md)
        agree_over_meshes({found_inf.device: found_inf}, {found_inf.device: mesh_groups})


def non_finite_check_and_unscale_(
    grads: Sequence[torch.Tensor],
    found_inf: torch.Tensor,
    inv_scale: torch.Tensor,
    *,
    backend: Backend = "auto",
) -> None:
    """Multiply every grad by ``inv_scale`` in place and flag non-finite values.

    Args:
        grads: float32 / float16 / bfloat16 / float64 tensors (any sizes, contiguous or
            not), all on ``found_inf``'s device. Each element becomes
            ``dtype(fp32(x) * inv_scale)`` (float64: ``x * fp64(inv_scale)``), bit-identical
            to ``torch._amp_foreach_non_finite_check_and_unscale_``.
        found_inf: one-element float32 tensor; set to exactly 1.0 when an input element or its
            product is non-finite, otherwise left untouched (callers zero it).
        inv_scale: one-element float32 tensor on the same device.
        backend: ``"auto"`` (Triton for CUDA tensors, the reference path otherwise),
            ``"reference"`` or ``"triton"``.

    Raises:
        TypeError: a grad of another dtype, sparse or nested; ``grads`` a single tensor;
            ``found_inf`` / ``inv_scale`` not a one-element float32 tensor.
        ValueError: tensors on different devices, or an unknown ``backend``.
        RuntimeError: on the Triton backend, grads that partly share memory (nothing written).

    .. note:: Does not synchronise with the host.
    """
    if torch.compiler.is_dynamo_compiling():
        _traced(grads, found_inf, inv_scale, backend, write=True)
        return
    unscale_or_check(grads, found_inf, inv_scale, backend, write=True)


def non_finite_check_(
    grads: Sequence[torch.Tensor],
    found_inf: torch.Tensor,
    inv_scale: torch.Tensor,
    *,
    backend: Backend = "auto",
) -> None:
    """Read-only variant of :func:`non_finite_check_and_unscale_`, for optimizers that unscale
    inside their own kernel: one read of each grad, which is left unchanged.

    Args:
        grads: as :func:`non_finite_check_and_unscale_`.
        found_inf: one-element float32 tensor; set to exactly 1.0 when an element of ``grads``
            or its product with ``inv_scale`` is non-finite, otherwise left untouched.
        inv_scale: one-element float32 tensor on the same device.
        backend: ``"auto"``, ``"reference"`` or ``"triton"``.

    Raises:
        TypeError, ValueError: as :func:`non_finite_check_and_unscale_`.

    .. note:: Does not synchronise with the host.
    """
    if torch.compiler.is_dynamo_compiling():
        _traced(grads, found_inf, inv_scale, backend, write=False)
        return
    unscale_or_check(grads, found_inf, inv_scale, backend, write=False)


def _traced(grads, found_inf, inv_scale, backend, write):
    """Under ``torch.compile``: the registered op, or (tensor subclasses, a single tensor, a
    bad backend) the eager implementation, a graph break."""
    if isinstance(grads, (list, tuple)) and isinstance(backend, str) and _plain(grads):
        op = (ops_namespace.non_finite_check_and_unscale_ if write
              else ops_namespace.non_finite_check_)
        op(list(grads), found_inf, inv_scale, backend)
        return
    run_eagerly(unscale_or_check, grads, found_inf, inv_scale, backend, write)


def _plain(tensors: Sequence) -> bool:
    """Whether each item is a plain tensor or parameter (a loop, not ``all(...)``: older
    dynamo versions cannot inline a generator there)."""
    for t in tensors:
        if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter:
            return False
    return True


def all_finite(tensors: Sequence[torch.Tensor], *, backend: Backend = "auto") -> torch.Tensor:
    """Whether every element of every tensor is finite (MindSpore's / jmp's ``all_finite``).

    Args:
        tensors: float32 / float16 / bfloat16 / float64 tensors on one device.
        backend: ``"auto"``, ``"reference"`` or ``"triton"``.

    Returns:
        A 0-d bool tensor on the tensors' device (CPU for an empty list).

    Raises:
        TypeError, ValueError: as :func:`non_finite_check_and_unscale_`.

    .. note:: Computed on the device; does not synchronise with the host.
    """
    tensors = as_tensor_list(tensors, "tensors")
    device = tensors[0].device if tensors else torch.device("cpu")
    found = torch.zeros((), dtype=torch.float32, device=device)
    one = torch.ones((), dtype=torch.float32, device=device)
    non_finite_check_(tensors, found, one, backend=backend)
    return found == 0


def update_scale_(
    scale: torch.Tensor,
    growth_tracker: torch.Tensor,
    found_inf: torch.Tensor,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    *,
    hysteresis_tracker: torch.Tensor | None = None,
    hysteresis: int = 1,
    consecutive_hysteresis: bool = False,
    min_scale: float = 0.0,
    max_scale: float = math.inf,
    backend: Backend = "auto",
    params: torch.Tensor | None = None,
) -> torch.Tensor:
    """Update the loss scale in place from ``found_inf``, on the device; returns ``scale``
    (as torch's op).

    With the defaults this is ``torch._amp_update_scale_`` bit for bit: an overflow
    (``found_inf != 0``) multiplies ``scale`` by ``backoff_factor`` and zeroes
    ``growth_tracker``; otherwise the tracker counts clean steps and the ``growth_interval``-th
    multiplies the scale by ``growth_factor`` if the result is finite. Factor math is fp64.

    Extensions: with ``hysteresis_tracker`` (0-d int32) an overflow decrements it and backs off
    only at <= 0; it refills to ``hysteresis`` on growth (Megatron-core) or on every clean step
    (``consecutive_hysteresis``, DeepSpeed). Backoff is floored at ``min_scale``, growth capped
    at ``max_scale``.

    Args:
        scale: 0-d float32 tensor, updated in place.
        growth_tracker: 0-d int32 tensor on ``scale``'s device.
        found_inf: 0-d float32 tensor on ``scale``'s device; non-zero (NaN too) is an overflow.
        growth_factor: finite, > 1.
        backoff_factor: in ``[2**-126, 1)``.
        growth_interval: int >= 1.
        hysteresis_tracker: 0-d int32 tensor, or None for no hysteresis.
        hysteresis: the tracker's refill value, int >= 1.
        consecutive_hysteresis: refill on every clean step, not only on growth.
        min_scale: floor of the backoff (0: none, as torch).
        max_scale: cap of the growth.
        backend: ``"auto"``, ``"reference"`` or ``"triton"``.
        params: optional precomputed :meth:`ScalePolicy.kernel_params` buffer (Triton
            backend); the kernel then reads the factors from it, so changes to it take effect
            in CUDA graphs.

    Returns:
        ``scale``, as torch's op.

    Raises:
        TypeError: a tensor of the wrong dtype, or a setting of the wrong type.
        ValueError: tensors on different devices, or a setting out of range (named).

    .. note:: Does not synchronise with the host.
    """
    if torch.compiler.is_dynamo_compiling() and _numbers(
            (growth_factor, backoff_factor, min_scale, max_scale), (growth_interval, hysteresis),
            (consecutive_hysteresis,)) and isinstance(backend, str):
        ops_namespace.update_scale_(scale, growth_tracker, found_inf, hysteresis_tracker,
                                    float(growth_factor), float(backoff_factor), growth_interval,
                                    hysteresis, consecutive_hysteresis, float(min_scale),
                                    float(max_scale), backend, params)
        return scale
    policy = cached_policy(growth_factor=growth_factor, backoff_factor=backoff_factor,
                           growth_interval=growth_interval, hysteresis=hysteresis,
                           consecutive_hysteresis=consecutive_hysteresis, min_scale=min_scale,
                           max_scale=max_scale)
    update_with_policy_(scale, growth_tracker, found_inf, policy,
                        hysteresis_tracker=hysteresis_tracker, backend=backend, params=params)
    return scale


def _numbers(reals: tuple, ints: tuple, bools: tuple) -> bool:
    """Whether the settings are Python numbers of their kinds, which the registered ops take
    (anything else is validated, and refused with its name, by the eager implementation)."""
    for v in reals:
        if type(v) is not int and type(v) is not float:
            return False
    for v in ints:
        if type(v) is not int:
            return False
    for v in bools:
        if type(v) is not bool:
            return False
    return True


def update_with_policy_(scale: torch.Tensor, growth_tracker: torch.Tensor,
                        found_inf: torch.Tensor, policy: ScalePolicy, *,
                        hysteresis_tracker: torch.Tensor | None = None,
                        backend: Backend = "auto", params: torch.Tensor | None = None) -> None:
    """:func:`update_scale_` with its settings as a validated :class:`ScalePolicy` (the
    DeepSpeed- and MindSpore-style scalers' call; :class:`GradScaler` binds its update once,
    :func:`bind_scaler_update`). ``hysteresis_tracker`` None: no hysteresis. No host sync.
    Traced under ``torch.compile`` as the registered ``update_scale_`` op."""
    if torch.compiler.is_dynamo_compiling() and isinstance(backend, str):
        ops_namespace.update_scale_(
            scale, growth_tracker, found_inf, hysteresis_tracker, policy.growth_factor,
            policy.backoff_factor, policy.growth_interval, policy.hysteresis,
            policy.consecutive_hysteresis, policy.min_scale, policy.max_scale, backend, params)
        return
    check_flag("scale", scale, torch.float32)
    check_flag("growth_tracker", growth_tracker, torch.int32)
    check_flag("found_inf", found_inf, torch.float32)
    if hysteresis_tracker is not None:
        check_flag("hysteresis_tracker", hysteresis_tracker, torch.int32)
    for name, t in (("growth_tracker", growth_tracker), ("found_inf", found_inf),
                    ("hysteresis_tracker", hysteresis_tracker)):
        if t is not None and t.device != scale.device:
            raise ValueError(f"{name} is on {t.device} but scale is on {scale.device}; scale, "
                             "growth_tracker, found_inf and hysteresis_tracker must share one "
                             "device")
    if resolve_backend(backend, scale.device) == "triton":
        if params is None:
            params = policy.kernel_params(scale.device)
        triton_kernels().bind_update_scale(scale, growth_tracker, found_inf, params,
                                           hysteresis_tracker, policy.consecutive_hysteresis)()
    else:
        reference.update_scale_(scale, growth_tracker, found_inf, policy, hysteresis_tracker)
