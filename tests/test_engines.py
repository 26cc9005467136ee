"""torch's distributed engines (FSDP2 with DTensor grads, also with fp16 MixedPrecisionPolicy;
DDP with and without gradient_as_bucket_view, and with ZeroRedundancyOptimizer; FSDP1 with
and without use_orig_params) × both backends, 2 gloo ranks on this machine (met through a file
store); FSDP2 on a 2-D mesh (HSDP, tensor parallel x FSDP2) with 4 ranks. Rank 1 (on the 2-D
meshes: see ``_engines.overflowing_ranks``) overflows at some steps, either in its loss (the engine's
reduction spreads it) or in its own grad shard after backward (only agreement saves the step).
Scale trajectory, skipped steps and final full parameters must equal the same run with torch's
scaler (``torch.amp.GradScaler`` for FSDP2, which agrees through DTensor dispatch;
``ShardedGradScaler`` for DDP and FSDP1)."""

import itertools
import math
import os
import re

import pytest
import torch
import torch.distributed as dist
from _engines import (
    ENGINES,
    INJECTIONS,
    MESH_ENGINES,
    MESH_PARAMS,
    OVERFLOW_STEPS,
    PLANTED_RANKS,
    run,
)
from _engines_clip import CLIP_CASES, CLIP_ENGINES, run_clip, run_clip_engines
from _engines_features import run_buckets
from _engines_mesh import mesh_results
from _spawn import spawn_bounded, spawned_results, store_file_in
from _util import assert_all_same

from triton_scaler import GradScaler, ops

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                 reason="needs torch.distributed with gloo")]

_results: dict = {}

# torch < 2.10's clip leaves the stack of DTensor norms partial and reduces only its total
# ((sum over ranks of total ** p) ** (1 / p)), its 1e-6 added to each rank's partial total
# first; from 2.10 each norm is reduced before the total, the arithmetic the reference
# backend reproduces bit for bit. Before 2.10, 2-norms of DTensor grads agree to rounding
# only (docs/distributed.md: the DTensor norm note).
_DTENSOR_NORM_REDUCED_LAST = tuple(map(int, torch.__version__.split(".")[:2])) < (2, 10)


def _exact_norm(backend: str, engine: str, norm_type: float) -> bool:
    """Whether the reference backend's clip must equal the engine's own bit for bit."""
    return backend == "reference" and not (
        _DTENSOR_NORM_REDUCED_LAST and engine.startswith("fsdp2") and norm_type != math.inf)


def _engine_results(backend, engine, tmp_path_factory):
    """One spawn per backend runs every 1-D engine (2 ranks), one every 2-D mesh case (4)."""
    if engine in MESH_ENGINES:
        return mesh_results(backend, tmp_path_factory)
    return spawned_results(_results, f"engines-{backend}", run, tmp_path_factory, backend,
                           ENGINES)


@pytest.mark.parametrize("injection", INJECTIONS)
@pytest.mark.parametrize("engine", [*ENGINES, *MESH_PARAMS])
def test_engine_matches_torchs_scaler(backend, engine, injection, tmp_path_factory):
    ranks = _engine_results(backend, engine, tmp_path_factory)
    for rank, results in enumerate(ranks):
        theirs, ours = results[engine, injection, "torch"], results[engine, injection, "ours"]
        assert "error" not in theirs, f"torch's run failed on rank {rank}: {theirs}"
        assert "error" not in ours, f"our run failed on rank {rank}: {ours}"
        assert ours["skipped"] == theirs["skipped"] == list(OVERFLOW_STEPS), rank
        assert ours["scales"] == theirs["scales"], rank
        assert len(ours["params"]) == len(theirs["params"])
        for a, b in zip(ours["params"], theirs["params"]):
            assert torch.equal(a, b), f"rank {rank}: final parameters differ"
    assert all(r[engine, injection, "ours"]["scales"] == ranks[0][engine, injection, "ours"]["scales"]
               for r in ranks)


def test_grad_buckets_with_the_engines(backend, tmp_path):
    spawn_bounded(run_buckets, (2, store_file_in(tmp_path), backend, str(tmp_path)), timeout_s=180)
    for rank in (0, 1):
        results = torch.load(tmp_path / f"rank{rank}.pt")
        assert "DTensor, not a plain tensor" in results["fsdp2"]
        assert "use GradScaler without GradBuckets" in results["fsdp2"]
        assert "gradient_as_bucket_view=True" in results["ddp_bucket_view"]
        assert results["ddp_buckets_equal"] and results["ddp_zero_buckets_equal"]
        theirs, ours = results["ddp_unused"]  # DDP(find_unused_parameters=True)
        for step, ((scale, nones, params), (scale_, nones_, params_)) in enumerate(zip(theirs,
                                                                                        ours)):
            assert scale_ == scale and nones_ == nones, (rank, step)
            assert all(torch.equal(a, b) for a, b in zip(params_, params)), (rank, step)
        assert theirs[4][1] == [False, False, True, True, True, True]  # none used the branches


@pytest.mark.parametrize("planted", PLANTED_RANKS, ids=["none", "rank-1", "both-ranks"])
def test_the_ops_agree_over_the_mesh_of_dtensor_grads(backend, planted, tmp_path_factory):
    """The public ops on DTensor grads (sharded, odd sizes, an empty shard, one replicated):
    as torch's op under DTensor dispatch, an inf in rank 1's shard alone sets found_inf on
    both ranks, an inf on both ranks sets it to exactly 1 (a MAX, not a sum), and the local
    grads are torch's bit for bit (``_engines.ops_on_dtensor_grads``)."""
    for rank, results in enumerate(_engine_results(backend, "fsdp2", tmp_path_factory)):
        case = results["ops_dtensor", planted]
        assert "error" not in case, f"rank {rank}: {case}"
        found_theirs, found_ours, found_checked = case["found"]
        assert found_theirs.item() == float(bool(planted)), rank  # torch's op agreed (MAX)
        assert_all_same([found_ours, found_checked], [found_theirs] * 2)
        assert_all_same(*case["grads"])
        assert_all_same(*case["checked"])  # the check writes nothing
        assert case["all_finite"].item() is not bool(planted), rank


def test_a_dtensor_whose_local_tensor_is_a_subclass(backend, tmp_path_factory):
    """A DTensor grad over a tensor subclass (``_engines.a_dtensor_of_a_subclass``, an inf in
    rank 1's shard alone): the Triton backend, which reads raw memory, refuses it in the op
    and in the scaler, naming both types, and changes nothing; the reference backend is
    torch's, found_inf agreed over the mesh and the step skipped on both ranks."""
    for rank, results in enumerate(_engine_results(backend, "fsdp2", tmp_path_factory)):
        case = results["dtensor_of_a_subclass"]
        assert "error" not in case, f"rank {rank}: {case}"
        grad = torch.tensor([8.0, 8.0, math.inf if rank == 1 else 2.0])
        for route, untouched, torchs in (("op", 0.0, 1.0), ("scaler", 8.0, 4.0)):
            theirs, ours = case[f"{route}_torch"], case[f"{route}_ours"]
            assert theirs[0] is None and theirs[1].item() == torchs, (rank, route, theirs)
            if backend == "triton":
                assert re.search("a gradient is a DTensor whose local tensor is a [\\w.]*Marked, "
                                 "a tensor subclass the Triton backend cannot take", ours[0] or "")
                assert_all_same(ours[1:], [torch.tensor(untouched), grad, torch.ones(3)])
            else:
                assert ours[0] is None, (rank, route, ours[0])
                assert_all_same(ours[1:], theirs[1:])


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="Triton on CPU tensors needs TRITON_INTERPRET=1")
def test_other_tensor_subclasses_are_refused_by_the_triton_backend():
    class Marked(torch.Tensor):
        pass

    grad = torch.ones(3).as_subclass(Marked)
    with pytest.raises(TypeError, match="tensor subclass the Triton backend cannot take"):
        ops.non_finite_check_and_unscale_([grad], torch.zeros(()), torch.ones(()),
                                          backend="triton")
    found = torch.zeros(())
    ops.non_finite_check_and_unscale_([grad], found, torch.ones(()), backend="reference")
    assert found.item() == 0.0
    for backend in ("triton", "reference"):  # through the scaler too, from its first step
        p = torch.nn.Parameter(torch.ones(3))
        opt = torch.optim.SGD([p], lr=0.1)
        scaler = GradScaler("cpu", init_scale=4.0, backend=backend)
        scaler.scale(torch.ones(()))  # (the scale is made lazily, as torch's)
        p.grad = torch.full((3,), 8.0).as_subclass(Marked)
        if backend == "triton":
            with pytest.raises(TypeError, match="tensor subclass the Triton backend cannot"):
                scaler.unscale_(opt)
        else:
            scaler.step(opt)
            assert p.grad.tolist() == [2.0] * 3 and torch.equal(p.detach(), torch.full((3,), 0.8))


def test_clip_grad_norm_is_global_with_a_process_group(backend, tmp_path):
    spawn_bounded(run_clip, (2, store_file_in(tmp_path), backend, str(tmp_path)), timeout_s=180)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    for case in CLIP_CASES:
        every = torch.cat([t.double().reshape(-1) for r in ranks for t in r[case]["targets"]])
        expected = torch.linalg.vector_norm(every, case[0]).item()
        totals = [r[case]["total"] for r in ranks]
        assert torch.equal(totals[0], totals[1])
        assert abs(totals[0].item() - expected) <= 1e-5 * expected, case
        coef = torch.clamp(1.0 / (totals[0] + 1e-6), max=1.0)
        for r in ranks:
            for grad, target in zip(r[case]["grads"], r[case]["targets"]):
                assert torch.equal(grad, target * coef)  # targets * 4 / 4 is exact
    for norm_type, on_rank_1 in itertools.product((2.0, math.inf), (True, False)):
        case = "with_a_dtensor", norm_type, on_rank_1  # plain shards, DTensor grads once
        every = torch.cat([t.double().reshape(-1) for r in ranks for t in r[case]["targets"]]
                          + [ranks[0][case]["full"].double().reshape(-1)])
        expected = torch.linalg.vector_norm(every, norm_type).item()
        totals = [r[case]["total"] for r in ranks]
        assert torch.equal(totals[0], totals[1])
        assert abs(totals[0].item() - expected) <= 1e-6 * expected, case
    for r in ranks:
        nan_norm, scale, param = r["a_rank_without_grads"]
        assert nan_norm and scale == 2.0 and torch.equal(param, torch.ones(3))
    for norm_type, enabled in CLIP_CASES:  # error_if_nonfinite: an inf on rank 0 alone
        for r in ranks:
            got = r["nonfinite_on_one_rank", norm_type, enabled]
            assert got["message"] is not None and \
                f"total norm of order {norm_type} for gradients" in got["message"] and \
                "is non-finite, so it cannot be clipped" in got["message"], (norm_type, enabled)
            assert_all_same(got["grads"], got["targets"])  # unscaled (* 4 / 4), not clipped
            if enabled:  # step skipped on both ranks, the scale backed off
                assert got["scale"] == 2.0
                assert_all_same(got["params"], [torch.zeros_like(t) for t in got["targets"]])
            else:  # no scaler: step takes the grads as they are
                assert_all_same(got["params"], [t * -0.1 for t in got["targets"]])


def _clip_engine_results(backend, tmp_path_factory, engine=None):
    """One spawn per backend runs every 1-D engine's clip (the 2-D mesh cases: their own)."""
    if engine in MESH_ENGINES:
        return mesh_results(backend, tmp_path_factory)
    return spawned_results(_results, f"clip-{backend}", run_clip_engines, tmp_path_factory,
                           backend)


def _same_norm(ours, theirs, exact):
    if not theirs.isfinite():  # an overflow step: both non-finite
        return not ours.isfinite()
    return torch.equal(ours, theirs) if exact else abs(ours - theirs) <= 1e-6 * theirs


@pytest.mark.parametrize("injection", INJECTIONS)
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
@pytest.mark.parametrize("engine", [*CLIP_ENGINES, *MESH_PARAMS])
def test_fused_clip_matches_the_engines_own_clip(backend, engine, norm_type, injection,
                                                 tmp_path_factory):
    """DDP: the norm of the rank's own (reduced) grads, as torch's clip; FSDP1: summed over
    the shards, as FSDP.clip_grad_norm_; FSDP2: over the mesh, as torch's clip of DTensors.
    Reference backend: the same norms and parameters, bit for bit (torch's arithmetic; for
    DTensor 2-norms from torch 2.10); Triton: the norm to 1e-6 (its sums run in another
    order), the same scales and skipped steps. ``injection="grad"``: an inf in one rank's
    own shard after the backward; the other ranks skip only through found_inf's agreement
    after the fused clip (over the mesh for DTensor grads, over process_group else)."""
    ranks = _clip_engine_results(backend, tmp_path_factory, engine)
    exact = _exact_norm(backend, engine, norm_type)
    key = engine, norm_type, injection
    for rank, results in enumerate(ranks):
        theirs, ours = results[(*key, "torch")], results[(*key, "ours")]
        assert "error" not in theirs, f"torch's run failed on rank {rank}: {theirs}"
        assert "error" not in ours, f"our run failed on rank {rank}: {ours}"
        assert ours["scales"] == theirs["scales"], rank
        assert ours["skipped"] == theirs["skipped"] == list(OVERFLOW_STEPS), rank
        for step, (a, b) in enumerate(zip(ours["norms"], theirs["norms"])):
            assert _same_norm(a, b, exact), (rank, step, a, b)
        if exact:
            for a, b in zip(ours["params"], theirs["params"]):
                assert torch.equal(a, b), f"rank {rank}: final parameters differ"
    for r in ranks[1:]:
        for a, b in zip(ranks[0][(*key, "ours")]["params"], r[(*key, "ours")]["params"]):
            assert torch.equal(a, b), "the ranks clipped by different norms"


@pytest.mark.exhaustive  # the 4-rank mesh spawn
def test_overflow_agreed_over_every_mesh_dimension_any_grad_is_sharded_on(backend,
                                                                          tmp_path_factory):
    """Tensor parallel x FSDP2, the first grad replicated over tp, an inf in rank 3's shard of
    another: every rank skips (torch's DTensor dispatch agrees over the first grad's sharded
    dimensions only, and its ranks 0 and 2 step; see tests/_engines_mesh.py)."""
    ranks = mesh_results(backend, tmp_path_factory)
    for rank, results in enumerate(ranks):
        ours = results["first_grad_replicated", "ours"]
        assert "error" not in ours, f"rank {rank}: {ours}"
        scale, unchanged = ours
        assert scale == 2.0**15 and unchanged, rank


@pytest.mark.exhaustive  # the 4-rank mesh spawn
@pytest.mark.parametrize("dim, overflowing", [("dp", (1, 3)), ("tp", (2, 3))], ids=["dp", "tp"])
def test_the_ops_agree_over_only_the_mesh_dimension_a_grad_is_sharded_on(backend, dim,
                                                                         overflowing,
                                                                         tmp_path_factory):
    """A grad sharded over one dimension of the (dp, tp) mesh, an inf in rank 3's shard: found_inf
    is agreed over that dimension's group, not the world (the ranks outside rank 3's group find
    nothing), as torch's op does (``_engines_mesh.ops_sharded_on_one_dimension``)."""
    for rank, results in enumerate(mesh_results(backend, tmp_path_factory)):
        found = results["sharded_on_one", dim]
        assert not isinstance(found, dict), f"rank {rank}: {found}"
        assert found[0].item() == float(rank in overflowing), rank  # torch's op
        assert_all_same(found[1:], found[:1] * 2)


@pytest.mark.exhaustive  # the 4-rank mesh spawn
def test_the_ops_agree_over_every_dimension_any_grad_is_sharded_on(backend, tmp_path_factory):
    """Grads replicated, sharded over dp, sharded over tp; an inf in rank 3's tp shard: every
    rank's found_inf is 1, unscale and check, as the scaler's (torch's op agrees over its
    first grad's dimensions only, none here; ``_engines_mesh.ops_over_mixed_placements``),
    and the local shards are unscaled to torch's bits."""
    for rank, results in enumerate(mesh_results(backend, tmp_path_factory)):
        result = results["ops_mixed"]
        assert not isinstance(result, dict), f"rank {rank}: {result}"
        found, same = result
        assert found[1].item() == found[2].item() == 1.0, rank
        assert same, rank


@pytest.mark.parametrize("mesh", ["1-D", pytest.param("2-D", marks=pytest.mark.exhaustive)])
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_fused_clip_counts_a_replicated_dtensor_grad_once(backend, norm_type, mesh,
                                                          tmp_path_factory):
    ranks = _clip_engine_results(backend, tmp_path_factory) if mesh == "1-D" else \
        mesh_results(backend, tmp_path_factory)
    for results in ranks:
        (ours, ours_grads, fulls) = results["mixed", norm_type, "ours"]
        (theirs, their_grads, _) = results["mixed", norm_type, "torch"]
        every = torch.cat([2 * f.double().reshape(-1) for f in fulls])  # d(p*p)/dp = 2p
        expected = torch.linalg.vector_norm(every, norm_type).item()
        assert abs(ours.item() - expected) <= 1e-6 * expected  # was 15.47 for 14.52 (2-norm)
        if _exact_norm(backend, "fsdp2" if mesh == "1-D" else "fsdp2_tp", norm_type):
            assert torch.equal(ours, theirs)
            assert all(torch.equal(a, b) for a, b in zip(ours_grads, their_grads))


@pytest.mark.exhaustive  # the 4-rank mesh spawn
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_fused_clip_reduces_over_its_own_mesh_not_the_world(backend, norm_type,
                                                           tmp_path_factory):
    """4 ranks as 2 pipeline stages, each its own 1-D mesh of 2 ranks (a sub-mesh of the
    (pp, tp) mesh) and its own DTensor grads: each stage's norm is torch's for that stage
    (``_engines_clip.mixed_placements(stages=True)``), the two stages' norms differ."""
    ranks = mesh_results(backend, tmp_path_factory)
    totals = []
    for rank, results in enumerate(ranks):
        ours, theirs = (results["stages", norm_type, kind] for kind in ("ours", "torch"))
        assert "error" not in ours, f"rank {rank}: {ours}"
        assert _same_norm(ours[0], theirs[0], exact=_exact_norm(backend, "fsdp2_tp", norm_type))
        totals.append(ours[0])
    assert torch.equal(totals[0], totals[1]) and torch.equal(totals[2], totals[3])
    assert not torch.equal(totals[0], totals[2])


def test_fused_clip_asks_whether_plain_grads_are_shards(backend, tmp_path_factory):
    for results in _clip_engine_results(backend, tmp_path_factory):
        errors = results["errors"]
        kind, message = errors[None]
        assert kind == "ValueError" and "sharded=True" in message and "sharded=False" in message
        assert errors["yes"] == ("TypeError", "sharded must be True, False, None or a "
                                  "torch.distributed.ProcessGroup; got 'yes'")
