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
step. A real backward (untimed) writes every grad before each step, so GradBuckets' hooks and
``zero_grad`` behave as in training.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterator

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


def make_step(impl: str, n_params: int, *, buckets: bool = False, fused: bool = False,
              set_to_none: bool = True):
    """(backward, step): ``backward()`` (untimed) zeroes and writes every grad through
    autograd; ``step()`` is the timed ``scale -> unscale_ -> step -> update``."""
    from triton_scaler import GradBuckets, GradScaler

    torch.manual_seed(0)
    sizes = torch.randint(NUMEL // 2, 3 * NUMEL // 2, (n_params,)).tolist()  # ~4k, mostly odd
    params = [torch.nn.Parameter(torch.zeros(n)) for n in sizes]
    opt = (_NoStepFused if fused else _NoStep)(params, lr=0.0)
    opt.step = _no_step  # the instance's own: no torch wrapper (profiling hooks) around it
    bucketed = GradBuckets(opt) if buckets else None
    scaler = (torch.amp.GradScaler("cpu") if impl == "torch"
              else GradScaler("cpu", backend="triton"))
    loss = torch.ones(())
    unscale_ = fused is False  # fused optimizers unscale inside their own step

    def backward() -> None:
        if bucketed is not None:
            bucketed.zero_()
        else:
            opt.zero_grad(set_to_none=set_to_none)
        total = torch.stack([p[:1] for p in params]).sum()
        total.backward()
        # Small ops, untimed: the CPU backward just wrote every grad (~160 MB at 10,000
        # parameters) and freed its graph; the first small allocations after it fault in
        # fresh heap pages (~1 ms), in both scalers alike. On a GPU the backward runs on the
        # device and the host allocator is not disturbed.
        for _ in range(64):
            torch.ones(()).mul(2.0)

    def step() -> None:
        scaler.scale(loss)
        if unscale_:
            scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
    return backward, step


def measure(impl: str, n_params: int, repeats: int = 15, **flags) -> dict:
    """Median host seconds per step and launches per step (kernels and other ops)."""
    with noop_launches() as counts:
        backward, step = make_step(impl, n_params, **flags)
        backward()
        step()  # warm-up: caches, lazy init
        times = []
        for _ in range(repeats):
            backward()
            gc.collect()
            gc.disable()  # a collection of the backward's garbage is not the step's cost
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
            gc.enable()
        backward()
        counts.clear()
        with _CountOps() as mode:
            step()
    return {"seconds": statistics.median(times), "kernels": sum(counts.values()),
            "other_ops": sum(mode.ops.values()), "ops": dict(mode.ops)}


CASES: list[tuple[str, dict]] = [
    ("torch", {}), ("torch", {"set_to_none": False}),
    ("ours", {}), ("ours", {"set_to_none": False}), ("ours", {"buckets": True}),
    ("torch", {"fused": True}), ("ours", {"fused": True}),
    ("ours", {"fused": True, "buckets": True}),
]


def label(impl: str, flags: dict) -> str:
    parts = [impl + ("+buckets" if flags.get("buckets") else "")]
    parts.append("fused" if flags.get("fused") else "plain")
    if not flags.get("buckets"):
        parts.append("zero_grad(set_to_none=False)" if flags.get("set_to_none") is False
                     else "zero_grad()")
    return ", ".join(parts)


def main(sizes: tuple[int, ...] = (100, 1000, 10000)) -> Callable | None:
    print(f"host time per step (scale+unscale_+step+update), no-op launches, "
          f"torch {torch.__version__}")
    print(f"{'params':>7} | {'case':<52} | {'host us':>9} | {'kernels':>7} | {'other ops':>9}")
    for n in sizes:
        for impl, flags in CASES:
            r = measure(impl, n, **flags)
            print(f"{n:>7} | {label(impl, flags):<52} | {r['seconds'] * 1e6:>9.1f} | "
                  f"{r['kernels']:>7} | {r['other_ops']:>9}")
    return None


if __name__ == "__main__":
    main()
