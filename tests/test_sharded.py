"""``triton_scaler.ShardedGradScaler`` against torch's ``ShardedGradScaler``: its positional
arguments, ``scale()`` keeping each output's dtype, float16 grads, the default group looked
up when needed; with 2 gloo ranks under DDP and FSDP1 (also a pure-float16 model), the same
scales, skipped steps and parameters, and agreement where torch's has none."""

import copy
import datetime
import operator
import pickle

import pytest
import torch
import torch.distributed as dist
from _engines import INJECTIONS, OVERFLOW_STEPS
from _engines_sharded import CLIP_MAX_NORMS, ROUTES, SHARDED_ENGINES, run_sharded
from _spawn import spawned_results

from triton_scaler import GradScaler, ShardedGradScaler

needs_gloo = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")


def _torchs():
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as TorchSharded

    return TorchSharded


@needs_gloo
def test_positional_arguments_are_torchs_backoff_then_growth():
    args = ("cpu", 8.0, 0.25, 4.0, 3, True)
    ours, theirs = ShardedGradScaler(*args), _torchs()(*args)
    mine = ours.state_dict()
    assert {key: mine[key] for key in theirs.state_dict()} == theirs.state_dict()
    assert ours.get_backoff_factor() == 0.25 and ours.get_growth_factor() == 4.0
    assert ours.process_group is None and isinstance(ours, GradScaler)
    assert ShardedGradScaler("cpu", hysteresis=2).policy.hysteresis == 2  # extensions apply
    defaults, torch_defaults = ShardedGradScaler("cpu").state_dict(), _torchs()("cpu").state_dict()
    assert {key: defaults[key] for key in torch_defaults} == torch_defaults


@needs_gloo
def test_scale_returns_each_output_in_its_own_dtype_as_torchs():
    ours, theirs = ShardedGradScaler("cpu"), _torchs()("cpu")
    half = torch.tensor(0.75, dtype=torch.float16)
    big = torch.tensor(2.0, dtype=torch.float16)  # 2 * 65536 > 65504: inf in float16
    vector = torch.tensor([1.5, -3.0], dtype=torch.bfloat16)
    single = torch.tensor(0.5)
    cases = [half, big, vector, single, [half, (vector, [single])], (big, half)]
    for outputs in cases:
        a, b = ours.scale(outputs), theirs.scale(outputs)
        flat_a, flat_b = _leaves(a), _leaves(b)
        assert [t.dtype for t in flat_a] == [t.dtype for t in flat_b] == [t.dtype for t in
                                                                         _leaves(outputs)]
        assert all(torch.equal(x, y) for x, y in zip(flat_a, flat_b))
        assert type(a) is type(b)
    assert ours.scale(big).isinf().item()
    lazy = ours.scale(t for t in (half, single))  # a generator: a lazy map, as torch's
    assert [t.dtype for t in lazy] == [torch.float16, torch.float32]
    with pytest.raises(TypeError, match="outputs must be a Tensor"):
        ours.scale("loss")
    for bad in (5.0, [single, None]):  # torch's error is a ValueError: ours is one too
        with pytest.raises(ValueError) as theirs_error:
            theirs.scale(bad)
        with pytest.raises(theirs_error.type, match="must be a Tensor"):
            ours.scale(bad)
    disabled, theirs_disabled = ShardedGradScaler("cpu", enabled=False), _torchs()("cpu", enabled=False)
    for outputs in (half, [half, single], (half,)):  # the same object, as torch's
        assert disabled.scale(outputs) is outputs and theirs_disabled.scale(outputs) is outputs


def _leaves(value):
    if isinstance(value, torch.Tensor):
        return [value]
    return [leaf for item in value for leaf in _leaves(item)]


@needs_gloo
def test_needs_the_default_group_or_a_process_group_when_it_agrees():
    assert not dist.is_initialized()
    scaler = ShardedGradScaler("cpu")
    param = torch.nn.Parameter(torch.ones(3))
    param.grad = torch.ones(3)
    opt = torch.optim.SGD([param], lr=1.0)
    scaler.scale(torch.ones(()))
    for _ in range(2):  # raised before unscaling: the grads still scaled, unscale_ not spent
        with pytest.raises(RuntimeError, match="init_process_group"):
            scaler.unscale_(opt)
        assert torch.equal(param.grad, torch.ones(3))
    theirs = _torchs()("cpu")  # torch's raises a ValueError there: ours is one too
    theirs.scale(torch.ones(()))
    with pytest.raises(ValueError) as theirs_error:
        theirs.unscale_(opt)
    with pytest.raises(theirs_error.type, match="init_process_group"):
        scaler.step(opt)


@needs_gloo
def test_pickles_and_copies_without_its_group():
    scaler = ShardedGradScaler("cpu", 2.0**4, 0.25, 4.0, 5)
    scaler.scale(torch.ones(()))
    for clone in (pickle.loads(pickle.dumps(scaler)), copy.deepcopy(scaler)):
        assert clone.state_dict() == scaler.state_dict()
        assert clone.process_group is None and type(clone) is ShardedGradScaler


@needs_gloo
def test_pickles_and_copies_with_a_group_leaving_it_out():
    """A process group does not pickle: a scaler holding one pickles and copies without it
    (set it again after loading), keeping its state. One in-process gloo rank on a HashStore."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    try:
        group = dist.new_group([0])
        for scaler in (ShardedGradScaler("cpu", 2.0**4, process_group=group),
                       GradScaler("cpu", 2.0**4, process_group=group)):
            scaler.scale(torch.ones(()))
            for clone in (pickle.loads(pickle.dumps(scaler)), copy.deepcopy(scaler)):
                assert clone.state_dict() == scaler.state_dict() and type(clone) is type(scaler)
                held = "process_group" if type(clone) is ShardedGradScaler else "_process_group"
                assert getattr(clone, held) is None
                assert set(vars(clone)) == set(vars(scaler))  # nothing stray left in
    finally:
        dist.barrier()
        dist.destroy_process_group()


@needs_gloo
def test_agrees_over_its_process_group_else_the_default_group(monkeypatch):
    """found_inf is all-reduced over ``process_group`` when one is given, and over the
    default group (looked up at the agreement) when it is None, by ``unscale_`` and by the
    fused ``clip_grad_norm_``. One in-process gloo rank on
    a HashStore; the all-reduce is watched for the group it is given."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    try:
        groups = []
        all_reduce = dist.all_reduce
        monkeypatch.setattr(dist, "all_reduce", lambda tensor, *args, **kwargs: (
            groups.append(kwargs.get("group")), all_reduce(tensor, *args, **kwargs))[1])
        subgroup = dist.new_group([0])
        param = torch.nn.Parameter(torch.ones(3))
        opt = torch.optim.SGD([param], lr=1.0)
        for process_group in (subgroup, None):
            for clip in (False, True):  # the fused clip agrees too (its norm: the rank's own)
                scaler = ShardedGradScaler("cpu", 2.0**4, process_group=process_group)
                param.grad = scaler.scale(torch.ones(3))
                if clip:
                    scaler.clip_grad_norm_(opt, 1.0, sharded=False)
                else:
                    scaler.unscale_(opt)
        expected = [subgroup, subgroup, dist.group.WORLD, dist.group.WORLD]
        assert len(groups) == 4 and all(map(operator.is_, groups, expected))
    finally:
        dist.barrier()
        dist.destroy_process_group()


_results: dict = {}


def _sharded_results(backend, tmp_path_factory):
    return spawned_results(_results, f"sharded-{backend}", run_sharded, tmp_path_factory,
                           backend)


@pytest.mark.slow
@needs_gloo
@pytest.mark.parametrize("injection", INJECTIONS)
@pytest.mark.parametrize("engine", SHARDED_ENGINES)
def test_trains_as_torchs_sharded_scaler(backend, engine, injection, tmp_path_factory):
    """Built alike with positional arguments (backoff 0.25, growth 4.0): scales, skipped
    steps, final parameters and the scaled loss's dtype (float16 for the float16 model)."""
    for rank, results in enumerate(_sharded_results(backend, tmp_path_factory)):
        theirs = results[engine, injection, "torch_sharded"]
        ours = results[engine, injection, "ours_sharded"]
        assert "error" not in theirs, f"torch's run failed on rank {rank}: {theirs}"
        assert "error" not in ours, f"our run failed on rank {rank}: {ours}"
        assert ours["skipped"] == theirs["skipped"] == list(OVERFLOW_STEPS), rank
        assert ours["scales"] == theirs["scales"], rank
        assert ours["scaled_dtypes"] == theirs["scaled_dtypes"]
        assert ours["scaled_dtypes"] == ["torch.float16" if engine == "fsdp1_fp16"
                                         else "torch.float32"]
        for a, b in zip(ours["params"], theirs["params"], strict=True):
            assert torch.equal(a, b), f"rank {rank}: final parameters differ"


@pytest.mark.slow
@needs_gloo
@pytest.mark.parametrize("route", ("built_before_init",) + ROUTES)
def test_every_rank_skips_an_overflow_in_one_ranks_shard(backend, route, tmp_path_factory):
    """Plain and fused AdamW (with and without unscale_ first), and a scaler built before
    init_process_group: the NaN in rank 1's shard skips the step on both ranks."""
    for rank, results in enumerate(_sharded_results(backend, tmp_path_factory)):
        outcome = results[route]
        assert "error" not in outcome, f"rank {rank}: {outcome}"
        assert outcome == (2.0**7, True), rank


@pytest.mark.slow
@needs_gloo
@pytest.mark.parametrize("max_norm", CLIP_MAX_NORMS)
def test_fused_clip_of_float16_shards_against_fsdps_clip(backend, max_norm, tmp_path_factory):
    """``clip_grad_norm_(sharded=True)`` of float16 FSDP1 grads against ``unscale_`` +
    ``FSDP.clip_grad_norm_``: the same scales and skipped step. FSDP's norm is float16 and
    its coefficient is rounded to float16 before the multiplication; ours are float32
    (docs/distributed.md): the norms agree to float16's rounding. The parameters come out equal, also with
    the clip active (max_norm 0.3, coefficients 0.45 to 0.65 here): the two roundings of
    ``g * coef`` did not part on this data."""
    for rank, results in enumerate(_sharded_results(backend, tmp_path_factory)):
        outcome = results["fp16_clip", max_norm]
        assert "error" not in outcome, f"rank {rank}: {outcome}"
        ours, theirs = outcome["ours"], outcome["torch"]
        assert ours["scales"] == theirs["scales"] == [2.0**8, 2.0**7, 2.0**7, 2.0**7], rank
        for step, (a, b) in enumerate(zip(ours["norms"], theirs["norms"], strict=True)):
            if step == 1:  # the overflow: both non-finite
                assert not a.isfinite() and not b.isfinite()
            else:
                assert abs(a - b) <= 2.0**-11 * b, (rank, step, a, b)
        for a, b in zip(ours["params"], theirs["params"], strict=True):
            assert torch.equal(a, b), f"rank {rank}: parameters differ"
