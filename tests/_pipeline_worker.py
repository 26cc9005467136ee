"""Worker of test_pipeline.py: one rank of a 2-process gloo group running a model split into
pipeline stages with ``torch.distributed.pipelining`` (GPipe, 1F1B: a stage per rank;
interleaved 1F1B: two per rank), the scaled loss entering through the schedule's ``loss_fn``,
and one GradScaler per rank over both ranks (``process_group``); and the single-process
reference: torch's scaler over the unsplit model and the same microbatches."""

import math
import os

import torch
import torch.distributed as dist
from _spawn import attempt, init_group

N_MICROBATCHES, STEPS = 4, 6
LOSS_OVERFLOW, GRAD_OVERFLOW = 2, 4  # an inf in one microbatch's target / a NaN in stage 0
#: the layers of each stage, for 2 and 4 stages
STAGES = {2: [(0, 2), (2, 7)], 4: [(0, 2), (2, 4), (4, 6), (6, 7)]}
CASES = [(schedule, optimizer, "unscale") for schedule in ("gpipe", "1f1b", "interleaved")
         for optimizer in ("sgd", "foreach", "fused")] + \
    [("1f1b", optimizer, route) for optimizer in ("sgd", "fused") for route in ("step", "clip")] + \
    [("1f1b", "fused", "resume")]  # a new scaler from the checkpoint at RESUME_AT: no scale()
RESUME_AT = 3  # on the first stage before its step
MAX_NORM = 0.5


def full_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16),
                               torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 3))


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(8, 8, generator=g), torch.randn(8, 3, generator=g)
    if step == LOSS_OVERFLOW:
        y[5] = math.inf  # one microbatch's loss overflows (it reaches every stage)
    return x, y


def optimizer(name, params):
    if name == "fused":
        return torch.optim.AdamW(params, lr=1e-2, fused=True)
    if name == "foreach":
        return torch.optim.AdamW(params, lr=1e-2, foreach=True)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, foreach=False)


def _stage_ids(schedule, rank):
    return [rank, rank + 2] if schedule == "interleaved" else [rank]


def train_stages(schedule, opt_name, route, backend, rank):
    """Every step's (scale, norm, skipped) and this rank's stages' parameters."""
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )

    from triton_scaler import GradScaler

    n_stages = 4 if schedule == "interleaved" else 2
    model = full_model()
    ids = _stage_ids(schedule, rank)
    modules = [torch.nn.Sequential(*model[slice(*STAGES[n_stages][s])]) for s in ids]
    opt = optimizer(opt_name, [p for m in modules for p in m.parameters()])
    scaler = GradScaler("cpu", init_scale=2.0**8, growth_interval=2, backend=backend,
                        process_group=dist.group.WORLD)
    stages = [PipelineStage(m, s, n_stages, torch.device("cpu")) for m, s in zip(modules, ids)]

    def loss_fn(output, target):
        return scaler.scale(torch.nn.functional.mse_loss(output, target))

    if schedule == "interleaved":
        runner = ScheduleInterleaved1F1B(stages, N_MICROBATCHES, loss_fn=loss_fn)
    else:
        kind = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
        runner = kind(stages[0], N_MICROBATCHES, loss_fn=loss_fn)
    seen, logged = [], []
    for step in range(STEPS):
        x, y = batch(step)
        losses: list = []
        if schedule == "interleaved" or rank == 0:
            runner.step(x, target=y, losses=losses)
        else:
            runner.step(target=y, losses=losses)
        if step == GRAD_OVERFLOW and rank == 0:
            modules[0][0].weight.grad[0, 0] = math.nan  # stage 0 only
        norm = torch.zeros(())
        if route == "resume" and step == RESUME_AT:  # a restart: the checkpoint, a new scaler
            saved = scaler.state_dict()
            scaler = GradScaler("cpu", backend=backend, process_group=dist.group.WORLD)
            scaler.load_state_dict(saved)  # (loss_fn reads the new one)
        if route == "unscale":
            scaler.unscale_(opt)
        elif route == "clip":
            norm = scaler.clip_grad_norm_(opt, MAX_NORM, sharded=True)
        logged.append([loss.item() for loss in scaler.unscaled(losses)])  # before update()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        seen.append((scaler.get_scale(), norm.item(), bool(scaler.last_step_skipped)))
    return {"seen": seen, "state": scaler.state_dict(), "losses": logged,
            "params": {s: [p.detach().clone() for p in m.parameters()]
                       for s, m in zip(ids, modules)}}


def reference(opt_name, route):
    """torch's scaler over the unsplit model, the microbatches' grads accumulated in order and
    divided by their number (the schedules' ``scale_grads``)."""
    model = full_model()
    opt = optimizer(opt_name, model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    seen, logged = [], []
    for step in range(STEPS):
        x, y = batch(step)
        logged.append([])
        for xb, yb in zip(x.chunk(N_MICROBATCHES), y.chunk(N_MICROBATCHES)):
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            logged[-1].append(loss.item())
            scaler.scale(loss).backward()
        for p in model.parameters():
            p.grad.div_(N_MICROBATCHES)
        if step == GRAD_OVERFLOW:
            model[0].weight.grad[0, 0] = math.nan
        norm = torch.zeros(())
        if route in ("unscale", "resume"):
            scaler.unscale_(opt)
        elif route == "clip":
            scaler.unscale_(opt)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        seen.append((scaler.get_scale(), norm.item(), False))
    return seen, model, logged


def run_pipelines(rank, world_size, store_file, backend, out_dir):
    init_group(rank, world_size, store_file)
    try:
        results = {}
        for case in CASES:
            attempt(results, case, train_stages, *case, backend, rank)
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()
