"""How much of a plain step's host time is the wait in its one host read.

On a GPU the plain route's ``step`` reads the overflow flag on the host (torch's scaler does
too, for optimizers that do not skip on the device): that read waits until the launched work
is done, which is device time, not host work. This times ``scale -> unscale_ -> step ->
update`` (``_host_cost.make_step``, optimizer steps stubbed) and, inside it, the time spent in
the read (``torch.cuda.Event.synchronize``, ``Tensor.tolist`` and ``Tensor.item``), median
microseconds of each over the steps:

    python benchmarks/_host_wait.py --device cuda 10 1000 10000

On CPU (``--device cpu``, the default) the launches are no-ops (``_host_stubs.py``)."""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import time
from collections.abc import Iterator

import torch
from _host_cost import make_step
from _host_stubs import noop_launches

#: (row, scaler, make_step's flags)
CASES = [("ours, plain, GradBuckets", "ours", {"buckets": True}),
         ("ours, plain, grads same", "ours", {}),
         ("torch, plain, grads same", "torch", {}),
         ("ours, fused, GradBuckets", "ours", {"buckets": True, "fused": True})]


@contextlib.contextmanager
def timed_reads() -> Iterator[list[float]]:
    """Seconds spent in host reads while inside, appended to the yielded list."""
    spent: list[float] = []
    patched = [(torch.Tensor, "tolist"), (torch.Tensor, "item"),
               (torch.cuda.Event, "synchronize")]
    originals = [getattr(owner, name) for owner, name in patched]

    def timing(original):
        def read(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                spent.append(time.perf_counter() - start)
        return read

    for (owner, name), original in zip(patched, originals):
        setattr(owner, name, timing(original))
    try:
        yield spent
    finally:
        for (owner, name), original in zip(patched, originals):
            setattr(owner, name, original)


def measure(n_params: int, impl: str, flags: dict, device: str, repeats: int) -> tuple:
    """(median step seconds, median seconds in host reads per step)."""
    prepare, step = make_step(impl, n_params, device=device, **flags)
    for _ in range(3):
        prepare()
        step()
    steps, reads = [], []
    gc.collect()
    gc.disable()
    try:
        with timed_reads() as spent:
            for _ in range(repeats):
                prepare()
                if device == "cuda":
                    torch.cuda.synchronize()  # the step starts with an idle device
                spent.clear()
                start = time.perf_counter()
                step()
                steps.append(time.perf_counter() - start)
                reads.append(sum(spent))
    finally:
        gc.enable()
    return statistics.median(steps), statistics.median(reads)


def main(sizes: list[int], device: str, repeats: int) -> None:
    print(f"host us per step and in its host reads, device {device}, torch {torch.__version__}")
    print("| params | case | step us | in host reads us | rest us |")
    print("|---|---|---|---|---|")
    with noop_launches() if device == "cpu" else contextlib.nullcontext():
        for n in sizes:
            for name, impl, flags in CASES:
                step, reads = measure(n, impl, flags, device, repeats)
                print(f"| {n} | {name} | {step * 1e6:.0f} | {reads * 1e6:.0f} | "
                      f"{(step - reads) * 1e6:.0f} |", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sizes", type=int, nargs="*", default=[10, 1000, 10000])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--repeats", type=int, default=60)
    args = parser.parse_args()
    main(args.sizes, args.device, args.repeats)
