"""Worker of test_watch_ddp.py: one rank of a 2-process gloo group training a DDP model with
a watched scaler; rank 1's loss overflows at one step (DDP's all-reduce spreads it)."""

import math
import os

import torch
import torch.distributed as dist
from _spawn import init_group
from _util import unscaled_stats

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
            expected = {name: unscaled_stats(p.grad, inv)
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


def run_watched_sharded(rank, world_size, store_file, engine, backend, out_dir):
    """``engine`` ``"fsdp2"`` (fully_shard over a 2-rank CPU mesh, DTensor grads) or
    ``"fsdp1"`` (FSDP with use_orig_params=True and triton_scaler's ShardedGradScaler): a
    watched run whose rank-1 loss overflows at OVERFLOW_STEP; the report of each rank and
    torch's numbers of the gathered gradients at the last step."""
    init_group(rank, world_size, store_file)
    try:
        from triton_scaler import GradScaler, ShardedGradScaler

        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(),
                                    torch.nn.Linear(5, 3))
        if engine == "fsdp2":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
            wrapped, named = model, model
            scaler = GradScaler("cpu", init_scale=2.0**8, backend=backend)
        else:
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

            wrapped = FSDP(model, device_id=torch.device("cpu"), use_orig_params=True)
            named = wrapped
            scaler = ShardedGradScaler("cpu", init_scale=2.0**8, backend=backend,
                                       process_group=dist.group.WORLD)
        opt = torch.optim.SGD(wrapped.parameters(), lr=0.05)
        watch = scaler.watch(named)
        gen = torch.Generator().manual_seed(rank + 1)  # each rank its own data
        expected = {}
        for step in range(5):
            loss = wrapped(torch.randn(4, 6, generator=gen)).square().mean()
            if step == OVERFLOW_STEP and rank == 1:
                loss = loss * math.inf
            scaler.scale(loss).backward()
            inv = torch.tensor(1.0 / scaler.get_scale())
            if engine == "fsdp2":  # the gathered gradients (a collective per parameter)
                expected = {name: unscaled_stats(p.grad.full_tensor(), inv)
                            for name, p in named.named_parameters()}
            else:
                with FSDP.summon_full_params(wrapped, with_grads=True):
                    expected = {name: unscaled_stats(p.grad, inv)
                                for name, p in wrapped.named_parameters()}
            scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        report = watch.report()  # a collective: every rank
        overflow = report.last_overflow
        torch.save({"expected": expected, "amax": report.amax, "norm": report.norm,
                    "nonfinite": report.nonfinite, "has_grad": report.has_grad,
                    "skipped": report.skipped_steps,
                    "overflow_step": overflow.step if overflow else None,
                    "overflow": overflow.tensors if overflow else None},
                   os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()
