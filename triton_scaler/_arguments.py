"""Argument checks of :class:`triton_scaler.GradScaler`."""

from __future__ import annotations

import math

from . import ops
from ._backend import check_backend


def check_scaler_arguments(init_scale, growth_factor, backoff_factor, growth_interval,
                           hysteresis, min_scale, max_scale, consecutive_hysteresis,
                           raise_at_min_scale, dynamic, skip_on_overflow, backend) -> None:
    """Raise for a bad GradScaler argument, naming it and its accepted values. torch's own
    checks (growth_factor <= 1, backoff_factor >= 1) keep torch's message and exception type
    (``ScalerArgumentError`` is both a ValueError and an AssertionError)."""
    check_backend(backend)
    if isinstance(growth_factor, (int, float)) and not isinstance(growth_factor, bool) \
            and growth_factor <= 1.0:
        raise ScalerArgumentError(f"The growth factor must be > 1.0. Got growth_factor={growth_factor!r}.")
    if isinstance(backoff_factor, (int, float)) and not isinstance(backoff_factor, bool) \
            and backoff_factor >= 1.0:
        raise ScalerArgumentError(f"The backoff factor must be < 1.0. Got backoff_factor={backoff_factor!r}.")
    ops.check_policy(growth_factor, backoff_factor, growth_interval, hysteresis, min_scale, max_scale)
    if isinstance(init_scale, bool) or not isinstance(init_scale, (int, float)) \
            or not 0.0 < init_scale < math.inf:
        raise ValueError(f"init_scale must be a finite number > 0; got {init_scale!r}")
    if not min_scale <= init_scale <= max_scale:
        raise ValueError(f"init_scale must lie in [min_scale, max_scale] = [{min_scale}, "
                         f"{max_scale}]; got {init_scale!r}")
    for name, value in (("consecutive_hysteresis", consecutive_hysteresis),
                        ("raise_at_min_scale", raise_at_min_scale), ("dynamic", dynamic),
                        ("skip_on_overflow", skip_on_overflow)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool; got {value!r}")


class ScalerArgumentError(ValueError, AssertionError):
    """A bad scaler argument. A ``ValueError``, and an ``AssertionError`` where torch's
    GradScaler raises one for the same value (growth_factor <= 1, backoff_factor >= 1)."""
