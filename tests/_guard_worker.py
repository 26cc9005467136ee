"""Worker of test_spike_guard.py's distributed test: one rank of a 2-process gloo group that
trains the same model under FSDP2, DDP and FSDP1 with a guarded clip, a spike planted in rank
1's batch only (the engines spread it, or the sharded norm sees it), and saves what each rank
decided."""

import os

import torch
import torch.distributed as dist
from _engines import _full_params, _model, _wrap
from _spawn import attempt, init_group

ENGINES = ("fsdp2", "ddp", "fsdp1")
SPIKE_STEP, STEPS = 6, 8


def _train(engine, backend, rank, action):
    from triton_scaler import GradScaler, SpikeGuard

    wrapped, (opt,) = _wrap(engine, _model())
    guard = SpikeGuard(warmup_steps=3, action=action)
    scaler = GradScaler("cpu", init_scale=2.0**8, growth_interval=3, backend=backend,
                        process_group=dist.group.WORLD, spike_guard=guard)
    gen = torch.Generator().manual_seed(10 + rank)
    norms, skipped = [], []
    for step in range(STEPS):
        x = torch.randn(4, 8, generator=gen)
        if step == SPIKE_STEP and rank == 1:
            x = x * 200.0
        scaler.scale(wrapped(x).square().mean()).backward()
        sharded = None if engine == "fsdp2" else engine == "fsdp1"
        norms.append(scaler.clip_grad_norm_(opt, 1.0, sharded=sharded).item())
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        skipped.append(bool(scaler.last_step_skipped))
    return {"norms": norms, "skipped": skipped, "scale": scaler.get_scale(),
            "statistics": guard.state_dict()["statistics"],
            "params": _full_params(engine, wrapped)}


def run_guarded(rank, world_size, store_file, backend, out_dir):
    init_group(rank, world_size, store_file)
    try:
        results = {}
        for engine in ENGINES:
            for action in ("clip", "skip"):
                attempt(results, (engine, action), _train, engine, backend, rank, action)
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()
