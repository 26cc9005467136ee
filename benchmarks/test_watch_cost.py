"""The device cost of ``scaler.watch``: ``unscale_`` with a watch against without, over a
flat gradient bucket and over many tensors, fp32 and fp16 grads (fp16 through a fused
optimizer's check, which torch allows for fp16). On CUDA the watch reads the grads in a pass
of its own before the unscale (one read more than the unscale's read and write, and a small
launch summing per tensor). On CPU (the reference backend) the statistics are torch's ops.

``python benchmarks/watch_cost.py OUT/watch.json`` prints the ratios (``gpu_all.sh``'s
``watch`` part)."""

import pytest
import torch
from _bench_common import DEVICE, FULL

from triton_scaler import GradBuckets, GradScaler

NUMEL = 10**8 if FULL and DEVICE.type == "cuda" else 2**22 if FULL else 2**12
CASES = {"bucket": (1, NUMEL), "many": (1000, NUMEL // 1000)}


def _step(case: str, dtype: torch.dtype, watched: bool):
    n_tensors, numel = CASES[case]
    params = [torch.nn.Parameter(torch.zeros(numel, device=DEVICE, dtype=dtype))
              for _ in range(n_tensors)]
    fused = dtype == torch.float16  # torch refuses to unscale fp16 grads: the check route
    opt = torch.optim.SGD(params, lr=0.0, fused=fused) if fused else \
        torch.optim.SGD(params, lr=0.0)
    if case == "bucket":
        GradBuckets(opt)
    scaler = GradScaler(DEVICE.type, init_scale=1.0, growth_interval=2**30)
    if watched:
        scaler.watch([(f"p{i}", p) for i, p in enumerate(params)])
    scaler.scale(sum(p.sum() for p in params)).backward()  # grads through the buckets' hooks
    check = scaler._check_inf_per_device

    def step():
        scaler.scale(torch.ones((), device=DEVICE))
        if fused:
            check(opt)  # the fused route's read-only pass, as step() runs it
        else:
            scaler.unscale_(opt)
        scaler.update()
    step()
    return step, n_tensors * numel * params[0].element_size() * (1 if fused else 2)


@pytest.mark.parametrize("watched", [False, True], ids=["plain", "watched"])
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("case", list(CASES))
def test_watch_cost(run_benchmark, case, dtype, watched):
    step, nbytes = _step(case, getattr(torch, {"fp32": "float32", "fp16": "float16"}[dtype]),
                         watched)
    run_benchmark(step, nbytes, case=case, dtype=dtype, numel=NUMEL,
                  impl="watched" if watched else "plain")
