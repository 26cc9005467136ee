"""update_scale_ against torch._amp_update_scale_ (one tiny kernel: launch overhead)."""

import pytest
import torch
from _bench_common import DEVICE

from triton_scaler import ops


@pytest.mark.parametrize("impl", ["torch", "ours", "ours_hysteresis"])
def test_update_scale(run_benchmark, impl):
    scale = torch.full((), 2.0**16, device=DEVICE)
    tracker = torch.zeros((), dtype=torch.int32, device=DEVICE)
    hysteresis = torch.full((), 2, dtype=torch.int32, device=DEVICE)
    found = torch.zeros((), device=DEVICE)
    if impl == "torch":
        def fn():
            torch._amp_update_scale_(scale, tracker, found, 2.0, 0.5, 2000)
    elif impl == "ours":
        def fn():
            ops.update_scale_(scale, tracker, found, 2.0, 0.5, 2000)
    else:
        def fn():
            ops.update_scale_(scale, tracker, found, 2.0, 0.5, 2000, hysteresis_tracker=hysteresis,
                              hysteresis=2, min_scale=1.0)
    run_benchmark(fn, 0, case="update", numel=1, n_tensors=1, dtype="fp32", impl=impl)
