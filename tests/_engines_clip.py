"""Worker of test_engines.py's clipping tests: one rank of a 2-process gloo group. The fused
``clip_grad_norm_`` under each engine against torch's route for that engine (``unscale_``,
then ``torch.nn.utils.clip_grad_norm_`` for FSDP2 and DDP, ``FSDP.clip_grad_norm_`` for FSDP1),
DTensor grads with mixed placements (tensor parallel), and the ``sharded`` argument's errors."""

import math
import os

import torch
import torch.distributed as dist
from _engines import (
    INJECTIONS,
    OVERFLOW_STEPS,
    STEPS,
    _full_params,
    _model,
    _scaler,
    _wrap,
    data_rank,
    overflowing_ranks,
    plant_inf_in_own_grad,
    snapshot,
    unchanged,
)
from _spawn import attempt, init_group

CLIP_ENGINES = ("fsdp2", "fsdp2_mixed_precision", "ddp", "ddp_zero", "fsdp1", "fsdp1_orig_params")
#: how each engine's plain grads relate across ranks (None: DTensor grads say it themselves)
SHARDED = {"fsdp2": None, "fsdp2_mixed_precision": None, "fsdp2_hsdp": None, "fsdp2_tp": None,
           "ddp": False, "ddp_zero": False, "fsdp1": True, "fsdp1_orig_params": True}
MAX_NORM = 0.05  # below the grads' norm: every step clips


def _torch_clip(engine, wrapped, scaler, opt, norm_type):
    scaler.unscale_(opt)
    if engine.startswith("fsdp1"):
        return wrapped.clip_grad_norm_(MAX_NORM, norm_type)
    total = torch.nn.utils.clip_grad_norm_(list(wrapped.parameters()), MAX_NORM, norm_type)
    return total.full_tensor() if hasattr(total, "full_tensor") else total


def train_clipped(engine, kind, backend, norm_type, injection, rank):
    """``STEPS`` clipped steps; at ``OVERFLOW_STEPS`` an inf in the loss of the overflowing
    ranks (the engine's reduction spreads it) or in their own grad shard after the backward
    (``injection="grad"``: the other ranks' grads stay finite, their norm is the reduced inf,
    so their clip coefficient is 0; only found_inf's agreement makes them skip too)."""
    wrapped, optimizers = _wrap(engine, _model())
    # one optimizer over every param (ZeRO's: it holds them all, each rank steps its part)
    opt = optimizers[0] if engine == "ddp_zero" else torch.optim.AdamW(wrapped.parameters(),
                                                                       lr=1e-2)
    scaler = _scaler(engine, kind, backend)
    gen = torch.Generator().manual_seed(data_rank(engine, rank) + 1)
    norms, scales, skipped = [], [], []
    watched = opt.param_groups[0]["params"]
    for step in range(STEPS):
        before = snapshot(watched)
        loss = wrapped(torch.randn(4, 8, generator=gen)).square().mean()
        overflow = rank in overflowing_ranks(engine, injection) and step in OVERFLOW_STEPS
        if overflow and injection == "loss":
            loss = loss * math.inf
        scaler.scale(loss).backward()
        if overflow and injection == "grad":
            plant_inf_in_own_grad(wrapped)
        if kind == "torch":
            total = _torch_clip(engine, wrapped, scaler, opt, norm_type)
        else:
            total = scaler.clip_grad_norm_(opt, MAX_NORM, norm_type, sharded=SHARDED[engine])
        norms.append(total.detach().float().cpu().reshape(()))
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
        if unchanged(before, watched):
            skipped.append(step)
    return {"norms": norms, "scales": scales, "skipped": skipped,
            "params": _full_params(engine, wrapped)}


def mixed_placements(kind, backend, norm_type, mesh_shape=(2,), stages=False):
    """DTensor grads with different placements (tensor parallel style: sharded and replicated
    ones, on a 1-D or a 2-D mesh; a replicated grad's norm counts once). ``stages``: 4 ranks
    as 2 pipeline stages, each its own 1-D mesh of 2 ranks and its own grads (a norm is
    reduced over the stage's ranks, not the world). Returns (total norm, full grads after
    the clip, the full tensors)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from triton_scaler import GradScaler

    if stages:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))["tp"]
    else:
        mesh = init_device_mesh("cpu", mesh_shape)
    # the same full tensors on every rank (of a stage)
    gen = torch.Generator().manual_seed(dist.get_rank() // 2 * 7 if stages else 0)
    # no rank holds an empty shard: torch 2.11's own inf-norm clip raises on one
    fulls = [torch.randn(shape, generator=gen) for shape in ((7, 3), (5,), (4, 6), (5,))]
    if stages or len(mesh_shape) == 1:
        placements = ([Shard(0)], [Replicate()], [Shard(1)], [Replicate()])
    else:  # replicated on one dimension, on the other, on both, and sharded on both
        placements = ([Replicate(), Shard(0)], [Shard(0), Replicate()],
                      [Replicate(), Replicate()], [Shard(0), Shard(0)])
    params = [torch.nn.Parameter(distribute_tensor(f, mesh, p)) for f, p in zip(fulls, placements)]
    opt = torch.optim.SGD(params, lr=0.1)
    scaler = (torch.amp.GradScaler("cpu", init_scale=4.0) if kind == "torch"
              else GradScaler("cpu", init_scale=4.0, backend=backend))
    scaler.scale(sum((p * p).sum() for p in params)).backward()
    if kind == "torch":
        scaler.unscale_(opt)
        total = torch.nn.utils.clip_grad_norm_(params, 1.0, norm_type).full_tensor()
    else:
        total = scaler.clip_grad_norm_(opt, 1.0, norm_type)
    return total, [p.grad.full_tensor() for p in params], fulls


def _shards_and_a_dtensor(rank, backend, norm_type, shards_on_rank_1=True):
    """``clip_grad_norm_(sharded=True)`` over plain grads that are shards of one gradient
    (summed over the group, FSDP1-style) beside DTensor grads, each counted once: a sharded
    one (its norm reduced over its mesh) and a replicated one (every rank holds all of it:
    not a shard over the group). Without ``shards_on_rank_1``, rank 1 holds no plain grad and
    must still join the shards' reduction, over a process group of its own (a 1-D mesh of
    the world reduces over the default group: the shards' key would be the mesh's). No
    clipping (a large ``max_norm``): the total."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from triton_scaler import GradScaler

    mesh = init_device_mesh("cpu", (2,))
    gen = torch.Generator().manual_seed(rank + 20)
    plain = [torch.nn.Parameter(torch.zeros(n)) for n in (3 + rank, 50)] \
        if shards_on_rank_1 or rank == 0 else []
    targets = [torch.randn(p.shape, generator=gen) for p in plain]
    full = torch.randn(6, 2, generator=torch.Generator().manual_seed(5)) * 3  # every rank's
    replicated = torch.randn(5, generator=torch.Generator().manual_seed(6)) * 2
    shard = torch.nn.Parameter(distribute_tensor(torch.zeros(6, 2), mesh, [Shard(0)]))
    whole = torch.nn.Parameter(distribute_tensor(torch.zeros(5), mesh, [Replicate()]))
    opt = torch.optim.SGD(plain + [shard, whole], lr=0.1)
    group = dist.group.WORLD if shards_on_rank_1 else dist.new_group([0, 1])
    scaler = GradScaler("cpu", init_scale=4.0, backend=backend, process_group=group)
    if plain:
        scaler.scale(sum((p * t).sum() for p, t in zip(plain, targets))).backward()
    scaler.scale((shard * distribute_tensor(full, mesh, [Shard(0)])).sum()).backward()
    whole.grad = distribute_tensor(replicated * 4.0, mesh, [Replicate()])  # scaled by 4
    total = scaler.clip_grad_norm_(opt, 1e6, norm_type, sharded=True)
    return {"total": total, "targets": targets, "full": torch.cat([full.reshape(-1),
                                                                  replicated])}


def _a_rank_without_grads(rank, backend):
    """Rank 1 holds no grad at the clip; rank 0's is NaN: rank 1 still joins the norm's and
    found_inf's reductions (with 0), and both ranks skip the step and back off."""
    from triton_scaler import GradScaler

    param = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([param], lr=0.1)
    scaler = GradScaler("cpu", init_scale=4.0, backend=backend, process_group=dist.group.WORLD)
    loss = scaler.scale(param.sum() * math.nan)
    if rank == 0:
        loss.backward()
    total = scaler.clip_grad_norm_(opt, 1.0, sharded=True)
    scaler.step(opt)
    scaler.update()
    return total.isnan().item(), scaler.get_scale(), param.detach().clone()


def _nonfinite_on_one_rank(rank, backend, norm_type, enabled):
    """``error_if_nonfinite=True`` with ``sharded=True``: rank 0 holds an inf, rank 1 none.
    The global norm is inf, so both ranks raise, leaving their grads unscaled and unclipped;
    then ``step`` skips on both (found_inf agreed over the group) and ``update`` backs off.
    Returns the message (or None), the grads after the raise, the scale and the params."""
    from triton_scaler import GradScaler

    params = [torch.nn.Parameter(torch.zeros(n)) for n in (5, 300 + rank)]
    opt = torch.optim.SGD(params, lr=0.1)
    scaler = GradScaler("cpu", init_scale=4.0, backend=backend, enabled=enabled,
                        process_group=dist.group.WORLD)
    gen = torch.Generator().manual_seed(rank + 30)
    targets = [torch.randn(p.shape, generator=gen) for p in params]
    if rank == 0:
        targets[-1][-1] = math.inf
    scaler.scale(sum((p * t).sum() for p, t in zip(params, targets))).backward()
    try:
        scaler.clip_grad_norm_(opt, 1.0, norm_type, error_if_nonfinite=True, sharded=True)
        message = None
    except RuntimeError as error:
        message = str(error)
    grads = [p.grad.clone() for p in params]
    scaler.step(opt)
    scaler.update()
    return {"message": message, "targets": targets, "grads": grads,
            "scale": scaler.get_scale(), "params": [p.detach().clone() for p in params]}


def _sharded_errors(backend):
    """With a process_group and plain grads, ``sharded`` must say whether they are shards."""
    from triton_scaler import GradScaler

    errors = {}
    param = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([param], lr=0.1)
    for value in (None, "yes"):
        scaler = GradScaler("cpu", backend=backend, process_group=dist.group.WORLD)
        scaler.scale(param.sum()).backward()
        try:
            scaler.clip_grad_norm_(opt, 1.0, sharded=value)
        except (TypeError, ValueError) as error:
            errors[value] = (type(error).__name__, str(error))
        param.grad = None
    return errors


def run_clip_engines(rank, world_size, store_file, backend, out_dir):
    init_group(rank, world_size, store_file)
    try:
        results = {}
        for norm_type in (2.0, math.inf):
            for engine in CLIP_ENGINES:
                for injection in INJECTIONS:
                    for kind in ("torch", "ours"):
                        attempt(results, (engine, norm_type, injection, kind), train_clipped,
                                engine, kind, backend, norm_type, injection, rank)
            for kind in ("torch", "ours"):
                results["mixed", norm_type, kind] = mixed_placements(kind, backend, norm_type)
        results["errors"] = _sharded_errors(backend)
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()  # gloo's teardown can abort a rank that destroys the group early
    finally:
        dist.destroy_process_group()


#: (norm_type, scaler enabled): fused norms, another p (unscale_ + clip), a disabled scaler
CLIP_CASES = ((2.0, True), (math.inf, True), (3.0, True), (2.0, False))


def run_clip(rank, world_size, store_file, backend, out_dir):
    """clip_grad_norm_(sharded=True): each rank holds a different gradient shard; the
    returned norm is the global one, and every rank clips by it."""
    from triton_scaler import GradScaler

    init_group(rank, world_size, store_file)
    try:
        results = {}
        for norm_type, enabled in CLIP_CASES:
            gen = torch.Generator().manual_seed(rank + 10)
            params = [torch.nn.Parameter(torch.zeros(n)) for n in (5 + rank, 1000 * (rank + 1))]
            opt = torch.optim.SGD(params, lr=0.1)
            scaler = GradScaler("cpu", init_scale=4.0, backend=backend, enabled=enabled,
                                process_group=dist.group.WORLD)
            targets = [torch.randn(p.shape, generator=gen) * (rank + 1) for p in params]
            scaler.scale(sum((p * t).sum() for p, t in zip(params, targets))).backward()
            total = scaler.clip_grad_norm_(opt, 1.0, norm_type, sharded=True)
            results[norm_type, enabled] = {"total": total, "targets": targets,
                                           "grads": [p.grad.clone() for p in params]}
        for norm_type in (2.0, math.inf):
            for on_rank_1 in (True, False):
                results["with_a_dtensor", norm_type, on_rank_1] = _shards_and_a_dtensor(
                    rank, backend, norm_type, on_rank_1)
        results["a_rank_without_grads"] = _a_rank_without_grads(rank, backend)
        for norm_type, enabled in CLIP_CASES:
            results["nonfinite_on_one_rank", norm_type, enabled] = _nonfinite_on_one_rank(
                rank, backend, norm_type, enabled)
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()
