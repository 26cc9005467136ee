"""Host cost of one ``ops.non_finite_check_and_unscale_`` call over many grads, with every
device launch a no-op (``_host_stubs.py``): with the launch plans the ops keep between calls
(``triton_scaler/_plans.py``'s ``ops_plans``) and without them (none kept; chunk tables
still kept), alternating in one process.
Grads of 1–4096 random float32 elements; ``CASES`` says how the grads change between calls.

``python benchmarks/_ops_host_cost.py 100 1000 10000`` prints the table of RESULTS.md."""

from __future__ import annotations

import argparse
import contextlib
import itertools
import statistics
import time
from collections.abc import Callable, Iterator

import torch
from _host_stubs import noop_launches

#: ``same_list``: one list, called again and again; ``new_tensors``: a new list of new grad
#: tensors over the same memory each call (a loop that rebuilds ``[p.grad for p in ...]``
#: after ``zero_grad()`` + backward on a GPU, whose allocator hands the same blocks back);
#: ``cycle12``: 12 grad sets in turn (each call's plans kept from its set's last call, twelve
#: calls before, as planning's store keeps 16 grad lists)
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


@contextlib.contextmanager
def plans_kept(kept: bool) -> Iterator[None]:
    """The ops keep plans as they do (``kept``), or keep none (chunk tables kept still)."""
    from triton_scaler import _plan_store

    keep = _plan_store.keep
    _plan_store.clear()
    if not kept:
        _plan_store.keep = lambda key, value: value if key[0] == "ops" else keep(key, value)
    try:
        yield
    finally:
        _plan_store.keep = keep
        _plan_store.clear()


def measure(n: int, case: str, timed: int = 18) -> dict[str, float]:
    """Median seconds per call, plans kept and not, over ``timed`` calls after two rounds of
    the case's grad sets (the first call at a set's addresses plans it, the second builds
    its guard); the two alternate in blocks, twice."""
    warmup = 2 * (12 if case == "cycle12" else 6)
    times: dict[str, list[float]] = {"kept": [], "not_kept": []}
    with noop_launches():
        for _ in range(2):
            for name in times:
                with plans_kept(name == "kept"):
                    prepare, call = make_call(n, case)
                    for i in range(warmup + timed // 2):
                        prepare()
                        start = time.perf_counter()
                        call()
                        if i >= warmup:
                            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main(sizes: list[int]) -> None:
    print(f"host us per ops call, no-op launches, torch {torch.__version__}; medians")
    print("| grads | case | plans not kept us | plans kept us | not kept / kept |\n"
          "|---|---|---|---|---|")
    for n in sizes:
        for case in CASES:
            m = measure(n, case)
            print(f"| {n} | {case} | {m['not_kept'] * 1e6:.0f} | {m['kept'] * 1e6:.0f} | "
                  f"{m['not_kept'] / m['kept']:.2f} |", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("sizes", nargs="*", type=int, default=[100, 1000, 10000])
    main(parser.parse_args().sizes)
