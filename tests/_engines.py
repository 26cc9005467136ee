"""Worker of test_engines.py: one rank of a 2-process gloo group (4 for the 2-D meshes,
tests/_engines_mesh.py) that trains the same model under torch's distributed engines (FSDP2,
DDP, FSDP1) with torch's scaler and with ours, then runs the public ops on DTensor grads
beside torch's op (:func:`ops_on_dtensor_grads`, :func:`a_dtensor_of_a_subclass`)."""

import math
import os

import pytest
import torch
import torch.distributed as dist
from _spawn import attempt, init_group

ENGINES = ("fsdp2", "fsdp2_fused", "fsdp2_mixed_precision", "ddp", "ddp_bucket_view", "ddp_zero",
           "fsdp1", "fsdp1_orig_params")
#: FSDP2 on a 2-D mesh of 4 ranks: HSDP (replicate x shard) and tensor parallel x FSDP2
MESH_ENGINES = ("fsdp2_hsdp", "fsdp2_tp")
#: the 2-D mesh cases as test parameters: one 4-rank spawn per backend (about 47 s of the
#: default tier's time on 2 cores), so they run in the long tier, which CI runs too
MESH_PARAMS = [pytest.param(engine, marks=pytest.mark.exhaustive) for engine in MESH_ENGINES]
INJECTIONS = ("loss", "grad")  # inf in rank 1's loss (spread by the engine) / in its own grad
OVERFLOW_STEPS = (2, 5)
PLANTED_RANKS = ((), (1,), (0, 1))  # the ranks holding an inf in ops_on_dtensor_grads
STEPS = 8


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


class _Half(torch.nn.Module):
    """The input cast to float16: the first layer of a pure-float16 model."""

    def forward(self, x):
        return x.half()


def _wrap(engine, model):
    """The wrapped model and the optimizers (fsdp1_orig_params: a second optimizer over
    parameters of which rank 0 holds no elements)."""
    if engine in MESH_ENGINES:
        _wrap_2d(engine, model)
        wrapped = model
    elif engine.startswith("fsdp2"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (2,))
        kwargs = {}
        if engine == "fsdp2_mixed_precision":  # fp16 compute, fp32 grads (docs/distributed.md's)
            from torch.distributed.fsdp import MixedPrecisionPolicy

            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.float16,
                                                       reduce_dtype=torch.float32)
        fully_shard(model[0], mesh=mesh, **kwargs)
        fully_shard(model, mesh=mesh, **kwargs)
        wrapped = model
    elif engine.startswith("ddp"):
        wrapped = torch.nn.parallel.DistributedDataParallel(
            model, gradient_as_bucket_view=engine == "ddp_bucket_view")
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        if engine == "fsdp1_fp16":  # float16 parameters and grads (ShardedGradScaler's case)
            model = torch.nn.Sequential(_Half(), *model.half())
        wrapped = FSDP(model, device_id=torch.device("cpu"),
                       use_orig_params=engine == "fsdp1_orig_params")
    params = list(wrapped.parameters())
    groups = [params[:1], params[1:]] if engine == "fsdp1_orig_params" else [params]
    if engine == "fsdp1_fp16":  # AdamW's eps underflows in float16
        return wrapped, [torch.optim.SGD(params, lr=1e-2, momentum=0.9)]
    if engine == "ddp_zero":  # ZeRO-1: each rank steps its part of the parameters
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return wrapped, [ZeroRedundancyOptimizer(params, torch.optim.AdamW, lr=1e-2)]
    return wrapped, [torch.optim.AdamW(g, lr=1e-2, fused=engine == "fsdp2_fused")
                     for g in groups]


def _wrap_2d(engine, model):
    """Ranks [[0, 1], [2, 3]]. HSDP: rows replicate, columns shard. Tensor parallel: rows are
    the data-parallel replicas (FSDP2 over them), columns split the layers (Megatron-style
    column-wise then row-wise linear)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if engine == "fsdp2_hsdp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    else:
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        full = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, full["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        mesh = full["dp"]
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)


def data_rank(engine, rank):
    """The rank's data-parallel replica (its batch's seed): tensor-parallel peers share it."""
    return rank // 2 if engine == "fsdp2_tp" else rank


def overflowing_ranks(engine, injection):
    """The ranks whose loss or own grad overflows. Realistic ones: HSDP's replicas hold equal
    grads (an overflow in a shard shows on both); tensor-parallel peers share one loss."""
    if engine == "fsdp2_hsdp" and injection == "grad":
        return (1, 3)  # the same shard, on both replicas
    if engine == "fsdp2_tp":
        return (3,) if injection == "grad" else (2, 3)  # a grad shard / a replica's loss
    return (1,)


def _local(grad):
    return grad._local_tensor if hasattr(grad, "_local_tensor") else grad


def plant_inf_in_own_grad(wrapped):
    """An inf at the last element of this rank's first non-empty grad (shard), after the
    backward: the engine's reduction does not spread it; only found_inf's agreement does."""
    grad = next(_local(p.grad) for p in wrapped.parameters()
                if p.grad is not None and _local(p.grad).numel())
    grad.view(-1)[-1] = math.inf


def snapshot(params):
    """Copies of this rank's (local) parameters, for :func:`unchanged`."""
    return [_local(p.detach()).clone() for p in params]


def unchanged(before, params):
    """Whether the step left every parameter as :func:`snapshot` saw it (a skipped step)."""
    return all(torch.equal(a, _local(p.detach())) for a, p in zip(before, params))


def _full_params(engine, wrapped):
    if engine.startswith("fsdp2"):
        return [p.full_tensor().detach().clone() for p in wrapped.parameters()]
    if engine.startswith("fsdp1"):
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import StateDictType

        with FSDP.state_dict_type(wrapped, StateDictType.FULL_STATE_DICT):
            return [t.clone() for t in wrapped.state_dict().values()]
    return [p.detach().clone() for p in wrapped.parameters()]


def _scaler(engine, kind, backend, **settings):
    """torch's scaler for the engine (``kind="torch"``; ``"disabled"``: one with
    ``enabled=False``) or ours, with our extension ``settings``; ``"torch_sharded"`` /
    ``"ours_sharded"``: torch's ShardedGradScaler / ours, built alike with positional
    arguments (``settings`` unused)."""
    kwargs = dict(init_scale=2.0**8, growth_interval=2)
    kwargs.update(settings)  # ours may set growth_interval too
    if kind.endswith("sharded"):  # ShardedGradScaler's positional order: backoff, growth
        if kind == "torch_sharded":
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
        else:
            from triton_scaler import ShardedGradScaler
        extra = {} if kind == "torch_sharded" else {"backend": backend}
        return ShardedGradScaler("cpu", 2.0**8, 0.25, 4.0, 2, **extra)
    if kind == "disabled":
        return torch.amp.GradScaler("cpu", enabled=False)
    if kind == "torch":
        if engine.startswith("fsdp2"):  # agrees over the mesh through DTensor dispatch
            return torch.amp.GradScaler("cpu", **kwargs)
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler("cpu", process_group=dist.group.WORLD, **kwargs)
    from triton_scaler import GradScaler

    group = None if engine.startswith("fsdp2") else dist.group.WORLD  # FSDP2: automatic
    return GradScaler("cpu", backend=backend, process_group=group, **kwargs)


def train(engine, kind, backend, injection, rank, settings=None, checkpoint_at=None):
    """``STEPS`` steps; rank 1 overflows at ``OVERFLOW_STEPS``. ``checkpoint_at``: after that
    step's update the scaler is replaced by a fresh one loaded from its state_dict. An
    update that raises ends the run (``raised_at``: its step)."""
    settings = settings or {}
    wrapped, optimizers = _wrap(engine, _model())
    scaler = _scaler(engine, kind, backend, **settings)
    gen = torch.Generator().manual_seed(data_rank(engine, rank) + 1)
    scales, skipped, raised_at, scaled_dtypes = [], [], None, set()
    watched = optimizers[0].param_groups[0]["params"]  # holds the grad that overflows
    for step in range(STEPS):
        before = snapshot(watched)
        loss = wrapped(torch.randn(4, 8, generator=gen)).square().mean()
        overflow = rank in overflowing_ranks(engine, injection) and step in OVERFLOW_STEPS
        if overflow and injection == "loss":
            loss = loss * math.inf
        scaled = scaler.scale(loss)
        scaled_dtypes.add(str(scaled.dtype))
        scaled.backward()
        if overflow and injection == "grad":
            plant_inf_in_own_grad(wrapped)
        for opt in optimizers:
            scaler.step(opt)
        try:
            scaler.update()
        except RuntimeError as error:  # MinScaleReachedError
            raised_at = (step, type(error).__name__)
            break
        for opt in optimizers:
            opt.zero_grad()
        if unchanged(before, watched):
            skipped.append(step)
        scales.append(scaler.get_scale())
        if step == checkpoint_at:
            state = scaler.state_dict()
            scaler = _scaler(engine, kind, backend, **settings)
            scaler.load_state_dict(state)
    return {"scales": scales, "skipped": skipped, "params": _full_params(engine, wrapped),
            "raised_at": raised_at, "scaled_dtypes": sorted(scaled_dtypes)}


def run(rank, world_size, store_file, backend, engines, out_dir):
    init_group(rank, world_size, store_file)
    try:
        results = {}
        train_each(results, engines, ("torch", "ours"), backend, rank)
        for planted in PLANTED_RANKS:
            attempt(results, ("ops_dtensor", planted), ops_on_dtensor_grads, backend, rank,
                    planted)
        attempt(results, "dtensor_of_a_subclass", a_dtensor_of_a_subclass, backend, rank)
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()  # gloo's teardown can abort a rank that destroys the group early
    finally:
        dist.destroy_process_group()


def train_each(results: dict, engines, kinds, backend, rank) -> None:
    """``results[engine, injection, kind]``: :func:`train` of every engine, injection and
    scaler kind, in that order."""
    for engine in engines:
        for injection in INJECTIONS:
            for kind in kinds:
                attempt(results, (engine, injection, kind), train, engine, kind, backend,
                        injection, rank)


def ops_on_dtensor_grads(backend, rank, planted):
    """The public ops on DTensor grads over the 2 ranks: sharded ones of odd sizes (rank 1's
    shard of the 1-element grad is empty), then a replicated one, which is agreed over no
    dimension and must not undo the agreement the sharded ones need; the ranks in ``planted``
    (one of :data:`PLANTED_RANKS`) hold an inf, at the last element of their shard of the last
    sharded grad (on both ranks, a MAX agreement gives 1, not the 2 a sum would). Ours and
    torch's op (which agrees over the mesh through DTensor dispatch) on copies: found_inf and
    local grads of each, for the unscale, the check (grads untouched) and ``all_finite``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from triton_scaler import ops

    mesh = init_device_mesh("cpu", (2,))
    full = [torch.randn(n, generator=torch.Generator().manual_seed(n)) * 1000 for n in (7, 1, 33, 5)]
    placements = (Shard(0), Shard(0), Shard(0), Replicate())

    def grads():
        made = [distribute_tensor(t.clone(), mesh, [p]) for t, p in zip(full, placements)]
        if rank in planted:
            made[-2]._local_tensor.view(-1)[-1] = math.inf
        return made

    inv_scale = torch.full((), 0.125)
    theirs, ours, checked = grads(), grads(), grads()
    found_theirs, found_ours, found_checked = torch.zeros(()), torch.zeros(()), torch.zeros(())
    torch._amp_foreach_non_finite_check_and_unscale_(theirs, found_theirs, inv_scale)
    ops.non_finite_check_and_unscale_(ours, found_ours, inv_scale, backend=backend)
    ops.non_finite_check_(checked, found_checked, inv_scale, backend=backend)
    return {"found": (found_theirs, found_ours, found_checked),
            "grads": ([g.to_local() for g in theirs], [g.to_local() for g in ours]),
            "checked": ([g.to_local() for g in checked], [g.to_local() for g in grads()]),
            "all_finite": ops.all_finite(grads(), backend=backend)}


class Marked(torch.Tensor):
    """A tensor subclass over storage of its own (made with ``as_subclass``)."""


def a_dtensor_of_a_subclass(backend, rank):
    """A DTensor grad whose local tensor is itself a subclass (:class:`Marked`), with an inf
    in rank 1's shard alone, through torch's op and ours, and through torch's scaler and ours
    (a step, then ``update``). Per route: the ``TypeError`` raised, or None; found_inf or the
    scale after ``update``; the local grad and parameter after (plain tensors)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from triton_scaler import GradScaler, ops

    mesh = init_device_mesh("cpu", (2,))

    def grad():
        local = torch.full((3,), 8.0)
        local[-1] = math.inf if rank == 1 else 2.0
        return DTensor.from_local(local.as_subclass(Marked), mesh, [Shard(0)], run_check=False)

    def plain(t):
        return t.to_local().as_subclass(torch.Tensor).clone()

    results = {}
    for route in ("op_torch", "op_ours", "scaler_torch", "scaler_ours"):
        error, g = None, grad()
        found_or_scale = torch.zeros(())
        param = torch.nn.Parameter(distribute_tensor(torch.ones(6), mesh, [Shard(0)]))
        try:
            if route == "op_torch":
                torch._amp_foreach_non_finite_check_and_unscale_([g], found_or_scale,
                                                                 torch.full((), 0.125))
            elif route == "op_ours":
                ops.non_finite_check_and_unscale_([g], found_or_scale, torch.full((), 0.125),
                                                  backend=backend)
            else:
                scaler = (torch.amp.GradScaler("cpu", init_scale=8.0) if route == "scaler_torch"
                          else GradScaler("cpu", init_scale=8.0, backend=backend))
                scaler.scale(torch.ones(()))  # (the scale is made lazily, as torch's)
                opt = torch.optim.SGD([param], lr=0.5)
                param.grad = g
                try:
                    scaler.step(opt)
                    scaler.update()
                finally:
                    found_or_scale = torch.tensor(scaler.get_scale())
        except TypeError as raised:
            error = str(raised)
        results[route] = (error, found_or_scale, plain(g), plain(param.detach()))
    return results
