"""Where the time goes in the cases where a GPU figure of gpu_figures.py is host-bound: device time
(the kernels' own, from ``torch.profiler``) against wall time per call, in one run.

    python benchmarks/gpu_profile.py --out DIR     # on the GPU: DIR/profile.txt
    python benchmarks/gpu_profile.py --smoke       # CPU plumbing check (CI), tiny sizes

* ``many``: ``ops.non_finite_check_and_unscale_`` over many tensors (one chunk-table launch),
  the same sizes as one GradBuckets buffer, and torch's foreach op. A call whose wall time is
  well above its device time is host-bound: ``do_bench`` (gpu_figures.py) then times the host,
  and the device-time ratio is the kernels' own;
* ``train``: one step of gpu_figures' transformer with each scaler: wall and device
  milliseconds per step and the ops with the most device time (``ours + GradBuckets`` against
  ``ours`` shows what the buckets add).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _gpu_cases as cases  # noqa: E402


def _kernel_or_copy(event) -> bool:
    """A device-side event (a kernel, a copy); an op's own device time repeats its kernels'."""
    return getattr(event, "device_type", DeviceType.CPU) != DeviceType.CPU


def _self_device_us(event) -> float:
    return float(getattr(event, "self_device_time_total", 0.0)
                 or getattr(event, "self_cuda_time_total", 0.0) or 0.0)


def measure(fn: Callable[[], None], device: torch.device, calls: int) -> tuple[float, float, list]:
    """Wall ms per call (``calls`` back to back, one sync at the end), device ms per call (the
    sum of every kernel's and copy's own time in a profiled run of ``calls``; ops' device
    times, which repeat their kernels', left out), and the profiler's per-op averages."""
    fn()
    cases._sync(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    cases._sync(device)
    wall = (time.perf_counter() - start) / calls * 1e3
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda"
                                           else [])
    with profile(activities=activities) as prof:
        for _ in range(calls):
            fn()
        cases._sync(device)
    averages = prof.key_averages()
    device_ms = sum(map(_self_device_us, filter(_kernel_or_copy, averages))) / calls / 1e3
    return wall, device_ms, averages


def many_lines(device: torch.device, smoke: bool) -> list[str]:
    lines = ["## many tensors: wall and device ms per call", "",
             "| case | tensors | impl | wall ms | device ms | wall / device |", "|---|---|---|---|---|---|"]
    for case in cases.kernel_cases(device, smoke):
        if case.section not in ("many", "check"):
            continue
        for impl, fn in case.fns.items():
            wall, dev, _ = measure(fn, device, 3 if smoke else 20)
            ratio = f"{wall / dev:.1f}" if dev else "n/a"
            lines.append(f"| {case.section}: {case.name} | {case.tensors} | {impl} | {wall:.3f} | "
                         f"{dev:.3f} | {ratio} |")
            print(lines[-1], flush=True)
    return lines


def train_lines(device: torch.device, smoke: bool, top: int = 12) -> list[str]:
    lines = ["", "## training step: wall and device ms per step, top ops by device time", ""]
    for name in ("torch", "ours", "ours + GradBuckets"):
        step, params = cases.train_step(name, device, smoke)
        for _ in range(2 if smoke else 4):
            step()
        calls = 2 if smoke else 5
        wall, dev, averages = measure(step, device, calls)
        lines += [f"### {name} ({params / 1e6:.0f}M params): wall {wall:.2f} ms, device "
                  f"{dev:.2f} ms per step", "", "| op or kernel | calls / step | device ms / step |"
                  " cpu ms / step |", "|---|---|---|---|"]
        ranked = sorted(averages, key=lambda e: (_self_device_us(e), e.self_cpu_time_total),
                        reverse=True)
        for e in ranked[:top]:
            lines.append(f"| {e.key[:90]} | {e.count / calls:g} | {_self_device_us(e) / calls / 1e3:.3f} "
                         f"| {e.self_cpu_time_total / calls / 1e3:.3f} |")
        lines.append("")
        print("\n".join(lines[-top - 6:]), flush=True)
        del step
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/gpu"))
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny sizes (CI check)")
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.smoke else "cuda")
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("no CUDA device (use --smoke on CPU)")
    args.out.mkdir(parents=True, exist_ok=True)
    lines = [f"# GPU profile: {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}"
             f", torch {torch.__version__}", ""]
    lines += many_lines(device, args.smoke)
    (args.out / "profile.txt").write_text("\n".join(lines) + "\n")
    lines += train_lines(device, args.smoke)
    (args.out / "profile.txt").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
