"""Worker of test_random_fsdp.py: one rank of a 2-process gloo group that runs random call
sequences on an FSDP2 model (DTensor grads) with triton_scaler's GradScaler on one side and
torch's on the other, and on an FSDP1 model (flat shards) with the sharded scalers. Both
ranks draw the same calls; an inf / NaN goes into one drawn rank's input (the reduce-scatter
then spreads it into some ranks' shards only) or into one rank's local grad shard, so only
the agreement over the group makes both ranks skip together."""

import contextlib
import math
import os
import random

import torch
import torch.distributed as dist
from _seeds import length
from _spawn import init_group
from _util import assert_same

CALLS = {"backward": 30, "unscale": 6, "clip": 6, "step": 20, "update": 15, "zero_grad": 10,
         "checkpoint": 3}
OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=False),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, foreach=False),
    "adam_fused": lambda ps: torch.optim.Adam(ps, lr=1e-2, fused=True),
    "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
}
#: torch's error where ours raises a clearer one (test_random_sequences.DELIBERATE); torch's
#: scaler state after it is not comparable: the calls go on (the ranks' collectives stay in
#: step, also where one rank alone met it) without comparing
DELIBERATE = (("AttributeError", "'int' object has no attribute 'device'"),
              ("AssertionError", "No inf checks were recorded for this optimizer."))


def _side(seed: int, ours: bool, backend: str, engine: str):
    """The model (random Linear sizes, some layers sharded on their own, a frozen weight, bf16
    compute), its optimizer and a scaler, drawn from ``seed`` alike for both sides. FSDP1:
    the sharded scalers, as its users take them (torch's fails with a CPU fused Adam)."""
    import triton_scaler

    rng = random.Random(seed)
    torch.manual_seed(seed)
    dims = [rng.randint(1, 9) for _ in range(rng.randint(2, 4))]
    layers = [torch.nn.Linear(a, b, bias=rng.random() < 0.7) for a, b in zip(dims, dims[1:])]
    model = torch.nn.Sequential(*[m for layer in layers for m in (layer, torch.nn.Tanh())])
    if rng.random() < 0.2 and len(layers) > 1:
        layers[0].weight.requires_grad_(False)
    bf16 = rng.random() < 0.3
    model = {"fsdp2": _fully_shard, "fsdp1": _fsdp1, "ddp": _ddp}[engine](model, layers, bf16,
                                                                          rng)
    params = [p for p in model.parameters() if p.requires_grad]
    kinds = sorted(OPTIMIZERS) if engine != "fsdp1" else sorted(set(OPTIMIZERS) - {"adam_fused"})
    optimizer = OPTIMIZERS[rng.choice(kinds)](params)
    settings = dict(init_scale=rng.choice([2.0**4, 2.0**16, 1.0]),
                    growth_interval=rng.randint(1, 4), backoff_factor=rng.choice([0.5, 0.25]))
    # DDP: ours with GradBuckets when drawn (DDP then copies the reduced grads into the views)
    buckets = (engine == "ddp" and not model.gradient_as_bucket_view and rng.random() < 0.6)
    if buckets and ours:
        buckets = triton_scaler.GradBuckets(optimizer)
    if engine != "fsdp1":
        scaler = (triton_scaler.GradScaler("cpu", **settings, backend=backend) if ours
                  else torch.amp.GradScaler("cpu", **settings))
    else:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        scaler = (triton_scaler.ShardedGradScaler("cpu", **settings, backend=backend) if ours
                  else ShardedGradScaler("cpu", **settings))
    return dict(model=model, params=params, optimizer=optimizer, scaler=scaler, dims=dims,
                ours=ours, engine=engine, buckets=buckets)


def _fully_shard(model, layers, bf16, rng):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (2,))
    kwargs = ({"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                 reduce_dtype=torch.float32)} if bf16 else {})
    for layer in layers:
        if rng.random() < 0.6:
            fully_shard(layer, mesh=mesh, **kwargs)
    return fully_shard(model, mesh=mesh, **kwargs)


def _ddp(model, layers, bf16, rng):
    """(bf16 is not drawn for DDP, which has no mixed-precision setting on CPU.)"""
    return torch.nn.parallel.DistributedDataParallel(
        model, gradient_as_bucket_view=rng.random() < 0.3)


def _fsdp1(model, layers, bf16, rng):
    from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision

    kwargs = dict(device_id=torch.device("cpu"),  # a frozen weight needs the original params
                  use_orig_params=rng.random() < 0.5 or not layers[0].weight.requires_grad,
                  mixed_precision=MixedPrecision(param_dtype=torch.bfloat16,
                                                 reduce_dtype=torch.float32) if bf16 else None)
    for i, layer in enumerate(layers):
        if rng.random() < 0.5:
            model[2 * i] = FullyShardedDataParallel(layer, **kwargs)
    return FullyShardedDataParallel(model, **kwargs)


#: a training iteration's next call, drawn more often than any other after each call
NEXT = {"backward": "step", "unscale": "step", "clip": "step", "step": "update",
        "update": "zero_grad", "zero_grad": "backward", "checkpoint": "backward"}


def _draw(rng: random.Random, previous: str, dims: list[int], n_params: int, rank: int,
          engine: str, bucketed: bool):
    """One call and its arguments, drawn alike on both ranks (rank only picks the data)."""
    kind = NEXT[previous] if rng.random() < 0.5 else rng.choices(list(CALLS),
                                                                  list(CALLS.values()))[0]
    if kind == "backward":
        rows, data_seed = rng.randint(1, 3), rng.randrange(10**6)
        x = torch.randn(rows, dims[0], generator=torch.Generator().manual_seed(data_seed + rank))
        bad_rank, position = rng.choice([None, None, None, 0, 1]), rng.randrange(x.numel())
        value = rng.choice([math.inf, -math.inf, math.nan])
        if bad_rank == rank:
            x.view(-1)[position] = value
        # and often one rank's own shard of one grad (an inf in the input mostly reaches
        # every rank's shards through the reduce-scatter)
        plant = (rng.randrange(n_params), rng.random(), rng.choice([math.inf, math.nan]),
                 rng.randrange(2) == rank) if rng.random() < 0.4 else None
        # DDP: some backwards inside no_sync() (accumulated locally, reduced at the next one)
        no_sync = engine == "ddp" and rng.random() < 0.3
        return kind, (x, 1e30 if rng.random() < 0.1 else 1.0, plant, no_sync)
    if kind == "update":
        return kind, (rng.choice([None] * 8 + [8.0, 2.0**10]),)
    if kind == "zero_grad":  # ("buckets": buckets.zero_() where ours has them)
        # (not set_to_none=False with buckets: before a parameter's first gradient torch's
        # grad is None and ours a 0.0 view, which turns a -0.0 in that gradient into 0.0,
        # the one sign-of-zero difference docs/buckets.md documents)
        return kind, (rng.choice([True, True, "buckets"] if bucketed else
                                 [True, True, False, "buckets"]),)
    return kind, ()


def _call(side: dict, kind: str, args: tuple, fused_clip: bool):
    scaler, optimizer, params = side["scaler"], side["optimizer"], side["params"]
    if kind == "backward":
        with side["model"].no_sync() if args[3] else contextlib.nullcontext():
            scaler.scale(side["model"](args[0]).sum() * args[1]).backward()
        if args[2] is not None:
            _plant(params, *args[2])
    elif kind == "unscale":
        scaler.unscale_(optimizer)
    elif kind == "clip":
        fsdp1 = side["engine"] == "fsdp1"
        if fused_clip and side["ours"]:
            return scaler.clip_grad_norm_(optimizer, 0.5, sharded=True if fsdp1 else None)
        scaler.unscale_(optimizer)  # then the engine's own clip
        norm = (side["model"].clip_grad_norm_(0.5) if fsdp1
                else torch.nn.utils.clip_grad_norm_(params, 0.5))
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # (no grads: 0.)
    elif kind == "step":
        return scaler.step(optimizer)
    elif kind == "update":
        scaler.update(*args)
    elif kind == "zero_grad":
        if args[0] == "buckets" and side["buckets"]:
            side["buckets"].zero_() if side["ours"] else optimizer.zero_grad()
        else:
            optimizer.zero_grad(set_to_none=args[0] in (True, "buckets"))
    else:
        scaler.load_state_dict(scaler.state_dict())
    return None


def _plant(params, index, where, value, here):
    """``value`` into this rank's local shard of one grad, when ``here``."""
    grad = params[index].grad
    if grad is not None and here and _local(grad).numel():
        local = _local(grad).view(-1)
        local[int(where * local.numel())] = value


def _outcome(side, kind, args, fused_clip):
    try:
        return "returned", _call(side, kind, args, fused_clip)
    except Exception as error:  # noqa: BLE001 (the errors are what is compared)
        return "raised", (type(error).__name__, str(error))


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _compare(ours: tuple, theirs: tuple, sides: tuple) -> None:
    assert ours[0] == theirs[0], (ours, theirs)
    if isinstance(theirs[1], torch.Tensor):
        assert_same(ours[1], theirs[1])
    else:
        assert ours[1] == theirs[1], (ours, theirs)
    mine, torchs = sides
    assert mine["scaler"].get_scale() == torchs["scaler"].get_scale()
    assert mine["scaler"]._get_growth_tracker() == torchs["scaler"]._get_growth_tracker()
    for i, (p, q) in enumerate(zip(mine["params"], torchs["params"])):
        assert_same(_local(p).detach(), _local(q).detach())
        if q.grad is None and mine["buckets"] and p.grad is not None:
            # a zero view until the step when no gradient came (docs/buckets.md)
            assert not p.grad.any(), f"grad {i}"
        else:
            assert (p.grad is None) == (q.grad is None), f"grad {i}"
            if p.grad is not None:
                assert_same(_local(p.grad), _local(q.grad))
    for state, expected in zip(mine["optimizer"].state.values(),
                               torchs["optimizer"].state.values()):
        for key, value in expected.items():
            if isinstance(value, torch.Tensor):
                assert_same(_local(state[key]), _local(value))


def run_seed(seed: int, rank: int, backend: str, engine: str) -> str | None:
    """The first difference of one random sequence, or None. Every call runs on both ranks
    whatever its outcome, so the ranks' collectives stay in step."""
    sides = (_side(seed, True, backend, engine), _side(seed, False, backend, engine))
    rng = random.Random(seed * 7 + 1)
    # ours' fused clip is bit-identical to torch's on the reference path (docs/clipping.md)
    fused_clip = backend == "reference" and rng.random() < 0.5
    first, kind, comparable = None, "zero_grad", True
    for number in range(length(rng.randint(5, 40))):
        kind, args = _draw(rng, kind, sides[0]["dims"], len(sides[0]["params"]), rank, engine,
                           bool(sides[0]["buckets"]))
        ours, theirs = (_outcome(side, kind, args, fused_clip) for side in sides)
        comparable = comparable and (theirs[1], ours[1]) != DELIBERATE and \
            not _made_on_first_use(theirs, ours)
        try:
            if comparable:
                _compare(ours, theirs, sides)
        except AssertionError as error:
            first = first or f"seed {seed}, call {number} ({kind}): {error!r}"[:600]
    return first


def _made_on_first_use(theirs: tuple, ours: tuple) -> bool:
    """torch's scaler raised for a call before any ``scale()``, where ours, with a
    ``process_group`` (the sharded scaler's default), made its scale on first use
    (docs/distributed.md, pipeline stages): the sides differ from there on, on purpose."""
    return theirs[0] == "raised" and "but _scale is None" in theirs[1][1] and ours != theirs


def run_random_fsdp(rank, world_size, store_file, seeds_by_engine, out_dir):
    init_group(rank, world_size, store_file)
    try:
        backends = ["reference"] + (["triton"] if os.environ.get("TRITON_INTERPRET") == "1"
                                    else [])
        failures = []
        for engine, seeds in seeds_by_engine.items():
            for backend in backends:
                for seed in seeds:
                    try:
                        failure = run_seed(seed, rank, backend, engine)
                    except Exception as error:  # noqa: BLE001 (reported per seed by the test)
                        failure = f"seed {seed}: {error!r}"[:600]
                    if failure:
                        failures.append(f"{engine}, {backend}: {failure}")
                    dist.barrier()
        torch.save({"failures": failures}, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()  # gloo's teardown can abort a rank that destroys the group early
    finally:
        dist.destroy_process_group()
