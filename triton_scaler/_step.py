"""The step decision of :class:`triton_scaler.GradScaler`: found_inf agreed over devices and
the process group, the plain route's one host read, and the fused-optimizer route."""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

import torch
from torch.amp.grad_scaler import OptState

from ._eager import eager_under_compile
from ._warn import warn_at_caller

if TYPE_CHECKING:  # a part of GradScaler beside the state it uses
    from ._state import ScalerStateMixin as _ScalerState
else:
    _ScalerState = object

#: On the optimizer: (its step function, whether that takes ``grad_scaler``).
_STEP_SIGNATURE_ATTR = "_triton_scaler_step_takes_grad_scaler"


def _step_takes_grad_scaler(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step`` has a ``grad_scaler`` parameter (torch's deprecated fused
    contract). torch asks ``inspect.signature`` at every fused step (~7 us); the answer is
    remembered on the optimizer for its current step function (a replaced ``step`` is asked
    again). Kept on the optimizer itself, not in a weak map, so that a ``step`` closure
    holding the optimizer cannot keep it alive."""
    step = optimizer.step
    func = getattr(step, "__func__", step)
    attrs = getattr(optimizer, "__dict__", None)  # None: an optimizer-like object with slots
    known = attrs.get(_STEP_SIGNATURE_ATTR) if attrs is not None else None
    if known is not None and known[0] is func:
        return known[1]
    takes = "grad_scaler" in inspect.signature(step).parameters
    if attrs is not None:
        attrs[_STEP_SIGNATURE_ATTR] = (func, takes)
    return takes


class StepMixin(_ScalerState):
    """``step``'s helpers: the scaler's state lives in :class:`ScalerStateMixin`."""

    def _agree_found_inf(self, state: dict[str, Any]):
        """0-d float32 found_inf on the scale's device, exactly 0.0 or 1.0: the max over
        devices, all-reduced (MAX) over ``process_group``. Cached in the optimizer state."""
        agreed = state.get("found_inf_agreed")
        if agreed is not None:
            return agreed
        device = self._scale.device
        values = list(state["found_inf_per_device"].values())
        if not values:
            raise AssertionError("No inf checks were recorded for this optimizer.")
        if len(values) > 1 or values[0].device != device:
            values = [t if t.device == device else t.to(device, non_blocking=True)
                      for t in values]
        # One device: the per-device flag itself (a MAX all-reduce in place leaves it 0 / 1).
        agreed = values[0] if len(values) == 1 else torch.stack(values).amax()
        if self._process_group is not None:
            import torch.distributed as dist

            dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self._process_group)
            state["found_inf_per_device"] = {agreed.device: agreed}
        state["found_inf_agreed"] = agreed
        return agreed

    def _note_written_padding(self, optimizer: torch.optim.Optimizer, groups: list) -> None:
        """Remember the gradient buckets an unscale wrote in this iteration. A bucket's
        alignment padding (zeros, in no grad) times an ``inv_scale`` that is not finite (a
        scale of 0, NaN, or 2**-128 and below, where its float32 reciprocal overflows) becomes
        NaN, and every later iteration would find it: ``update()`` zeroes the padding again
        (:meth:`_rezero_written_padding`), unless the plain route's host read saw no
        overflow (then ``inv_scale`` was finite and the padding is still zero: no launch)."""
        written = [(group.grads[0], group.padding) for group in groups
                   if group.padding is not None]
        if written:
            self._per_optimizer_states[id(optimizer)]["written_padding"] = written

    def _host_read_span(self, state: dict[str, Any],
                        agreed: torch.Tensor) -> tuple[torch.Tensor, int]:
        """A device tensor holding the scale at 0 and ``agreed`` at the returned index: a
        prefix of the [scale, flags...] buffer when ``agreed`` is one of its flags (no op),
        else a stack of the two."""
        index = self._buffer_index(state, agreed)
        if index and self._host_spans:  # none: the state was made in traced code
            return self._host_spans[index], index
        return torch.stack([self._scale.to(agreed.device), agreed]), 1

    @eager_under_compile  # as torch's (dynamo skips torch.amp)
    def _maybe_opt_step(self, optimizer: torch.optim.Optimizer, optimizer_state: dict[str, Any],
                        *args: Any, **kwargs: Any) -> float | None:
        if not self._policy.skip_on_overflow:
            return optimizer.step(*args, **kwargs)
        agreed = self._agree_found_inf(optimizer_state)
        span, index = self._host_read_span(optimizer_state, agreed)
        values = span.tolist()  # the one host sync of the plain route, as torch's item()
        if not values[index]:
            optimizer_state.pop("written_padding", None)  # no overflow: padding still zero
            return optimizer.step(*args, **kwargs)
        self._warn_if_underflowed(values[0])
        return None

    def _fused_step(self, optimizer, state, *args, **kwargs):
        if _step_takes_grad_scaler(optimizer):
            warn_at_caller(
                "GradScaler is going to stop passing itself as a keyword argument to the passed "
                "optimizer. In the near future GradScaler registers `grad_scale: Tensor` and "
                "`found_inf: Tensor` to the passed optimizer and let the optimizer use them "
                "directly.", FutureWarning)
            retval = optimizer.step(*args, **kwargs, grad_scaler=self)
            state["stage"] = OptState.STEPPED
            return retval
        if state["stage"] is OptState.READY:
            self._check_inf_per_device(optimizer)
        elif not state["found_inf_per_device"] and any(
                p.grad is not None for g in optimizer.param_groups for p in g["params"]):
            # unscale_() saw no grads, backward made some since: torch hands the optimizer
            # found_inf=0 (an int) and no grad_scale, and torch's fused optimizers fail
            # ("'int' object has no attribute 'device'"); the plain route's error instead
            raise AssertionError("No inf checks were recorded for this optimizer.")
        scale = self._get_scale_async()
        own = getattr(optimizer, "grad_scale", None)
        if state["stage"] is OptState.UNSCALED:
            optimizer.grad_scale = own
        else:  # the scale itself when the optimizer has none of its own (torch: scale * 1)
            optimizer.grad_scale = scale if own is None else scale * own
        if state["found_inf_per_device"] and self._policy.skip_on_overflow:
            optimizer.found_inf = self._agree_found_inf(state)
        else:  # no grads (torch hands the optimizer 0), or steps are never skipped
            optimizer.found_inf = torch.zeros((), dtype=torch.float32, device=self._scale.device)
        retval = optimizer.step(*args, **kwargs)
        state["stage"] = OptState.STEPPED
        del optimizer.grad_scale
        del optimizer.found_inf
        return retval
