"""Worker of test_sharded.py: one rank of a 2-process gloo group that trains under DDP and
FSDP1 (also a pure-float16 FSDP1 model) with torch's ``ShardedGradScaler`` and with
``triton_scaler.ShardedGradScaler``, and checks the cases torch's does not agree on."""

import math
import os

import torch
import torch.distributed as dist
from _engines import _full_params, _model, _wrap, train_each
from _spawn import attempt, init_group

SHARDED_ENGINES = ("ddp", "fsdp1", "fsdp1_orig_params", "fsdp1_fp16")
#: how ``one_overflow_step`` steps: torch's ShardedGradScaler agrees on none of the fused
#: routes (without unscale_: no all-reduce; after unscale_: its (1,)-shaped found_inf fails
#: in fused AdamW's step)
ROUTES = ("plain", "fused", "fused_after_unscale")
#: the fused clip of float16 FSDP1 grads: never active (coefficient 1) / active every step
CLIP_MAX_NORMS = (1e6, 0.3)


def run_sharded(rank, world_size, store_file, backend, out_dir):
    from triton_scaler import ShardedGradScaler

    # built before the default group exists, as torch's may be (process_group=None)
    early = ShardedGradScaler("cpu", 2.0**8, backend=backend)
    init_group(rank, world_size, store_file)
    try:
        results = {}
        train_each(results, SHARDED_ENGINES, ("torch_sharded", "ours_sharded"), backend, rank)
        attempt(results, "built_before_init", one_overflow_step, early, rank, "plain")
        for max_norm in CLIP_MAX_NORMS:
            attempt(results, ("fp16_clip", max_norm), clip_fp16, backend, rank, max_norm)
        for route in ROUTES:
            attempt(results, route, one_overflow_step,
                    ShardedGradScaler("cpu", 2.0**8, backend=backend), rank, route)
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()  # gloo's teardown can abort a rank that destroys the group early
    finally:
        dist.destroy_process_group()


def one_overflow_step(scaler, rank, route):
    """One FSDP1 step with a NaN in rank 1's own grad shard only (no reduction spreads it):
    every rank must skip. Returns (scale after update, this rank's parameters unchanged)."""
    wrapped, _ = _wrap("fsdp1", _model())
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-2, fused=route != "plain")
    scaler.scale(wrapped(torch.ones(4, 8)).square().mean()).backward()
    if rank == 1:
        grad = next(p.grad for p in wrapped.parameters() if p.grad is not None and p.grad.numel())
        grad.view(-1)[0] = math.nan
    before = [p.detach().clone() for p in wrapped.parameters()]
    if route == "fused_after_unscale":
        scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    return scaler.get_scale(), all(torch.equal(a, b) for a, b in zip(before,
                                                                    wrapped.parameters()))


def clip_fp16(backend, rank, max_norm):
    """Four steps of the pure-float16 FSDP1 model, rank 1's loss overflowing at step 1,
    clipped by torch's route (``ShardedGradScaler.unscale_`` + ``FSDP.clip_grad_norm_``) and
    by ours (``ShardedGradScaler.clip_grad_norm_(sharded=True)``): per kind the norms, scales
    and final full parameters."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as TorchSharded

    from triton_scaler import ShardedGradScaler

    out = {}
    for kind in ("torch", "ours"):
        wrapped, (opt,) = _wrap("fsdp1_fp16", _model())
        scaler = TorchSharded("cpu", 2.0**8) if kind == "torch" else \
            ShardedGradScaler("cpu", 2.0**8, backend=backend)
        gen = torch.Generator().manual_seed(rank + 1)
        norms, scales = [], []
        for step in range(4):
            loss = wrapped(torch.randn(4, 8, generator=gen)).square().mean()
            scaler.scale(loss * (math.inf if rank == 1 and step == 1 else 1.0)).backward()
            if kind == "torch":
                scaler.unscale_(opt)
                norm = wrapped.clip_grad_norm_(max_norm)
            else:
                norm = scaler.clip_grad_norm_(opt, max_norm, sharded=True)
            norms.append(norm.float())
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            scales.append(scaler.get_scale())
        out[kind] = {"norms": norms, "scales": scales, "params": _full_params("fsdp1", wrapped)}
    return out
