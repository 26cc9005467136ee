"""The device a launch goes to.

Triton launches on the *current* CUDA device and its current stream, not on the device of
the pointers it is given: grads on ``cuda:1`` while ``cuda:0`` is current would be read
through the wrong device's context. Every launch helper enters :func:`launch_device` of its
first tensor argument. The stream is then the current stream of the grads' device, the one
torch's own ops would use.
"""

from __future__ import annotations

import contextlib

import torch

_SAME_DEVICE = contextlib.nullcontext()


def launch_device(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """A context making ``t``'s CUDA device current for the launch: a no-op (no CUDA call)
    for CPU tensors (the interpreter) and when that device is already current."""
    if t.device.type != "cuda" or t.device.index == torch.cuda.current_device():
        return _SAME_DEVICE
    return torch.cuda.device(t.device)
