"""Gradient telemetry from the scaler's own calls: :meth:`GradScaler.watch` returns a
:class:`GradWatch`, whose :meth:`~GradWatch.report` gives per-parameter norms, amax and inf /
NaN counts of the unscaled gradients, the last overflow named by parameter, and the skipped
steps, with one device-to-host copy. Nothing is read on the host before ``report()``.
"""

from __future__ import annotations

import math
import operator
import weakref
from collections.abc import Callable
from typing import Any

import torch

from ._compile import is_traced
from ._dispatch import watch_stats
from ._distributed import is_dtensor, mesh_layout
from ._grads import param_lists, same_param_lists
from ._plans import upload
from ._watch_params import named_parameters_of, reduced_over_shards
from ._watch_report import Overflow, SkippedStepsError, Spike, WatchReport

__all__ = ["GradWatch", "WatchReport", "Overflow", "SkippedStepsError", "Spike"]

#: the columns of a watch's per-parameter stats (then: seen); the norm's square is kept
_AMAX, _SUMSQ, _INF, _NAN = range(4)
_GRAD = operator.attrgetter("grad")
_DTYPE = operator.attrgetter("dtype")
_DEVICE = operator.attrgetter("device")
_NUMEL = torch.Tensor.numel


class GradWatch:
    """Per-parameter gradient statistics from a :class:`triton_scaler.GradScaler`'s own
    calls. Made by :meth:`GradScaler.watch`; see docs/telemetry.md.

    Each ``unscale_``, ``clip_grad_norm_`` or fused-route ``step`` records, on the device,
    each watched parameter's unscaled gradient's amax, L2 norm and inf / NaN counts (the
    values before clipping); each ``update()`` records an overflow and the run of skipped
    steps. Only :meth:`report` reads them on the host (one copy).
    """

    def __init__(self, model: Any, max_consecutive_skips: int | None = None,
                 check_every: int | None = None, *, backend: str = "auto",
                 process_group: Any = None,
                 scale_and_skips: Callable[[torch.device | None], torch.Tensor] | None = None,
                 on_close: Callable[[], None] | None = None) -> None:
        if max_consecutive_skips is not None and (
                isinstance(max_consecutive_skips, bool)
                or not isinstance(max_consecutive_skips, int) or max_consecutive_skips < 0):
            raise ValueError("max_consecutive_skips must be None or an int >= 0; got "
                             f"{max_consecutive_skips!r}")
        if check_every is not None and (isinstance(check_every, bool) or
                                        not isinstance(check_every, int) or check_every < 1):
            raise ValueError(f"check_every must be None or an int >= 1; got {check_every!r}")
        if check_every is not None and max_consecutive_skips is None:
            raise ValueError("check_every needs max_consecutive_skips")
        pairs = named_parameters_of(model)
        # what the scaler hands in: its backend and process group, its float64 ``(scale,
        # skipped steps)`` on a given device (None: the scale's) for reports, and what
        # detaches the watch from it
        self._backend, self._process_group = backend, process_group
        self._scale_and_skips = scale_and_skips or _no_scaling
        self._on_close = on_close
        self.names: tuple[str, ...] = tuple(name for name, _ in pairs)
        self.max_consecutive_skips = max_consecutive_skips
        self.check_every = check_every
        self._index = {id(p): i for i, (_, p) in enumerate(pairs)}
        self._state: dict[str, torch.Tensor] | None = None
        #: the last rows written by _observe and their device index tensor (a loop writes the
        #: same rows every step: uploaded once)
        self._rows: tuple[tuple[int, ...], torch.Tensor] | None = None
        self._seen_any: set[int] | None = set()  # until the first update: which were seen
        #: the last optimizer asked for (weakly), its parameter lists and its watched
        #: parameters (:meth:`_watched_of`)
        self._watched: tuple | None = None
        #: the rows of DTensor grads sharded over process groups: those groups, by row (a
        #: report reduces their shards' numbers over them); a scaler with a process_group
        #: (ShardedGradScaler, FSDP1) reduces every row over it
        self._sharded: dict[int, tuple[Any, ...]] = {}
        self._updates = 0
        self._closed = False

    # ------------------------------------------------------------------ device state
    def _device_state(self, device: torch.device) -> dict[str, torch.Tensor]:
        state = self._state
        if state is None:
            n = len(self.names)
            stats = torch.zeros((n, 5), dtype=torch.float64, device=device)
            stats[:, _AMAX] = math.nan
            stats[:, _SUMSQ] = math.nan
            state = self._state = {
                "stats": stats,  # amax, norm**2, inf, nan, seen (float64: exact counts)
                # the rows of a parameter without a grad, and of an empty grad
                "fill": torch.tensor([[math.nan, math.nan, 0.0, 0.0, 0.0],
                                      [0.0, 0.0, 0.0, 0.0, 1.0]], dtype=torch.float64,
                                     device=device),
                "overflow": torch.zeros((n, 2), dtype=torch.float64, device=device),
                # step of the last overflow (-1: none), its scale, iteration, the run of
                # skipped steps, the longest run since the last report
                "counters": torch.tensor([-1.0, 0.0, 0.0, 0.0, 0.0], dtype=torch.float64,
                                         device=device),
            }
        return state

    def _observe(self, optimizer: Any, inv_scale: torch.Tensor) -> None:
        """Record the stats of the watched grads of ``optimizer``, still scaled, times
        ``inv_scale`` (the values an unscale by it gives, bit for bit): one
        :func:`~._dispatch.watch_stats` per device and dtype. In eager code the watched
        parameters of the optimizer's lists are kept while it holds the same lists
        (:meth:`_watched_of`), and non-empty plain grads of one device and dtype are read
        with C-level passes. Device ops only."""
        if is_traced():
            self._observe_rows(self._watched_in(optimizer), inv_scale)
            return
        rows, params, watched = self._watched_of(optimizer)
        grads = list(map(_GRAD, params))
        if not grads or set(map(type, grads)) != {torch.Tensor} or 0 in map(_NUMEL, grads) \
                or len(set(map(_DTYPE, grads))) != 1 or len(set(map(_DEVICE, grads))) != 1:
            self._observe_rows(watched, inv_scale)
            return
        stats = self._device_state(inv_scale.device)["stats"]
        values = watch_stats(grads, inv_scale.to(grads[0].device), self._backend)
        stats.index_copy_(0, self._row_index(rows, stats.device), values.to(stats.device))
        if self._seen_any is not None:
            self._seen_any.update(rows)

    def _watched_of(self, optimizer: Any) -> tuple[tuple[int, ...], list, list]:
        """The watched parameters of ``optimizer`` (:meth:`_watched_in`) with their rows and
        themselves apart: kept for the last optimizer asked for while it holds the same
        parameter lists of the same lengths (``_grads.same_param_lists``)."""
        kept = self._watched
        if kept is not None and kept[0]() is optimizer and \
                same_param_lists(kept[1], optimizer.param_groups):
            return kept[2]
        watched = self._watched_in(optimizer)
        found = (tuple(i for i, _ in watched), [p for _, p in watched], watched)
        try:
            self._watched = (weakref.ref(optimizer), param_lists(optimizer.param_groups), found)
        except TypeError:  # an optimizer-like object that takes no weak reference
            self._watched = None
        return found

    def _watched_in(self, optimizer: Any) -> list[tuple[int, torch.Tensor]]:
        """``(row, parameter)`` of each watched parameter of ``optimizer``."""
        index = self._index
        watched = []
        for group in optimizer.param_groups:  # loops: code that dynamo traces
            for p in group["params"]:
                i = index.get(id(p))
                if i is not None:
                    watched.append((i, p))
        return watched

    def _observe_rows(self, watched: list[tuple[int, torch.Tensor]],
                      inv_scale: torch.Tensor) -> None:
        """:meth:`_observe` of the ``(row, parameter)`` pairs ``watched``."""
        if not watched:
            return
        no_grad: list[int] = []
        empty: list[int] = []
        groups: dict[tuple, tuple[list[int], list[torch.Tensor]]] = {}
        meshes: dict = {}
        for i, p in watched:
            grad = p.grad
            if grad is not None and type(grad) is not torch.Tensor and is_dtensor(grad):
                grad, layout = mesh_layout(grad, meshes)  # its local shard
                assert layout is not None
                if layout.agreed_over:
                    self._sharded[i] = layout.agreed_over
            if grad is None:
                no_grad.append(i)
            elif grad.numel() == 0:
                empty.append(i)
            else:
                key = (grad.device, grad.dtype)
                if key not in groups:
                    groups[key] = ([], [])
                groups[key][0].append(i)
                groups[key][1].append(grad)
        state = self._device_state(inv_scale.device)
        device = state["stats"].device
        written: list[int] = []
        values: list[torch.Tensor] = []
        for (grad_device, _), (rows, grads) in groups.items():
            values.append(watch_stats(grads, inv_scale.to(grad_device), self._backend)
                          .to(device))
            written += rows
        fill = state["fill"]
        for rows, row in ((no_grad, 0), (empty, 1)):
            if rows:
                values.append(fill[row].expand(len(rows), 5))
                written += rows
        traced = is_traced()
        index = torch.tensor(written, dtype=torch.int64, device=device) if traced else \
            self._row_index(tuple(written), device)
        state["stats"].index_copy_(0, index, torch.cat(values))
        if not traced and self._seen_any is not None:
            self._seen_any.update(written)

    def _row_index(self, rows: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """``rows`` as a device index tensor: the one made for the last call when the rows
        are the same (no upload in a loop's steady state)."""
        kept = self._rows
        if kept is None or kept[0] != rows:
            kept = self._rows = (rows, upload(torch.tensor(rows, dtype=torch.int64), device))
        return kept[1]

    def update_tensors(self, device: torch.device
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What each ``update()`` records into before the scale changes: ``(stats,
        overflow, counters)`` (made on ``device``, the scale's, when nothing was recorded
        yet), read by the update's own launch when on the scale's device, else by
        :func:`reference.record_watch_` (as in traced code); see
        :func:`~._dispatch.scaler_update`. Then :meth:`_updated`."""
        state = self._device_state(device)
        return state["stats"], state["overflow"], state["counters"]

    def _updated(self) -> None:
        """After an eager ``update()``: the warning about parameters never seen (at the
        first), and every ``check_every`` updates a :meth:`report` (a host read). Nothing in
        traced code (a compiled update counts nothing on the host)."""
        if self._seen_any is None and self.check_every is None or is_traced():
            return  # a loop's steady state without check_every: nothing
        if self._seen_any is not None:
            self._warn_unseen()
        if self.check_every is not None:
            self._updates += 1
            if self._updates % self.check_every == 0:
                self.report()  # raises SkippedStepsError past the limit

    def _warn_unseen(self) -> None:
        """At the first update: warn once about watched parameters no optimizer of the
        scaler holds (a name that matches nothing the scaler steps)."""
        seen, self._seen_any = self._seen_any, None
        assert seen is not None
        unseen = [name for i, name in enumerate(self.names) if i not in seen]
        if unseen:
            from ._warn import warn_at_caller

            shown = ", ".join(unseen[:5]) + (f" and {len(unseen) - 5} more"
                                             if len(unseen) > 5 else "")
            warn_at_caller(f"watched parameters that no optimizer stepped by this scaler holds "
                           f"(their gradients are never seen): {shown}", UserWarning)

    # ------------------------------------------------------------------ host side
    def report(self) -> WatchReport:
        """Read the statistics: one device-to-host copy.

        Returns:
            A :class:`WatchReport`.

        Raises:
            SkippedStepsError: more than ``max_consecutive_skips`` steps in a row were skipped
                since the last report (the report's numbers are in the error's ``report``).
            RuntimeError: the watch was closed.

        With sharded gradients (DTensor parameters: FSDP2, tensor parallel; or a scaler with
        a ``process_group``: ShardedGradScaler, FSDP1) the shards' numbers are reduced first:
        two collectives per process group, so every rank of those groups must call it.

        .. note:: Synchronises with the host (one copy).
        """
        if self._closed:
            raise RuntimeError("this watch was closed")
        n = len(self.names)
        extra = self._scale_and_skips(None if self._state is None else self._state["stats"].device)
        state = self._device_state(extra.device)
        counters = state["counters"]
        stats, overflow = reduced_over_shards(state["stats"], state["overflow"],
                                              self._sharded, self._process_group)
        packed = torch.cat([stats.t().reshape(-1), overflow.t().reshape(-1), counters, extra])
        values = packed.tolist()  # the one host copy
        spikes, spike_norm, spike_threshold, spike_step = values[-6:-2]
        scale_now, skipped = values[-2], int(values[-1])
        counters[4].fill_(0)  # the longest run of skipped steps: since this report
        columns = [values[k * n:(k + 1) * n] for k in range(7)]
        amax, sumsq, inf, nan, seen, over_inf, over_nan = columns
        norm = [math.sqrt(x) if x >= 0 else x for x in sumsq]  # NaN: never seen, or NaN
        last_step, last_scale, iteration, run, most = values[7 * n:7 * n + 5]
        names = self.names
        last_overflow = None
        if last_step >= 0:
            tensors = [(names[i], int(over_inf[i]), int(over_nan[i])) for i in reversed(range(n))
                       if over_inf[i] or over_nan[i]]
            last_overflow = Overflow(int(last_step), tensors, last_scale)
        report = WatchReport(
            step=int(iteration),
            norm=dict(zip(names, norm)), amax=dict(zip(names, amax)),
            nonfinite={name: (int(i), int(j)) for name, i, j in zip(names, inf, nan)},
            has_grad={name: bool(s) for name, s in zip(names, seen)},
            last_overflow=last_overflow, scale=scale_now, skipped_steps=skipped,
            consecutive_skips=int(run), most_consecutive_skips=int(most), spikes=int(spikes),
            last_spike=Spike(int(spike_step), spike_norm, spike_threshold) if spikes else None)
        self._raise_if_too_many_skips(most, report)
        return report

    def _raise_if_too_many_skips(self, most: float, report: WatchReport) -> None:
        limit = self.max_consecutive_skips
        if limit is None or most <= limit:
            return
        overflow = report.last_overflow
        where = ""
        if overflow is not None and overflow.tensors:
            shown, more = overflow.tensors[:8], len(overflow.tensors) - 8
            where = (f"; the last overflow (step {overflow.step}) was in: "
                     + ", ".join(f"{name} ({inf} inf, {nan} NaN)" for name, inf, nan in shown)
                     + (f" and {more} more (report().last_overflow lists all)" if more > 0
                        else ""))
        error = SkippedStepsError(
            f"{int(most)} steps in a row were skipped (max_consecutive_skips={limit}); the "
            f"scale is {report.scale:g}{where}")
        error.report = report  # type: ignore[attr-defined]
        raise error

    def close(self) -> None:
        """Stop watching: the scaler records nothing more, and a new watch can be made."""
        if not self._closed:
            self._closed = True
            if self._on_close is not None:
                self._on_close()

    def __repr__(self) -> str:
        return f"GradWatch({len(self.names)} parameters{', closed' if self._closed else ''})"


def _no_scaling(device: torch.device | None) -> torch.Tensor:
    """``(no spikes, scale, skipped steps)`` of a watch without a scaler behind it: zeros,
    1.0 and 0."""
    return torch.tensor([0.0] * 4 + [1.0, 0.0], dtype=torch.float64, device=device or "cpu")
