""":class:`GradScaler`'s calls as code that ``torch.compile`` traces.

Dynamo skips ``torch.amp``, so torch's scaler always runs eagerly between graphs. Under
``torch.compile`` GradScaler's public calls run these functions instead, which use no method
of torch's class, no host read and no per-address state: the device work goes through the
registered ops (:mod:`._library`), the bookkeeping (which optimizer was unscaled, its
found_inf) is the same per-optimizer dict the eager methods keep, so traced and eager calls
mix within one iteration.

What runs eagerly instead (a graph break, or an error under ``fullgraph=True``): a scaler with
a ``process_group`` (:class:`ShardedGradScaler` always has one), ``raise_at_min_scale=True`` or
a subclass's own ``_unscale_grads_``;
grads that are tensor subclasses (DTensor) or sparse; ``clip_grad_norm_`` with
``error_if_nonfinite=True``, ``sharded=True`` or a ``norm_type`` other than 2 and inf.
:func:`step` traces the unscale / check and the found_inf agreement, then calls the optimizer
from an eager helper (a graph break; dynamo still compiles the optimizer's own step frame, as
under torch's scaler): a fused optimizer gets ``grad_scale`` / ``found_inf`` there and skips
on the device (no host read); any other optimizer is stepped unless the one flag read that
torch's scaler also makes finds an overflow.

With GradBuckets the grads are unscaled as the views they are (one op call per dtype); a
parameter in a bucket that received no gradient keeps its zero view as its grad (eager code
sets it to None, which needs the buckets' host-side records).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch
from torch.amp.grad_scaler import OptState

from . import reference
from ._eager import run_eagerly
from ._library import ops_namespace
from ._norms import reference_total_norm
from .policy import check_scale_value

if TYPE_CHECKING:
    from .grad_scaler import GradScaler

_Method = TypeVar("_Method", bound=Callable[..., Any])

_FIX = ("This may indicate your script did not use scaler.scale(loss or outputs) earlier in "
        "the iteration.")


def traceable(scaler: GradScaler) -> bool:
    """Whether ``scaler``'s calls can be traced (the module doc lists what cannot)."""
    return scaler._traceable and scaler._process_group is None and \
        not scaler._policy.raise_at_min_scale and not scaler._overrides_unscale_grads()


def _supported(name: str, scaler: GradScaler, args: tuple, kwargs: dict) -> bool:
    """Whether the call ``scaler.<name>(*args, **kwargs)`` can be traced (module doc)."""
    if not traceable(scaler):
        return False
    if name == "update":
        return True
    if name == "scale":  # tensors in (nested) lists / tuples; other iterables map lazily
        return _lists_of_tensors(args[0] if args else kwargs.get("outputs"))
    optimizer = args[0] if args else kwargs.get("optimizer")
    if not isinstance(optimizer, torch.optim.Optimizer) or not plain_grads(optimizer):
        return False
    if name == "clip_grad_norm_":
        norm_type = args[2] if len(args) > 2 else kwargs.get("norm_type", 2.0)
        if len(args) > 3 or kwargs.get("error_if_nonfinite") or kwargs.get("sharded"):
            return False
        return type(norm_type) in (int, float) and norm_type in (2.0, math.inf)
    return True


def _lists_of_tensors(outputs: Any) -> bool:
    if isinstance(outputs, torch.Tensor):
        return True
    if not isinstance(outputs, (list, tuple)):
        return False
    for item in outputs:  # a loop: older dynamo versions cannot inline all(...) here
        if not _lists_of_tensors(item):
            return False
    return True


def traced_under_compile(traced: Callable[..., Any]) -> Callable[[_Method], _Method]:
    """Decorate a GradScaler method: in code that dynamo traces, call ``traced`` (this
    module's form of the method) where the call can be traced, else the method eagerly (a
    graph break); in eager code the method itself, at the cost of one plain function call
    (``is_dynamo_compiling`` is ``return False`` outside dynamo)."""

    def decorate(method: _Method) -> _Method:
        name = method.__name__

        @functools.wraps(method)
        def wrapper(self, *args, **kwargs):
            if torch.compiler.is_dynamo_compiling():
                if _supported(name, self, args, kwargs):
                    return traced(self, *args, **kwargs)
                return run_eagerly(method, self, *args, **kwargs)
            return method(self, *args, **kwargs)
        return cast(_Method, wrapper)
    return decorate


def lazy_init(scaler: GradScaler, device: torch.device) -> None:
    """torch's ``_lazy_init_scale_growth_tracker`` and the scaler's own device state, as
    traceable tensor creation (the eager method calls torch's)."""
    if scaler._growth_tracker is not None:
        raise AssertionError("_growth_tracker initialized before _scale")
    scaler._scale = torch.full((), scaler._init_scale, dtype=torch.float32, device=device)
    scaler._growth_tracker = torch.full((), scaler._init_growth_tracker, dtype=torch.int32,
                                        device=device)
    params = torch.tensor(scaler._policy.kernel_values(), dtype=torch.float64, device=device)
    scaler._init_device_state(device, params, buffered=False)


def check_state(scaler: GradScaler, funcname: str) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's ``_check_scale_growth_tracker``: the scale and growth tracker, or its error."""
    if scaler._scale is None:
        raise AssertionError(f"Attempted {funcname} but _scale is None.  " + _FIX)
    if scaler._growth_tracker is None:
        raise AssertionError(f"Attempted {funcname} but _growth_tracker is None.  " + _FIX)
    return scaler._scale, scaler._growth_tracker


def scale(scaler: GradScaler, outputs: Any) -> Any:
    """``outputs`` times the scale, as torch's ``scale``: a tensor, or nested lists / tuples of
    tensors (anything else runs the eager method, which checks it)."""
    if not scaler._enabled:
        return outputs
    ops_namespace.before_backward_(scaler._backward_token)  # as the eager method: buckets
    return _scaled(scaler, outputs)


def _scaled(scaler: GradScaler, outputs: Any) -> Any:
    if isinstance(outputs, torch.Tensor):
        if scaler._scale is None:
            lazy_init(scaler, outputs.device)
        return outputs * scaler._scale.to(device=outputs.device, non_blocking=True)
    return type(outputs)(_scaled(scaler, value) for value in outputs)  # lists / tuples


def _grads_by_device(optimizer: torch.optim.Optimizer, allow_fp16: bool
                     ) -> dict[torch.device, dict[torch.dtype, list[torch.Tensor]]]:
    """The optimizer's grads by device and dtype, in the parameters' order (torch's grouping)."""
    grouped: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            grad = param.grad
            if grad is None:
                continue
            if not allow_fp16 and grad.dtype == torch.float16:
                raise ValueError("Attempting to unscale FP16 gradients.")
            grouped.setdefault(grad.device, {}).setdefault(grad.dtype, []).append(grad)
    return grouped


def plain_grads(optimizer: torch.optim.Optimizer) -> bool:
    """Whether every grad of ``optimizer`` is a dense, plain tensor (what the traced calls
    take; a DTensor's or a sparse grad runs the eager method)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            grad = p.grad
            if grad is not None and (type(grad) is not torch.Tensor or grad.is_sparse):
                return False
    return True


def _check_grads(scaler: GradScaler, optimizer: torch.optim.Optimizer, found_inf: torch.Tensor,
                 write: bool) -> dict[torch.device, torch.Tensor]:
    """Unscale (``write``) or only check the optimizer's grads, one registered op per
    (device, dtype); returns found_inf per device, as the eager ``_unscale_or_check``."""
    assert scaler._scale is not None
    per_device: dict[torch.device, torch.Tensor] = {}
    inv_scale = reference.inv_scale_of(scaler._scale)
    op = ops_namespace.non_finite_check_and_unscale_ if write else ops_namespace.non_finite_check_
    with torch.no_grad():
        by_device = _grads_by_device(optimizer, scaler._unscales_fp16 or not write)
        for device, by_dtype in by_device.items():
            found = found_inf if device == found_inf.device else \
                torch.zeros((), dtype=torch.float32, device=device)
            inv = inv_scale.to(device)
            for grads in by_dtype.values():
                op(grads, found, inv, scaler._backend)
            per_device[device] = found
    return per_device


def unscale_(scaler: GradScaler, optimizer: torch.optim.Optimizer) -> None:
    """:meth:`GradScaler.unscale_`, traced."""
    if not scaler._enabled:
        return
    state = scaler._ready_to_unscale(optimizer, "unscale_")
    per_device = _check_grads(scaler, optimizer, scaler._found_inf_flag(state), write=True)
    state["found_inf_per_device"] = per_device
    state["stage"] = OptState.UNSCALED
    if per_device:
        scaler._agree_found_inf(state)


def clip_grad_norm_(scaler: GradScaler, optimizer: torch.optim.Optimizer, max_norm: float,
                    norm_type: float = 2.0, error_if_nonfinite: bool = False, *,
                    sharded: bool | None = None) -> torch.Tensor:
    """:meth:`GradScaler.clip_grad_norm_` (2 or inf norm, grads whole on this rank), traced:
    the unscale op, torch's norm arithmetic (as the eager reference backend), the clip."""
    from ._clip import check_clip_arguments

    max_norm, norm_type = check_clip_arguments(max_norm, norm_type)
    grads = [p.grad for group in optimizer.param_groups for p in group["params"]
             if p.grad is not None]
    if scaler._enabled:
        unscale_(scaler, optimizer)
        device = scaler._scale.device
    else:
        device = grads[0].device if grads else torch.device("cpu")
    with torch.no_grad():
        total = reference_total_norm([(g, None) for g in grads], norm_type, None, device)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for grad in grads:
            by_device.setdefault(grad.device, []).append(grad)
        for dev, same in by_device.items():
            torch._foreach_mul_(same, coef.to(dev))
    return total.float()


def check_inf_per_device(scaler: GradScaler, optimizer: torch.optim.Optimizer
                         ) -> dict[torch.device, torch.Tensor]:
    """:meth:`GradScaler._check_inf_per_device`, traced: the read-only check."""
    check_state(scaler, "_check_inf_per_device")
    state = scaler._per_optimizer_states[id(optimizer)]
    state["found_inf_per_device"] = _check_grads(scaler, optimizer,
                                                 scaler._found_inf_flag(state), write=False)
    state.pop("found_inf_agreed", None)
    return state["found_inf_per_device"]


def _fused_optimizer_step(optimizer: torch.optim.Optimizer, grad_scale: torch.Tensor | None,
                          found_inf: torch.Tensor, args: tuple, kwargs: dict) -> Any:
    """A fused optimizer's step with the scaler's tensors, run eagerly: attributes set on the
    optimizer inside traced code would not reach a step that dynamo does not trace."""
    optimizer.grad_scale = grad_scale  # type: ignore[attr-defined]
    optimizer.found_inf = found_inf  # type: ignore[attr-defined]
    try:
        return optimizer.step(*args, **kwargs)
    finally:
        del optimizer.grad_scale  # type: ignore[attr-defined]
        del optimizer.found_inf  # type: ignore[attr-defined]


def _plain_optimizer_step(scaler: GradScaler, optimizer: torch.optim.Optimizer,
                          found_inf: torch.Tensor, args: tuple, kwargs: dict) -> Any:
    """The plain route's one host read (as torch's scaler), then the step unless an overflow
    was found, run eagerly."""
    assert scaler._scale is not None
    scale_value, found = torch.stack([scaler._scale.to(found_inf.device), found_inf]).tolist()
    if found:
        scaler._warn_if_underflowed(scale_value)
        return None
    return optimizer.step(*args, **kwargs)


def step(scaler: GradScaler, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any
         ) -> Any:
    """:meth:`GradScaler.step`, traced up to the optimizer's own step (module doc)."""
    if not scaler._enabled:
        return optimizer.step(*args, **kwargs)
    if "closure" in kwargs:
        raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
    check_state(scaler, "step")
    state = scaler._per_optimizer_states[id(optimizer)]
    if state["stage"] is OptState.STEPPED:
        raise RuntimeError("step() has already been called since the last update().")
    if getattr(optimizer, "_step_supports_amp_scaling", False):
        if state["stage"] is OptState.READY:
            check_inf_per_device(scaler, optimizer)
        grad_scale = None if state["stage"] is OptState.UNSCALED else scaler._scale
        if state["found_inf_per_device"] and scaler._policy.skip_on_overflow:
            found = scaler._agree_found_inf(state)
        else:
            found = torch.zeros((), dtype=torch.float32, device=scaler._scale.device)
        retval = run_eagerly(_fused_optimizer_step, optimizer, grad_scale, found, args, kwargs,
                             recursive=False)
    else:
        if state["stage"] is OptState.READY:
            unscale_(scaler, optimizer)
        if len(state["found_inf_per_device"]) == 0:
            raise AssertionError("No inf checks were recorded for this optimizer.")
        if scaler._policy.skip_on_overflow:
            retval = run_eagerly(_plain_optimizer_step, scaler, optimizer,
                                 scaler._agree_found_inf(state), args, kwargs, recursive=False)
        else:
            retval = optimizer.step(*args, **kwargs)
    state["stage"] = OptState.STEPPED
    return retval


def update(scaler: GradScaler, new_scale: float | torch.Tensor | None = None) -> None:
    """:meth:`GradScaler.update`, traced: one registered op for the whole update."""
    if not scaler._enabled:
        return
    scale_t, growth_tracker = check_state(scaler, "update")
    flags = scaler._flags
    assert flags is not None and scaler._last_step_skipped is not None
    assert scaler._skipped_steps_t is not None and scaler._params_t is not None
    scaler._rezero_written_padding()
    if new_scale is not None:
        if isinstance(new_scale, torch.Tensor):
            scale_t.copy_(new_scale)
        else:
            scale_t.fill_(check_scale_value("new_scale", new_scale, scaler._policy))
        flags.zero_()
        scaler._reset_iteration()
        return
    states = [s for s in scaler._per_optimizer_states.values() if s["found_inf_per_device"]]
    if not states:
        raise AssertionError("No inf checks were recorded prior to update.")
    # the op gets this iteration's overflow as a flag of its own, and the flags are zeroed
    # here: the flags are a view of the scale's buffer (state made in eager code), and inductor
    # in older torch mistranslated a copy of them (a garbage flag: an overflow every step)
    found = (flags != 0).any()
    for state in states:
        agreed = scaler._agree_found_inf(state)
        if not scaler._buffer_index(state, agreed):  # a flag outside the buffer
            found = found | (agreed != 0).to(found.device)
    policy = scaler._policy
    ops_namespace.scaler_update_(
        scale_t, growth_tracker, found.float().reshape(1), scaler._hysteresis_tracker_t,
        scaler._last_step_skipped,
        scaler._skipped_steps_t, scaler._params_t, policy.growth_factor, policy.backoff_factor,
        policy.growth_interval, policy.hysteresis, policy.consecutive_hysteresis,
        policy.min_scale, policy.max_scale, policy.dynamic, policy.skip_on_overflow,
        scaler._backend)
    flags.zero_()
    scaler._reset_iteration()
