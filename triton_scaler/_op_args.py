"""Argument checks and grouping of the public ops' grads (:mod:`.ops`): every check names
the argument and the accepted values, before any grad changes. Host work only, no sync."""

from __future__ import annotations

from collections import defaultdict
from operator import attrgetter

import torch

#: The grad dtypes the ops accept: torch's op takes these four (and no others).
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_ACCEPTED = "float32, float16, bfloat16 or float64"
#: The grad types taken as they are; any other (a DTensor) is unwrapped or refused first.
PLAIN = frozenset((torch.Tensor, torch.nn.Parameter))


def check_grad_dtype(where: str, dtype: torch.dtype) -> None:
    """``TypeError`` naming the dtype and the accepted ones unless torch's op takes it."""
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"{where} has dtype {dtype}; gradients must be {_ACCEPTED}")


def check_flag(name: str, t: object, dtype: torch.dtype) -> None:
    """``TypeError`` naming ``name`` unless ``t`` is a one-element ``dtype`` tensor
    (found_inf, inv_scale, scale, the trackers)."""
    if not isinstance(t, torch.Tensor) or t.numel() != 1 or t.dtype != dtype:
        raise TypeError(f"{name} must be a one-element {dtype} tensor; got "
                        f"{t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}"
                        f"{'' if not isinstance(t, torch.Tensor) else f' of {t.numel()} elements'}")


def as_tensor_list(grads: object, name: str = "grads") -> list[torch.Tensor]:
    """``grads`` (a list, tuple or any iterable of tensors, a generator included) as a list;
    ``TypeError`` for a single tensor or a non-iterable."""
    if isinstance(grads, torch.Tensor):
        raise TypeError(f"{name} must be a list or tuple of tensors, not a single tensor "
                        f"(wrap it: [{name}])")
    if isinstance(grads, (list, tuple)):
        return list(grads)
    try:
        return list(grads)  # type: ignore[call-overload]
    except TypeError:
        raise TypeError(f"{name} must be a list or tuple of tensors; got "
                        f"{type(grads).__name__}") from None


_dtype_of, _device_of, _tensor_layout, _is_nested = (
    attrgetter(a) for a in ("dtype", "device", "layout", "is_nested"))


def nested_grad_error(i: int) -> TypeError:
    return TypeError(f"grads[{i}] is a nested tensor, which neither backend (nor torch's op) "
                     "takes; pass its components (.unbind()) or its values (jagged: .values())")


_is_cpu = attrgetter("is_cpu")


def _all_on(grads: list[torch.Tensor], device: torch.device) -> bool:
    """Every grad on ``device``, in a C-level pass (on the CPU ``is_cpu``, which makes no
    device object per grad)."""
    return all(map(_is_cpu, grads)) if device.type == "cpu" else \
        set(map(_device_of, grads)) <= {device}


def check_before_writing(grads: list[torch.Tensor], device: torch.device, plain: bool) -> None:
    """What torch's op checks only as it comes to each grad, having written the ones before
    (or, a grad on the meta device among them, writing none and raising nothing): every grad
    of an accepted dtype on ``device``. C-level passes over plain grads; where one fails, or
    a grad is not plain, :func:`group_grads` checks each and names the one it refuses."""
    if not (plain and set(map(_dtype_of, grads)).issubset(FLOAT_DTYPES)
            and _all_on(grads, device)):
        group_grads(grads, device, plain)


def group_grads(grads: list[torch.Tensor], device: torch.device, plain: bool):
    """``grads`` split by dtype, every grad checked (a tensor of an accepted dtype, dense and
    not nested, on ``device``). The usual case, plain dense grads (``plain``: every one a
    Tensor or Parameter, as the caller found) of one dtype on ``device``, is checked in
    C-level passes (half the per-grad loop's host time at 1000 grads)."""
    if (plain and len(dtypes := set(map(_dtype_of, grads))) == 1
            and dtypes.issubset(FLOAT_DTYPES) and _all_on(grads, device)
            and set(map(_tensor_layout, grads)) == {torch.strided}
            and not any(map(_is_nested, grads))):
        return [grads]
    groups: dict[torch.dtype, list[torch.Tensor]] = defaultdict(list)
    for i, g in enumerate(grads):
        if not isinstance(g, torch.Tensor):
            raise TypeError(f"grads[{i}] must be a tensor; got {type(g).__name__}")
        check_grad_dtype(f"grads[{i}]", g.dtype)
        if g.device != device:
            raise ValueError(f"grads[{i}] is on {g.device} but found_inf is on {device}; "
                             "every grad must be on found_inf's device")
        if g.is_sparse:
            raise TypeError(f"grads[{i}] is sparse; pass its ._values()")
        if g.is_nested:
            raise nested_grad_error(i)
        groups[g.dtype].append(g)
    return groups.values()
