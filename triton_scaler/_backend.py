"""Backend selection: ``"auto"``, ``"reference"`` (pure PyTorch) or ``"triton"``."""

from __future__ import annotations

import importlib.util
import re
from types import ModuleType
from typing import Literal

import torch

BACKENDS = ("auto", "reference", "triton")
Backend = Literal["auto", "reference", "triton"]
#: The oldest triton the whole test suite passes with (docs/testing.md: supported versions).
MIN_TRITON = (3, 3)


def check_backend(backend: object) -> None:
    """Raise ``ValueError`` naming the accepted values unless ``backend`` is one of them."""
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(map(repr, BACKENDS))}; got {backend!r}")


_triton_found: bool | None = None


def triton_available() -> bool:
    """Whether the ``triton`` package can be imported (checked once, without importing it;
    a module global, not ``functools.cache``, which traced code would not honour)."""
    global _triton_found
    if _triton_found is None:
        _triton_found = importlib.util.find_spec("triton") is not None
    return _triton_found


#: The ``triton_scaler.kernels`` package once :func:`triton_kernels` imported it (a hot path
#: reads this global, falling back to that call).
loaded_kernels: ModuleType | None = None


def triton_kernels() -> ModuleType:
    """The ``triton_scaler.kernels`` package: imported (with triton) on the first call, then
    a global read. The hot paths reach the kernels through this rather than an ``import``
    statement, which costs host time on every call with the host's caches cold (a training
    step's forward and backward leave them so). ``RuntimeError`` for a triton older than
    :data:`MIN_TRITON`."""
    global loaded_kernels
    if loaded_kernels is None:
        import triton

        check_triton_version(triton.__version__)
        from triton_scaler import kernels

        loaded_kernels = kernels
    return loaded_kernels


def check_triton_version(version: str) -> None:
    """Raise ``RuntimeError`` unless triton ``version`` is at least :data:`MIN_TRITON`:
    triton 3.2's interpreter flagged an overflow torch's op did not see, 3.0's and 3.1's
    reject the kernel, and what their compilers make of it was never run."""
    if tuple(int(part) for part in re.findall(r"\d+", version)[:2]) < MIN_TRITON:
        raise RuntimeError(
            f"triton_scaler's Triton kernels need triton >= {'.'.join(map(str, MIN_TRITON))} "
            f"(the oldest its tests pass with); triton {version} is installed. Upgrade triton, "
            "or pass backend='reference' (pure PyTorch, the same results)")


def triton_interpreting() -> bool:
    """Whether Triton kernels run through the CPU interpreter (``TRITON_INTERPRET=1`` was set
    before triton_scaler's kernels were first imported)."""
    return triton_kernels().unscale.is_interpreting()


def resolve_backend(backend: str, device: torch.device) -> Literal["reference", "triton"]:
    """The concrete backend for tensors on ``device``.

    ``"auto"`` picks ``"triton"`` for CUDA tensors when triton is importable, else
    ``"reference"``. ``"triton"`` on non-CUDA tensors works only under the interpreter.
    """
    if backend == "reference":
        return "reference"
    if backend != "auto" and backend != "triton":
        check_backend(backend)  # raises, naming the accepted values
    if device.type == "cuda" and triton_available():
        return "triton"  # the common case: two comparisons and a cached lookup
    if backend == "auto":
        return "reference"
    if not triton_available():
        raise RuntimeError("backend='triton' needs the 'triton' package; install it or use "
                           "backend='reference'")
    if device.type != "cuda" and not triton_interpreting():
        raise RuntimeError(
            f"backend='triton' runs on CUDA tensors; got tensors on {device}. On CPU use "
            "backend='reference' (or 'auto'), or set TRITON_INTERPRET=1 before importing "
            "triton to run the kernels through Triton's interpreter")
    return "triton"
