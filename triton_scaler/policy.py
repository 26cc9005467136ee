"""One home for the scale settings: :class:`ScalePolicy`.

A frozen, validated value used by :class:`triton_scaler.GradScaler` (constructor, setters,
``load_state_dict``), by :func:`triton_scaler.ops.update_scale_` and by the peer adapters. It
knows its accepted values (one set of rules, one set of messages), the update kernel's float64
parameter layout and the state_dict keys. A change of settings builds and validates a new policy,
then swaps it in: a bad value never leaves a half-changed scaler.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable, Mapping
from typing import Any

import torch

FP32_MAX = float(torch.finfo(torch.float32).max)
FP32_TINY = float(torch.finfo(torch.float32).tiny)  # smallest normal float32, 2**-126
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1

#: The update kernel's float64 parameter buffer (:meth:`ScalePolicy.kernel_params`), in the
#: order its ``params_ptr`` reads (``triton_scaler.kernels.update.PARAMS_LAYOUT``).
PARAMS_LAYOUT = ("growth_factor", "backoff_factor", "growth_interval", "min_scale", "max_scale",
                 "hysteresis")

Namer = Callable[[str], str]


def _field_name(field: str) -> str:
    return field


class ScalerArgumentError(ValueError, AssertionError):
    """A bad scaler argument. A ``ValueError``, and an ``AssertionError`` where torch's
    GradScaler raises one for the same value (growth_factor <= 1, backoff_factor >= 1)."""


def as_real(name: str, value: object) -> float:
    """``value`` as a Python float (ints, floats, numpy scalars); ``TypeError`` naming ``name``
    for anything else, bools and strings included. Range checks are the caller's."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number (int or float); got "
                        f"{type(value).__name__} {value!r}")
    return float(value)


def as_int(name: str, value: object, lo: int, hi: int, accepted: str | None = None) -> int:
    """``value`` as a Python int in ``[lo, hi]`` (ints and numpy integers, not bools)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int; got {type(value).__name__} {value!r}")
    if int(value) > hi and accepted is not None:
        raise ValueError(f"{name} must be {accepted} and at most {hi} (it is stored as int32); "
                         f"got {value!r}")
    if not lo <= int(value) <= hi:
        raise ValueError(f"{name} must be {accepted or f'an int in [{lo}, {hi}]'}; got {value!r}")
    return int(value)


def as_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool (True or False); got {type(value).__name__} "
                        f"{value!r}")
    return value


def check_scale_value(name: str, value: object, policy: ScalePolicy | None = None,
                      bounds: Namer = _field_name) -> float:
    """A loss scale as a Python float: finite, a normal float32 (so its reciprocal, the
    ``inv_scale`` of the unscale op, is finite) and within the policy's
    ``[min_scale, max_scale]``. ``ValueError`` / ``TypeError`` naming ``name`` otherwise (and
    the bounds as ``bounds(field)``: an adapter's own argument names)."""
    scale = as_real(name, value)
    if not FP32_TINY <= scale <= FP32_MAX:
        raise ValueError(f"{name} must be a finite number > 0 that float32 holds with a finite "
                         f"reciprocal: in float32's normal range (about 1.2e-38 to 3.4e38, "
                         f"i.e. [{FP32_TINY!r}, {FP32_MAX!r}]); got {value!r}")
    if policy is not None and not policy.min_scale <= scale <= policy.max_scale:
        raise ValueError(f"{name} must lie in [{bounds('min_scale')}, {bounds('max_scale')}] = "
                         f"[{policy.min_scale!r}, {policy.max_scale!r}]; got {value!r}")
    return scale


@dataclasses.dataclass(frozen=True)
class ScalePolicy:
    """The settings of a dynamic (or static) loss scale; validated when built.

    Attributes:
        growth_factor: finite float > 1. backoff_factor: float in ``[2**-126, 1)``.
        growth_interval: clean steps before growth, int in ``[1, 2**31 - 1]``.
        hysteresis: overflows tolerated before backing off, int in ``[1, 2**31 - 1]``.
        consecutive_hysteresis: refill the hysteresis tracker on every clean step.
        min_scale: floor of the backoff, finite float >= 0 (``0``: none). max_scale: cap of
            the growth, float >= min_scale (``inf``: none).
        raise_at_min_scale: raise when an overflow arrives with the scale at ``min_scale``.
        dynamic: ``False`` keeps the scale fixed. skip_on_overflow: ``False`` steps anyway.
    """

    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    hysteresis: int = 1
    consecutive_hysteresis: bool = False
    min_scale: float = 0.0
    max_scale: float = math.inf
    raise_at_min_scale: bool = False
    dynamic: bool = True
    skip_on_overflow: bool = True

    def __post_init__(self) -> None:
        for field, value in _normalized(self, _field_name).items():
            object.__setattr__(self, field, value)

    @classmethod
    def create(cls, values: Mapping[str, Any], name: Namer = _field_name,
               base: ScalePolicy | None = None) -> ScalePolicy:
        """A policy from ``base`` (default settings when None) with ``values`` replaced.
        Unknown fields raise ``TypeError``; errors name each field as ``name(field)``, e.g.
        ``state_dict['growth_factor']`` or an adapter's own argument name."""
        unknown = set(values) - set(FIELDS)
        if unknown:
            raise TypeError(f"unknown scale settings {sorted(unknown)}; accepted: {FIELDS}")
        current = dataclasses.asdict(base) if base is not None else dict(_DEFAULT_VALUES)
        current.update(values)
        return cls(**_normalized(_Raw(current), name))

    def replace(self, **values: Any) -> ScalePolicy:
        """A validated copy with ``values`` changed (this policy is unchanged on error)."""
        return ScalePolicy.create(values, base=self)

    def kernel_params(self, device: torch.device | str) -> torch.Tensor:
        """The update kernel's float64 buffer (:data:`PARAMS_LAYOUT`) on ``device``; cached per
        device and values, so repeated calls make no host-to-device copy. Treat as read-only."""
        key = (torch.device(device), self.kernel_values())
        params = _params_cache.get(key)
        if params is None:
            if len(_params_cache) > 64:
                _params_cache.clear()
            params = _params_cache[key] = torch.tensor(key[1], dtype=torch.float64,
                                                       device=key[0])
        return params

    def kernel_values(self) -> tuple[float, ...]:
        return tuple(float(getattr(self, field)) for field in PARAMS_LAYOUT)

    def state_items(self) -> dict[str, Any]:
        """The settings as state_dict entries (each key is the field name)."""
        return dataclasses.asdict(self)


FIELDS = tuple(f.name for f in dataclasses.fields(ScalePolicy))
_DEFAULT_VALUES = {f.name: f.default for f in dataclasses.fields(ScalePolicy)}
_params_cache: dict[tuple, torch.Tensor] = {}


class _Raw:
    """Attribute access to a dict of unvalidated settings, for :func:`_normalized`."""

    def __init__(self, values: Mapping[str, Any]) -> None:
        self.__dict__.update(values)


def _normalized(raw: Any, name: Namer) -> dict[str, Any]:
    """Validated, normalised (Python float / int / bool) settings of ``raw``."""
    growth = as_real(name("growth_factor"), raw.growth_factor)
    if growth <= 1.0:
        raise ScalerArgumentError(f"The growth factor must be > 1.0. Got "
                                  f"{name('growth_factor')}={raw.growth_factor!r}; "
                                  f"{name('growth_factor')} must be finite and > 1.")
    if not growth < math.inf:
        raise ValueError(f"{name('growth_factor')} must be finite and > 1; got "
                         f"{raw.growth_factor!r}")
    backoff = as_real(name("backoff_factor"), raw.backoff_factor)
    if backoff >= 1.0:
        raise ScalerArgumentError(f"The backoff factor must be < 1.0. Got "
                                  f"{name('backoff_factor')}={raw.backoff_factor!r}; "
                                  f"{name('backoff_factor')} must be in (0, 1).")
    if not backoff >= FP32_TINY:
        raise ValueError(f"{name('backoff_factor')} must be in (0, 1) and at least {FP32_TINY!r} "
                         f"(the smallest normal float32); got {raw.backoff_factor!r}")
    min_scale = as_real(name("min_scale"), raw.min_scale)
    if not 0.0 <= min_scale <= FP32_MAX:
        raise ValueError(f"{name('min_scale')} must be finite and >= 0 (at most float32's max "
                         f"{FP32_MAX!r}); got {raw.min_scale!r}")
    max_scale = as_real(name("max_scale"), raw.max_scale)
    if not max_scale > 0.0:
        raise ValueError(f"{name('max_scale')} must be > 0 (inf for no cap); got "
                         f"{raw.max_scale!r}")
    if min_scale > max_scale:
        raise ValueError(f"{name('min_scale')} must be <= {name('max_scale')}; got "
                         f"{raw.min_scale!r} > {raw.max_scale!r}")
    return {
        "growth_factor": growth,
        "backoff_factor": backoff,
        "growth_interval": as_int(name("growth_interval"), raw.growth_interval, 1, INT32_MAX,
                                  "an int >= 1"),
        "hysteresis": as_int(name("hysteresis"), raw.hysteresis, 1, INT32_MAX,
                             "an int >= 1"),
        "consecutive_hysteresis": as_bool(name("consecutive_hysteresis"),
                                          raw.consecutive_hysteresis),
        "min_scale": min_scale,
        "max_scale": max_scale,
        "raise_at_min_scale": as_bool(name("raise_at_min_scale"), raw.raise_at_min_scale),
        "dynamic": as_bool(name("dynamic"), raw.dynamic),
        "skip_on_overflow": as_bool(name("skip_on_overflow"), raw.skip_on_overflow),
    }


_policy_cache: dict[tuple, ScalePolicy] = {}


def cached_policy(**values: Any) -> ScalePolicy:
    """:meth:`ScalePolicy.create` for per-step callers (``ops.update_scale_``): settings seen
    before are not validated again."""
    key = tuple((k, type(v), v) for k, v in sorted(values.items()))
    try:
        policy = _policy_cache.get(key)
    except TypeError:  # an unhashable setting (a list, a dict): validation names it
        return ScalePolicy.create(values)
    if policy is None:
        policy = ScalePolicy.create(values)
        if len(_policy_cache) > 256:
            _policy_cache.clear()
        _policy_cache[key] = policy
    return policy
