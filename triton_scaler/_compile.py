"""Whether ``torch.compile`` is tracing the code that runs now, and how code that must not be
traced runs eagerly from inside it.

The scaler's calls are written once and run both eagerly and traced. Only the seams ask
:func:`is_traced`: collecting the grads (:func:`triton_scaler._grads.collect_grads`),
dispatching device work (:mod:`triton_scaler._dispatch`), making the device state
(:meth:`triton_scaler._state.ScalerState._init_device_state`) and a watch's host records
(:mod:`triton_scaler.telemetry`: kept passes and row indices, which traced code makes
afresh). Host work that must not be traced (an optimizer's own step with attributes set on
it, a host read, bookkeeping of gradient buckets) runs in an :func:`eager_frame`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch

_Fn = TypeVar("_Fn", bound=Callable[..., Any])


def own_code(wrapper: Callable[..., Any], fn: Callable[..., Any]) -> Callable[..., Any]:
    """Give ``wrapper`` a code object of its own, named after ``fn``: dynamo keeps its compiled
    frames per code object, so one shared wrapper code would hold every decorated call's
    entries in one cache (recompiling as calls alternate, up to its size limit)."""
    code = wrapper.__code__
    names: dict[str, Any] = {"co_name": getattr(fn, "__name__", code.co_name)}
    if hasattr(code, "co_qualname"):  # Python 3.11+
        names["co_qualname"] = getattr(fn, "__qualname__", names["co_name"])
    wrapper.__code__ = code.replace(**names)
    return wrapper


#: Whether dynamo is tracing the caller (``torch.compile``): torch's own function, so that
#: asking costs no call into this module (in eager code ``is_dynamo_compiling`` returns False).
is_traced = torch.compiler.is_dynamo_compiling


def run_eagerly(fn: Callable[..., Any], *args: Any, recursive: bool = True, **kwargs: Any) -> Any:
    """Call ``fn`` eagerly from code that dynamo traces: a graph break. ``recursive=False``:
    only ``fn``'s own frame; dynamo still compiles the frames it calls (an optimizer's step,
    as it does when torch's scaler calls it)."""
    from torch._dynamo import disable

    return disable(fn, recursive=recursive)(*args, **kwargs)


def eager_frame(fn: _Fn) -> _Fn:
    """Run ``fn``'s own frame eagerly when traced code calls it (a graph break); the frames
    it calls are traced as usual (an optimizer's own step). In eager code a plain call."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if is_traced():
            return run_eagerly(fn, *args, recursive=False, **kwargs)
        return fn(*args, **kwargs)
    return cast(_Fn, own_code(wrapper, fn))


def never_traced(fn: _Fn) -> _Fn:
    """Run ``fn`` and everything it calls eagerly when traced code calls it, as dynamo does
    for ``torch.amp.GradScaler`` itself (it skips torch.amp): a graph break per call."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if is_traced():
            return run_eagerly(fn, *args, **kwargs)
        return fn(*args, **kwargs)
    return cast(_Fn, own_code(wrapper, fn))
