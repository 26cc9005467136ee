"""Checks of :class:`triton_scaler.GradScaler`'s arguments that are not scale settings (those
live in :mod:`triton_scaler.policy`): device, process group, ``scale()`` outputs."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from .policy import ScalerArgumentError

__all__ = ["ScalerArgumentError", "ScaleOutputsError", "check_device", "check_process_group",
           "check_outputs", "refuse_non_optimizer"]


def check_device(device: object) -> None:
    """``device`` must name a torch device type, e.g. ``"cuda"``, ``"cpu"``, ``"xpu"``."""
    if isinstance(device, torch.device):
        return
    if not isinstance(device, str):
        raise TypeError(f"device must be a device string such as 'cuda' or 'cpu'; got "
                        f"{type(device).__name__} {device!r}")
    try:
        torch.device(device)
    except RuntimeError as error:
        raise ValueError(f"device must be a torch device string such as 'cuda' or 'cpu'; got "
                         f"{device!r} ({error})") from None


def check_process_group(process_group: object) -> None:
    """``process_group`` must be None or a ``torch.distributed.ProcessGroup``."""
    if process_group is None:
        return
    import torch.distributed as dist

    if not (dist.is_available() and isinstance(process_group, dist.ProcessGroup)):
        raise TypeError("process_group must be None or a torch.distributed.ProcessGroup (e.g. "
                        f"dist.group.WORLD or dist.new_group(...)); got "
                        f"{type(process_group).__name__} {process_group!r}")


def refuse_non_optimizer(optimizer: object, call: str) -> None:
    """Raise the ``TypeError`` for an ``optimizer`` argument without ``param_groups`` (what
    torch's scaler reads: a ``torch.optim.Optimizer`` or a framework's wrapper has them),
    naming ``call`` and what was passed, with the usual slips spelled out: a model, or its
    ``parameters()``. Callers test ``hasattr(optimizer, "param_groups")`` first (no call on
    the hot path)."""
    if isinstance(optimizer, torch.nn.Module):
        hint = f"pass the optimizer, not the model (a {type(optimizer).__name__})"
    elif isinstance(optimizer, torch.Tensor) or isinstance(optimizer, Iterable):
        hint = ("pass the optimizer, not model.parameters() or a list of parameters "
                f"(got a {type(optimizer).__name__})")
    else:
        hint = f"got {type(optimizer).__name__} {optimizer!r:.80}"
    raise TypeError(f"{call}() takes the optimizer whose gradients to handle (a "
                    f"torch.optim.Optimizer, or an object with param_groups): {hint}")


class ScaleOutputsError(TypeError, ValueError):
    """``scale()`` was given something that is not tensors: a ``TypeError``, and the
    ``ValueError`` torch's ``scale`` raises for the same outputs (``except ValueError`` in
    code written for torch's scaler catches it)."""


def check_outputs(outputs: object, where: str = "outputs") -> torch.Tensor | Iterable[Any]:
    """Validate what ``scale()`` was given, eagerly: a tensor, or lists / tuples / iterables
    of them, nested. Returns ``outputs`` for torch's ``scale``, with each iterable that is not
    a list or tuple materialised (checking consumes it) and handed on as an iterator over its
    items, which torch's ``scale`` maps lazily, as it maps the original."""
    if isinstance(outputs, torch.Tensor):
        return outputs
    if isinstance(outputs, (str, bytes, Mapping)) or not isinstance(outputs, Iterable):
        raise ScaleOutputsError(f"{where} must be a Tensor or a (nested) list / tuple / "
                                f"iterable of Tensors; got {type(outputs).__name__} "
                                f"{outputs!r:.80}")
    items = [check_outputs(item, f"{where}[{i}]") for i, item in enumerate(outputs)]
    if not isinstance(outputs, (list, tuple)):
        return iter(items)
    if all(new is old for new, old in zip(items, outputs)):
        return outputs
    return type(outputs)(items)  # a nested iterable materialised (torch rebuilds it too)
