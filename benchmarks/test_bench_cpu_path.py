"""The CPU path against torch's (both on the reference backend there; on a GPU the same cases
run the Triton kernels): one thread, many small grads (100 and 1,000 x 64) and a few large
ones (4 x 2**20), float32 / float16 / bfloat16.

* ``unscale``: ``ops.non_finite_check_and_unscale_`` against torch's op, inv_scale just
  below 1 (the ops' alias check and the product check's decision included);
* ``check``: ``ops.non_finite_check_`` (read-only) against torch's op with inv_scale 1 (what
  torch's scaler runs for a fused optimizer);
* ``step``: a scaler's whole ``scale``, ``step``, ``update`` (grads kept) with a for-loop
  SGD, a foreach AdamW and a fused AdamW.

``bash benchmarks/run_cpu.sh`` runs them at full sizes; ``benchmarks/plot.py`` tables the
ratios to torch (``cpu_tables.md``)."""

import pytest
import torch
from _bench_common import DEVICE, FULL

from triton_scaler import GradScaler, ops

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
SHAPES = [(100, 64), (1000, 64), (4, 2**20)] if FULL else [(10, 64), (2, 2**12)]
STEP_PARAMS = [100, 1000] if FULL else [10]
INV = 0.99999994  # just below 1: every product rounds, none overflows


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _grads(n, numel, dtype):
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    return [torch.randn(numel, device=DEVICE, generator=gen).to(dtype) for _ in range(n)]


@pytest.mark.parametrize("impl", ["torch", "ours"])
@pytest.mark.parametrize("op", ["unscale", "check"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("n_tensors, numel", SHAPES)
def test_cpu_ops(run_benchmark, impl, op, dtype, n_tensors, numel):
    if DEVICE.type == "cuda" and dtype == "bf16" and impl == "torch":
        pytest.skip("torch's CUDA op does not support bf16 gradients (unsupported)")
    grads = _grads(n_tensors, numel, DTYPES[dtype])
    found = torch.zeros((), device=DEVICE)
    inv = torch.full((), 1.0 if op == "check" and impl == "torch" else INV, device=DEVICE)
    fn = {("torch", "unscale"): torch._amp_foreach_non_finite_check_and_unscale_,
          ("torch", "check"): torch._amp_foreach_non_finite_check_and_unscale_,
          ("ours", "unscale"): ops.non_finite_check_and_unscale_,
          ("ours", "check"): ops.non_finite_check_}[impl, op]
    nbytes = (1 if op == "check" and impl == "ours" else 2) * n_tensors * numel * \
        grads[0].element_size()
    run_benchmark(lambda: fn(grads, found, inv), nbytes, case=f"cpu path {op}", dtype=dtype,
                  n_tensors=n_tensors, numel=numel, impl=impl)


def _optimizer(kind, params):
    if kind == "for-loop SGD":
        return torch.optim.SGD(params, lr=1e-3, foreach=False)
    return torch.optim.AdamW(params, lr=1e-3, **({"foreach": True} if kind == "foreach AdamW"
                                                 else {"fused": True}))


@pytest.mark.parametrize("impl", ["torch", "ours"])
@pytest.mark.parametrize("kind", ["for-loop SGD", "foreach AdamW", "fused AdamW"])
@pytest.mark.parametrize("n_params", STEP_PARAMS)
def test_cpu_scaler_step(run_benchmark, impl, kind, n_params):
    params = [torch.nn.Parameter(torch.randn(64, device=DEVICE)) for _ in range(n_params)]
    for p in params:
        p.grad = torch.randn(64, device=DEVICE)  # kept: no backward in the timed step
    opt = _optimizer(kind, params)
    scaler = (torch.amp.GradScaler if impl == "torch" else GradScaler)(DEVICE.type,
                                                                       init_scale=1.0)
    loss = torch.ones((), device=DEVICE)

    def step():
        scaler.scale(loss)
        scaler.step(opt)
        scaler.update()
    run_benchmark(step, 0, case=f"cpu path step, {kind}", dtype="fp32", n_tensors=n_params,
                  numel=64, impl=impl)
