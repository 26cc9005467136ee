"""Host cost of a scaler step, with every device launch replaced by a counting no-op.

On a GPU a scaler is host-bound before it is bandwidth-bound, so what matters per step is the
Python and dispatcher work of ``scale -> unscale_ -> step -> update`` and the number of device
launches it issues. Here both scalers run on CPU tensors with their device work stubbed out:

* triton_scaler's Triton kernels (``unscale_kernel``, ``update_scale_kernel``) become no-ops
  that count their launches (the launch configuration is the GPU's: 4096-element blocks);
* torch's ``_amp_foreach_non_finite_check_and_unscale_`` / ``_amp_update_scale_`` become
  no-ops that count their calls;
* the optimizer's ``step`` does nothing (its cost is the user's, the same for both).

Every other tensor op the scaler issues still runs (it is host work too) and is counted by a
dispatch mode in a separate, untimed step: ``kernels`` + ``other_ops`` = device launches per
step (the optimizer's profiling records excluded). See ``GRAD_MODES`` for how the grads change
between steps.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from collections import Counter
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

NUMEL = 4096


class _NoOpLaunch:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](*args)`` counts and returns."""

    def __init__(self, name: str, counts: Counter) -> None:
        self.name, self.counts = name, counts

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.counts[self.name] += 1
        return launch


@contextlib.contextmanager
def noop_launches() -> Iterator[Counter]:
    """Patch both scalers' device kernels to counting no-ops (see the module docstring)."""
    from triton_scaler.kernels import unscale, update

    counts: Counter = Counter()
    saved = [(unscale, "unscale_kernel"), (update, "update_scale_kernel"),
             (unscale, "_INTERPRETED"), (unscale, "INTERPRETER_BLOCK"),
             (torch, "_amp_foreach_non_finite_check_and_unscale_"),
             (torch, "_amp_update_scale_")]
    originals = [getattr(m, name) for m, name in saved]

    def torch_op(name):
        def op(*args, **kwargs):
            counts[name] += 1
        return op

    replacements = [_NoOpLaunch("triton_unscale", counts), _NoOpLaunch("triton_update", counts),
                    True, unscale.GPU_BLOCK, torch_op("torch_unscale"), torch_op("torch_update")]
    try:
        for (module, name), value in zip(saved, replacements):
            setattr(module, name, value)
        yield counts
    finally:
        for (module, name), value in zip(saved, originals):
            setattr(module, name, value)


class _CountOps(TorchDispatchMode):
    """Counts the tensor ops that launch device work: not views, not host reads."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func.__name__ not in ("_local_scalar_dense.default",
                                                       "empty.memory_format",
                                                       "empty_strided.default"):
            self.ops[func.__name__] += 1
        return func(*args, **(kwargs or {}))


def _no_step(closure=None):  # the optimizer's own work is not the scaler's
    return None


class _NoStep(torch.optim.SGD):
    pass


class _NoStepFused(_NoStep):
    _step_supports_amp_scaling = True  # the fused-optimizer route (grad_scale / found_inf)


#: How the grads change between two timed steps (untimed):
#: ``same``: the same grad tensors (``zero_grad(set_to_none=False)``, or GradBuckets);
#: ``new_tensors``: new grad tensors at the same addresses (``zero_grad()`` + backward on a
#: GPU, whose caching allocator hands the same blocks back in the same order);
#: ``new_memory``: new grad tensors at new addresses (the worst case: every cache misses).
GRAD_MODES = ("same", "new_tensors", "new_memory")


def make_step(impl: str, n_params: int, *, buckets: bool = False, fused: bool = False,
              grads: str = "same"):
    """(prepare, step): ``step()`` is the timed ``scale -> unscale_ -> step -> update``;
    ``prepare()`` (untimed) renews the grads as ``grads`` says. One real backward first
    writes every grad through autograd (GradBuckets' hooks fire)."""
    from triton_scaler import GradBuckets, GradScaler

    torch.manual_seed(0)
    sizes = torch.randint(NUMEL // 2, 3 * NUMEL // 2, (n_params,)).tolist()  # ~4k, mostly odd
    params = [torch.nn.Parameter(torch.zeros(n)) for n in sizes]
    opt = (_NoStepFused if fused else _NoStep)(params, lr=0.0)
    opt.step = _no_step  # the instance's own: no torch wrapper (profiling hooks) around it
    if buckets:
        GradBuckets(opt)
    scaler = (torch.amp.GradScaler("cpu") if impl == "torch"
              else GradScaler("cpu", backend="triton"))
    loss = torch.ones(())
    torch.stack([p[:1] for p in params]).sum().backward()

    def prepare() -> None:
        if grads == "new_tensors":
            for p in params:
                p.grad = p.grad.detach()  # a new tensor over the same memory
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


def measure(impl: str, n_params: int, repeats: int = 21, **flags) -> dict:
    """Median host seconds per step and launches per step (kernels and other ops)."""
    with noop_launches() as counts:
        prepare, step = make_step(impl, n_params, **flags)
        _settle()
        step()  # warm-up: caches, lazy init
        times = []
        for _ in range(repeats):
            prepare()
            gc.collect()
            gc.disable()  # a collection of unrelated garbage is not the step's cost
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
            gc.enable()
        prepare()
        counts.clear()
        with _CountOps() as mode:
            step()
    ops = {k: v for k, v in mode.ops.items() if not k.startswith("_record_function")}
    return {"seconds": statistics.median(times), "kernels": sum(counts.values()),
            "other_ops": sum(ops.values()), "ops": ops}


CASES: list[tuple[str, dict]] = [
    ("torch", {"grads": "same"}), ("ours", {"grads": "same"}),
    ("torch", {"grads": "new_tensors"}), ("ours", {"grads": "new_tensors"}),
    ("torch", {"grads": "new_memory"}), ("ours", {"grads": "new_memory"}),
    ("ours", {"buckets": True}),
    ("torch", {"fused": True}), ("ours", {"fused": True}), ("ours", {"fused": True, "buckets": True}),
]


def label(impl: str, flags: dict) -> str:
    name = impl + ("+buckets" if flags.get("buckets") else "")
    route = "fused" if flags.get("fused") else "plain"
    return f"{name}, {route}" + ("" if flags.get("buckets") else f", grads {flags.get('grads', 'same')}")


def main(sizes: tuple[int, ...] = (100, 1000, 10000)) -> None:
    print(f"host time per step (scale+unscale_+step+update), no-op launches, "
          f"torch {torch.__version__}, median of 21 steps")
    print("| params | case | host us | kernels | other ops |\n|---|---|---|---|---|")
    for n in sizes:
        for impl, flags in CASES:
            r = measure(impl, n, **flags)
            print(f"| {n} | {label(impl, flags)} | {r['seconds'] * 1e6:.0f} | "
                  f"{r['kernels']} | {r['other_ops']} |", flush=True)


if __name__ == "__main__":
    main()
