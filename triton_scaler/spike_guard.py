"""``SpikeGuard``: adaptive clipping or skip-on-spike, decided on the device by the scaler's clip.

ZClip's rule (arXiv 2504.02507; ``zclip`` 1.0.0's ``ZClip``, applied after ``unscale_``) with
ZClip's argument names, kept in float64 on the device, fed by the pre-clip total norm that
``GradScaler.clip_grad_norm_`` computes anyway. See docs/stability.md.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ._dispatch import spike_guard_step
from .policy import as_int, as_real

__all__ = ["SpikeGuard"]

_MODES = ("zscore", "percentile")
_CLIP_OPTIONS = ("adaptive_scaling", "mean")
_ACTIONS = ("clip", "skip")
_EPS = 1e-6  # ZClip's eps in the z-score's denominator
#: The device statistics' order, as ``kernels/guard.py``'s ``STATS_LAYOUT`` (a test pins the two)
STATS_LAYOUT = ("count", "mean", "var", "limit", "spike", "spikes", "last_norm",
                "last_threshold", "last_step", "steps")
_N_STATS = len(STATS_LAYOUT)
_SPIKE = STATS_LAYOUT.index("spike")  # a skipping guard's update() reads and zeroes it
_LIMIT = STATS_LAYOUT.index("limit")
#: what a watch's report reads: spikes, last_norm, last_threshold, last_step
_RECORD = slice(STATS_LAYOUT.index("spikes"), STATS_LAYOUT.index("last_step") + 1)


def _choice(name: str, value: object, allowed: tuple[str, ...]) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be one of {list(allowed)}; got {type(value).__name__} "
                        f"{value!r}")
    if value.lower() not in allowed:
        raise ValueError(f"{name} must be one of {list(allowed)}; got {value!r}")
    return value.lower()


class SpikeGuard:
    """A gradient-norm spike guard for :meth:`GradScaler.clip_grad_norm_`
    (``GradScaler(..., spike_guard=SpikeGuard())``), ZClip's rule on the device.

    For its first ``warmup_steps`` finite steps it collects the pre-clip total norm and clips
    at ``max_norm``; then it keeps an EMA of the norm's mean and variance. A step whose norm is
    a spike (``mode="zscore"``: its z-score against the EMA is above ``z_thresh``;
    ``"percentile"``: it is above ``mean + z_thresh * std``) is clipped at ZClip's adaptive
    threshold (``action="clip"``, at most ``max_norm``), or skipped (``action="skip"``: the
    optimizer step is not taken and the EMA does not see it; the scale does not back off).
    An overflow step (a non-finite norm) leaves the statistics unchanged. One guarded clip per
    iteration and scaler.

    Args:
        alpha: the EMA's smoothing factor, in (0, 1).
        z_thresh: the z-score (or the number of standard deviations) above which a norm is a
            spike, > 0.
        warmup_steps: finite steps collected before the EMA starts, an int >= 1.
        mode: ``"zscore"`` or ``"percentile"``.
        clip_option: with ``"zscore"``, the threshold of a spike: ``"adaptive_scaling"``
            (``mean + z_thresh * std / (z / z_thresh)``, times ``clip_factor``) or ``"mean"``.
        clip_factor: the adaptive threshold's factor, > 0.
        action: ``"clip"`` or ``"skip"``.

    Raises:
        TypeError, ValueError: a bad setting, named.
    """

    def __init__(self, alpha: float = 0.97, z_thresh: float = 2.5, warmup_steps: int = 25,
                 mode: str = "zscore", clip_option: str = "adaptive_scaling",
                 clip_factor: float = 1.0, action: str = "clip") -> None:
        self.alpha = as_real("alpha", alpha)
        if not 0.0 < self.alpha < 1.0:
            raise ValueError(f"alpha must be in (0, 1); got {alpha!r}")
        self.z_thresh = as_real("z_thresh", z_thresh)
        if not 0.0 < self.z_thresh < math.inf:
            raise ValueError(f"z_thresh must be a finite number > 0; got {z_thresh!r}")
        self.warmup_steps = as_int("warmup_steps", warmup_steps, 1, 2**53, "an int >= 1")
        self.mode = _choice("mode", mode, _MODES)
        self.clip_option = _choice("clip_option", clip_option, _CLIP_OPTIONS)
        self.clip_factor = as_real("clip_factor", clip_factor)
        if not 0.0 < self.clip_factor < math.inf:
            raise ValueError(f"clip_factor must be a finite number > 0; got {clip_factor!r}")
        self.action = _choice("action", action, _ACTIONS)
        self._stats: torch.Tensor | None = None  # on the norm's device, made on first use
        self._settings: torch.Tensor | None = None
        self._max_norm: float | None = None  # the max_norm in _settings
        self._statistics = [0.0] * _N_STATS  # before the device state is made (a checkpoint)

    def settings(self) -> dict[str, Any]:
        """The constructor's arguments, as given (normalised)."""
        return {"alpha": self.alpha, "z_thresh": self.z_thresh,
                "warmup_steps": self.warmup_steps, "mode": self.mode,
                "clip_option": self.clip_option, "clip_factor": self.clip_factor,
                "action": self.action}

    @property
    def skips(self) -> bool:
        """Whether a spike skips the step (``action="skip"``)."""
        return self.action == "skip"

    def limit(self, norm: torch.Tensor, max_norm: float, backend: str) -> torch.Tensor:
        """One guard step from this step's total ``norm`` (0-d, before clipping): the
        statistics are updated on ``norm``'s device, and the result is this step's max norm
        (0-d float64: ``max_norm``, or a spike's threshold below it). No host sync, but the
        statistics' one read when ``norm`` is on another device than the last step's."""
        stats = self._stats
        if stats is None or stats.device != norm.device:
            stats = self._stats = torch.tensor(self._statistics if stats is None
                                               else stats.tolist(), dtype=torch.float64,
                                               device=norm.device)
            self._settings = None
        if self._settings is None or self._max_norm != max_norm:
            self._settings = torch.tensor(
                [self.alpha, 1.0 - self.alpha, self.z_thresh, _EPS, self.clip_factor, max_norm,
                 float(self.warmup_steps)], dtype=torch.float64, device=norm.device)
            self._max_norm = max_norm
        spike_guard_step(stats, self._settings, norm, self.mode == "zscore",
                         self.clip_option == "mean", self.skips, backend)
        return stats[_LIMIT]

    def skip_statistics(self) -> torch.Tensor | None:
        """The device statistics whose spike ``update()`` records as a skipped step and
        zeroes: a skipping guard's, once it has run; else None."""
        return self._stats if self.skips else None

    def spike(self) -> torch.Tensor | None:
        """This iteration's spike flag (0-d float64 view, 0 or 1), None before the first
        step."""
        return None if self._stats is None else self._stats[_SPIKE]

    def spike_record(self) -> torch.Tensor | None:
        """The spikes so far, the last one's norm, threshold and step (a float64 view of the
        device statistics), None before the first step."""
        return None if self._stats is None else self._stats[_RECORD]

    def statistics(self) -> dict[str, float]:
        """The statistics by name: ``count`` (finite warm-up steps seen), ``mean`` and
        ``var`` (during the warm-up: the norms' sum and squared deviations), ``limit`` and
        ``spike`` (the last step's), ``spikes``, ``last_norm``, ``last_threshold``,
        ``last_step`` (the last spike's) and ``steps``.

        .. note:: Synchronises with the host (one read of the device statistics).
        """
        values = self._statistics if self._stats is None else self._stats.tolist()
        return dict(zip(STATS_LAYOUT, values))

    def state_dict(self) -> dict[str, Any]:
        """The settings and the statistics (float64 values, exact).

        .. note:: Synchronises with the host (one read of the device statistics).
        """
        values = self._statistics if self._stats is None else self._stats.tolist()
        return {**self.settings(), "statistics": values}

    @classmethod
    def from_state_dict(cls, state: Any, name: str = "spike_guard") -> SpikeGuard:
        """A guard with ``state``'s settings and statistics (:meth:`state_dict`); errors name
        the entry under ``name``."""
        if not isinstance(state, dict):
            raise TypeError(f"{name} must be a dict; got {type(state).__name__}")
        values = state.get("statistics")
        if not isinstance(values, (list, tuple)) or len(values) != _N_STATS or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            raise ValueError(f"{name}['statistics'] must be a list of {_N_STATS} numbers; got "
                             f"{values!r}")
        try:
            guard = cls(**{k: v for k, v in state.items() if k != "statistics"})
        except TypeError as error:
            raise TypeError(f"{name}: {error}") from None
        except ValueError as error:
            raise ValueError(f"{name}: {error}") from None
        guard._statistics = [float(v) for v in values]
        return guard

    def load_from(self, other: SpikeGuard) -> None:
        """Take ``other``'s settings and statistics (in place: the device state is refilled
        without a host sync)."""
        self.__dict__.update({k: v for k, v in other.settings().items()})
        self._statistics = list(other._statistics)
        self._settings = None
        if self._stats is not None:  # filled in place: no upload, no host sync
            for slot, value in zip(self._stats, self._statistics):
                slot.fill_(value)
