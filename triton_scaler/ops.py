"""Public device ops, with the argument order of torch's private AMP ops.

| torch (private)                                    | triton_scaler.ops                  |
|----------------------------------------------------|------------------------------------|
| ``torch._amp_foreach_non_finite_check_and_unscale_`` | :func:`non_finite_check_and_unscale_` |
| ``torch._amp_update_scale_``                         | :func:`update_scale_`              |

None of these functions synchronises with the host. ``backend`` is ``"auto"`` (Triton for CUDA
tensors when triton is importable, else the pure-PyTorch reference), ``"reference"`` or
``"triton"``. Called from code that ``torch.compile`` compiles, each is traced as its
registered torch op (``torch.ops.triton_scaler.*``), which runs the same implementation at
run time; grads that are tensor subclasses (DTensor) run eagerly there instead, a graph break.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ._backend import Backend
from ._dispatch import unscale_or_check, update_scale_with_settings
from ._op_args import as_tensor_list

__all__ = ["all_finite", "non_finite_check_", "non_finite_check_and_unscale_", "update_scale_"]

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
    unscale_or_check(grads, found_inf, inv_scale, backend, write=False)


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
    update_scale_with_settings(
        scale, growth_tracker, found_inf, hysteresis_tracker, growth_factor, backoff_factor,
        growth_interval, hysteresis, consecutive_hysteresis, min_scale, max_scale, backend,
        params)
    return scale
