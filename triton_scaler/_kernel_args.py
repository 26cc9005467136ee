"""What the Triton kernels (``triton_scaler.kernels``) take, described without triton: the
unscale launch's plan and the update kernel's parameter layout. The only module of the
package that ``kernels/`` imports; planning (:mod:`._plans`) and the settings
(:mod:`.policy`) build these values."""

from __future__ import annotations

import torch

#: The update kernel's float64 parameter buffer (:meth:`ScalePolicy.kernel_params`), in order.
PARAMS_LAYOUT = ("growth_factor", "backoff_factor", "growth_interval", "min_scale", "max_scale",
                 "hysteresis")


class UnscalePlan:
    """One launch of the unscale kernel over same-device, same-dtype grads, as built by
    :func:`triton_scaler._plans.plan_unscale`.

    Attributes:
        base: the tensor whose address, dtype and device the launch takes (the
            ``base_index``-th non-empty grad, or its flat view); None for a plan without
            elements or a template.
        base_index: that grad's index among the grads the plan was built for.
        table: the int64 ``[grid, 3]`` chunk table, rows ``(grad, offset, length)`` in
            elements, the grad an index into ``starts``; None for the flat launch over ``n``
            elements of ``base``. It depends on the grads' sizes alone.
        starts: with a table, the int64 byte address of each of its grads, ``base``'s first
            (on the grads' device).
        n: elements of the flat launch (0 with a table).
        grid: programs launched (0: no elements, nothing launched).
        copies: ``(grad, contiguous copy)`` pairs of gapped grads, launched over as copies
            and written back.
        contiguous: every grad was contiguous.
        overlapping: two grads share part of their memory.
        fp64: the grads are float64 (the norm partials' precision, also for no elements).
        refusal: why a write over this plan would not give torch's op's result, or None.
        reusable: launchable again over grads at the same addresses and laid out the same
            (no copies, no shared memory).
    """

    __slots__ = ("base", "base_index", "table", "starts", "n", "grid", "copies", "contiguous",
                 "overlapping", "fp64", "refusal", "reusable")

    def __init__(self, base: torch.Tensor | None, base_index: int, table: torch.Tensor | None,
                 n: int, grid: int, copies: list, contiguous: bool, *,
                 starts: torch.Tensor | None = None, overlapping: bool = False,
                 fp64: bool = False, refusal: str | None = None) -> None:
        self.base, self.base_index, self.table, self.n = base, base_index, table, n
        self.starts = starts
        self.grid, self.copies, self.contiguous = grid, copies, contiguous
        self.overlapping, self.fp64, self.refusal = overlapping, fp64, refusal
        self.reusable = not copies and not overlapping

    def template(self) -> UnscalePlan:
        """This plan without its grads (a reusable plan's, kept by :mod:`._plan_store`)."""
        return self.rebased(None)

    def rebased(self, base: torch.Tensor | None) -> UnscalePlan:
        """This template over a new grads list at the same addresses and laid out as the
        grads it was made for, whose ``base_index``-th grad is ``base`` (None for a plan
        without elements)."""
        return UnscalePlan(base if self.grid else None, self.base_index, self.table, self.n,
                           self.grid, [], self.contiguous, starts=self.starts, fp64=self.fp64)
