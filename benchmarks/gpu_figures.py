"""The GPU figures in one run, each against torch measured in the same run.

    python benchmarks/gpu_figures.py --out DIR           # on the GPU: DIR/figures.json, .md
    python benchmarks/gpu_figures.py --plot DIR          # anywhere with matplotlib: DIR/*.png
    python benchmarks/gpu_figures.py --smoke --out DIR   # CPU plumbing check (CI), tiny sizes

Kernels are timed with ``triton.testing.do_bench``: CUDA events, median over repetitions with
the L2 cache flushed between them (sizes under 50 MB would otherwise report L2 bandwidth).
GB/s counts bytes read + written. Sections (see ``benchmarks/_gpu_cases.py``):

* ``flat``: one bucket, triton_scaler's unscale against torch's
  ``_amp_foreach_non_finite_check_and_unscale_`` and ``Tensor.copy_`` (the bandwidth ceiling);
* ``many``: many tensors in one chunk-table launch, and the same sizes as one GradBuckets
  buffer, against torch's foreach op over the list;
* ``check``: the fused-optimizer route's read-only check against torch's
  ``_check_inf_per_device`` (the same foreach op with ``inv_scale = 1``);
* ``host``: host time of ``scale -> unscale_ -> step -> update`` with real launches;
* ``train``: one training step of a ~100M-parameter transformer (fused AdamW, fp16 autocast).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _gpu_cases as cases  # noqa: E402

TARGETS = {"flat": "ours >= 90% of copy_ bandwidth at >= 1e8 elements",
           "many": "ratio to torch >= 2 (chunk table), more with GradBuckets",
           "check": "ratio to torch >= 1.8", "host": "ours / torch <= 1.2"}


def timer(smoke: bool):
    """Median milliseconds of ``fn``: do_bench on the GPU, perf_counter in smoke mode."""
    if not smoke:
        from triton.testing import do_bench

        return lambda fn: do_bench(fn, warmup=25, rep=100, return_mode="median")

    def cpu_time(fn):
        fn()
        times = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e3
    return cpu_time


def kernel_rows(device: torch.device, smoke: bool) -> list[dict]:
    """flat / many / check rows: milliseconds, GB/s and ratios, one row per case."""
    bench = timer(smoke)
    rows = []
    for case in cases.kernel_cases(device, smoke):
        timed = {}
        for impl, fn in case.fns.items():
            try:
                timed[impl] = bench(fn)
            except RuntimeError as error:  # torch's op without this dtype: recorded, not fatal
                timed[impl] = None
                case.notes.append(f"{impl}: {str(error).splitlines()[0][:120]}")
        row = {"section": case.section, "case": case.name, "dtype": case.dtype,
               "elements": case.elements, "tensors": case.tensors, "ms": timed,
               "gbps": {k: (case.bytes_of(k) / (t * 1e-3) / 1e9 if t else None)
                        for k, t in timed.items()},
               "notes": case.notes}
        ours, theirs, copy = timed.get("ours"), timed.get("torch"), timed.get("copy")
        row["ratio_vs_torch"] = theirs / ours if ours and theirs else None
        if "ours_buckets" in timed and theirs and timed["ours_buckets"]:
            row["ratio_buckets_vs_torch"] = theirs / timed["ours_buckets"]
        if copy and ours:
            row["fraction_of_copy"] = row["gbps"]["ours"] / row["gbps"]["copy"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def host_rows(device: torch.device, smoke: bool) -> list[dict]:
    """Host seconds per scale/unscale_/step/update, ours and torch timed in one process, ours
    through Triton's launcher and (``direct``) through the compiled launchers themselves
    (``kernels/launcher.py``); and host microseconds per single launch (is Triton's Python
    launcher the cost?)."""
    from _host_cost import PAIRS, measure_pair

    rows = [launch_row(device, smoke)]
    print(json.dumps(rows[-1]), flush=True)
    for direct in (False, True):
        for n in ((10,) if smoke else (10, 1000, 10000) if direct else (10, 100, 1000)):
            for label, ours, theirs in PAIRS:
                if ours.get("grads") == "new_memory":
                    continue
                with _direct_launches(direct):
                    r = measure_pair(n, ours, theirs, repeats=3 if smoke else 60,
                                     device=device.type)
                rows.append({"section": "host", "case": label + (", direct" if direct else ""),
                             "params": n, "us": {"ours": r["ours"] * 1e6, "torch": r["torch"] * 1e6},
                             "ratio_ours_over_torch": r["ratio"]})
                print(json.dumps(rows[-1]), flush=True)
    return rows


@contextlib.contextmanager
def _direct_launches(on: bool):
    from triton_scaler.kernels import launcher

    before, launcher.DIRECT = launcher.DIRECT, on
    try:
        yield
    finally:
        launcher.DIRECT = before
        launcher.clear()


def launch_row(device: torch.device, smoke: bool) -> dict:
    """Host microseconds per call, the GPU not waited for: torch's foreach op, our public op
    and our launcher with a prepared plan, each over one 1024-element fp32 tensor; ours
    through Triton's launcher and (``direct``, the default) through the compiled kernel's."""
    from triton_scaler.kernels import launch_unscale

    from triton_scaler import ops
    from triton_scaler._plans import plan_unscale

    g = torch.zeros(1024, device=device)
    found, one = torch.zeros((), device=device), torch.ones((), device=device)
    backend = "triton" if device.type == "cuda" else "auto"
    calls = {"torch op": lambda: torch._amp_foreach_non_finite_check_and_unscale_([g], found, one),
             "ours ops.non_finite_check_and_unscale_":
                 lambda: ops.non_finite_check_and_unscale_([g], found, one, backend=backend)}
    if device.type == "cuda":
        calls["ours ops.non_finite_check_and_unscale_, direct"] = \
            calls["ours ops.non_finite_check_and_unscale_"]
        plan = plan_unscale([g])
        calls["ours launch_unscale(plan)"] = lambda: launch_unscale(plan, found, one)
        calls["ours launch_unscale(plan), direct"] = lambda: launch_unscale(plan, found, one)
    us = {}
    for name, fn in calls.items():
        with _direct_launches(name.endswith("direct")):
            us[name] = _host_us(fn, device, smoke)
    return {"section": "launch", "case": "host us per call", "us": us}


def _host_us(fn, device: torch.device, smoke: bool) -> float:
    """Median host microseconds per call of ``fn``, in batches, the GPU drained between."""
    fn()
    times = []
    for _ in range(3 if smoke else 20):
        start = time.perf_counter()
        for _ in range(10 if smoke else 200):
            fn()
        times.append((time.perf_counter() - start) / (10 if smoke else 200))
        if device.type == "cuda":
            torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def summary(result: dict) -> str:
    lines = [f"# GPU figures: {result['device']}",
             f"torch {result['torch']}, triton {result['triton']}, python {result['python']}, "
             f"{result['date']}", ""]
    lines += ["| section | case | dtype | elements | tensors | ours ms | torch ms | copy ms | "
              "ours GB/s | torch GB/s | copy GB/s | ours/copy | torch/ours | torch/buckets |",
              "|" + "---|" * 14]
    for r in result["kernels"]:
        ms, gb = r["ms"], r["gbps"]
        lines.append("| " + " | ".join([
            r["section"], r["case"], r["dtype"], f"{r['elements']:.3g}", str(r["tensors"]),
            _fmt(ms.get("ours")), _fmt(ms.get("torch")), _fmt(ms.get("copy")),
            _fmt(gb.get("ours"), 0), _fmt(gb.get("torch"), 0), _fmt(gb.get("copy"), 0),
            _fmt(r.get("fraction_of_copy")), _fmt(r.get("ratio_vs_torch")),
            _fmt(r.get("ratio_buckets_vs_torch"))]) + " |")
    lines += ["", "| host case | params | ours us | torch us | ours / torch |",
              "|---|---|---|---|---|"]
    for r in result["host"]:
        if r["section"] == "launch":
            lines.append("| one launch: " + ", ".join(f"{k} {v:.1f} us" for k, v in
                                                  r["us"].items()) + " | | | | |")
            continue
        lines.append(f"| {r['case']} | {r['params']} | {r['us']['ours']:.0f} | "
                     f"{r['us']['torch']:.0f} | {r['ratio_ours_over_torch']:.2f} |")
    lines += ["", "| training step | ms / step | host syncs / step |", "|---|---|---|"]
    for r in result["train"]:
        syncs = "n/a (CPU)" if r["syncs"] is None else r["syncs"]
        lines.append(f"| {r['case']} ({r['params'] / 1e6:.0f}M params) | {r['ms']:.2f} | "
                     f"{syncs} |")
    lines += ["", "Targets: " + "; ".join(f"{k}: {v}" for k, v in TARGETS.items())]
    return "\n".join(lines) + "\n"


def _fmt(value, digits: int = 3) -> str:
    if value is None:
        return "n/a"
    return f"{value:.{digits}f}" if digits else f"{value:.0f}"


def plot(out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    result = json.loads((out / "figures.json").read_text())
    flat = [r for r in result["kernels"] if r["section"] == "flat"]
    fig, ax = plt.subplots(figsize=(8, 4))
    names = [f"{r['case']}\n{r['dtype']}" for r in flat]
    for i, impl in enumerate(("ours", "torch", "copy")):
        ax.bar([x + 0.27 * i for x in range(len(flat))],
               [r["gbps"].get(impl) or 0 for r in flat], width=0.27, label=impl)
    ax.set_xticks([x + 0.27 for x in range(len(flat))], names, fontsize=7)
    ax.set_ylabel("GB/s (read + write)")
    ax.set_title(f"flat bucket unscale, {result['device']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "gpu_flat.png", dpi=120)
    print(f"wrote {out / 'gpu_flat.png'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/gpu"))
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny sizes (CI check)")
    parser.add_argument("--plot", type=Path, help="plot DIR/figures.json; no measurement")
    parser.add_argument("--sections", default="kernels,host,train")
    args = parser.parse_args(argv)
    if args.plot:
        plot(args.plot)
        return 0
    device = torch.device("cpu" if args.smoke else "cuda")
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("no CUDA device (use --smoke on CPU)")
    import platform

    import triton

    sections = args.sections.split(",")
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "triton": triton.__version__,
              "python": platform.python_version(), "date": time.strftime("%Y-%m-%d"),
              "kernels": [], "host": [], "train": []}
    measure = {"kernels": kernel_rows, "host": host_rows, "train": cases.train_rows}
    args.out.mkdir(parents=True, exist_ok=True)
    for section in ("kernels", "host", "train"):
        if section in sections:
            result[section] = measure[section](device, args.smoke)
            # written after each section: a run cut short keeps what it measured
            (args.out / "figures.json").write_text(json.dumps(result, indent=1))
            (args.out / "figures.md").write_text(summary(result))
    print(summary(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
