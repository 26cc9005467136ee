"""The watch's device cost from ``benchmarks/test_watch_cost.py``'s pytest-benchmark JSON: per
case and dtype, the median time with a watch over the median without."""

import json
import sys


def main(path: str) -> None:
    medians: dict[tuple, dict[str, float]] = {}
    for bench in json.load(open(path))["benchmarks"]:
        info = bench["extra_info"]
        key = (info["case"], info["dtype"], info["numel"])
        medians.setdefault(key, {})[info["impl"]] = bench["stats"]["median"]
    print("| case | dtype | elements | plain ms | watched ms | watched / plain |")
    print("|---|---|---|---|---|---|")
    for (case, dtype, numel), m in sorted(medians.items()):
        if {"plain", "watched"} <= m.keys():
            print(f"| {case} | {dtype} | {numel:.0e} | {m['plain'] * 1e3:.3f} | "
                  f"{m['watched'] * 1e3:.3f} | {m['watched'] / m['plain']:.3f} |")


if __name__ == "__main__":
    main(sys.argv[1])
