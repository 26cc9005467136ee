"""Host cost of a scaler step, with every device launch replaced by a counting no-op.

On a GPU a scaler is host-bound before it is bandwidth-bound, so what matters per step is the
Python and dispatcher work of ``scale -> unscale_ -> step -> update`` and the number of device
launches it issues. Here both scalers run on CPU tensors with their device work stubbed out
(``_host_stubs.py``: no-op kernels and torch ops that count their calls, an optimizer whose
``step`` does nothing). Every other tensor op the scaler issues still runs (it is host work
too) and is counted by a dispatch mode in a separate, untimed step: ``kernels`` +
``other_ops`` = device launches per step (the optimizer's profiling records excluded). See
``GRAD_MODES`` for how the grads change between steps and ``HOST_LAYOUTS`` for where their
data lies.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import statistics
import subprocess
import sys
import time

import torch
from _host_stubs import CountOps, NoStep, NoStepFused, no_step, noop_launches

NUMEL = 4096


#: How the grads change between two timed steps (untimed):
#: ``same``: the same grad tensors (``zero_grad(set_to_none=False)``, or GradBuckets);
#: ``new_tensors``: new grad tensors at the same addresses (``zero_grad()`` + backward on a
#: GPU, whose caching allocator hands the same blocks back in the same order);
#: ``alternating``: two sets of grad memory, one step each (an allocator whose blocks cycle
#: with period 2: the forward takes the blocks the last grads freed);
#: ``new_memory``: new grad tensors at new addresses (the worst case: every cache misses).
GRAD_MODES = ("same", "new_tensors", "alternating", "new_memory")

#: Where the parameters' and grads' data lie on the CPU (not used on a GPU):
#: ``heap``: each tensor's data allocated on its own (torch's CPU allocator), so at ~4k
#: elements the tensors' host metadata (Python objects, TensorImpls, storages) lies ~16 KB
#: apart, between the data;
#: ``dense``: each set of tensors over one buffer outside the heap (``torch.frombuffer``:
#: still one storage and one TensorImpl per tensor), so their metadata lies together, as on
#: a GPU, whose tensors keep only metadata in the host heap. There ``new_memory`` makes new
#: tensors over the grads' buffer shifted by 64 bytes more each step, over ``_SHIFTS``
#: addresses (more than triton_scaler keeps chunk tables for: every step misses).
HOST_LAYOUTS = ("heap", "dense")

_SHIFTS = 40  # dense new_memory's address cycle: more layouts than planning's store keeps


def _tensors(sizes: list[int], host_layout: str, device: str = "cpu") -> list[torch.Tensor]:
    """Zeroed float32 tensors of ``sizes`` (non-empty), laid out as ``host_layout`` says
    (``dense``: CPU only, one new buffer per call)."""
    if host_layout == "heap":
        return [torch.zeros(n, device=device) for n in sizes]
    if host_layout != "dense":
        raise ValueError(f"host_layout must be one of {HOST_LAYOUTS}, got {host_layout!r}")
    return _dense_views(sizes, _dense_buffer(sizes), 0)


def _dense_buffer(sizes: list[int]) -> bytearray:
    """Room for ``dense`` tensors of ``sizes`` from any of the ``_SHIFTS`` shifts."""
    return bytearray(sum(_dense_bytes(sizes)) + 64 * _SHIFTS)


def _dense_bytes(sizes: list[int]) -> list[int]:
    """Each tensor's bytes in a ``dense`` buffer: 64-byte aligned, as an allocator's blocks."""
    return [-(-4 * n // 64) * 64 for n in sizes]


def _dense_views(sizes: list[int], buffer: bytearray, shift: int) -> list[torch.Tensor]:
    """New float32 tensors of ``sizes`` one after another in ``buffer``, from byte ``shift``."""
    offsets = itertools.accumulate(_dense_bytes(sizes)[:-1], initial=shift)
    return [torch.frombuffer(buffer, dtype=torch.float32, count=n, offset=o)
            for n, o in zip(sizes, offsets)]


def _as_conv_weights(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """1-D tensors of 36k elements as channels_last conv weights ``(k, 4, 3, 3)`` over the
    same memory (their grads are channels_last too: torch's gradient layout contract)."""
    return [t.view(-1, 3, 3, 4).permute(0, 3, 1, 2) for t in tensors]


def param_sizes(n_params: int, numel: int = NUMEL, channels_last: bool = False) -> list[int]:
    """The parameters' sizes, the same at every call: drawn from ``[numel // 2,
    3 * numel // 2)`` (mostly odd); ``channels_last``: rounded down to multiples of 36 (conv
    weights ``(k, 4, 3, 3)``), at least 36."""
    if not isinstance(numel, int) or numel < 2:
        raise ValueError(f"numel must be an int >= 2; got {numel!r}")
    seeded = torch.Generator().manual_seed(0)  # (the global generator left as it is)
    sizes = torch.randint(numel // 2, 3 * numel // 2, (n_params,), generator=seeded).tolist()
    return [36 * max(1, n // 36) for n in sizes] if channels_last else sizes


def make_step(impl: str, n_params: int, *, buckets: bool = False, fused: bool = False,
              grads: str = "same", device: str = "cpu", host_layout: str = "heap",
              channels_last: bool = False, numel: int = NUMEL, watch: bool = False):
    """(prepare, step): ``step()`` is the timed ``scale -> unscale_ -> step -> update``;
    ``prepare()`` (untimed) renews the grads as ``grads`` says. One real backward first
    writes every grad through autograd (GradBuckets' hooks fire); with ``host_layout="dense"``
    the grads outside buckets are then moved to one buffer (``HOST_LAYOUTS``).
    ``device="cuda"``: real launches (the GPU run of this benchmark). ``channels_last``: the
    parameters and grads are channels_last conv weights of ~4k elements. ``numel``: the
    parameters' mean size (each drawn from ``[numel // 2, 3 * numel // 2)``; channels_last
    rounds to multiples of 36): a small one makes a bucket's device work negligible (its
    one kernel over ``n_params * numel`` elements is what a plain step's host read waits
    for on a GPU). ``watch``: ours with ``scaler.watch`` over every parameter."""
    from triton_scaler import GradBuckets, GradScaler

    if host_layout == "dense" and device != "cpu":
        raise ValueError(f"host_layout='dense' is for CPU tensors; device={device!r} takes "
                         f"'heap'")
    sizes = param_sizes(n_params, numel, channels_last)
    laid_out = _as_conv_weights if channels_last else list
    params = [torch.nn.Parameter(t) for t in laid_out(_tensors(sizes, host_layout, device))]
    opt = (NoStepFused if fused else NoStep)(params, lr=0.0)
    opt.step = no_step  # the instance's own: no torch wrapper (profiling hooks) around it
    if buckets:
        GradBuckets(opt)
    kind = torch.device(device).type
    scaler = (torch.amp.GradScaler(kind) if impl == "torch"
              else GradScaler(kind, backend="triton"))
    if watch:
        scaler.watch([(f"p{i}", p) for i, p in enumerate(params)])
    loss = torch.ones((), device=device)
    torch.stack([p[:1] for p in params]).sum().backward()
    grad_buffer = None  # dense: the grads' memory outside buckets (and new_memory's)
    if host_layout == "dense" and (not buckets or grads == "new_memory"):
        grad_buffer = _dense_buffer(sizes)
    if grad_buffer is not None and not buckets:
        for p, g in zip(params, laid_out(_dense_views(sizes, grad_buffer, 0))):
            p.grad = g
    shift = itertools.count(1)  # dense new_memory: the next step's shift, in 64 bytes
    spare = []  # alternating: the second set of grad memory
    if grads == "alternating":
        spare = laid_out(_tensors(sizes, host_layout)) if host_layout == "dense" else \
            [p.grad.clone() for p in params]

    def prepare() -> None:
        if grads == "alternating":
            last = [p.grad for p in params]
            for p, g in zip(params, spare):
                p.grad = g
            spare[:] = last
        elif grads == "new_tensors":
            for p in params:
                p.grad = p.grad.detach()  # a new tensor over the same memory
        elif grads == "new_memory" and grad_buffer is not None:
            new = laid_out(_dense_views(sizes, grad_buffer, 64 * (next(shift) % _SHIFTS)))
            for p, g in zip(params, new):
                p.grad = g
        elif grads == "new_memory":
            for p in params:
                p.grad = p.grad.clone()
            _settle()

    def step() -> None:
        scaler.scale(loss)
        if not fused:  # fused optimizers unscale inside their own step
            scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
    return prepare, step


def _settle() -> None:
    """Small ops, untimed: after ~160 MB of fresh grads on the CPU, the first small
    allocations fault in heap pages (~0.5 ms), whichever scaler comes next. On a GPU the grads
    live on the device and the host allocator is not disturbed."""
    for _ in range(64):
        torch.ones(()).mul(2.0)


def _counted(impl: str, n_params: int, **flags) -> dict:
    """Launches per step (kernels and other ops) of one scaler, in an untimed step."""
    with noop_launches() as counts:
        prepare, step = make_step(impl, n_params, **flags)
        for _ in range(2):  # warm-up: caches, lazy init, both sets of alternating grads
            step()
            prepare()
        counts.clear()
        with CountOps() as mode:
            step()
    ops = {k: v for k, v in mode.ops.items() if not k.startswith("_record_function")}
    return {"kernels": sum(counts.values()), "other_ops": sum(ops.values()), "ops": ops}


def measure_pair(n_params: int, ours: dict, torch_flags: dict, repeats: int = 30,
                 cold: bool = False, device: str = "cpu", host_layout: str = "heap") -> dict:
    """Both scalers built side by side and timed in the same process, so that both see the
    same machine state: median seconds per step of each and the median of the per-step
    ratios ours / torch. ``cold=False``: each scaler's steps back to back (warm CPU caches),
    in alternating blocks; ``cold=True``: a 64 MB pass evicts the CPU caches before every
    step (as a training step's forward and backward do), the two scalers alternating.
    ``device="cuda"``: real launches on the GPU, no launch counts. ``host_layout``: see
    ``HOST_LAYOUTS``."""
    return _measure(n_params, {"ours": ("ours", ours), "torch": ("torch", torch_flags)},
                    repeats, cold, device, host_layout)


def _measure(n_params: int, cases: dict[str, tuple[str, dict]], repeats: int, cold: bool,
             device: str, host_layout: str) -> dict:
    """Two steps (``{name: (impl, flags)}``, the first's time over the second's is "ratio")
    built side by side and timed in the same process (see :func:`measure_pair`): per name
    the median seconds per step, and on the CPU its launches (``{name}_counts``)."""
    cases = {name: (impl, {**flags, "host_layout": host_layout})
             for name, (impl, flags) in cases.items()}
    with noop_launches() if device == "cpu" else contextlib.nullcontext():
        pairs = [make_step(impl, n_params, device=device, **flags)
                 for impl, flags in cases.values()]
        _settle()
        for _, step in pairs:
            step()
        first, second = _timed(pairs, repeats, cold)
    result = {name: statistics.median(times) for name, times in zip(cases, (first, second))}
    result["ratio"] = statistics.median(a / b for a, b in zip(first, second))
    if device == "cpu":
        for name, (impl, flags) in cases.items():
            result[f"{name}_counts"] = _counted(impl, n_params, **flags)
    return result


_EVICT = 64 * 2**20 // 4  # float32 elements: larger than any CPU cache


def _timed(pairs, repeats: int, cold: bool) -> list[list[float]]:
    """Per (prepare, step): the host seconds of ``repeats`` steps (see measure_pair)."""
    times: list[list[float]] = [[] for _ in pairs]
    evict = torch.zeros(_EVICT) if cold else None
    blocks, per_block = (repeats, 1) if cold else (3, repeats // 3)
    gc.collect()
    gc.disable()  # a collection of unrelated garbage is not the step's cost
    try:
        for _ in range(blocks):
            for (prepare, step), out in zip(pairs, times):
                for _ in range(per_block):
                    prepare()
                    if evict is not None:
                        evict.add_(1.0)
                    start = time.perf_counter()
                    step()
                    out.append(time.perf_counter() - start)
    finally:
        gc.enable()
    return times


#: (row, ours, torch): each of ours against torch's nearest case (torch has no buckets)
PAIRS: list[tuple[str, dict, dict]] = [
    ("plain, grads same", {"grads": "same"}, {"grads": "same"}),
    ("plain, grads new_tensors", {"grads": "new_tensors"}, {"grads": "new_tensors"}),
    ("plain, grads new_memory", {"grads": "new_memory"}, {"grads": "new_memory"}),
    ("plain, GradBuckets (torch: grads same)", {"buckets": True}, {"grads": "same"}),
    ("fused, grads same", {"fused": True}, {"fused": True}),
    ("fused, GradBuckets (torch: grads same)", {"fused": True, "buckets": True}, {"fused": True}),
    ("plain, grads alternating", {"grads": "alternating"}, {"grads": "alternating"}),
    ("plain, grads same, channels_last", {"channels_last": True}, {"channels_last": True}),
]

#: Each scaler's distinct cases of PAIRS, for the pytest-benchmark suite (one test each).
CASES: list[tuple[str, dict]] = list({(impl, tuple(sorted(flags.items()))): (impl, flags)
                                      for _, ours, theirs in PAIRS
                                      for impl, flags in (("torch", theirs), ("ours", ours))
                                      }.values())


def label(impl: str, flags: dict) -> str:
    name = impl + ("+buckets" if flags.get("buckets") else "")
    route = "fused" if flags.get("fused") else "plain"
    grads = "" if flags.get("buckets") else f", grads {flags.get('grads', 'same')}"
    return f"{name}, {route}{grads}" + (", channels_last" if flags.get("channels_last") else "")


def row(n: int, index: int, host_layout: str = "heap") -> str:
    """One table row: PAIRS[index] at ``n`` parameters, warm and cold."""
    label, ours, theirs = PAIRS[index]
    w = measure_pair(n, ours, theirs, host_layout=host_layout)
    c = measure_pair(n, ours, theirs, cold=True, host_layout=host_layout)
    oc, tc = w["ours_counts"], w["torch_counts"]
    return (f"| {n} | {label} | {w['ours'] * 1e6:.0f} | {w['torch'] * 1e6:.0f} | "
            f"{w['ratio']:.2f} | {c['ours'] * 1e6:.0f} | {c['torch'] * 1e6:.0f} | "
            f"{c['ratio']:.2f} | {oc['kernels']} + {oc['other_ops']} | "
            f"{tc['kernels']} + {tc['other_ops']} |")


def measure_watch(n_params: int, flags: dict, repeats: int = 30, cold: bool = False,
                  host_layout: str = "dense") -> dict:
    """Ours with ``scaler.watch`` over every parameter against ours without, timed in the
    same process as :func:`measure_pair` times two scalers; launches per step of each."""
    return _measure(n_params, {"watched": ("ours", {**flags, "watch": True}),
                               "plain": ("ours", flags)}, repeats, cold, "cpu", host_layout)


def watch_row(n: int, index: int, host_layout: str = "dense") -> str:
    """One row of the watch's table: PAIRS[index]'s case of ours at ``n`` parameters."""
    label, ours, _ = PAIRS[index]
    w = measure_watch(n, ours, host_layout=host_layout)
    c = measure_watch(n, ours, cold=True, host_layout=host_layout)
    wc, pc = w["watched_counts"], w["plain_counts"]
    return (f"| {n} | {label.split(' (')[0]} | {w['watched'] * 1e6:.0f} | "
            f"{w['plain'] * 1e6:.0f} | {w['ratio']:.2f} | {c['watched'] * 1e6:.0f} | "
            f"{c['plain'] * 1e6:.0f} | {c['ratio']:.2f} | {wc['kernels']} + {wc['other_ops']} "
            f"| {pc['kernels']} + {pc['other_ops']} |")


def main(sizes: tuple[int, ...], host_layout: str, watch: bool = False) -> None:
    """The table; each row in a fresh process, so that no row inherits the heap of the
    rows before it (10,000 parameters allocate and free ~320 MB per row). ``watch``: the
    watch's table (ours watched / ours), its rows the first six of PAIRS."""
    print(f"host time per step (scale+unscale_+step+update), no-op launches, torch "
          f"{torch.__version__}, host layout {host_layout}; medians of 30 steps; warm: steps "
          f"back to back, cold: CPU caches evicted before each step; one process per row")
    a, b = ("watched", "plain") if watch else ("ours", "torch")
    print(f"| params | case | {a} warm us | {b} warm us | ratio warm | {a} cold us "
          f"| {b} cold us | ratio cold | {a} kernels + other ops | {b} kernels + other ops "
          "|\n|---|---|---|---|---|---|---|---|---|---|")
    for n in sizes:
        for index in range(6 if watch else len(PAIRS)):
            done = subprocess.run([sys.executable, __file__, "--host-layout", host_layout,
                                   *(["--watch"] if watch else []), "--row", str(n),
                                   str(index)],
                                  capture_output=True, text=True, check=True)
            print(done.stdout.strip(), flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("sizes", nargs="*", type=int, default=[100, 1000, 10000],
                        help="parameter counts, one table block each")
    parser.add_argument("--host-layout", choices=HOST_LAYOUTS, default="heap",
                        help="where the tensors' data lie on the CPU (HOST_LAYOUTS)")
    parser.add_argument("--row", nargs=2, type=int, metavar=("N", "INDEX"),
                        help="one row alone: PAIRS[INDEX] at N parameters")
    parser.add_argument("--watch", action="store_true",
                        help="ours with scaler.watch against ours without (measure_watch), "
                             "not against torch")
    args = parser.parse_args()
    if args.row and args.watch:
        print(watch_row(*args.row, host_layout=args.host_layout))
    elif args.row:
        print(row(*args.row, host_layout=args.host_layout))
    else:
        main(tuple(args.sizes), args.host_layout, args.watch)
