"""``triton_scaler.ShardedGradScaler``: a drop-in replacement for torch's FSDP1 scaler,
``torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler``, on triton_scaler's kernels."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, overload

import torch

from ._arguments import check_outputs
from .grad_scaler import GradScaler


class NoDefaultGroupError(RuntimeError, ValueError):
    """No ``process_group`` and no default group to agree over: a ``RuntimeError``, and the
    ``ValueError`` torch's ``ShardedGradScaler`` raises in the same place."""


class ShardedGradScaler(GradScaler):
    """Drop-in replacement for torch's ``ShardedGradScaler`` (FSDP1, and DDP or ZeRO-style
    sharding with plain tensors): a :class:`GradScaler` whose found_inf is agreed over
    ``process_group``, with torch's ``ShardedGradScaler`` interface:

    * its positional arguments: ``backoff_factor`` comes *before* ``growth_factor`` (the
      reverse of ``GradScaler``), then ``growth_interval``, ``enabled``, ``process_group``;
    * ``process_group=None`` agrees over the default group, looked up at each agreement, so
      the scaler may be built before ``init_process_group`` (torch's default,
      ``dist.group.WORLD``, is read when its module is imported: None before
      ``init_process_group``, which its all-reduce takes as the default group); with neither,
      an agreement raises ``NoDefaultGroupError``. The group is the public ``process_group``;
    * ``unscale_`` (and :meth:`clip_grad_norm_`) accept float16 grads (a float16 model, or
      FSDP1's ``keep_low_precision_grads=True``);
    * ``scale()`` returns each output in its own dtype: a float16 loss stays float16 (a scaled
      value past 65504 is inf, as with torch's).

    With these the scale trajectory, skipped steps and parameters are those of torch's
    ``ShardedGradScaler``.
    Different on purpose (docs/distributed.md): the agreement is a MAX (flags exactly 0.0 / 1.0, which fused
    optimizers need; torch's sums them) and also runs on the fused-optimizer route (torch's
    agrees in ``unscale_`` only); the scale update is ``torch.amp.GradScaler``'s rule on every
    device (torch's applies a Python rule to a CPU scale, whose product with a factor that is
    not a power of two may round differently). The keyword-only extensions of
    :class:`GradScaler` (``hysteresis``, ``min_scale``, ``backend``, ...) apply unchanged.

    Synchronisation: as :class:`GradScaler`'s, plus one all-reduce per agreement.
    """

    _unscales_fp16 = True

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        backoff_factor: float = 0.5,
        growth_factor: float = 2.0,
        growth_interval: int = 2000,
        enabled: bool = True,
        process_group: Any = None,
        **extensions: Any,
    ) -> None:
        super().__init__(device, init_scale, growth_factor, backoff_factor, growth_interval,
                         enabled, process_group=process_group, **extensions)

    _traceable = False  # found_inf is agreed over a process group: eager under compile

    @property
    def _process_group(self) -> Any:
        """The group found_inf is agreed over: ``process_group``, else the default group."""
        group = self.process_group
        if group is None:
            import torch.distributed as dist

            if not (dist.is_available() and dist.is_initialized()):
                raise NoDefaultGroupError(
                    "ShardedGradScaler agrees found_inf over torch.distributed's default group, "
                    "which is not initialised: call torch.distributed.init_process_group() "
                    "first, or pass process_group=")
            group = dist.group.WORLD
        return group

    @_process_group.setter
    def _process_group(self, group: Any) -> None:
        self.process_group = group

    def _ready_to_unscale(self, optimizer: torch.optim.Optimizer, funcname: str) -> dict:
        """GradScaler's, with the agreement group looked up first: without one,
        ``NoDefaultGroupError`` leaves the grads still scaled and the iteration as it was
        (torch's raises at its all-reduce, after unscaling)."""
        _ = self._process_group
        return super()._ready_to_unscale(optimizer, funcname)

    @overload  # as GradScaler.scale's
    def scale(self, outputs: torch.Tensor) -> torch.Tensor: ...
    @overload
    def scale(self, outputs: list[torch.Tensor]) -> list[torch.Tensor]: ...
    @overload
    def scale(self, outputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]: ...
    @overload
    def scale(self, outputs: Iterable[torch.Tensor]) -> Iterable[torch.Tensor]: ...

    def scale(self, outputs: torch.Tensor | Iterable[torch.Tensor]
              ) -> torch.Tensor | Iterable[torch.Tensor]:
        """Multiply each output by the scale and return it in its own dtype, as torch's
        ``ShardedGradScaler``. No host sync."""
        if not self._enabled:
            return outputs
        scale_one = super().scale

        def apply(value):
            if isinstance(value, torch.Tensor):
                return scale_one(value).type(value.dtype)
            scaled = map(apply, value)
            return type(value)(scaled) if isinstance(value, (list, tuple)) else scaled
        return apply(check_outputs(outputs))

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.pop("_process_group", None)
        state["process_group"] = None  # process groups do not pickle: the default group
        return state
