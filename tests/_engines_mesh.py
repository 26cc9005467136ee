"""Worker of the 2-D mesh cases: one rank of a 4-process gloo group, ranks [[0, 1], [2, 3]].
FSDP2 as HSDP (replicate x shard) and tensor parallel x FSDP2: training against torch's scaler,
the fused clip against torch's clip of DTensors, every extension setting; DTensor grads with
different placements on the 2-D mesh: the clip's norm and the overflow agreement (see
``first_grad_replicated``, ``ops_sharded_on_one_dimension`` and ``ops_over_mixed_placements``)."""

import math
import os

import torch
import torch.distributed as dist
from _engines import INJECTIONS, MESH_ENGINES, train
from _engines_clip import mixed_placements, train_clipped
from _engines_features import feature_runs
from _spawn import attempt, init_group, spawned_results

WORLD_SIZE = 4
_cache: dict = {}


def mesh_results(backend, tmp_path_factory):
    """The 4 ranks' results, one spawn per backend shared by every test module."""
    return spawned_results(_cache, f"mesh-{backend}", run_mesh, tmp_path_factory, backend,
                           world_size=WORLD_SIZE)


def first_grad_replicated(kind, backend, rank):
    """Two DTensor grads on the (dp, tp) mesh: the first replicated over tp (a norm's weight),
    the second sharded over both; rank 3 (dp 1, tp 1) overflows in the second. torch's op under
    DTensor dispatch agrees over the first grad's sharded dimensions only (dp): ranks 1 and 3
    skip, 0 and 2 step (seen with torch 2.13). Ours agrees over every dimension any grad is
    sharded on: every rank skips. Returns (scale after update, parameters unchanged)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from triton_scaler import GradScaler

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    placements = ([Shard(0), Replicate()], [Shard(0), Shard(1)])
    params = [torch.nn.Parameter(distribute_tensor(torch.ones(4, 4), mesh, p))
              for p in placements]
    before = [p.detach().full_tensor() for p in params]
    opt = torch.optim.SGD(params, lr=0.1)
    scaler = (torch.amp.GradScaler("cpu") if kind == "torch"
              else GradScaler("cpu", backend=backend))
    scaler.scale(sum((p * p).sum() for p in params)).backward()
    if rank == 3:
        params[1].grad._local_tensor.view(-1)[0] = math.inf
    scaler.step(opt)
    scaler.update()
    after = [p.detach().full_tensor() for p in params]
    return scaler.get_scale(), all(torch.equal(a, b) for a, b in zip(before, after))


def ops_sharded_on_one_dimension(backend, rank, dim):
    """One DTensor grad on the (dp, tp) mesh sharded over ``dim`` alone (replicated over the
    other), an inf in rank 3's shard: torch's op (under DTensor dispatch) and ours, unscale and
    check, agree over ``dim``'s group only, so only the ranks sharing rank 3's group see it
    (dp: ranks 1 and 3; tp: ranks 2 and 3). Returns found_inf of torch's op, ours, our check."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from triton_scaler import ops

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    placements = [Shard(0), Replicate()] if dim == "dp" else [Replicate(), Shard(1)]
    full = torch.randn(4, 6, generator=torch.Generator().manual_seed(4))

    def grads():
        grad = distribute_tensor(full.clone(), mesh, placements)
        if rank == 3:
            grad._local_tensor.view(-1)[-1] = math.inf
        return [grad]

    inv_scale = torch.full((), 0.5)
    found = [torch.zeros(()) for _ in range(3)]
    torch._amp_foreach_non_finite_check_and_unscale_(grads(), found[0], inv_scale)
    ops.non_finite_check_and_unscale_(grads(), found[1], inv_scale, backend=backend)
    ops.non_finite_check_(grads(), found[2], inv_scale, backend=backend)
    return found


def ops_over_mixed_placements(backend, rank):
    """Three DTensor grads on the (dp, tp) mesh: replicated over both dimensions, sharded over
    dp alone, sharded over tp alone; an inf in rank 3's shard of the last. Ours agree over
    every dimension any grad is sharded on (dp and tp: every rank finds it), unscale and
    check alike, as the scaler does; torch's op agrees over its first grad's sharded
    dimensions (none here: rank 3 alone). Returns (found_inf of torch's op, of ours, of our
    check; whether ours unscaled every local shard to torch's bits)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from triton_scaler import ops

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    placements = ([Replicate(), Replicate()], [Shard(0), Replicate()], [Replicate(), Shard(1)])
    gen = torch.Generator().manual_seed(5)
    fulls = [torch.randn(4, 6, generator=gen) * 1024 for _ in placements]

    def grads():
        made = [distribute_tensor(f.clone(), mesh, p) for f, p in zip(fulls, placements)]
        if rank == 3:
            made[-1]._local_tensor.view(-1)[0] = math.inf
        return made

    inv_scale = torch.full((), 1 / 1024)
    found = [torch.zeros(()) for _ in range(3)]
    theirs, ours = grads(), grads()
    torch._amp_foreach_non_finite_check_and_unscale_(theirs, found[0], inv_scale)
    ops.non_finite_check_and_unscale_(ours, found[1], inv_scale, backend=backend)
    ops.non_finite_check_(grads(), found[2], inv_scale, backend=backend)
    same = all(torch.equal(a._local_tensor, b._local_tensor) for a, b in zip(theirs, ours))
    return found, same


def run_mesh(rank, world_size, store_file, backend, out_dir):
    init_group(rank, world_size, store_file)
    try:
        results = {}
        for engine in MESH_ENGINES:
            for kind in ("torch", "ours"):
                for injection in INJECTIONS:
                    attempt(results, (engine, injection, kind), train, engine, kind, backend,
                            injection, rank)
                for norm_type in (2.0, math.inf):
                    for injection in INJECTIONS:
                        attempt(results, (engine, norm_type, injection, kind), train_clipped,
                                engine, kind, backend, norm_type, injection, rank)
            feature_runs(results, engine, backend, rank)
        for norm_type in (2.0, math.inf):
            for kind in ("torch", "ours"):
                results["mixed", norm_type, kind] = mixed_placements(kind, backend, norm_type,
                                                                     (2, 2))
                attempt(results, ("stages", norm_type, kind), mixed_placements, kind, backend,
                        norm_type, (2,), True)
        for dim in ("dp", "tp"):
            attempt(results, ("sharded_on_one", dim), ops_sharded_on_one_dimension, backend,
                    rank, dim)
        attempt(results, "ops_mixed", ops_over_mixed_placements, backend, rank)
        for kind in ("torch", "ours"):
            attempt(results, ("first_grad_replicated", kind), first_grad_replicated, kind,
                    backend, rank)
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()  # gloo's teardown can abort a rank that destroys the group early
    finally:
        dist.destroy_process_group()
