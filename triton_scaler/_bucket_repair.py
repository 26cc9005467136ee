"""The way back for a :class:`triton_scaler._bucket.GradBucket` whose grads are no longer all
its views: DDP's reduced grads of locally unused parameters found, views of grads that are
None zeroed, grads copied back into their views (or left outside) and views re-pointed. Only
the per-parameter path runs these; the O(1) step never does."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from collections.abc import Callable


class BucketRepairMixin:
    """Per-parameter repairs of a bucket's grads. The bucket provides the attributes below."""

    params: list[torch.Tensor]
    buffer: torch.Tensor
    received: dict[int, torch.Tensor]
    _zeroed: set[int]
    view: Callable[[int], torch.Tensor]
    _is_view: Callable[[int, torch.Tensor], bool]
    _in_buffer: Callable[[torch.Tensor], bool]

    def _written_views_of(self, indices: list[int]) -> list[int]:
        """The parameters among ``indices`` (none received a gradient from autograd) whose
        views hold a value other than zero: DDP with ``find_unused_parameters=True`` writes
        the reduced gradient of a parameter unused on this rank but used on another into its
        grad, which torch's optimizer then steps. Recorded as received. One host read; runs
        only with a process group and when the buffer was written more often than autograd
        accumulated. (Without a process group a value written into such a view is no grad:
        torch's grad is None there, so code writing into every ``p.grad`` skips it.)"""
        if self.buffer.is_cuda and torch.cuda.is_current_stream_capturing():
            return []  # no host read inside a CUDA graph capture
        with torch.no_grad():
            flags = torch.stack([(self.view(i) != 0).any() for i in indices]).tolist()
        written = [i for i, flag in zip(indices, flags) if flag]
        for i in written:
            self.received[i] = self.params[i]
        return written

    def _zero_views_of(self, indices: list[int]) -> None:
        """Zero the views of parameters whose grad is None, once until they are written (one
        ``_foreach_zero_``): the bucket's launches read them, and they are no grads."""
        todo = [i for i in indices if i not in self._zeroed]
        if todo:
            self._zeroed.update(todo)
            with torch.no_grad():
                torch._foreach_zero_([self.view(i) for i in todo])

    def _reattach(self, detached: list[int], copy_back: bool = True) -> set[int]:
        """Copy each grad back into its view (or zero the view and leave the grad outside);
        returns the ids of the parameters left outside the bucket."""
        outside = set()
        with torch.no_grad():
            # a grad that is itself a piece of this buffer (two parameters of one shape
            # whose grads were swapped) is read before any view is written: copied out first
            grads = [self._own_piece_copied(self.params[i].grad) for i in detached]
            for i, grad in zip(detached, grads):
                p, view = self.params[i], self.view(i)
                if grad is not None and copy_back and not grad.is_sparse:
                    view.copy_(grad)
                    p.grad = view
                    self._zeroed.discard(i)
                else:
                    if grad is not p.grad:  # a piece of the buffer: its own memory, outside
                        p.grad = grad
                    view.zero_()  # the bucket launch must not see stale values
                    outside.add(id(p))
        return outside

    def _own_piece_copied(self, grad: torch.Tensor | None) -> torch.Tensor | None:
        """``grad``, or a copy of it when it lies in this bucket's buffer."""
        return grad.clone() if grad is not None and self._in_buffer(grad) else grad

    def _repoint(self) -> None:
        """Give every parameter whose grad is not its view the view again."""
        for i, p in enumerate(self.params):
            grad = p.grad
            if grad is None or not self._is_view(i, grad):
                p.grad = self.view(i)
