"""How much of a plain step's host time is the wait in its one host read.

On a GPU the plain route's ``step`` reads the overflow flag on the host (torch's scaler does
too, for optimizers that do not skip on the device): that read waits until the launched work
is done, which is device time, not host work. This times ``scale -> unscale_ -> step ->
update`` (``_host_cost.make_step``, optimizer steps stubbed) and, inside it, each of the four
calls, two parts of ours (the grads' grouping, the unscale launches) and the read (ours:
``Tensor.tolist`` of the scale and the flag, their copy to the host included; torch's:
``Tensor.item``), median microseconds of each over the steps:

    python benchmarks/_host_wait.py --device cuda 10 1000 10000

``--numel`` sets the parameters' mean size (4096 by default): the plain GradBuckets row's
read waits for one kernel over every grad's bytes (at 10,000 parameters of ~4k float32
elements, ~330 MB read and written), which a small size takes away, leaving the host work.
On CPU (``--device cpu``, the default) the launches are no-ops (``_host_stubs.py``).

The last two rows per size: the first row with its host read made early, as an earlier
version made it (``EARLY_COPY_CASE``), and the first row's step over 10 parameters timed with the size's
parameters alive beside it (``BESIDE_CASE``, a control for the first row's growth)."""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import time
from collections.abc import Iterator

import torch
from _host_cost import NUMEL, make_step
from _host_stubs import noop_launches

#: (row, scaler, make_step's flags)
CASES = [("ours, plain, GradBuckets", "ours", {"buckets": True}),
         ("ours, plain, grads same", "ours", {}),
         ("torch, plain, grads same", "torch", {}),
         ("ours, fused, GradBuckets", "ours", {"buckets": True, "fused": True})]
#: the first row with the earlier version's host read (``early_host_copy``), timed beside it
EARLY_COPY_CASE = ("ours, plain, GradBuckets, early host copy", "ours", {"buckets": True})
#: a control for the first row's growth with the parameters (every call grew 1.6-2.1x
#: from 10 to 10,000 parameters on an H200, ``scale`` too): the same step over 10 parameters, timed
#: while the size's parameters (their scaler, GradBuckets, after a step) are alive beside
#: it. If it keeps the 10-parameter time, the growth is the step's per-parameter work; if it
#: grows as the first row does, holding the parameters slows every call
BESIDE_CASE = ("ours, plain, GradBuckets, 10 params, the row's beside", "ours",
               {"buckets": True})


@contextlib.contextmanager
def early_host_copy() -> Iterator[None]:
    """The plain route's host read as an earlier version made it: ``unscale_`` started the copy
    of (scale, found_inf) into new pinned host memory with an event (``copy_to_host_async``),
    and ``step`` waited on that event; now ``step`` reads the device tensor (``tolist``).
    Kept to time both in one run; CUDA tensors only (on CPU nothing changes)."""
    from triton_scaler import GradScaler
    from triton_scaler._host_copy import copy_to_host_async

    agree, span_of = GradScaler._agree_found_inf, GradScaler._host_read_span

    def agree_and_start_copy(self, state):
        started = "found_inf_agreed" in state
        agreed = agree(self, state)
        if not started and agreed.is_cuda:
            span, index = span_of(self, state, agreed)
            state["early_host_copy"] = (*copy_to_host_async(span), index)
        return agreed

    def copied_span(self, state, agreed):
        copied = state.get("early_host_copy")
        if copied is None:
            return span_of(self, state, agreed)
        copied[1].synchronize()
        return copied[0], copied[2]

    GradScaler._agree_found_inf, GradScaler._host_read_span = agree_and_start_copy, copied_span
    try:
        yield
    finally:
        GradScaler._agree_found_inf, GradScaler._host_read_span = agree, span_of


#: the host reads timed inside a step: (owner, method name)
READS = [(torch.Tensor, "tolist"), (torch.Tensor, "item"), (torch.cuda.Event, "synchronize")]


def _phases() -> list[tuple[str, list[tuple[object, str]]]]:
    """The four calls, then what runs inside ours: grouping the grads and the launches of
    ``unscale_``; and the host read."""
    from triton_scaler import GradScaler, grad_scaler

    scalers = (GradScaler, torch.amp.GradScaler)
    return [(name, [(cls, name) for cls in scalers if name in vars(cls)])
            for name in ("scale", "unscale_", "step", "update")] + [
        ("grad groups", [(grad_scaler, "collect_grads")]),
        ("unscale launches", [(grad_scaler, "unscale_group")]),
        ("host read", READS)]


@contextlib.contextmanager
def timed_calls(phases: list[tuple[str, list[tuple[type, str]]]]) -> Iterator[dict]:
    """Seconds spent in each phase's methods while inside, summed per label into the yielded
    dict; a call inside another of the same label (ours calling torch's ``scale``) counts
    once."""
    spent: dict[str, float] = dict.fromkeys((label for label, _ in phases), 0.0)
    active: set[str] = set()
    patched = [(owner, name, label) for label, methods in phases for owner, name in methods]
    originals = [getattr(owner, name) for owner, name, _ in patched]
    own = [vars(owner).get(name) for owner, name, _ in patched]  # None: inherited

    def timing(original, label):
        def timed(*args, **kwargs):
            if label in active:
                return original(*args, **kwargs)
            active.add(label)
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                spent[label] += time.perf_counter() - start
                active.discard(label)
        return timed

    for (owner, name, label), original in zip(patched, originals):
        setattr(owner, name, timing(original, label))
    try:
        yield spent
    finally:
        for (owner, name, _), original in zip(patched, own):
            if original is None:
                delattr(owner, name)  # inherited (Tensor.tolist is TensorBase's): again so
            else:
                setattr(owner, name, original)


def measure(n_params: int, impl: str, flags: dict, device: str, repeats: int,
            numel: int = NUMEL, beside: int = 0) -> dict:
    """Median seconds of the whole step and of each phase in it (``_phases``). ``beside``:
    that many parameters of the same case (their optimizer, scaler and grads, after one
    step) are alive, untouched, while the ``n_params`` step is timed (``BESIDE_CASE``)."""
    held = make_step(impl, beside, device=device, numel=numel, **flags) if beside else None
    if held is not None:
        held[1]()  # its step, then alive (untouched) until this returns
    prepare, step = make_step(impl, n_params, device=device, numel=numel, **flags)
    for _ in range(3):
        prepare()
        step()
    phases = _phases()
    times: dict[str, list[float]] = {"whole step": [], **{label: [] for label, _ in phases}}
    gc.collect()
    gc.disable()
    try:
        with timed_calls(phases) as spent:
            for _ in range(repeats):
                prepare()
                if device == "cuda":
                    torch.cuda.synchronize()  # the step starts with an idle device
                for label in spent:
                    spent[label] = 0.0
                start = time.perf_counter()
                step()
                times["whole step"].append(time.perf_counter() - start)
                for label, seconds in spent.items():
                    times[label].append(seconds)
    finally:
        gc.enable()
    return {label: statistics.median(values) for label, values in times.items()}


def main(sizes: list[int], device: str, repeats: int, numel: int = NUMEL) -> None:
    labels = ["whole step"] + [label for label, _ in _phases()]
    print(f"host us per step and in its parts (the host read is inside step), device {device}, "
          f"torch {torch.__version__}, parameters of ~{numel} elements, median of {repeats} "
          f"steps")
    print("| params | case | " + " | ".join(labels) + " |")
    print("|---|---|" + "---|" * len(labels))
    with noop_launches() if device == "cpu" else contextlib.nullcontext():
        for n in sizes:
            for name, impl, flags in [*CASES, EARLY_COPY_CASE, BESIDE_CASE]:
                with early_host_copy() if name == EARLY_COPY_CASE[0] else \
                        contextlib.nullcontext():
                    control = name == BESIDE_CASE[0]
                    us = measure(10 if control else n, impl, flags, device, repeats, numel,
                                 beside=n if control else 0)
                print(f"| {n} | {name} | " + " | ".join(f"{us[label] * 1e6:.0f}"
                                                         for label in labels) + " |", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sizes", type=int, nargs="*", default=[10, 1000, 10000])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--repeats", type=int, default=60)
    parser.add_argument("--numel", type=int, default=NUMEL,
                        help="the parameters' mean size in elements (default %(default)s)")
    args = parser.parse_args()
    main(args.sizes, args.device, args.repeats, args.numel)
