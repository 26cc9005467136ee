"""Checks of :class:`triton_scaler.GradScaler`'s arguments that are not scale settings (those
live in :mod:`triton_scaler.policy`): device, process group, ``scale()`` outputs."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from .policy import ScalerArgumentError

__all__ = ["ScalerArgumentError", "check_device", "check_process_group", "check_outputs"]


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


def check_outputs(outputs: object, where: str = "outputs") -> list | None:
    """Validate what ``scale()`` was given, eagerly: a tensor, or a list / tuple / iterable of
    them, nested. Returns the materialised items of a non-list, non-tuple iterable (which
    ``scale`` then maps lazily, as torch), else None."""
    if isinstance(outputs, torch.Tensor):
        return None
    if isinstance(outputs, (str, bytes, Mapping)) or not isinstance(outputs, Iterable):
        raise TypeError(f"{where} must be a Tensor or a (nested) list / tuple / iterable of "
                        f"Tensors; got {type(outputs).__name__} {outputs!r:.80}")
    items = list(outputs)
    for i, item in enumerate(items):
        materialised = check_outputs(item, f"{where}[{i}]")
        if materialised is not None:
            raise TypeError(f"{where}[{i}] is a {type(item).__name__}: nested outputs must be "
                            "Tensors, lists or tuples")
    return None if isinstance(outputs, (list, tuple)) else items
