"""The launch plans :mod:`triton_scaler._grads` keeps per address layout of an optimizer's
grads, and how a step tells that its grads are laid out as those the plans were made for:
one C++ call, torch's ``TensorGuards`` (the tensor check behind ``torch.compile``'s guards,
a private API), or without it one Python pass each over sizes, dtypes and contiguity."""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING

import torch

try:  # one C++ call checking many tensors' types, dtypes, devices, shapes and strides
    from torch._C._dynamo.guards import TensorGuards
except ImportError:  # pragma: no cover - a torch built without dynamo: Python passes
    TensorGuards = None  # type: ignore[assignment, misc]

if TYPE_CHECKING:
    from triton_scaler.kernels.plan import UnscalePlan

_NUMEL = torch.Tensor.numel
_DTYPE = operator.attrgetter("dtype")
_IS_CONTIGUOUS = torch.Tensor.is_contiguous


class StoredPlans:
    """Each plain group's launch plan (without its grads) for grads at some addresses, and
    what tells that new grads there are laid out as the ones the plans were made for. Holds
    no grad."""

    __slots__ = ("backend", "templates", "numels", "dtypes", "guard")

    def __init__(self, backend: str, templates: list[UnscalePlan], numels: tuple[int, ...],
                 dtypes: tuple[torch.dtype, ...]) -> None:
        self.backend, self.templates, self.numels, self.dtypes = backend, templates, numels, dtypes
        # a TensorGuards over grads the plans fit: those they were made for when some are
        # not contiguous (channels_last), else (built lazily) those of their first reuse
        self.guard: TensorGuards | None = None

    def fit(self, grads: list[torch.Tensor]) -> bool:
        """``grads``, at the addresses the plans were made for, are laid out as the grads
        they were made for. One C++ call (``TensorGuards``: type, dtype, device, shape and
        strides of each grad) from the second reuse on; at the first, one pass each reading
        sizes, dtypes and contiguity, which only contiguous grads pass."""
        if self.guard is not None:
            return self.guard.check(*grads)
        if tuple(map(_NUMEL, grads)) != self.numels or tuple(map(_DTYPE, grads)) != \
                self.dtypes or not all(map(_IS_CONTIGUOUS, grads)):
            return False
        self.guard = tensor_guards(grads)
        return True


def tensor_guards(grads: list[torch.Tensor]) -> TensorGuards | None:
    """torch's ``TensorGuards`` over ``grads``, or None (a torch without it, or whose private
    API changed: its keywords are required, without them torch 2.11 - 2.13 crash)."""
    if TensorGuards is None:
        return None
    try:
        return TensorGuards(*grads, dynamic_dims_sizes=None, dynamic_dims_strides=None)
    except TypeError:
        return None
