"""One scaler step as a timeline: every host op, CUDA runtime / driver call and device kernel
of ``scale -> unscale_ -> step -> update`` (``_host_cost.make_step``, optimizer steps
stubbed), with its start and length in microseconds from the step's start, from
``torch.profiler``. Where ``_host_wait.py`` says which call of a step holds its time, this
says what inside it does: a launch, a pinned host allocation, a copy, a wait.

    python benchmarks/_step_timeline.py --device cuda 10000 "ours, plain, GradBuckets"

Each of ``--steps`` steps starts on an idle device (a synchronize before it) and is marked
by a ``record_function``; the step of median length is printed. The profiler's own overhead
lengthens every op (a few microseconds each), so read the gaps and the long entries, not
the total. On CPU (the default device) the launches are no-ops (``_host_stubs.py``)."""

from __future__ import annotations

import argparse
import contextlib
import statistics

import torch
from _host_cost import make_step
from _host_stubs import noop_launches
from _host_wait import CASES
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

_MARK = "timed step "


def _span(event) -> tuple[float, float]:
    return event.time_range.start, event.time_range.end


def _on_device(event) -> bool:
    return getattr(event, "device_type", DeviceType.CPU) != DeviceType.CPU


def timeline(n_params: int, case: str, device: str, steps: int) -> tuple[float, list[tuple]]:
    """(the printed step's length in us, [(start us, length us, where, name)] of the events
    from its start to the next step's, start order)."""
    impl, flags = {name: (impl, flags) for name, impl, flags in CASES}[case]
    prepare, step = make_step(impl, n_params, device=device, **flags)
    for _ in range(3):
        prepare()
        step()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        for k in range(steps):
            prepare()
            sync()
            with record_function(f"{_MARK}{k}"):
                step()
            sync()
    events = list(prof.events())
    # (on a GPU each mark also has a device-side copy, which spans the step's kernels)
    marks = sorted((e for e in events if e.name.startswith(_MARK) and not _on_device(e)),
                   key=lambda e: _span(e)[0])
    lengths = [_span(m)[1] - _span(m)[0] for m in marks]
    pick = lengths.index(statistics.median_low(lengths))
    start = _span(marks[pick])[0]
    stop = _span(marks[pick + 1])[0] if pick + 1 < len(marks) else float("inf")
    rows = []
    for event in events:
        begin, end = _span(event)
        if start <= begin < stop and not event.name.startswith(_MARK):
            where = "device" if _on_device(event) else "cpu"
            rows.append((begin - start, end - begin, where, event.name))
    return lengths[pick], sorted(rows + _host_gaps(sorted(rows), lengths[pick]))


def _host_gaps(rows: list[tuple], length: float) -> list[tuple]:
    """The stretches of the step with no host op running: Python (the scaler's own, or the
    interpreter's) between the ops, as rows of their own."""
    gaps, covered = [], 0.0
    for begin, span, where, _ in rows:
        if where == "cpu":
            if begin > covered:
                gaps.append((covered, begin - covered, "cpu", "(between ops: Python)"))
            covered = max(covered, begin + span)
    if length > covered:
        gaps.append((covered, length - covered, "cpu", "(between ops: Python)"))
    return gaps


def main(n_params: int, case: str, device: str, steps: int, min_us: float) -> None:
    with noop_launches() if device == "cpu" else contextlib.nullcontext():
        length, rows = timeline(n_params, case, device, steps)
    print(f"{case}, {n_params} params, device {device}, torch {torch.__version__}: step "
          f"{length:.0f} us under the profiler (median of {steps}); events from its start, "
          f"those of {min_us:g} us or more")
    print("| start us | length us | where | event |\n|---|---|---|---|")
    for begin, span, where, name in rows:
        if span >= min_us:
            print(f"| {begin:.1f} | {span:.1f} | {where} | {name[:80]} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("params", type=int, nargs="?", default=10000)
    parser.add_argument("case", nargs="?", default=CASES[0][0],
                        choices=[name for name, _, _ in CASES])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--steps", type=int, default=9)
    parser.add_argument("--min-us", type=float, default=1.0,
                        help="leave out events shorter than this")
    args = parser.parse_args()
    main(args.params, args.case, args.device, args.steps, args.min_us)
