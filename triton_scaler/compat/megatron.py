"""Megatron-core's grad scalers (``megatron.core.optimizer.grad_scaler``) on triton_scaler's ops.

Megatron's mixed-precision optimizers use four things of their ``grad_scaler``: ``scale`` (the
loss scale, a one-element fp32 tensor), ``inv_scale`` (for the unscale op), ``update(found_inf)``
and ``state_dict()`` / ``load_state_dict()``. These classes keep that interface, so one can be
passed where Megatron builds its own (``get_megatron_optimizer``'s ``grad_scaler``):

* ``update`` runs on the device, one :func:`triton_scaler.ops.update_scale_` launch. It
  takes Megatron's host ``bool`` or the one-element ``found_inf`` tensor itself (then without
  the host read Megatron makes to form the bool).
* The factors and ``min_scale`` are rounded to float32 first, as Megatron holds them, so the
  update's float64 product rounded once to float32 is Megatron's float32 product, bit for bit,
  for any factor (not only powers of two).
* Difference: growth stops at the last finite scale. Megatron's has no finiteness check and
  grows to ``inf``; from then on every step overflows and the scale stays ``inf``.
* ``state_dict()`` has Megatron's keys and types (``scale`` a copy of the one-element tensor,
  the trackers Python ints: one host read), so checkpoints load in both directions.
"""

from __future__ import annotations

import abc
import contextlib
import math
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from .. import reference
from .._backend import Backend, check_backend
from ..policy import (
    INT32_MAX,
    INT32_MIN,
    ScalePolicy,
    ScalerArgumentError,
    as_int,
    as_real,
    check_scale_value,
)
from ._common import bool_flags, default_device, fp32_value, overflow_flag, update_scale

FoundInf = bool | torch.Tensor


@contextlib.contextmanager
def _asserted() -> Iterator[None]:
    """Megatron asserts its arguments: a ``ValueError`` raised inside becomes a
    :class:`ScalerArgumentError` (also an ``AssertionError``), same message."""
    try:
        yield
    except ScalerArgumentError:
        raise
    except ValueError as error:
        raise ScalerArgumentError(str(error)) from None


def _float32_factor(name: str, value: object) -> float:
    """A factor as Megatron holds it, in a float32 tensor; one past float32's range (which
    that tensor would hold as inf) raises, naming the value given."""
    given = as_real(name, value)
    rounded = fp32_value(given)
    if math.isinf(rounded) and math.isfinite(given):
        raise ValueError(f"{name} must be finite in float32 (Megatron holds it in a float32 "
                         f"tensor); got {value!r}")
    return rounded


def _checked_found_inf(found_inf: object) -> FoundInf:
    """Megatron's flag (a bool) or its ``found_inf`` tensor (one element, float or bool);
    ``TypeError`` for anything else."""
    if isinstance(found_inf, bool) or isinstance(found_inf, torch.Tensor) and (
            found_inf.numel() == 1
            and (found_inf.is_floating_point() or found_inf.dtype == torch.bool)):
        return found_inf
    raise TypeError("found_inf must be a bool or a one-element float or bool tensor (e.g. "
                    f"the optimizer's found_inf); got {type(found_inf).__name__} {found_inf!r}")


class MegatronGradScaler(abc.ABC):
    """Megatron's abstract base: a loss scale held as a one-element float32 tensor on
    ``device`` (default: CUDA when available, else CPU). ``backend`` as in
    :mod:`triton_scaler.ops`."""

    def __init__(self, initial_scale: float, *, device: str | torch.device | None = None,
                 backend: Backend = "auto") -> None:
        with _asserted():
            scale = check_scale_value("initial_scale", initial_scale)
        self._init_scale(scale, device, backend)

    def _init_scale(self, initial_scale: float, device, backend: Backend) -> None:
        check_backend(backend)
        self._backend = backend
        self._device = default_device(device)
        self._scale = torch.full((1,), initial_scale, dtype=torch.float32, device=self._device)

    @property
    def scale(self) -> torch.Tensor:
        """The loss scale: this scaler's one-element float32 tensor (updated in place)."""
        return self._scale

    @property
    def inv_scale(self) -> torch.Tensor:
        """``fp32(1 / fp64(scale))``, a new one-element tensor on the device (no sync)."""
        return reference.inv_scale_of(self._scale)

    @abc.abstractmethod
    def update(self, found_inf: FoundInf) -> None: ...

    @abc.abstractmethod
    def state_dict(self) -> dict[str, Any]: ...

    @abc.abstractmethod
    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None: ...


class ConstantGradScaler(MegatronGradScaler):
    """Megatron ``ConstantGradScaler``: the scale never changes; its state is empty and
    ``load_state_dict`` ignores what it is given, as Megatron's (a run resumed with a constant
    scale from a dynamic scaler's checkpoint keeps the constant)."""

    def update(self, found_inf: FoundInf) -> None:
        """Nothing to update (the flag's type is still checked)."""
        _checked_found_inf(found_inf)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict must be a dict; got {type(state_dict).__name__}")


class DynamicGradScaler(MegatronGradScaler):
    """Megatron ``DynamicGradScaler``: back off by ``backoff_factor`` (never below
    ``min_scale``) once ``hysteresis`` overflows have come since the last growth; grow by
    ``growth_factor`` after ``growth_interval`` clean steps in a row, refilling the hysteresis.

    The scale and both trackers live on the device; :meth:`update` is one launch, without a
    host sync. Bad arguments raise :class:`~triton_scaler.policy.ScalerArgumentError` (a
    ``ValueError`` and, where Megatron asserts, an ``AssertionError``) or ``TypeError``,
    naming the argument.
    """

    def __init__(self, initial_scale: float, min_scale: float, growth_factor: float,
                 backoff_factor: float, growth_interval: int, hysteresis: int, *,
                 device: str | torch.device | None = None, backend: Backend = "auto") -> None:
        with _asserted():
            if not as_real("min_scale", min_scale) > 0.0:
                raise ValueError(f"min_scale must be > 0; got {min_scale!r}")
            scale = check_scale_value("initial_scale", initial_scale)
            if float(min_scale) > scale:  # compared as given, as Megatron's assert
                raise ValueError(f"min_scale must be <= initial_scale; got min_scale="
                                 f"{min_scale!r} > initial_scale={initial_scale!r}")
            self._policy = ScalePolicy.create(dict(
                growth_factor=_float32_factor("growth_factor", growth_factor),
                backoff_factor=_float32_factor("backoff_factor", backoff_factor),
                growth_interval=growth_interval, hysteresis=hysteresis,
                min_scale=fp32_value(min_scale)))
        self._init_scale(scale, device, backend)
        self._growth_tracker = torch.zeros((1,), dtype=torch.int32, device=self._device)
        self._hysteresis_tracker = torch.full((1,), self._policy.hysteresis, dtype=torch.int32,
                                              device=self._device)
        self._bool_flags = bool_flags(self._device)

    def _fp32_tensor(self, value: float) -> torch.Tensor:
        return torch.tensor([value], dtype=torch.float32, device=self._device)

    @property
    def min_scale(self) -> torch.Tensor:
        """A one-element float32 tensor, as Megatron's (read-only)."""
        return self._fp32_tensor(self._policy.min_scale)

    @property
    def growth_factor(self) -> torch.Tensor:
        return self._fp32_tensor(self._policy.growth_factor)

    @property
    def backoff_factor(self) -> torch.Tensor:
        return self._fp32_tensor(self._policy.backoff_factor)

    @property
    def growth_interval(self) -> int:
        return self._policy.growth_interval

    @property
    def hysteresis(self) -> int:
        return self._policy.hysteresis

    def update(self, found_inf: FoundInf) -> None:
        """Megatron's update from ``found_inf`` (a bool, or a one-element tensor of which any
        non-zero value is an overflow), on the device. No host read for a tensor flag."""
        found = overflow_flag(_checked_found_inf(found_inf), self._bool_flags)
        update_scale(self._scale, self._growth_tracker, found, self._policy, self._backend,
                     self._hysteresis_tracker)

    def state_dict(self) -> dict[str, Any]:
        """Megatron's state: ``scale`` (a one-element float32 tensor, a copy),
        ``growth_tracker`` and ``hysteresis_tracker`` (ints). One host read."""
        trackers = torch.cat([self._growth_tracker, self._hysteresis_tracker]).tolist()
        return {"scale": self._scale.clone(), "growth_tracker": trackers[0],
                "hysteresis_tracker": trackers[1]}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a state_dict of this class or of Megatron's ``DynamicGradScaler`` (unknown
        keys ignored, as Megatron). Every value is checked before anything changes; an error
        names the key. One host read (the scale's value)."""
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict must be a dict; got {type(state_dict).__name__}")
        missing = [k for k in ("scale", "growth_tracker", "hysteresis_tracker")
                   if k not in state_dict]
        if missing:
            raise KeyError(f"state_dict lacks {missing}; a Megatron DynamicGradScaler "
                           "state_dict has 'scale', 'growth_tracker' and 'hysteresis_tracker'")
        scale = state_dict["scale"]
        if not isinstance(scale, torch.Tensor) or scale.numel() != 1 \
                or not scale.is_floating_point():
            raise TypeError("state_dict['scale'] must be a one-element float tensor; got "
                            f"{type(scale).__name__} {scale!r}")
        value = check_scale_value("state_dict['scale']", float(scale.float().item()))
        growth = as_int("state_dict['growth_tracker']", _plain_int(state_dict["growth_tracker"]),
                        0, INT32_MAX)
        hysteresis = as_int("state_dict['hysteresis_tracker']",
                            _plain_int(state_dict["hysteresis_tracker"]), INT32_MIN,
                            self._policy.hysteresis,
                            f"an int <= hysteresis ({self._policy.hysteresis})")
        self._scale.fill_(value)
        self._growth_tracker.fill_(growth)
        self._hysteresis_tracker.fill_(hysteresis)


def _plain_int(value: object) -> object:
    """A one-element integer tensor as its int (a checkpoint may hold either); else as is."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point() \
            and value.dtype != torch.bool:
        return int(value.item())
    return value
