"""A full training iteration (scale -> backward -> unscale_ -> clip -> step -> update) on a
small transformer's parameter set, triton_scaler against torch.amp.GradScaler; plus the
scaler-only part (unscale_ + update), and host syncs per iteration."""

import pytest
import torch
from _bench_common import DEVICE, FULL

from triton_scaler import GradBuckets, GradScaler
from triton_scaler.bench import scaler_step_pair
from triton_scaler.diagnostics import count_host_syncs, optimizer_step_uncounted

D_MODEL, LAYERS = (512, 6) if FULL and DEVICE.type == "cuda" else (128, 2) if FULL else (64, 1)


def _transformer():
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(D_MODEL, nhead=8, dim_feedforward=4 * D_MODEL,
                                             batch_first=True, dropout=0.0)
    return torch.nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False).to(DEVICE)


def _iteration_fn(impl, fused, buckets):
    model = _transformer()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)
    if buckets:
        GradBuckets(opt)
    scaler = (torch.amp.GradScaler(DEVICE.type) if impl == "torch"
              else GradScaler(DEVICE.type))
    x = torch.randn(8, 32, D_MODEL, device=DEVICE)
    dtype = torch.float16 if DEVICE.type == "cuda" else torch.bfloat16
    nbytes = 2 * sum(p.numel() * p.element_size() for p in model.parameters())

    def fn():
        with torch.autocast(DEVICE.type, dtype=dtype):
            loss = model(x).float().square().mean()
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        if buckets:
            opt.zero_grad(set_to_none=False)
        else:
            opt.zero_grad()
    return fn, nbytes, opt


@pytest.mark.parametrize("impl, buckets", [("torch", False), ("ours", False), ("ours", True)])
@pytest.mark.parametrize("fused", [False, True])
def test_training_iteration(run_benchmark, impl, buckets, fused):
    fn, nbytes, opt = _iteration_fn(impl, fused, buckets)
    fn()
    with count_host_syncs() as counter, optimizer_step_uncounted(opt, counter):
        fn()
    run_benchmark(fn, nbytes, case="iteration", numel=D_MODEL, n_tensors=LAYERS,
                  dtype="amp", impl=impl + ("+buckets" if buckets else ""),
                  fused=fused, host_syncs=counter.count)


@pytest.mark.parametrize("impl", ["torch", "ours"])
@pytest.mark.parametrize("n_tensors, numel", [(2000, 4096), (4, 4 * 2**20)] if FULL
                         else [(20, 256), (2, 4096)])
def test_scaler_unscale_and_update(run_benchmark, impl, n_tensors, numel):
    torch_fn, ours_fn, nbytes = scaler_step_pair(n_tensors, numel, torch.float32, DEVICE)
    run_benchmark(torch_fn if impl == "torch" else ours_fn, nbytes, case="scaler",
                  numel=numel, n_tensors=n_tensors, dtype="fp32", impl=impl)
