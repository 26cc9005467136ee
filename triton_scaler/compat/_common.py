"""Helpers shared by the adapters: the default device and the gradient lists."""

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

