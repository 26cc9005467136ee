"""Several threads at once, each with its own grads (or its own model, optimizer and scaler):
the memos that every caller shares (planning's rows per size pattern, ``_plans._patterns``;
the launcher's compiled launches, ``kernels.launcher``) stay usable, and each thread's results
equal torch's.

A lookup in such a memo reads an entry, then moves it to the end; another thread may evict
it in between (its own launch filled the memo). ``_EvictedOnRead`` makes that happen at every
lookup, so the tests below see it every time (before, a ``KeyError``).
The threaded tests force a thread switch every microsecond. Triton's interpreter is not
thread-safe (it patches ``triton.language`` while a kernel runs): on CPU the interpreter's
kernel runs are serialised by a lock, and the host work around them, where the caches are
read and written, runs interleaved. In a GPU run the compiled kernels launch from the
threads as they are.
"""

import math
import os
import sys
import threading
from collections import OrderedDict

import pytest
import torch
from _util import assert_all_same
from test_launcher import _Kernel, _launch, direct  # noqa: F401 (direct: a fixture)
from triton_scaler.kernels import launcher

import triton_scaler
from triton_scaler import _plans, ops


class _EvictedOnRead(OrderedDict):
    """A cache whose entry another thread evicts right after this thread has read it."""

    def get(self, key, default=None):
        value = super().get(key, default)
        self.pop(key, None)
        return value


def test_a_size_pattern_evicted_between_lookup_and_use(monkeypatch, triton_device):
    grads = [torch.ones(n, device=triton_device) for n in (5, 4099, 1)]
    numels = tuple(g.numel() for g in grads)
    table, starts, _ = _plans.chunk_table(grads, numels, 4096)
    monkeypatch.setattr(_plans, "_patterns", _EvictedOnRead(_plans._patterns))
    assert _plans.chunk_table(grads, numels, 4096)[0] is table  # the kept one, then evicted
    again, again_starts, _ = _plans.chunk_table(grads, numels, 4096)  # built anew
    assert again is not table
    assert torch.equal(again, table) and torch.equal(again_starts, starts)


@pytest.mark.usefixtures("direct")
def test_a_remembered_launch_evicted_between_lookup_and_run():
    kernel, x = _Kernel(), torch.zeros(8)
    _launch(kernel, x)  # through kernel[grid]: its compiled kernel remembered
    launcher._compiled[kernel] = _EvictedOnRead(launcher._compiled[kernel])
    _launch(kernel, x)  # the remembered kernel's launcher, the entry evicted meanwhile
    _launch(kernel, x)  # through kernel[grid] again
    assert (len(kernel.launches), len(kernel.runs)) == (2, 1)


@pytest.fixture
def switching_threads(monkeypatch):
    """A thread switch forced every microsecond; on CPU, the interpreter's kernel runs
    serialised (it is not thread-safe), the host work around them not."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        from triton.runtime import interpreter

        lock, run = threading.Lock(), interpreter.GridExecutor.__call__

        def serialised(self, *args, **kwargs):
            with lock:
                return run(self, *args, **kwargs)

        monkeypatch.setattr(interpreter.GridExecutor, "__call__", serialised)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(interval)


def _in_threads(work, n: int) -> list:
    """``work(i)`` in ``n`` threads at once; their results, or the first exception raised."""
    results, errors = [None] * n, []

    def run(i):
        try:
            results[i] = work(i)
        except BaseException as e:  # noqa: BLE001 - re-raised below, in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a thread did not finish in 300 s"
    if errors:
        raise errors[0]
    return results


def _grad_lists(seed: int, device: torch.device) -> list[list[torch.Tensor]]:
    """Three grad lists of odd sizes and mixed dtypes; an inf in the second list's last grad."""
    gen = torch.Generator().manual_seed(seed)
    lists = []
    for k in range(3):
        sizes = torch.randint(1, 5000, (4,), generator=gen).tolist()
        dtypes = [torch.float32, torch.float16, torch.bfloat16, torch.float32]
        grads = [torch.randn(n, generator=gen).mul_(256).to(device, d)
                 for n, d in zip(sizes, dtypes)]
        if k == 1:
            grads[-1][-1] = math.inf
        lists.append(grads)
    return lists


def test_ops_from_several_threads_equal_torch(switching_threads, triton_device, monkeypatch):
    """4 threads x 3 grad lists: 12 lists in turn, more than planning's memo keeps (here 8):
    size patterns evicted and made again meanwhile."""
    monkeypatch.setattr(_plans, "PATTERNS_KEPT", 8)
    calls = 9
    inv = torch.full((), 2.0 ** -7, device=triton_device)

    def work(i):
        lists, found = _grad_lists(i, triton_device), []
        for c in range(calls):
            flag = torch.zeros((), device=triton_device)
            ops.non_finite_check_and_unscale_(lists[c % 3], flag, inv, backend="triton")
            found.append(flag)
        return lists, found

    _plans.clear()
    for i, (lists, found) in enumerate(_in_threads(work, 4)):
        expected = [[g.cpu() for g in grads] for grads in _grad_lists(i, triton_device)]
        expected_found = []
        for c in range(calls):
            flag = torch.zeros(())  # torch's CPU op takes the dtypes mixed, in one call
            torch._amp_foreach_non_finite_check_and_unscale_(expected[c % 3], flag, inv.cpu())
            expected_found.append(flag)
        assert_all_same([g.cpu() for grads in lists for g in grads],
                        [g for grads in expected for g in grads])
        assert_all_same([f.cpu() for f in found], expected_found)


def _train(scaler_cls, seed: int, device: torch.device, **kwargs):
    torch.manual_seed(seed)  # the model's initial weights (drawn before the threads start)
    model = torch.nn.Sequential(torch.nn.Linear(11, 13), torch.nn.Tanh(),
                                torch.nn.Linear(13, 3)).to(device)
    gen = torch.Generator().manual_seed(seed)
    data = [torch.randn(5, 11, generator=gen).to(device) for _ in range(6)]

    def run():
        if seed % 3 == 2:  # the fused route: no unscale_ pass, found_inf passed to the kernel
            opt = torch.optim.Adam(model.parameters(), lr=0.01, fused=True)
        else:
            opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        buckets = triton_scaler.GradBuckets(opt) if seed % 3 == 1 and kwargs else None
        scaler = scaler_cls(device.type, init_scale=2.0 ** 10, growth_interval=2, **kwargs)
        scales = []
        for step, x in enumerate(data):
            if buckets is not None:
                buckets.zero_()
            else:
                opt.zero_grad()
            loss = model(x).square().mean() * (math.inf if step == 2 + seed % 2 else 1.0)
            scaler.scale(loss).backward()
            if seed % 3 != 2:
                scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        return scales, [p.detach().cpu() for p in model.parameters()]

    return run


def test_scalers_in_several_threads_equal_torchs(switching_threads, backend):
    """3 threads, each training its own model with its own scaler (SGD; SGD over
    GradBuckets; fused Adam), against torch's scaler run alone for each."""
    device = torch.device("cpu")
    runs = [_train(triton_scaler.GradScaler, i, device, backend=backend) for i in range(3)]
    results = _in_threads(lambda i: runs[i](), 3)
    for i, (scales, params) in enumerate(results):
        expected_scales, expected = _train(torch.amp.GradScaler, i, device)()
        assert scales == expected_scales
        assert_all_same(params, expected)
