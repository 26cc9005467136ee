"""apex amp's loss scaling (``amp.scale_loss``) on triton_scaler's GradScaler.

Each loss gets its own :class:`triton_scaler.GradScaler`, created on the device of the first
loss it scales. apex's rule is torch's with a cap (``max_loss_scale``) and an optional floor
(``min_loss_scale``): both are GradScaler settings. A static ``loss_scale`` never skips.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from ..grad_scaler import GradScaler

_SKIP_ATTR = "_triton_scaler_apex_pending"


class Amp:
    """apex amp's loss-scale handling for ``num_losses`` losses.

    Args:
        num_losses: number of separately scaled losses (``loss_id`` 0 .. num_losses - 1).
        init_scale: initial dynamic scale (capped at ``max_loss_scale``), apex's 2**16.
        min_loss_scale, max_loss_scale: floor (None: none) and cap of the dynamic scale.
        loss_scale: ``"dynamic"`` or a number (a static scale that never skips a step).
        scale_window: clean steps before doubling (apex: 2000).
        backend: ``"auto"``, ``"reference"`` or ``"triton"``.
    """

    def __init__(self, num_losses: int = 1, init_scale: float = 2.0**16,
                 min_loss_scale: float | None = None, max_loss_scale: float = 2.0**24,
                 loss_scale: float | str = "dynamic", scale_window: int = 2000,
                 backend: str = "auto") -> None:
        if not isinstance(num_losses, int) or num_losses < 1:
            raise ValueError(f"num_losses must be an int >= 1; got {num_losses!r}")
        if loss_scale != "dynamic" and not isinstance(loss_scale, (int, float)):
            raise ValueError(f"loss_scale must be 'dynamic' or a number; got {loss_scale!r}")
        self.num_losses = num_losses
        self._dynamic = loss_scale == "dynamic"
        self._init = min(max_loss_scale, init_scale) if self._dynamic else float(loss_scale)
        self._kwargs = dict(growth_interval=scale_window, backend=backend,
                            min_scale=float(min_loss_scale or 0.0),
                            max_scale=float(max_loss_scale), dynamic=self._dynamic)
        self._scalers: list[GradScaler | None] = [None] * num_losses
        self._pending_state: list[dict | None] = [None] * num_losses

    def _scaler(self, loss_id: int, device: torch.device) -> GradScaler:
        if not 0 <= loss_id < self.num_losses:
            raise ValueError(f"loss_id must be in [0, {self.num_losses}); got {loss_id!r}")
        scaler = self._scalers[loss_id]
        if scaler is None:
            scaler = GradScaler(device.type, init_scale=self._init, **self._kwargs)
            if self._pending_state[loss_id] is not None:
                scaler.load_state_dict(self._pending_state[loss_id])
            self._scalers[loss_id] = scaler
        return scaler

    @contextlib.contextmanager
    def scale_loss(self, loss: torch.Tensor, optimizers: torch.optim.Optimizer | Sequence[Any],
                   loss_id: int = 0, delay_unscale: bool = False) -> Iterator[torch.Tensor]:
        """Yield ``loss * scale``. On exit (unless ``delay_unscale``) unscale and check the
        optimizers' grads, update the scale, and make each optimizer's next ``step()`` a no-op
        if there was an overflow (once). No host sync here; the plain optimizers' ``step()``
        reads one flag, fused optimizers skip on the device."""
        optimizers = [optimizers] if isinstance(optimizers, torch.optim.Optimizer) \
            else list(optimizers)
        scaler = self._scaler(loss_id, loss.device)
        yield scaler.scale(loss)
        if delay_unscale:
            return
        for opt in optimizers:
            scaler.unscale_(opt)
        flags = [scaler._agree_found_inf(scaler._per_optimizer_states[id(opt)])
                 for opt in optimizers]
        scaler.update()
        if self._dynamic:
            for opt, found_inf in zip(optimizers, flags):
                _skip_next_step_if(opt, found_inf)

    def loss_scale(self, loss_id: int = 0) -> float:
        """The current scale of ``loss_id`` (synchronises)."""
        scaler = self._scalers[loss_id]
        return self._init if scaler is None else scaler.get_scale()

    def state_dict(self) -> dict[str, dict[str, float | int]]:
        """apex's format: ``{"loss_scaler<i>": {"loss_scale": ..., "unskipped": ...}}``."""
        out = {}
        for i, scaler in enumerate(self._scalers):
            if scaler is None:
                out[f"loss_scaler{i}"] = {"loss_scale": self._init, "unskipped": 0}
            else:
                out[f"loss_scaler{i}"] = {"loss_scale": scaler.get_scale(),
                                          "unskipped": scaler._get_growth_tracker()}
        return out

    def load_state_dict(self, state_dict: dict[str, dict[str, float | int]]) -> None:
        if len(state_dict) != self.num_losses:
            raise ValueError(f"state_dict has {len(state_dict)} loss scalers; this Amp has "
                             f"{self.num_losses}")
        for i in range(self.num_losses):
            entry = state_dict[f"loss_scaler{i}"]
            torch_state = {"scale": float(entry["loss_scale"]), "growth_factor": 2.0,
                           "backoff_factor": 0.5,
                           "growth_interval": self._kwargs["growth_interval"],
                           "_growth_tracker": int(entry["unskipped"])}
            if self._scalers[i] is None:
                self._pending_state[i] = torch_state
            else:
                self._scalers[i].load_state_dict(torch_state)


def _skip_next_step_if(optimizer: torch.optim.Optimizer, found_inf: torch.Tensor) -> None:
    """Make the optimizer's next ``step()`` a no-op when ``found_inf`` is set (once)."""
    pending = optimizer.__dict__.get(_SKIP_ATTR)
    if pending is not None:  # an earlier patch that was never consumed
        _restore_step(optimizer)
    had_own_step = "step" in optimizer.__dict__  # e.g. an LR scheduler's wrapper
    original = optimizer.step
    setattr(optimizer, _SKIP_ATTR, (had_own_step, original))

    def step(*args, **kwargs):
        _restore_step(optimizer)
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            optimizer.grad_scale, optimizer.found_inf = None, found_inf
            try:
                return original(*args, **kwargs)  # skips on the device: no sync
            finally:
                del optimizer.grad_scale, optimizer.found_inf
        if not found_inf.item():  # the one host read of the plain route
            return original(*args, **kwargs)
        return None

    optimizer.step = step


def _restore_step(optimizer: torch.optim.Optimizer) -> None:
    had_own_step, original = optimizer.__dict__.pop(_SKIP_ATTR)
    if had_own_step:
        optimizer.step = original
    else:
        del optimizer.step
