"""The device work as registered torch ops (namespace ``triton_scaler``), so that code compiled
by ``torch.compile`` traces the calls instead of breaking the graph around them.

Each op is a ``torch.library.custom_op`` with exact ``mutates_args`` and a fake implementation
(the ops return nothing; their outputs are their mutated arguments). Inductor treats them as
opaque: at run time each receives real tensors and runs the eager implementation, Triton
kernels or reference path, with its launch plans keyed by the grads' addresses as in eager
code. In eager code the public functions call the implementations directly (a registered op
costs host microseconds of dispatch per call), so eager speed is unchanged.

The ops, each the registered form of the function named:

* ``non_finite_check_and_unscale_(grads, found_inf, inv_scale, backend)``, mutating grads and
  found_inf: :func:`triton_scaler.ops.non_finite_check_and_unscale_`;
* ``non_finite_check_(grads, found_inf, inv_scale, backend)``, mutating found_inf:
  :func:`triton_scaler.ops.non_finite_check_`;
* ``update_scale_(scale, growth_tracker, found_inf, hysteresis_tracker, <settings>, backend,
  params)``, mutating the scale and the trackers: :func:`triton_scaler.ops.update_scale_`;
* ``scaler_update_(scale, growth_tracker, flags, hysteresis_tracker, skipped, skipped_count,
  params, <settings>, backend)``, mutating all but ``params``: the one launch of
  :meth:`triton_scaler.GradScaler.update`;
* ``before_backward_(token)``: the host-side note that :meth:`triton_scaler.GradScaler.scale`
  gives gradient buckets (a backward follows), run where the traced ``scale`` runs. It writes
  nothing; ``token`` (an empty tensor the scaler holds) is declared mutated so that the op is
  kept in the graph, in order.

Importing this module registers the ops (once per process; a second import finds them).
"""

from __future__ import annotations

import torch
from torch.library import custom_op

_NAMESPACE = "triton_scaler"


def _registered(name: str) -> bool:
    return hasattr(getattr(torch.ops, _NAMESPACE), name)


def _unscale_impl(grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor,
                  backend: str) -> None:
    from .ops import unscale_or_check

    unscale_or_check(grads, found_inf, inv_scale, backend, write=True)


def _check_impl(grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor,
                backend: str) -> None:
    from .ops import unscale_or_check

    unscale_or_check(grads, found_inf, inv_scale, backend, write=False)


def _update_scale_impl(scale: torch.Tensor, growth_tracker: torch.Tensor,
                       found_inf: torch.Tensor, hysteresis_tracker: torch.Tensor | None,
                       growth_factor: float, backoff_factor: float, growth_interval: int,
                       hysteresis: int, consecutive_hysteresis: bool, min_scale: float,
                       max_scale: float, backend: str, params: torch.Tensor | None) -> None:
    from .ops import update_with_policy_
    from .policy import cached_policy

    policy = cached_policy(growth_factor=growth_factor, backoff_factor=backoff_factor,
                           growth_interval=growth_interval, hysteresis=hysteresis,
                           consecutive_hysteresis=consecutive_hysteresis, min_scale=min_scale,
                           max_scale=max_scale)
    update_with_policy_(scale, growth_tracker, found_inf, policy,
                        hysteresis_tracker=hysteresis_tracker,
                        backend=backend,  # type: ignore[arg-type]  # checked there
                        params=params)


def _scaler_update_impl(scale: torch.Tensor, growth_tracker: torch.Tensor, flags: torch.Tensor,
                        hysteresis_tracker: torch.Tensor | None, skipped: torch.Tensor,
                        skipped_count: torch.Tensor, params: torch.Tensor,
                        growth_factor: float, backoff_factor: float, growth_interval: int,
                        hysteresis: int, consecutive_hysteresis: bool, min_scale: float,
                        max_scale: float, dynamic: bool, skip_on_overflow: bool,
                        backend: str) -> None:
    from .ops import bind_scaler_update
    from .policy import cached_policy

    policy = cached_policy(growth_factor=growth_factor, backoff_factor=backoff_factor,
                           growth_interval=growth_interval, hysteresis=hysteresis,
                           consecutive_hysteresis=consecutive_hysteresis, min_scale=min_scale,
                           max_scale=max_scale, dynamic=dynamic,
                           skip_on_overflow=skip_on_overflow)
    bind_scaler_update(scale, growth_tracker, flags, policy,
                       hysteresis_tracker=hysteresis_tracker, skipped=skipped.view(torch.uint8),
                       skipped_count=skipped_count, backend=backend, params=params)()


def _before_backward_impl(token: torch.Tensor) -> None:
    from ._bucket import before_backward

    before_backward()


def _nothing(*args, **kwargs) -> None:
    """The fake implementation of every op: each returns nothing and mutates its arguments
    in place, which keeps their shapes, dtypes and devices."""
    return None


def _define(name: str, mutates: tuple[str, ...], impl) -> None:
    if _registered(name):
        return
    op = custom_op(f"{_NAMESPACE}::{name}", mutates_args=mutates)(impl)
    op.register_fake(_nothing)


_define("non_finite_check_and_unscale_", ("grads", "found_inf"), _unscale_impl)
_define("non_finite_check_", ("found_inf",), _check_impl)
_define("update_scale_", ("scale", "growth_tracker", "hysteresis_tracker"), _update_scale_impl)
_define("scaler_update_", ("scale", "growth_tracker", "flags", "hysteresis_tracker", "skipped",
                           "skipped_count"), _scaler_update_impl)

_define("before_backward_", ("token",), _before_backward_impl)

#: ``torch.ops.triton_scaler``: the registered ops, e.g. ``ops_namespace.scaler_update_``.
ops_namespace = getattr(torch.ops, _NAMESPACE)
