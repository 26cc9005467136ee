"""How ``clip_grad_norm_`` combines the norms of grads that live on several ranks
(``triton_scaler/_clip.py``), in one process: torch's fake process group (4 ranks, every
collective a no-op) lets DTensors be made on a CPU (2, 2) mesh and a process group be passed.
Each rank's arithmetic around the collectives is then checked alone, against torch's own on the
same tensors: the norms of DTensor grads as torch's clip forms them under DTensor dispatch
(a replicated norm partitioned first), plain grads sharded over a group as
``FullyShardedDataParallel.clip_grad_norm_`` combines them. The reductions themselves, over
real ranks, are tested in ``test_engines.py`` and ``test_sharded.py`` (gloo)."""

import math

import pytest
import torch
from _util import assert_all_same, assert_same, fake_process_group

dist = pytest.importorskip("torch.distributed")

from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp.fully_sharded_data_parallel import _get_grad_norm  # noqa: E402
from torch.distributed.tensor import DTensor, Replicate, Shard  # noqa: E402

from triton_scaler import GradScaler, ShardedGradScaler  # noqa: E402

SCALE = 2.0**10
MAX_NORM = 0.5  # below every total here: every grad is clipped
# local shapes on the (2, 2) mesh: sharded on both dimensions, on the first or the second
# alone, replicated on both; odd sizes, one a single element
PLACEMENTS = ([Shard(0), Shard(1)], [Shard(0), Replicate()], [Replicate(), Shard(0)],
              [Replicate(), Replicate()], [Shard(0), Replicate()])
SHAPES = ((3, 5), (7,), (1,), (2, 3), (33,))


@pytest.fixture(scope="module")
def mesh():
    """A (2, 2) CPU mesh over the fake group of 4 ranks (destroyed after)."""
    with fake_process_group(4):
        yield init_device_mesh("cpu", (2, 2))


def _scaled(shape, dtype, seed, integers=False, magnitude=1.0):
    """Scaled grad values (random, or integers), exact after unscaling (a power of two)."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.randint(-9, 10, shape, generator=gen) if integers else \
        torch.randn(shape, generator=gen, dtype=torch.float64) * magnitude
    return values.to(dtype) * SCALE


def _dtensor_params(mesh, dtypes, shapes=SHAPES, placements=PLACEMENTS, **values):
    """Parameters with DTensor grads on ``mesh`` (local tensors of ``shapes``; ``values``:
    :func:`_scaled`'s)."""
    params = []
    for i, (shape, placement, dtype) in enumerate(zip(shapes, placements, dtypes)):
        local = _scaled(shape, dtype, i, **values)
        param = torch.nn.Parameter(DTensor.from_local(torch.zeros_like(local), mesh, placement,
                                                      run_check=False))
        param.grad = DTensor.from_local(local, mesh, placement, run_check=False)
        params.append(param)
    return params


def _clip(scaler, params, norm_type, error_if_nonfinite=False, **kwargs):
    """``scaler``'s clip of ``params``' grads: ours (with ``kwargs``: ``sharded``), or
    torch's ``unscale_`` + clip."""
    opt = torch.optim.SGD(params, lr=0.1)
    scaler.scale(torch.ones(()))  # the scale made
    if isinstance(scaler, GradScaler):
        return scaler.clip_grad_norm_(opt, MAX_NORM, norm_type, error_if_nonfinite, **kwargs)
    scaler.unscale_(opt)
    return torch.nn.utils.clip_grad_norm_(params, MAX_NORM, norm_type, error_if_nonfinite)


def _locals(params):
    return [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params]


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
@pytest.mark.parametrize("dtypes", [(torch.float32,) * 5, (torch.float64,) * 5,
                                    (torch.float32, torch.float64) * 2 + (torch.float32,)],
                         ids=["fp32", "fp64", "mixed"])
def test_dtensor_grads_are_clipped_by_torchs_norm(mesh, norm_type, dtypes):
    """Sharded, partly replicated and replicated DTensor grads (reference backend): the norm
    and the clipped local grads are torch's bit for bit, the replicated norms partitioned over
    the dimensions the others are sharded on (``/ size ** (1 / p)``) before the stack's
    reduction, as torch's ``_NormPartial``."""
    theirs, ours = _dtensor_params(mesh, dtypes), _dtensor_params(mesh, dtypes)
    total = _clip(torch.amp.GradScaler("cpu", init_scale=SCALE), theirs, norm_type)
    total_ours = _clip(GradScaler("cpu", init_scale=SCALE, backend="reference"), ours,
                       norm_type)
    assert_same(total_ours, total.full_tensor().float())
    assert_all_same(_locals(ours), _locals(theirs))


def test_an_empty_shard_joins_the_mesh_norm_with_zero(mesh):
    """A rank whose shard of a grad is empty still takes part in the mesh's reduction (its
    norm is 0), and the norm is torch's (2-norm: torch's inf norm of no elements raises)."""
    shapes = ((3, 5), (0,), (2, 3))
    placements = (PLACEMENTS[0], PLACEMENTS[1], PLACEMENTS[3])
    theirs, ours = (_dtensor_params(mesh, (torch.float32,) * 3, shapes, placements)
                    for _ in range(2))
    total = _clip(torch.amp.GradScaler("cpu", init_scale=SCALE), theirs, 2.0)
    total_ours = _clip(GradScaler("cpu", init_scale=SCALE, backend="reference"), ours, 2.0)
    assert_same(total_ours, total.full_tensor())
    assert_all_same(_locals(ours), _locals(theirs))


def _fsdp1_norm(shards, whole, norm_type):
    """``FullyShardedDataParallel.clip_grad_norm_``'s total norm, op for op (its all-reduce a
    no-op here): the sharded grads' float32 norm, its ``p``-th power summed over the group,
    plus that of the grads counted once (``whole``, a norm or None)."""
    try:
        local = _get_grad_norm(shards, norm_type, torch.zeros(()), torch.device("cpu"))
    except ValueError as error:  # torch 2.8's refuses mixed dtypes; later ones do not, and
        if "uniform dtype" not in str(error):  # compute what follows its check, op for op
            raise
        local = torch.linalg.vector_norm(torch.stack([
            torch.linalg.vector_norm(p.grad, norm_type, dtype=torch.float32) for p in shards]),
            norm_type, dtype=torch.float32)
    if norm_type == math.inf:
        return torch.maximum(local, whole) if whole is not None else local
    total = local**norm_type
    if whole is not None:
        total += whole**norm_type
    return total ** (1.0 / norm_type)


@pytest.mark.parametrize("norm_type", [2.0, math.inf, 3.0])
@pytest.mark.parametrize("with_dtensor_grad", [False, True])
@pytest.mark.parametrize("enabled", [True, False])
def test_sharded_plain_grads_combine_as_fsdp1(mesh, norm_type, with_dtensor_grad, enabled):
    """``sharded=True`` (reference backend, FSDP1's scaler): plain grads (fp32, bf16, fp16, odd
    sizes, an empty one; their float32 norms stacked in the parameters' order, not by dtype)
    are shards over the scaler's process group, their norm's ``p``-th power summed over it,
    as FSDP1's clip (an empty shard left out of the inf norm, where FSDP1's raises); a
    DTensor grad beside them is counted once, with torch's norm of it (larger, so that it
    decides the inf norm). A disabled scaler clips the same way."""
    unscale = SCALE if enabled else 1.0
    dtypes = (torch.float32, torch.bfloat16, torch.float32, torch.float16, torch.float32,
              torch.bfloat16, torch.float32)
    shards = [torch.nn.Parameter(torch.zeros(n, dtype=d))
              for n, d in zip((5, 1, 9, 3, 17, 2, 0), dtypes)]
    for i, param in enumerate(shards):
        param.grad = _scaled(param.shape, param.dtype, 28 + i, magnitude=1.0 + i) / \
            (SCALE / unscale)
    others = _dtensor_params(mesh, (torch.float32,), magnitude=8.0) if with_dtensor_grad else []
    for param in others:
        param.grad = param.grad / (SCALE / unscale)
    counted = [p for p in shards if p.numel() or norm_type != math.inf]  # FSDP1's would raise
    expected_shards = [torch.nn.Parameter(p.detach().clone()) for p in counted]
    for param, copy in zip(counted, expected_shards):
        copy.grad = param.grad / unscale
    whole = torch.nn.utils.get_total_norm([p.grad / unscale for p in others],
                                          norm_type).full_tensor() if others else None
    expected = _fsdp1_norm(expected_shards, whole, norm_type)
    scaler = ShardedGradScaler("cpu", init_scale=SCALE, backend="reference", enabled=enabled,
                               process_group=dist.group.WORLD)  # FSDP1's: fp16 grads taken
    total = _clip(scaler, shards + others, norm_type, sharded=True)
    assert_same(total, expected)
    coef = torch.clamp(MAX_NORM / (expected + 1e-6), max=1.0)
    assert_all_same([p.grad for p in counted], [p.grad * coef for p in expected_shards])


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
@pytest.mark.parametrize("plain_shards", [None, 0, 2], ids=["whole", "no-shard", "2-shards"])
def test_the_triton_partials_of_each_group_are_summed_once(mesh, norm_type, plain_shards,
                                                           interpreter):
    """Triton backend: one partial (sum of squares, or max) per launch group, the groups
    keyed by the mesh dimensions their grads are sharded on (plain grads: by the scaler's
    process group with ``sharded=True``, a key this rank joins also with no plain grad),
    each reduced over those (a no-op here) and then summed: every local element counted
    once (integers, so the sum of squares is exact and the 2-norm its rounded root)."""
    params = _dtensor_params(mesh, (torch.float32,) * 5, integers=True)
    for n in range(plain_shards or 0):
        params.append(torch.nn.Parameter(torch.zeros(3 + n)))
        params[-1].grad = _scaled((3 + n,), torch.float32, 20 + n, integers=True)
    grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params]
    unscaled = torch.cat([g.reshape(-1) / SCALE for g in grads])
    expected = unscaled.abs().max() if norm_type == math.inf else \
        unscaled.double().square().sum().float().sqrt()
    sharded = {} if plain_shards is None else {"sharded": True}
    scaler = GradScaler("cpu", init_scale=SCALE, backend="triton",
                        process_group=dist.group.WORLD if sharded else None)
    total = _clip(scaler, params, norm_type, **sharded)
    assert_same(total, expected)


def test_an_empty_shard_is_left_out_of_the_inf_norm(mesh):
    """A DTensor grad whose local shard is empty joins the mesh's inf norm with 0 (torch's
    inf norm of no elements raises): the norm and grads are torch's without that grad."""
    shapes, placements = ((3, 5), (0,), (2, 3)), (PLACEMENTS[0], PLACEMENTS[1], PLACEMENTS[3])
    ours = _dtensor_params(mesh, (torch.float32,) * 3, shapes, placements)
    theirs = [p for p in _dtensor_params(mesh, (torch.float32,) * 3, shapes, placements)
              if p.grad.to_local().numel()]
    total = _clip(torch.amp.GradScaler("cpu", init_scale=SCALE), theirs, math.inf)
    total_ours = _clip(GradScaler("cpu", init_scale=SCALE, backend="reference"), ours,
                       math.inf)
    assert_same(total_ours, total.full_tensor())
    assert_all_same([g for g in _locals(ours) if g.numel()], _locals(theirs))


@pytest.mark.parametrize("error_if_nonfinite", [False, True])
@pytest.mark.parametrize("norm_type, enabled", [(3.0, True), (2.0, False)])
def test_a_nonfinite_sharded_norm_raises_only_when_asked(mesh, norm_type, enabled,
                                                         error_if_nonfinite):
    """``sharded=True`` through the unfused route (``norm_type`` 3, or a disabled scaler)
    with an inf in one shard: as torch's clip on this rank's grads, the norm is inf and the
    grads are multiplied by its coefficient, or, with ``error_if_nonfinite=True``, the
    clip raises and leaves them (unscaled) as they were. Without the inf it never raises."""
    finite = GradScaler("cpu", init_scale=SCALE, backend="reference", enabled=enabled,
                        process_group=dist.group.WORLD)
    params = [torch.nn.Parameter(torch.zeros(5))]
    params[0].grad = _scaled((5,), torch.float32, 39)
    total = _clip(finite, params, norm_type, error_if_nonfinite, sharded=True)
    assert math.isfinite(total.item()) and bool(params[0].grad.isfinite().all())
    results = []
    for ours in (True, False):
        params = [torch.nn.Parameter(torch.zeros(n)) for n in (5, 3)]
        for i, param in enumerate(params):
            param.grad = _scaled(param.shape, torch.float32, 40 + i) / (1.0 if enabled else SCALE)
        params[-1].grad[-1] = math.inf
        scaler = GradScaler("cpu", init_scale=SCALE, backend="reference", enabled=enabled,
                            process_group=dist.group.WORLD) if ours else \
            torch.amp.GradScaler("cpu", init_scale=SCALE, enabled=enabled)
        try:
            outcome = _clip(scaler, params, norm_type, error_if_nonfinite, sharded=True)
        except RuntimeError as error:
            outcome = str(error)
        results.append((outcome, [p.grad for p in params]))
    (ours, our_grads), (theirs, their_grads) = results
    if error_if_nonfinite:
        assert ours == theirs and "is non-finite, so it cannot be clipped" in ours
    else:
        assert_same(ours, theirs)
        assert math.isinf(ours.item())
    assert_all_same(our_grads, their_grads)


@pytest.mark.parametrize("norm_type", [2.0, math.inf, 3.0])
@pytest.mark.parametrize("enabled", [True, False])
def test_a_rank_without_grads_joins_the_sharded_norm_with_zero(mesh, norm_type, enabled):
    """``sharded=True`` on a rank whose parameters have no grad (every route: fused, unfused,
    disabled): the norm is a float32 zero, as torch's clip of no grads."""
    scaler = GradScaler("cpu", init_scale=SCALE, enabled=enabled,
                        process_group=dist.group.WORLD)
    total = _clip(scaler, [torch.nn.Parameter(torch.zeros(3))], norm_type, sharded=True)
    assert_same(total, torch.zeros(()))


def test_dtensor_grads_need_no_sharded_argument_beside_a_process_group(mesh):
    """Only plain grads ask whether they are shards: DTensor grads alone (FSDP2) clip with a
    ``process_group`` and ``sharded`` left out, as without the group."""
    totals = []
    for group in (None, dist.group.WORLD):
        params = _dtensor_params(mesh, (torch.float32,) * 5)
        scaler = GradScaler("cpu", init_scale=SCALE, backend="reference", process_group=group)
        totals.append((_clip(scaler, params, 2.0), _locals(params)))
    assert_same(totals[0][0], totals[1][0])
    assert_all_same(totals[0][1], totals[1][1])
