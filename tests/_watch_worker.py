"""Worker of test_watch_ddp.py: one rank of a 2-process gloo group training a DDP model with
a watched scaler; rank 1's loss overflows at one step (DDP's all-reduce spreads it)."""

import math
import os

import torch
import torch.distributed as dist
from _spawn import init_group

OVERFLOW_STEP = 3


def run_watched_ddp(rank, world_size, store_file, backend, out_dir):
    init_group(rank, world_size, store_file)
    try:
        from torch.nn.parallel import DistributedDataParallel

        from triton_scaler import GradScaler

        torch.manual_seed(0)
        model = DistributedDataParallel(torch.nn.Sequential(
            torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2)))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        scaler = GradScaler("cpu", init_scale=2.0**8, backend=backend)
        watch = scaler.watch(model.module)
        gen = torch.Generator().manual_seed(rank + 1)  # each rank its own data
        expected = {}
        for step in range(6):
            loss = model(torch.randn(4, 6, generator=gen)).square().mean()
            if step == OVERFLOW_STEP and rank == 1:
                loss = loss * math.inf
            scaler.scale(loss).backward()
            inv = torch.tensor(1.0 / scaler.get_scale())
            expected = {name: ((p.grad * inv).abs().max().item(),
                               torch.linalg.vector_norm(p.grad * inv).item(),
                               int(torch.isinf(p.grad * inv).sum()),
                               int(torch.isnan(p.grad * inv).sum()))
                        for name, p in model.module.named_parameters()}
            scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        report = watch.report()
        overflow = report.last_overflow
        torch.save({"expected": expected, "amax": report.amax, "norm": report.norm,
                    "nonfinite": report.nonfinite, "skipped": report.skipped_steps,
                    "overflow_step": overflow.step if overflow else None,
                    "overflow_names": [name for name, _, _ in overflow.tensors]
                    if overflow else None,
                    "params": [p.detach().clone() for p in model.parameters()]},
                   os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()
