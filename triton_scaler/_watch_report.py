"""What :meth:`triton_scaler.telemetry.GradWatch.report` returns (:class:`WatchReport`, with
the last :class:`Overflow`) and raises (:class:`SkippedStepsError`): host-side values only."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable


class SkippedStepsError(RuntimeError):
    """More than ``max_consecutive_skips`` steps in a row were skipped (the loss scale cannot
    find a value at which the gradients are finite): raised by :meth:`GradWatch.report`, or
    by ``update()`` every ``check_every`` updates when that is set."""


@dataclasses.dataclass(frozen=True)
class Overflow:
    """The last iteration whose gradients had inf or NaN values.

    Attributes:
        step: the iteration's index since ``watch()`` (the number of ``update()`` calls
            before it).
        tensors: ``(name, inf count, NaN count)`` of each watched parameter with non-finite
            values, the parameter registered last first (for a model: nearest the loss, the
            likely origin: inf and NaN spread backwards through the graph).
        scale: the loss scale of that iteration.
    """

    step: int
    tensors: list[tuple[str, int, int]]
    scale: float

    def __str__(self) -> str:
        if not self.tensors:
            return (f"overflow at step {self.step} (scale {self.scale:g}): in no watched "
                    "parameter")
        lines = [f"overflow at step {self.step} (scale {self.scale:g}), "
                 f"{len(self.tensors)} parameter(s) with non-finite gradients, nearest the loss "
                 "first:"]
        lines += [f"  {name}: {inf} inf, {nan} NaN" for name, inf, nan in self.tensors]
        return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class Spike:
    """The last gradient-norm spike a :class:`~triton_scaler.SpikeGuard` found.

    Attributes:
        step: the guard's step at the spike (its clips since the run began, 1 for the first;
            a checkpoint carries it).
        norm: the total norm of that step, before clipping.
        threshold: the guard's threshold there (the norm it clipped to, before the min with
            ``max_norm``; for a skipping guard, the one the norm exceeded).
    """

    step: int
    norm: float
    threshold: float


@dataclasses.dataclass(frozen=True)
class WatchReport:
    """What :meth:`GradWatch.report` read: Python numbers only.

    Attributes:
        step: ``update()`` calls since ``watch()``.
        norm: per parameter name, the L2 norm of its unscaled gradient before clipping, at
            the last iteration that unscaled or checked the grads (NaN: never seen; see
            ``has_grad``).
        amax: per parameter name, the largest absolute value there (NaN when it had a NaN).
        nonfinite: per parameter name, ``(inf count, NaN count)`` there.
        has_grad: per parameter name, whether it had a gradient there.
        last_overflow: the last iteration with non-finite gradients, or None.
        scale: the loss scale now.
        skipped_steps: steps skipped since the scaler was made.
        consecutive_skips: steps skipped in a row up to now.
        most_consecutive_skips: the longest run of skipped steps since the last report
            (a spike guard's skips count).
        spikes: spikes the scaler's spike guard found since the run began (0: none, or no
            guard).
        last_spike: the last of them, or None.
    """

    step: int
    norm: dict[str, float]
    amax: dict[str, float]
    nonfinite: dict[str, tuple[int, int]]
    has_grad: dict[str, bool]
    last_overflow: Overflow | None
    scale: float
    skipped_steps: int
    consecutive_skips: int
    most_consecutive_skips: int
    spikes: int = 0
    last_spike: Spike | None = None

    @property
    def total_norm(self) -> float:
        """The L2 norm of all watched gradients together (those that had one)."""
        return math.sqrt(sum(n * n for name, n in self.norm.items() if self.has_grad[name]))

    def metrics(self, prefix: str = "", rollup: str | Callable[[str], str] | None = None
                ) -> dict[str, float]:
        """A flat ``{name: float}`` for any logger.

        Args:
            prefix: put before every key, e.g. ``"grad/"``.
            rollup: None for one entry per parameter; ``"module"`` for one per module (the
                name up to its last dot); or a function from a parameter name to its group.
                A group's norm is the L2 norm over its members, its amax their largest, its
                counts their sums.

        Returns:
            ``{prefix}{name}/norm``, ``/amax``, ``/inf``, ``/nan`` per parameter or group
            (those that had a gradient), and ``{prefix}total_norm``, ``scale``,
            ``skipped_steps``, ``consecutive_skips``, ``nonfinite_params``, ``spikes``, and
            after a spike ``last_spike_step``, ``last_spike_norm``, ``last_spike_threshold``.
        """
        group_of = _group_function(rollup)
        groups: dict[str, list[float]] = {}
        for name in self.norm:
            if not self.has_grad[name]:
                continue
            inf, nan = self.nonfinite[name]
            acc = groups.setdefault(group_of(name), [0.0, 0.0, 0.0, 0.0])
            acc[0] += self.norm[name] ** 2
            acc[1] = _nan_max(acc[1], self.amax[name])
            acc[2] += inf
            acc[3] += nan
        out: dict[str, float] = {}
        for group, (sumsq, amax, infs, nans) in groups.items():
            out[f"{prefix}{group}/norm"] = math.sqrt(sumsq)
            out[f"{prefix}{group}/amax"] = amax
            out[f"{prefix}{group}/inf"] = infs
            out[f"{prefix}{group}/nan"] = nans
        out[f"{prefix}total_norm"] = self.total_norm
        out[f"{prefix}scale"] = self.scale
        out[f"{prefix}skipped_steps"] = float(self.skipped_steps)
        out[f"{prefix}consecutive_skips"] = float(self.consecutive_skips)
        out[f"{prefix}nonfinite_params"] = float(sum(
            1 for name, (inf, nan) in self.nonfinite.items() if inf or nan))
        out[f"{prefix}spikes"] = float(self.spikes)
        if self.last_spike is not None:
            out[f"{prefix}last_spike_step"] = float(self.last_spike.step)
            out[f"{prefix}last_spike_norm"] = self.last_spike.norm
            out[f"{prefix}last_spike_threshold"] = self.last_spike.threshold
        return out


def _nan_max(a: float, b: float) -> float:
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)


def _group_function(rollup: str | Callable[[str], str] | None) -> Callable[[str], str]:
    if rollup is None:
        return lambda name: name
    if rollup == "module":
        return lambda name: name.rpartition(".")[0] or name
    if callable(rollup):
        return rollup
    raise ValueError(f"rollup must be None, 'module' or a function of a name; got {rollup!r}")
