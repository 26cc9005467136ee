"""Scaler methods run eagerly when code compiled by ``torch.compile`` calls them."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch

_Method = TypeVar("_Method", bound=Callable[..., Any])


def eager_under_compile(method: _Method) -> _Method:
    """Run ``method`` eagerly when code compiled by ``torch.compile`` calls it, as dynamo does
    for ``torch.amp.GradScaler`` itself (it skips torch.amp): a graph break per call, and the
    scaler's host-side bookkeeping never traced. No cost (and no dynamo import) in eager:
    ``is_dynamo_compiling`` is a plain ``return False`` that dynamo replaces with True when
    it traces (``is_compiling`` also asks ``torch.jit.is_scripting``: one more call)."""

    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        if torch.compiler.is_dynamo_compiling():
            from torch._dynamo import disable

            return disable(method, recursive=True)(*args, **kwargs)
        return method(*args, **kwargs)
    return cast(_Method, wrapper)  # the method's own signature, for type checkers


def run_eagerly(fn: Callable[..., Any], *args: Any, recursive: bool = True, **kwargs: Any) -> Any:
    """Call ``fn`` eagerly from code that dynamo traces: a graph break. ``recursive=False``:
    only ``fn``'s own frame; dynamo still compiles the frames it calls (an optimizer's step,
    as it does when torch's scaler calls it)."""
    from torch._dynamo import disable

    return disable(fn, recursive=recursive)(*args, **kwargs)
