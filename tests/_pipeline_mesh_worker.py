"""Worker of test_pipeline.py's mesh test: one of 4 gloo ranks on a 2-D mesh, 2 pipeline
stages x 2 data-parallel ranks (``mesh["pp"]``, ``mesh["dp"]``), each stage under FSDP2 or
DDP over ``dp``, a 1F1B schedule over ``pp``, one GradScaler per rank over all four ranks.
A NaN on one rank's own grads (after the engine's reduction) must skip the step on all four,
and the clip (``sharded=mesh["pp"].get_group()``) must give every rank the whole model's
norm."""

import math
import os

import torch
import torch.distributed as dist
from _pipeline_worker import N_MICROBATCHES, STAGES, batch, full_model
from _spawn import attempt, init_group

STEPS, GRAD_OVERFLOW, NAN_RANK = 5, 3, 3  # a NaN in rank 3's (stage 1, dp 1) own grads


def train_mesh(engine, backend, rank):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from triton_scaler import GradScaler

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp, dp = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    module = torch.nn.Sequential(*full_model()[slice(*STAGES[2][pp])])
    if engine == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        fully_shard(module, mesh=mesh["dp"])
    else:
        module = torch.nn.parallel.DistributedDataParallel(
            module, process_group=mesh["dp"].get_group())
    opt = torch.optim.AdamW(module.parameters(), lr=1e-2, foreach=True)
    scaler = GradScaler("cpu", init_scale=2.0**8, growth_interval=2, backend=backend,
                        process_group=dist.group.WORLD)
    stage = PipelineStage(module, pp, 2, torch.device("cpu"), group=mesh["pp"].get_group())
    runner = Schedule1F1B(stage, N_MICROBATCHES, loss_fn=lambda out, y: scaler.scale(
        torch.nn.functional.mse_loss(out, y)))
    seen = []
    for step in range(STEPS):
        x, y = batch(step)
        x, y = x.chunk(2)[dp], y.chunk(2)[dp]  # each data-parallel rank its half
        if pp == 0:
            runner.step(x)
        else:
            runner.step(target=y, losses=[])
        if step == GRAD_OVERFLOW and rank == NAN_RANK:
            grad = next(p.grad for p in module.parameters() if p.grad is not None)
            (grad.to_local() if hasattr(grad, "to_local") else grad).view(-1)[0] = math.nan
        norm = scaler.clip_grad_norm_(opt, 1e6, sharded=mesh["pp"].get_group())
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        seen.append((scaler.get_scale(), norm.item(), bool(scaler.last_step_skipped)))
    return {"seen": seen, "pp": pp}


def reference_norms():
    """The whole model's grad norm per step, in one process: each data-parallel half's
    microbatches accumulated and divided by their number, the halves averaged."""
    model = full_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    norms = []
    for step in range(STEPS):
        x, y = batch(step)
        for xb, yb in zip(x.chunk(2 * N_MICROBATCHES), y.chunk(2 * N_MICROBATCHES)):
            scaler.scale(torch.nn.functional.mse_loss(model(xb), yb)).backward()
        for p in model.parameters():
            p.grad.div_(2 * N_MICROBATCHES)
        if step == GRAD_OVERFLOW:
            model[-1].weight.grad.view(-1)[0] = math.nan
        scaler.unscale_(opt)
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e6).item())
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return norms


def run_meshes(rank, world_size, store_file, backend, out_dir):
    init_group(rank, world_size, store_file)
    try:
        results = {}
        for engine in ("fsdp2", "ddp"):
            attempt(results, engine, train_mesh, engine, backend, rank)
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()
