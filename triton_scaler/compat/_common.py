"""Helpers shared by the adapters: device default, gradient lists, argument checks."""

from __future__ import annotations

from collections.abc import Iterable

import torch


def default_device(device: str | torch.device | None) -> torch.device:
    """The given device, else CUDA when available, else CPU."""
    if device is not None:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def grads_of(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The dense gradients of ``params`` (sparse ones as their values), skipping ``None``."""
    grads = []
    for p in params:
        g = p.grad
        if g is not None:
            grads.append(g._values() if g.is_sparse else g)
    return grads


def require(name: str, value: object, ok: bool, accepted: str) -> None:
    """Raise ``ValueError`` naming the adapter's own argument and its accepted values."""
    if isinstance(value, bool) or not ok:
        raise ValueError(f"{name} must be {accepted}; got {value!r}")


def is_int(value: object, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
