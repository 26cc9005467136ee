"""The optimizer's side of a fused step: whether its ``step`` takes torch's deprecated
``grad_scaler`` argument (:meth:`GradScaler.step` asks every fused step)."""

from __future__ import annotations

import inspect

import torch

from ._compile import never_traced

#: On the optimizer: (its step function, whether that takes ``grad_scaler``).
_STEP_SIGNATURE_ATTR = "_triton_scaler_step_takes_grad_scaler"


@never_traced  # inspect and the optimizer's __dict__: host work, never in a graph
def step_takes_grad_scaler(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step`` has a ``grad_scaler`` parameter (torch's deprecated fused
    contract). torch asks ``inspect.signature`` at every fused step; the answer is
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
