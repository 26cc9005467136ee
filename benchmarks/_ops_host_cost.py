"""Host cost of one ``ops.non_finite_check_and_unscale_`` call over many grads, with every
device launch a no-op (``_host_stubs.py``): each call plans from the grads as they are (the
chunk table's rows kept per size pattern). Grads of 1–4096 random float32 elements;
``CASES`` says how the grads change between calls.

``python benchmarks/_ops_host_cost.py 100 1000 10000`` prints the table of RESULTS.md."""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from collections.abc import Callable

import torch
from _host_stubs import noop_launches

#: ``same_list``: one list, called again and again; ``new_tensors``: a new list of new grad
#: tensors over the same memory each call (a loop that rebuilds ``[p.grad for p in ...]``
#: after ``zero_grad()`` + backward on a GPU, whose allocator hands the same blocks back);
#: ``cycle12``: 12 grad sets of the same sizes in turn (new addresses at each call)
CASES = ("same_list", "new_tensors", "cycle12")


def make_call(n: int, case: str) -> tuple[Callable[[], None], Callable[[], None]]:
    """``(prepare, call)``: ``call()`` is one ops call on ``n`` grads; ``prepare()``
    (untimed) sets up the next call's grads as ``case`` says."""
    from triton_scaler import ops

    if case not in CASES:
        raise ValueError(f"case must be one of {CASES}; got {case!r}")
    torch.manual_seed(0)
    sizes = torch.randint(1, 4097, (n,)).tolist()
    sets = [[torch.zeros(k) for k in sizes] for _ in range(12 if case == "cycle12" else 1)]
    found, inv = torch.zeros(()), torch.ones(())
    turn, grads = itertools.count(), sets[0]

    def prepare() -> None:
        nonlocal grads
        grads = sets[next(turn) % len(sets)]
        if case == "new_tensors":
            grads = [g.view(g.shape) for g in grads]

    def call() -> None:
        ops.non_finite_check_and_unscale_(grads, found, inv, backend="triton")
    return prepare, call


def measure(n: int, case: str, timed: int = 18) -> float:
    """Median seconds per call over ``timed`` calls after two rounds of the case's grad
    sets."""
    warmup = 2 * (12 if case == "cycle12" else 6)
    times: list[float] = []
    with noop_launches():
        prepare, call = make_call(n, case)
        for i in range(warmup + timed):
            prepare()
            start = time.perf_counter()
            call()
            if i >= warmup:
                times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(sizes: list[int]) -> None:
    print(f"host us per ops call, no-op launches, torch {torch.__version__}; medians")
    print("| grads | case | us per call |\n|---|---|---|")
    for n in sizes:
        for case in CASES:
            print(f"| {n} | {case} | {measure(n, case) * 1e6:.0f} |", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("sizes", nargs="*", type=int, default=[100, 1000, 10000])
    main(parser.parse_args().sizes)
