"""Launch and op counting for the scaler tests: device ops outside the kernels
(:class:`_Ops`), kernel launches (:func:`_launches`), the calls of one function
(:func:`count_calls`: launch plans made, layouts built), and calls left out of the count
(:func:`_uncounted`: the interpreter's work inside a launch, an optimizer's own step)."""

import contextlib
import os
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from triton_scaler.kernels import guard, stats, unscale, update

from triton_scaler import GradBuckets

_IN_KERNEL = [0]  # the interpreter's own tensor work inside a launch is not counted


class _Ops(TorchDispatchMode):
    """Counts device ops (not views, not host reads) issued outside the kernels, and
    separately the views (host work only, but each is a dispatcher call)."""

    def __init__(self):
        super().__init__()
        self.ops, self.views = Counter(), Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not _IN_KERNEL[0]:
            if func.is_view:
                self.views[func.__name__] += 1
            elif func.__name__ not in ("_local_scalar_dense.default", "empty.memory_format"):
                self.ops[func.__name__] += 1
        return func(*args, **(kwargs or {}))


class _Counted:
    def __init__(self, kernel, name, counts):
        self.kernel, self.name, self.counts = kernel, name, counts

    def __getitem__(self, grid):
        self.counts[self.name] += 1  # triton's own getitem too (3.5's interpreter imports)
        return _uncounted(_uncounted(self.kernel.__getitem__)(grid))  # none is reused


def _uncounted(fn):
    """``fn`` whose own ops (and imports) are not counted: a kernel's, an optimizer's."""
    def call(*args, **kwargs):
        _IN_KERNEL[0] += 1
        try:
            return fn(*args, **kwargs)
        finally:
            _IN_KERNEL[0] -= 1
    return call


@contextlib.contextmanager
def _launches(monkeypatch):
    counts = Counter()
    monkeypatch.setattr(unscale, "unscale_kernel",
                        _Counted(unscale.unscale_kernel, "unscale", counts))
    monkeypatch.setattr(update, "update_scale_kernel",
                        _Counted(update.update_scale_kernel, "update", counts))
    monkeypatch.setattr(stats, "finish_stats_kernel",
                        _Counted(stats.finish_stats_kernel, "finish_stats", counts))
    monkeypatch.setattr(guard, "spike_guard_kernel",
                        _Counted(guard.spike_guard_kernel, "guard", counts))
    yield counts


def count_calls(monkeypatch, owner, name, counts=None, key=None) -> Counter:
    """Counts the calls of ``owner.name`` (e.g. ``_plans.plan_unscale``: the launch plans
    made, which torch's scaler never calls; ``_grads._Layout``: the layouts built) in
    ``counts[key]`` (key: ``name``); returns ``counts``."""
    counts = Counter() if counts is None else counts
    real = getattr(owner, name)

    def counted(*args, **kwargs):
        counts[key or name] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return counts


def _setup(n_params, buckets, fused=False, dtypes=(torch.float32,)):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(7 + 5 * i, dtype=dtypes[i % len(dtypes)]))
              for i in range(n_params)]
    opt = torch.optim.AdamW(params, lr=1e-3, fused=fused)
    if buckets:
        GradBuckets(opt)
    return params, opt


def os_interpreter_missing():
    return os.environ.get("TRITON_INTERPRET") != "1"
