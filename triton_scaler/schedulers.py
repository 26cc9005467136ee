"""Step an LR scheduler only for optimizer steps that were applied, without a host sync."""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any

import torch

from ._host_copy import copy_to_host_async

if TYPE_CHECKING:
    from .grad_scaler import GradScaler


class SkipAwareScheduler:
    """Wraps a ``torch.optim.lr_scheduler`` scheduler so that it steps once per *applied*
    optimizer step, reading :attr:`GradScaler.last_step_skipped` without synchronising.

    Call :meth:`step` after every ``scaler.update()``. On CUDA each iteration's flag is copied
    to pinned host memory asynchronously and consumed once its copy has completed (checked with
    a non-blocking ``Event.query()``), so the wrapped scheduler may step up to a few iterations
    late but never waits for the GPU; :meth:`flush` waits for all pending flags (call it before
    checkpointing). On CPU the flag is known at once.

    The simpler alternative costs one sync per iteration::

        if not scaler.last_step_skipped.item():
            scheduler.step()
    """

    def __init__(self, scheduler: Any, scaler: GradScaler) -> None:
        """
        Args:
            scheduler: the LR scheduler to step (anything with ``step()``).
            scaler: the :class:`GradScaler` whose skipped steps it leaves out.

        Raises:
            TypeError: the arguments swapped (a scaler first, or an LR scheduler second), or
                ``scheduler`` has no ``step()``.
        """
        if isinstance(scheduler, torch.amp.GradScaler) or \
                isinstance(scaler, torch.optim.lr_scheduler.LRScheduler):
            raise TypeError("SkipAwareScheduler(scheduler, scaler) takes the LR scheduler first "
                            "and the GradScaler second; got "
                            f"({type(scheduler).__name__}, {type(scaler).__name__})")
        if not callable(getattr(scheduler, "step", None)):
            raise TypeError("scheduler must be an LR scheduler (with step()); got "
                            f"{type(scheduler).__name__}")
        self.scheduler = scheduler
        self.scaler = scaler
        self._pending: deque[tuple[torch.Tensor, Any]] = deque()

    def step(self) -> None:
        """Queue the flag of the step just taken and step the scheduler for every resolved,
        applied step. Call it after every ``scaler.update()``.

        .. note:: Never synchronises with the device.
        """
        flag = self.scaler.last_step_skipped
        if flag.is_cuda:
            self._pending.append(copy_to_host_async(flag))
        else:
            self._pending.append((flag.clone(), None))
        self._resolve(wait=False)

    def flush(self) -> None:
        """Wait for every pending flag and apply it.

        .. note:: Synchronises with the device (waits for the pending copies).
        """
        self._resolve(wait=True)

    def _resolve(self, *, wait: bool) -> None:
        while self._pending:
            host, event = self._pending[0]
            if event is not None and not event.query():
                if not wait:
                    return
                event.synchronize()
            self._pending.popleft()
            if not host.untyped_storage()[0]:  # host memory, already written: no device sync
                self.scheduler.step()

    def state_dict(self) -> dict[str, Any]:
        """The wrapped scheduler's state.

        Returns:
            ``scheduler.state_dict()`` after :meth:`flush`.

        .. note:: Synchronises (through :meth:`flush`).
        """
        self.flush()
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the wrapped scheduler's state and drop the pending flags.

        Args:
            state_dict: from :meth:`state_dict`.
        """
        self._pending.clear()
        self.scheduler.load_state_dict(state_dict)
