"""triton_scaler's extension settings under torch's distributed engines (FSDP2, FSDP2 with a
fused optimizer, DDP, FSDP1; 2 gloo ranks; HSDP and tensor parallel x FSDP2 on 4) × both
backends, rank 1 (2-D meshes: ``_engines.overflowing_ranks``) overflowing in its own grad
(in its loss for the run that never skips) at ``OVERFLOW_STEPS``: hysteresis (Megatron-core's
and the consecutive kind), min / max scale, static scaling, no skipping, raising at the
minimum, and checkpoints taken mid-run.

Oracles: the scale trajectory of the same settings in one process with the same overflow steps
(itself checked against Megatron-core's and apex's rules where they apply); the parameters of
torch's scaler run under the same engine (the same steps are skipped, and power-of-two scales
unscale exactly), or of a disabled scaler's run when no step is skipped."""

import math

import pytest
import torch
import torch.distributed as dist
from _engines import MESH_ENGINES, MESH_PARAMS, OVERFLOW_STEPS, STEPS
from _engines_features import FEATURE_ENGINES, FEATURES, run_features
from _engines_mesh import mesh_results
from _peers import ApexLossScaler, MegatronDynamicGradScaler
from _spawn import spawned_results
from _util import assert_all_same

from triton_scaler import GradScaler, MinScaleReachedError

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                 reason="needs torch.distributed with gloo")]

INIT_SCALE, GROWTH_INTERVAL = 2.0**8, 2  # as tests/_engines.py's scalers

_results: dict = {}


def _feature_results(backend, engine, tmp_path_factory):
    """One spawn per backend runs every 1-D engine and feature (2 ranks; the 2-D mesh cases:
    tests/_engines_mesh.py, 4 ranks)."""
    if engine in MESH_ENGINES:
        return mesh_results(backend, tmp_path_factory)
    return spawned_results(_results, f"features-{backend}", run_features, tmp_path_factory,
                           backend)


def _one_process(settings, overflow_steps=OVERFLOW_STEPS):
    """(scales, step whose update raised or None): the same settings and overflow steps on
    one parameter in one process."""
    settings = {"growth_interval": GROWTH_INTERVAL, **settings}
    scaler = GradScaler("cpu", init_scale=INIT_SCALE, backend="reference", **settings)
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=0.0)
    scales = []
    for step in range(STEPS):
        scaler.scale(param.sum() * (math.inf if step in overflow_steps else 1.0)).backward()
        scaler.step(opt)
        try:
            scaler.update()
        except MinScaleReachedError:
            return scales, step
        opt.zero_grad()
        scales.append(scaler.get_scale())
    return scales, None


def test_the_one_process_oracle_follows_the_peers():
    flags = [step in OVERFLOW_STEPS for step in range(STEPS)]
    megatron = MegatronDynamicGradScaler(INIT_SCALE, 1.0, 2.0, 0.5, GROWTH_INTERVAL, 2)
    apex = ApexLossScaler(INIT_SCALE, GROWTH_INTERVAL, min_loss_scale=128.0, max_loss_scale=512.0)
    megatron_scales, apex_scales = [], []
    for flag in flags:
        megatron.update(flag)
        apex.update_scale(flag)
        megatron_scales.append(megatron._scale.item())
        apex_scales.append(apex._loss_scale)
    assert _one_process(FEATURES["hysteresis"][0]) == (megatron_scales, None)
    assert _one_process(FEATURES["min_max_scale"][0]) == (apex_scales, None)
    assert _one_process(FEATURES["static"][0]) == ([INIT_SCALE] * STEPS, None)
    assert _one_process(FEATURES["raise_at_min_scale"][0]) == ([INIT_SCALE] * 2, 2)
    assert len(set(megatron_scales)) > 1 and len(set(apex_scales)) > 1  # they do move


@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("engine", [*FEATURE_ENGINES, *MESH_PARAMS])
def test_feature_under_engine(backend, engine, feature, tmp_path_factory):
    ranks = _feature_results(backend, engine, tmp_path_factory)
    settings, _ = FEATURES[feature]
    skips = settings.get("skip_on_overflow", True)
    # a step taken on an overflow leaves NaN parameters: every later step overflows too
    overflows = OVERFLOW_STEPS if skips else range(OVERFLOW_STEPS[0], STEPS)
    expected_scales, raises_at = _one_process(settings, overflows)
    for rank, results in enumerate(ranks):
        ours, theirs = results[engine, feature], results[engine, "torch"]
        for run in (ours, theirs, results[engine, "disabled"]):
            assert "error" not in run, f"rank {rank}: {run}"
        assert ours["scales"] == expected_scales, rank
        if raises_at is not None:  # both ranks raise at the same update
            assert ours["raised_at"] == (raises_at, "MinScaleReachedError"), rank
            continue
        assert ours["raised_at"] is None
        if skips:
            assert ours["skipped"] == theirs["skipped"] == list(OVERFLOW_STEPS), rank
            assert_all_same(ours["params"], theirs["params"])
        else:  # every step taken, the overflowing ones too: as with no scaler at all
            assert ours["skipped"] == [], rank
            assert_all_same(ours["params"], results[engine, "disabled"]["params"])
    assert all(r[engine, feature]["scales"] == ranks[0][engine, feature]["scales"] for r in ranks)
