"""Turn a saved pytest-benchmark JSON into markdown tables (GB/s, ratio to torch) and PNG plots.

    python benchmarks/plot.py benchmarks/results/cpu.json --label cpu

writes ``benchmarks/results/<label>_tables.md`` and ``<label>_bucket.png``,
``<label>_many.png``, ``<label>_ratio.png``. Needs matplotlib (the ``benchmark`` extra).
GB/s = bytes read + written / median time. ratio = torch median / triton_scaler median
(> 1: triton_scaler is faster), both measured in the same run.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def load(path: Path) -> tuple[dict, dict, dict, dict, dict]:
    """(kernel rows, host-cost rows, ops-call rows, watch-cost rows, machine info) of a
    pytest-benchmark JSON."""
    data = json.loads(path.read_text())
    rows: dict = defaultdict(dict)
    watch: dict = defaultdict(dict)  # (case, dtype) -> {"plain" / "watched": median seconds}
    host: dict = {}  # (n_params, host layout, impl label) -> median seconds, kernels
    ops: dict = {}  # (n_grads, how the grads change) -> median seconds
    for bench in data["benchmarks"]:
        info = bench["extra_info"]
        if info["case"] == "host":  # test_bench_host.py: a step's host time, no bytes
            key = (info["n_params"], info.get("host_layout", "heap"), info["impl"])
            host[key] = {"median": bench["stats"]["median"], "kernels": info["kernels"]}
            continue
        if info["case"] == "ops host":  # test_bench_host.py: one ops call's host time
            ops[(info["n_grads"], info["grads"])] = bench["stats"]["median"]
            continue
        if info["impl"] in ("plain", "watched"):  # test_watch_cost.py: with a watch or not
            watch[info["case"], info["dtype"]][info["impl"]] = bench["stats"]["median"]
            continue
        key = (info["case"], info["dtype"], info["n_tensors"], info["numel"],
               info.get("fused", ""))
        rows[key][info["impl"]] = {"median": bench["stats"]["median"], "bytes": info["bytes"],
                                   "host_syncs": info.get("host_syncs")}
    return rows, host, ops, watch, data.get("machine_info", {})


def host_table(host: dict) -> str:
    """The host-cost rows (``_host_cost.PAIRS``: ours against torch's nearest case), each
    scaler timed in its own test of the same run."""
    from _host_cost import PAIRS, label

    lines = ["| params | case | host layout | ours us | torch us | ours / torch | ours kernels |",
             "|---|---|---|---|---|---|---|"]
    for n, layout in sorted({k[:2] for k in host}):
        for name, ours, theirs in PAIRS:
            mine, torch_row = host.get((n, layout, label("ours", ours))), \
                host.get((n, layout, label("torch", theirs)))
            if mine and torch_row:
                lines.append(f"| {n} | {name} | {layout} | {mine['median'] * 1e6:.0f} | "
                             f"{torch_row['median'] * 1e6:.0f} | "
                             f"{mine['median'] / torch_row['median']:.2f} | {mine['kernels']} |")
    return "\n".join(lines) + "\n"


def ops_table(ops: dict) -> str:
    """One ``ops.non_finite_check_and_unscale_`` call's host time (``_ops_host_cost.py``)."""
    lines = ["| grads | grads between calls | us per call |", "|---|---|---|"]
    for (n, grads), median in sorted(ops.items()):
        lines.append(f"| {n} | {grads} | {median * 1e6:.0f} |")
    return "\n".join(lines) + "\n"


def watch_table(watch: dict) -> str:
    """``unscale_`` with a watch against without (``test_watch_cost.py``), one run."""
    lines = ["| case | dtype | plain | watched | watched / plain |", "|---|---|---|---|---|"]
    for (case, dtype), by_impl in sorted(watch.items()):
        plain, watched = by_impl.get("plain"), by_impl.get("watched")
        if plain and watched:
            lines.append(f"| {case} | {dtype} | {plain * 1e6:.1f} us | {watched * 1e6:.1f} us | "
                         f"{watched / plain:.2f} |")
    return "\n".join(lines) + "\n"


def _gbps(entry):
    return entry["bytes"] / entry["median"] / 1e9 if entry and entry["bytes"] else None


def tables(rows: dict) -> str:
    lines = ["| case | dtype | tensors x elements | impl | median | GB/s | speed ratio vs torch |",
             "|---|---|---|---|---|---|---|"]
    for key in sorted(rows, key=lambda k: (k[0], k[1], k[2], k[3], str(k[4]))):
        case, dtype, n, numel, fused = key
        impls = rows[key]
        torch_entry = impls.get("torch")
        label = f"{case}{' fused' if fused is True else ''}"
        for impl, entry in sorted(impls.items(), key=lambda kv: kv[0] != "torch"):
            gbps = _gbps(entry)
            if impl == "torch":
                ratio = "1.00"
            elif torch_entry:
                ratio = f"{torch_entry['median'] / entry['median']:.2f}"
            elif case == "copy":
                ratio = "(copy floor)"
            else:
                ratio = "torch: unsupported"
            syncs = "" if entry["host_syncs"] is None else f", {entry['host_syncs']} syncs"
            median = entry["median"]
            time = f"{median * 1e6:.1f} us" if median < 1e-3 else f"{median * 1e3:.3f} ms"
            lines.append(f"| {label} | {dtype} | {n} x {numel} | {impl}{syncs} | {time} | "
                         f"{'' if gbps is None else f'{gbps:.1f}'} | {ratio} |")
    return "\n".join(lines) + "\n"


def plots(rows: dict, out: Path, label: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    colors = {"fp32": "C0", "fp16": "C1", "bf16": "C2", 1024: "C0", 4096: "C1", 65536: "C2"}
    series = {  # case -> (x label, [(legend suffix, colour key, row filter, x of a row)])
        "bucket": ("elements in one bucket", [
            (dtype, dtype, lambda k, d=dtype: k[0] == "bucket" and k[1] == d, lambda k: k[3])
            for dtype in ("fp32", "fp16", "bf16")]),
        "many": ("number of tensors (fp32)", [
            (f"{numel}-element tensors", numel,
             lambda k, n=numel: k[0] == "many" and k[1] == "fp32" and k[3] == n, lambda k: k[2])
            for numel in sorted({k[3] for k in rows if k[0] == "many"})]),
    }
    for case, (xlabel, lines) in series.items():
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for suffix, color, keep, xof in lines:
            for impl, style in (("torch", "--"), ("ours", "-")):
                pts = sorted((xof(k), _gbps(v[impl])) for k, v in rows.items()
                             if keep(k) and impl in v)
                if pts:
                    ax.plot(*zip(*pts), style, marker="o", color=colors.get(color),
                            label=f"{'triton_scaler' if impl == 'ours' else 'torch'} {suffix}")
        ax.set_xscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("GB/s (read + write)")
        ax.set_title(f"unscale + inf check, {label}: {case} (dashed: torch)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        path = out / f"{label}_{case}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    names, ratios = [], []
    for key in sorted(rows, key=lambda k: (k[0], k[1], k[2], k[3], str(k[4]))):
        impls = rows[key]
        if "torch" not in impls:
            continue
        for impl, entry in impls.items():
            if impl == "torch":
                continue
            names.append(f"{key[0]}{' fused' if key[4] is True else ''} {key[1]} "
                         f"{key[2]}x{key[3]} {impl}")
            ratios.append(impls["torch"]["median"] / entry["median"])
    ax.barh(range(len(ratios)), ratios)
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_yticks(range(len(ratios)), names, fontsize=6)
    ax.set_xlabel("speed ratio: torch time / triton_scaler time (> 1 faster)")
    ax.set_title(f"triton_scaler vs torch, {label}")
    fig.tight_layout()
    path = out / f"{label}_ratio.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
    return written


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("json", type=Path)
    parser.add_argument("--label", required=True)
    args = parser.parse_args()
    rows, host, ops, watch, _ = load(args.json)
    out = args.json.parent
    text = tables(rows)
    if host:
        text += "\nHost time per step, no-op launches (test_bench_host.py):\n\n" + host_table(host)
    if ops:
        text += ("\nHost time of one ops.non_finite_check_and_unscale_ call, no-op launches "
                 "(test_bench_host.py):\n\n" + ops_table(ops))
    if watch:
        text += "\nunscale_ with scaler.watch against without (test_watch_cost.py):\n\n" + \
            watch_table(watch)
    (out / f"{args.label}_tables.md").write_text(text)
    for path in plots(rows, out, args.label):
        print(path)
    print(out / f"{args.label}_tables.md")


if __name__ == "__main__":
    main()
