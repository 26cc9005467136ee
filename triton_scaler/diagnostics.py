"""Host-synchronisation counting, for tests, the demo and the benchmarks."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

SYNC_METHODS = ("item", "__bool__", "tolist", "cpu", "numpy", "__float__", "__int__")


class SyncCounter:
    """Counts calls of the tensor methods that read device values on the host.

    ``paused()`` excludes a region (e.g. the optimizer's own ``step``, which may read its step
    counter) from the count.
    """

    def __init__(self) -> None:
        self.count = 0
        self._paused = 0

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def _record(self) -> None:
        if not self._paused:
            self.count += 1


@contextlib.contextmanager
def count_host_syncs() -> Iterator[SyncCounter]:
    """Patch ``torch.Tensor``'s host-read methods (``SYNC_METHODS``) to count their calls
    while the context is open. Not thread-safe; for tests and diagnostics only."""
    counter = SyncCounter()
    originals = {name: getattr(torch.Tensor, name) for name in SYNC_METHODS}

    def counted(original):
        def method(self, *args, **kwargs):
            counter._record()
            return original(self, *args, **kwargs)
        return method

    try:
        for name, original in originals.items():
            setattr(torch.Tensor, name, counted(original))
        yield counter
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def optimizer_step_uncounted(optimizer: torch.optim.Optimizer, counter: SyncCounter
                             ) -> contextlib.AbstractContextManager[None]:
    """Context manager that excludes ``optimizer.step``'s own host reads from ``counter``."""
    had_own_step = "step" in optimizer.__dict__
    step = optimizer.step

    def wrapped(*args, **kwargs):
        with counter.paused():
            return step(*args, **kwargs)

    @contextlib.contextmanager
    def patch() -> Iterator[None]:
        optimizer.step = wrapped  # type: ignore[method-assign]  # (an instance attribute)
        try:
            yield
        finally:
            if had_own_step:
                optimizer.step = step  # type: ignore[method-assign]
            else:
                del optimizer.step
    return patch()
