"""What a host-cost step (``_host_cost.py``) runs in place of device work, and how it counts
the launches. Both scalers run on CPU tensors with their device work stubbed out:

* triton_scaler's Triton kernels (``unscale_kernel``, ``update_scale_kernel``) become no-ops
  that count their launches (the launch configuration is the GPU's: 4096-element blocks);
* torch's ``_amp_foreach_non_finite_check_and_unscale_`` / ``_amp_update_scale_`` become
  no-ops that count their calls;
* the optimizer's ``step`` does nothing (its cost is the user's, the same for both).

Every other tensor op the scaler issues still runs (it is host work too); :class:`CountOps`
counts those that would launch device work.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode


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
    from triton_scaler.kernels import stats, unscale, update

    counts: Counter = Counter()
    saved = [(unscale, "unscale_kernel"), (update, "update_scale_kernel"),
             (stats, "finish_stats_kernel"),
             (unscale, "_INTERPRETED"), (unscale, "BLOCK"),
             (torch, "_amp_foreach_non_finite_check_and_unscale_"),
             (torch, "_amp_update_scale_")]
    originals = [getattr(m, name) for m, name in saved]

    def torch_op(name):
        def op(*args, **kwargs):
            counts[name] += 1
        return op

    replacements = [_NoOpLaunch("triton_unscale", counts), _NoOpLaunch("triton_update", counts),
                    _NoOpLaunch("triton_finish_stats", counts),
                    True, unscale.GPU_BLOCK, torch_op("torch_unscale"), torch_op("torch_update")]
    try:
        for (module, name), value in zip(saved, replacements):
            setattr(module, name, value)
        yield counts
    finally:
        for (module, name), value in zip(saved, originals):
            setattr(module, name, value)


class CountOps(TorchDispatchMode):
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


def no_step(closure=None):  # the optimizer's own work is not the scaler's
    return None


class NoStep(torch.optim.SGD):
    pass


class NoStepFused(NoStep):
    _step_supports_amp_scaling = True  # the fused-optimizer route (grad_scale / found_inf)
