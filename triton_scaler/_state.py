"""Extension state of :class:`triton_scaler.GradScaler`: device tensors, settings, skip signal,
state_dict / load_state_dict and pickling. Kept apart from the step logic."""

from __future__ import annotations

from typing import Any

import torch

from . import ops

EXTENSION_KEYS = ("hysteresis", "_hysteresis_tracker", "consecutive_hysteresis", "min_scale",
                  "max_scale", "raise_at_min_scale", "dynamic", "skip_on_overflow",
                  "skipped_steps")
_SETTINGS = ("hysteresis", "consecutive_hysteresis", "min_scale", "max_scale",
             "raise_at_min_scale", "dynamic", "skip_on_overflow")


class ScalerStateMixin:
    """State handling shared by GradScaler; expects torch.amp.GradScaler as a later base."""

    def _init_extension_state(self) -> None:
        self._init_hysteresis_tracker = self._hysteresis
        self._init_skipped_steps = 0
        self._hysteresis_tracker_state: torch.Tensor | None = None
        self._skipped_steps_t: torch.Tensor | None = None
        self._last_step_skipped: torch.Tensor | None = None
        self._params_t: torch.Tensor | None = None

    def _lazy_init_scale_growth_tracker(self, dev: torch.device) -> None:
        super()._lazy_init_scale_growth_tracker(dev)  # type: ignore[misc]
        self._hysteresis_tracker_state = torch.full((), self._init_hysteresis_tracker,
                                                    dtype=torch.int32, device=dev)
        self._skipped_steps_t = torch.full((), self._init_skipped_steps, dtype=torch.int64,
                                           device=dev)
        self._last_step_skipped = torch.zeros((), dtype=torch.bool, device=dev)
        self._params_t = ops.policy_params(*self._policy_values(), dev).clone()

    def _policy_values(self) -> tuple:
        return (self._growth_factor, self._backoff_factor, self._growth_interval,
                self._min_scale, self._max_scale, self._hysteresis)

    def _refresh_params(self) -> None:
        ops.check_policy(self._growth_factor, self._backoff_factor, self._growth_interval,
                         self._hysteresis, self._min_scale, self._max_scale)
        if self._params_t is not None:  # in place: a captured CUDA graph sees the new values
            values = ops.policy_params(*self._policy_values(), torch.device("cpu"))
            if self._params_t.is_cuda:  # stream-ordered upload that does not block the host
                values = values.pin_memory()
            self._params_t.copy_(values, non_blocking=True)

    @property
    def _hysteresis_tracker_t(self) -> torch.Tensor | None:
        """The tracker handed to the update op: None when hysteresis is 1 (torch's rule)."""
        return self._hysteresis_tracker_state if self._hysteresis > 1 else None

    # ---------------------------------------------------------------- public accessors
    @property
    def last_step_skipped(self) -> torch.Tensor:
        """0-d bool tensor on the scale's device: whether the last :meth:`update` followed a
        skipped step. Reading it as a Python bool synchronises; using it on the device does not."""
        if self._last_step_skipped is None:
            return torch.zeros((), dtype=torch.bool)
        return self._last_step_skipped

    @property
    def skipped_steps(self) -> int:
        """Total number of skipped steps (saved in the state_dict). Synchronises when read."""
        if not self._enabled or self._skipped_steps_t is None:
            return self._init_skipped_steps
        return int(self._skipped_steps_t.item())

    def _get_hysteresis_tracker(self) -> int:
        if self._hysteresis_tracker_state is None:
            return self._init_hysteresis_tracker
        return int(self._hysteresis_tracker_state.item())

    def set_growth_factor(self, new_factor: float) -> None:
        """Set the growth factor (> 1); takes effect on the device, also inside CUDA graphs."""
        old, self._growth_factor = self._growth_factor, new_factor
        self._set_checked(old, "_growth_factor")

    def set_backoff_factor(self, new_factor: float) -> None:
        """Set the backoff factor (in (0, 1)); takes effect on the device."""
        old, self._backoff_factor = self._backoff_factor, new_factor
        self._set_checked(old, "_backoff_factor")

    def set_growth_interval(self, new_interval: int) -> None:
        """Set the growth interval (int >= 1); takes effect on the device."""
        old, self._growth_interval = self._growth_interval, new_interval
        self._set_checked(old, "_growth_interval")

    def _set_checked(self, old: Any, attribute: str) -> None:
        try:
            self._refresh_params()
        except (TypeError, ValueError):
            setattr(self, attribute, old)
            raise

    # ---------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """torch's five keys plus the extension settings, the hysteresis tracker and the
        skipped-step count; ``{}`` when disabled. Synchronises (reads the device state)."""
        state = super().state_dict()  # type: ignore[misc]
        if not self._enabled:
            return state
        state.update({
            "hysteresis": self._hysteresis,
            "_hysteresis_tracker": self._get_hysteresis_tracker(),
            "consecutive_hysteresis": self._consecutive_hysteresis,
            "min_scale": self._min_scale,
            "max_scale": self._max_scale,
            "raise_at_min_scale": self._raise_at_min_scale,
            "dynamic": self._dynamic,
            "skip_on_overflow": self._skip_on_overflow,
            "skipped_steps": self.skipped_steps,
        })
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state_dict of this class or of ``torch.amp.GradScaler`` (whose missing
        extension keys keep this instance's settings). Unknown keys are ignored, as torch."""
        super().load_state_dict(state_dict)  # type: ignore[misc]
        if not self._enabled:
            return
        for key in _SETTINGS:
            if key in state_dict:
                setattr(self, "_" + key, state_dict[key])
        self._refresh_params()
        for key, attr, tensor in (
            ("_hysteresis_tracker", "_init_hysteresis_tracker", self._hysteresis_tracker_state),
            ("skipped_steps", "_init_skipped_steps", self._skipped_steps_t),
        ):
            if key in state_dict:
                setattr(self, attr, int(state_dict[key]))
                if tensor is not None:
                    tensor.fill_(int(state_dict[key]))

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()  # type: ignore[misc]
        if self._enabled:
            state["_init_hysteresis_tracker"] = self._get_hysteresis_tracker()
            state["_init_skipped_steps"] = self.skipped_steps
            for key in ("_hysteresis_tracker_state", "_skipped_steps_t", "_last_step_skipped",
                        "_params_t"):
                state[key] = None
        state["_process_group"] = None  # process groups do not pickle; set it again after load
        return state
