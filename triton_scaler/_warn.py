"""Warnings that point at the user's line, whichever route through the scaler led to them."""

from __future__ import annotations

import os
import sys
import warnings
from types import FrameType

import torch


def warn_at_caller(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message, category)`` attributed to the first frame outside this package,
    torch's ``torch/amp`` (whose ``GradScaler.step`` calls back into ours) and ``torch/_dynamo``
    (which runs our methods eagerly inside code that ``torch.compile`` compiles): the user's
    ``scaler.step(opt)`` or ``scaler.unscale_(opt)`` line, however many of our frames (the
    eager-under-compile wrapper, the step routes, the bucket check) lie between. Host only."""
    torch_dir = os.path.dirname(torch.__file__)
    inside = (os.path.dirname(__file__) + os.sep, os.path.join(torch_dir, "amp", ""),
              os.path.join(torch_dir, "_dynamo", ""))
    frame: FrameType | None = sys._getframe(0)
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(inside):
        frame, level = frame.f_back, level + 1
    if frame is None:
        warnings.warn(message, category, stacklevel=level)
        return
    # explicit, not ``stacklevel``: under torch.compile the interpreter's own walk counts
    # dynamo's resume frames otherwise than f_back does
    warnings.warn_explicit(message, category, frame.f_code.co_filename, frame.f_lineno,
                           frame.f_globals.get("__name__", "<string>"),
                           frame.f_globals.setdefault("__warningregistry__", {}))
