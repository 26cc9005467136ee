"""Public device ops, with the argument order of torch's private AMP ops.

| torch (private)                                    | triton_scaler.ops                  |
|----------------------------------------------------|------------------------------------|
| ``torch._amp_foreach_non_finite_check_and_unscale_`` | :func:`non_finite_check_and_unscale_` |
| ``torch._amp_update_scale_``                         | :func:`update_scale_`              |

None of these functions synchronises with the host. ``backend`` is ``"auto"`` (Triton for CUDA
tensors when triton is importable, else the pure-PyTorch reference), ``"reference"`` or
``"triton"``.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence

import torch

from . import reference
from ._backend import Backend, resolve_backend

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_params_cache: dict[tuple, torch.Tensor] = {}


def _check_flag(name: str, t: object, dtype: torch.dtype) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.numel() != 1 or t.dtype != dtype:
        raise TypeError(f"{name} must be a one-element {dtype} tensor; got "
                        f"{t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}"
                        f"{'' if not isinstance(t, torch.Tensor) else f' of {t.numel()} elements'}")
    return t


def _group_grads(grads: Sequence[torch.Tensor], device: torch.device):
    if isinstance(grads, torch.Tensor):
        raise TypeError("grads must be a list or tuple of tensors, not a single tensor")
    groups: dict[torch.dtype, list[torch.Tensor]] = defaultdict(list)
    for i, g in enumerate(grads):
        if not isinstance(g, torch.Tensor):
            raise TypeError(f"grads[{i}] must be a tensor; got {type(g).__name__}")
        if g.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"grads[{i}] has dtype {g.dtype}; accepted: float32, float16, bfloat16")
        if g.device != device:
            raise ValueError(f"grads[{i}] is on {g.device} but found_inf is on {device}; "
                             "every grad must be on found_inf's device")
        if g.is_sparse:
            raise TypeError(f"grads[{i}] is sparse; pass its ._values()")
        groups[g.dtype].append(g)
    return groups.values()


def unscale_group_(grads: list[torch.Tensor], found_inf: torch.Tensor,
                   inv_scale: torch.Tensor, backend: str, write: bool) -> None:
    """Unscale (or only check) grads of one device and dtype, with no argument checks: the
    caller (GradScaler, which groups grads as torch does) guarantees them."""
    if resolve_backend(backend, found_inf.device) == "triton":
        from triton_scaler.kernels import launch_unscale

        launch_unscale(grads, found_inf, inv_scale, write=write)
    elif write:
        reference.non_finite_check_and_unscale_(grads, found_inf, inv_scale)
    else:
        reference.check_(grads, found_inf, inv_scale)


def _unscale_or_check(grads, found_inf, inv_scale, backend, write):
    _check_flag("found_inf", found_inf, torch.float32)
    _check_flag("inv_scale", inv_scale, torch.float32)
    if inv_scale.device != found_inf.device:
        raise ValueError(f"inv_scale is on {inv_scale.device} but found_inf is on {found_inf.device}")
    if resolve_backend(backend, found_inf.device) == "reference":
        if isinstance(grads, torch.Tensor):
            raise TypeError("grads must be a list or tuple of tensors, not a single tensor")
        grads = list(grads)
        try:  # torch's op checks the grads itself: no per-tensor Python work when they are fine
            unscale_group_(grads, found_inf, inv_scale, "reference", write)
        except (RuntimeError, TypeError, ValueError):
            _group_grads(grads, found_inf.device)  # raises the clearer error, if it finds one
            raise
        return
    for group in _group_grads(grads, found_inf.device):
        unscale_group_(group, found_inf, inv_scale, backend, write)


def non_finite_check_and_unscale_(
    grads: Sequence[torch.Tensor],
    found_inf: torch.Tensor,
    inv_scale: torch.Tensor,
    *,
    backend: Backend = "auto",
) -> None:
    """Multiply every grad by ``inv_scale`` in place and flag non-finite values.

    Args:
        grads: float32 / float16 / bfloat16 tensors (any sizes, contiguous or not), all on
            ``found_inf``'s device. Each element becomes ``dtype(fp32(x) * inv_scale)``,
            bit-identical to ``torch._amp_foreach_non_finite_check_and_unscale_``.
        found_inf: one-element float32 tensor; set to exactly 1.0 when an input element or its
            product is non-finite, otherwise left untouched (callers zero it).
        inv_scale: one-element float32 tensor on the same device.
        backend: ``"auto"``, ``"reference"`` or ``"triton"``.

    Does not synchronise with the host.
    """
    _unscale_or_check(grads, found_inf, inv_scale, backend, write=True)


def non_finite_check_(
    grads: Sequence[torch.Tensor],
    found_inf: torch.Tensor,
    inv_scale: torch.Tensor,
    *,
    backend: Backend = "auto",
) -> None:
    """Read-only variant of :func:`non_finite_check_and_unscale_`: sets ``found_inf = 1.0``
    when an element of ``grads`` (or its product with ``inv_scale``) is non-finite, and leaves
    the grads unchanged. For optimizers that unscale inside their own kernel. No host sync."""
    _unscale_or_check(grads, found_inf, inv_scale, backend, write=False)


def all_finite(tensors: Sequence[torch.Tensor], *, backend: Backend = "auto") -> torch.Tensor:
    """0-d bool tensor, on the tensors' device (CPU for an empty list): True when every element
    of every tensor is finite (MindSpore / jmp ``all_finite``). Computed on the device, no sync."""
    device = tensors[0].device if len(tensors) else torch.device("cpu")
    found = torch.zeros((), dtype=torch.float32, device=device)
    one = torch.ones((), dtype=torch.float32, device=device)
    non_finite_check_(tensors, found, one, backend=backend)
    return found == 0


def _check_number(name: str, value: object, *, integer: bool = False) -> float:
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise TypeError(f"{name} must be {'an int' if integer else 'a number'}; got {value!r}")
    return value  # type: ignore[return-value]


_valid_policies: set[tuple] = set()


def check_policy(growth_factor: float, backoff_factor: float, growth_interval: int,
                 hysteresis: int = 1, min_scale: float = 0.0,
                 max_scale: float = math.inf) -> None:
    """Raise ``ValueError`` naming the argument and its accepted range for a bad setting
    (``TypeError`` for a wrong type). Settings seen valid before are not checked again."""
    args = (growth_factor, backoff_factor, growth_interval, hysteresis, min_scale, max_scale)
    key = tuple((type(a), a) for a in args)
    if key in _valid_policies:
        return
    for name, value, ok, accepted in (
        ("growth_factor", growth_factor, lambda v: 1.0 < v < math.inf, "finite and > 1"),
        ("backoff_factor", backoff_factor, lambda v: 0.0 < v < 1.0, "in (0, 1)"),
        ("min_scale", min_scale, lambda v: 0.0 <= v < math.inf, "finite and >= 0"),
        ("max_scale", max_scale, lambda v: v > 0.0, "> 0 (inf allowed)"),
    ):
        if not ok(_check_number(name, value)):
            raise ValueError(f"{name} must be {accepted}; got {value!r}")
    for name, value in (("growth_interval", growth_interval), ("hysteresis", hysteresis)):
        if _check_number(name, value, integer=True) < 1:
            raise ValueError(f"{name} must be an int >= 1; got {value!r}")
    if min_scale > max_scale:
        raise ValueError(f"min_scale must be <= max_scale; got min_scale={min_scale!r}, "
                         f"max_scale={max_scale!r}")
    if len(_valid_policies) < 256:
        _valid_policies.add(key)


def policy_params(growth_factor: float, backoff_factor: float, growth_interval: int,
                  min_scale: float, max_scale: float, hysteresis: int,
                  device: torch.device) -> torch.Tensor:
    """The float64 parameter buffer of the update kernel (``kernels.update.PARAMS_LAYOUT``),
    cached per device and values so repeated calls make no host-to-device copy."""
    values = (float(growth_factor), float(backoff_factor), float(growth_interval),
              float(min_scale), float(max_scale), float(hysteresis))
    key = (device, values)
    params = _params_cache.get(key)
    if params is None:
        if len(_params_cache) > 64:
            _params_cache.clear()
        params = _params_cache[key] = torch.tensor(values, dtype=torch.float64, device=device)
    return params


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
) -> None:
    """Update the loss scale in place from ``found_inf``, on the device.

    With the defaults this is ``torch._amp_update_scale_`` bit for bit: an overflow
    (``found_inf != 0``) multiplies ``scale`` by ``backoff_factor`` and zeroes
    ``growth_tracker``; otherwise the tracker counts clean steps and the ``growth_interval``-th
    multiplies the scale by ``growth_factor`` if the result is finite. Factor math is fp64.

    Extensions: with ``hysteresis_tracker`` (0-d int32) an overflow decrements it and backs off
    only at <= 0; it refills to ``hysteresis`` on growth (Megatron-core) or on every clean step
    (``consecutive_hysteresis``, DeepSpeed). Backoff is floored at ``min_scale``, growth capped
    at ``max_scale``.

    Args:
        scale: 0-d float32 tensor. growth_tracker: 0-d int32 tensor. found_inf: 0-d float32.
            All on one device.
        params: optional precomputed :func:`policy_params` buffer (Triton backend); when given
            the kernel reads the factors from it, so changes to it take effect in CUDA graphs.

    Does not synchronise with the host.
    """
    _check_flag("scale", scale, torch.float32)
    _check_flag("growth_tracker", growth_tracker, torch.int32)
    _check_flag("found_inf", found_inf, torch.float32)
    if hysteresis_tracker is not None:
        _check_flag("hysteresis_tracker", hysteresis_tracker, torch.int32)
    check_policy(growth_factor, backoff_factor, growth_interval, hysteresis, min_scale, max_scale)
    tensors = [growth_tracker, found_inf] + ([hysteresis_tracker] if hysteresis_tracker is not None else [])
    for t in tensors:
        if t.device != scale.device:
            raise ValueError(f"scale is on {scale.device} but a state tensor is on {t.device}; "
                             "all must share one device")
    if resolve_backend(backend, scale.device) == "triton":
        from triton_scaler.kernels import launch_update_scale

        if params is None:
            params = policy_params(growth_factor, backoff_factor, growth_interval,
                                   min_scale, max_scale, hysteresis, scale.device)
        launch_update_scale(scale, growth_tracker, found_inf, params, hysteresis_tracker,
                            consecutive_hysteresis)
    else:
        reference.update_scale_(scale, growth_tracker, found_inf, growth_factor, backoff_factor,
                                growth_interval, hysteresis_tracker, hysteresis,
                                consecutive_hysteresis, min_scale, max_scale)
