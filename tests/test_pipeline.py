"""fp16 under pipeline parallelism (``torch.distributed.pipelining``): a stage that never calls
``scale()`` makes its scale on first use, so every stage of a GPipe, 1F1B or interleaved
schedule steps, skips and scales as one process running the unsplit model with torch's scaler
over the same microbatches (2 gloo ranks)."""

import math

import pytest
import torch
import torch.distributed as dist
from _pipeline_worker import CASES, GRAD_OVERFLOW, LOSS_OVERFLOW, STAGES, reference, run_pipelines
from _spawn import spawned_results
from _util import assert_all_same, fake_process_group

from triton_scaler import GradScaler

needs_gloo = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")
_SPAWNED: dict = {}


@needs_gloo
@pytest.mark.parametrize("schedule, opt_name, route", CASES)
def test_every_stage_follows_the_unsplit_model(backend, tmp_path_factory, schedule, opt_name,
                                               route):
    """Scales, skipped steps and every stage's parameters equal the single-process run bit for
    bit (clip: the norm over every stage's parameters, the same on both ranks, within 4 ulps
    of torch's clip over the unsplit model; parameters within 1e-7); an overflow in one
    microbatch's loss and a NaN in stage 0's grads alone skip the step on both stages; both
    ranks save the same checkpoint; the losses the schedule returns, unscaled for logging, are
    the unsplit model's."""
    ranks = spawned_results(_SPAWNED, f"pipelines_{backend}", run_pipelines, tmp_path_factory,
                            backend)
    results = [rank[(schedule, opt_name, route)] for rank in ranks]
    assert all("error" not in r for r in results), results
    expected, model, losses = reference(opt_name, route)
    first, second = results
    assert first["state"] == second["state"]
    # the last stage's losses, unscaled for logging (scaler.unscaled), are the unsplit model's
    if route != "clip":  # (clipped parameters agree to rounding, and the later losses too)
        assert [list(map(repr, step)) for step in second["losses"]] == \
            [list(map(repr, step)) for step in losses]
    for seen in (first["seen"], second["seen"]):
        assert [s for s, _, _ in seen] == [s for s, _, _ in expected]
        assert [k for _, _, k in seen] == [step in (LOSS_OVERFLOW, GRAD_OVERFLOW)
                                           for step in range(len(seen))]
    n_stages = 4 if schedule == "interleaved" else 2
    params = {s: ps for r in results for s, ps in r["params"].items()}
    assert sorted(params) == list(range(n_stages))
    for s, (lo, hi) in enumerate(STAGES[n_stages]):
        theirs = [p.detach() for layer in model[lo:hi] for p in layer.parameters()]
        if route == "clip":
            torch.testing.assert_close(params[s], theirs, rtol=0, atol=1e-7)
        else:
            assert_all_same(params[s], theirs)
    if route == "clip":
        assert [repr(n) for _, n, _ in first["seen"]] == [repr(n) for _, n, _ in second["seen"]]
        for step, ((_, ours, _), (_, torchs, _)) in enumerate(zip(first["seen"], expected)):
            if step in (LOSS_OVERFLOW, GRAD_OVERFLOW):
                assert not math.isfinite(ours) and not math.isfinite(torchs)
            else:
                ulp = 2.0 ** (math.frexp(torchs)[1] - 24)  # float32's at torch's norm
                assert abs(ours - torchs) <= 4 * ulp, (step, ours, torchs)


def test_a_rank_that_never_scales_makes_its_scale_on_first_use(backend):
    """With a process_group, unscale_ / clip / step / update on a scaler whose scale() was never
    called make the scale at init_scale (the loaded scale after load_state_dict); without
    one, torch's error for a forgotten scale() stays."""
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    with pytest.raises(AssertionError, match="Attempted unscale_ but _scale is None"):
        GradScaler("cpu", backend=backend).unscale_(opt)
    with fake_process_group(2):
        group = dist.group.WORLD
        for call in ("unscale_", "clip", "step"):
            scaler = GradScaler("cpu", init_scale=32.0, backend=backend, process_group=group)
            if call == "step":
                scaler.load_state_dict({**scaler.state_dict(), "scale": 8.0})
            p.grad = torch.full((3,), 64.0)
            if call == "unscale_":
                scaler.unscale_(opt)
                assert torch.equal(p.grad, torch.full((3,), 2.0))
            elif call == "clip":
                assert scaler.clip_grad_norm_(opt, 100.0, sharded=False).item() == \
                    pytest.approx(2.0 * math.sqrt(3))
            before = p.detach().clone()
            scaler.step(opt)
            scaler.update()
            expected = {"unscale_": 32.0, "clip": 32.0, "step": 8.0}[call]
            assert scaler.get_scale() == expected
            assert torch.equal(p.detach(), before - 0.1 * 64.0 / expected)
            p.data.fill_(1.0)


def test_unscaled_gives_the_losses_a_schedule_returns_unscaled(backend):
    """scaler.unscaled(losses): each scaled loss divided by the scale (exactly, a power of
    two), in kind, also before a restarted scaler has made its scale; the values themselves
    when disabled or in the guard-only mode."""
    losses = [torch.tensor(0.3), torch.tensor(1.7), torch.tensor(math.inf)]
    scaler = GradScaler("cpu", init_scale=2.0**8, backend=backend)
    scaled = [scaler.scale(loss) for loss in losses]
    assert_all_same(scaler.unscaled(scaled), losses)
    assert_all_same(list(scaler.unscaled(tuple(scaled))), losses)
    assert torch.equal(scaler.unscaled(scaled[1]), losses[1])
    for other in (GradScaler("cpu", enabled=False), GradScaler("cpu", scaling=False)):
        assert other.unscaled(losses) is losses
    # a scaler restarted from a checkpoint, before its scale is made: the scale it will have
    resumed = GradScaler("cpu", backend=backend)
    resumed.load_state_dict(scaler.state_dict())
    assert_all_same(resumed.unscaled(scaled), losses)


@needs_gloo
@pytest.mark.exhaustive  # a 4-rank spawn per backend
@pytest.mark.parametrize("engine", ["fsdp2", "ddp"])
def test_pipeline_by_data_parallel_mesh(backend, tmp_path_factory, engine):
    """2 stages x 2 data-parallel ranks (FSDP2 or DDP over dp, 1F1B over pp): a NaN in one
    rank's own grads, or an inf in one microbatch's loss, skips the step on all four; the
    clip with sharded=<the pp group> gives every rank the same norm, the whole model's
    (within 1e-6 of one process's; DTensor grads already span their shards, so the sum is
    over the stages only)."""
    from _pipeline_mesh_worker import GRAD_OVERFLOW, reference_norms, run_meshes

    ranks = spawned_results(_SPAWNED, f"pipeline_meshes_{backend}", run_meshes,
                            tmp_path_factory, backend, world_size=4)
    results = [rank[engine] for rank in ranks]
    assert all("error" not in r for r in results), results
    seen = [r["seen"] for r in results]
    for other in seen:  # the same scales, skips and norms on every rank
        assert [(scale, skipped) for scale, _, skipped in other] == \
            [(scale, skipped) for scale, _, skipped in seen[0]]
        # but for DDP where rank 3 alone wrote a NaN after the reduction: the norm is of the
        # grads each rank holds, so its replica's pipeline (ranks 0 and 2) sees none
        assert [repr(norm) for step, (_, norm, _) in enumerate(other)
                if engine == "fsdp2" or step != GRAD_OVERFLOW] == \
            [repr(norm) for step, (_, norm, _) in enumerate(seen[0])
             if engine == "fsdp2" or step != GRAD_OVERFLOW]
    overflows = (LOSS_OVERFLOW, GRAD_OVERFLOW)  # an inf in one microbatch's target too
    assert [skipped for _, _, skipped in seen[0]] == [step in overflows
                                                     for step in range(len(seen[0]))]
    for step, ((_, ours, _), theirs) in enumerate(zip(seen[-1], reference_norms())):
        if step in overflows:
            assert not math.isfinite(ours) and not math.isfinite(theirs)
        else:
            assert ours == pytest.approx(theirs, rel=1e-6), step


def _recipe(name):
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "docs" / "distributed.md").read_text()
    marker = f"<!-- recipe: {name} -->\n```python\n"
    start = text.index(marker) + len(marker)
    return text[start:text.index("```", start)]


@needs_gloo
def test_the_actor_recipe_skips_on_every_rank_and_logs_the_norm(tmp_path_factory):
    """docs/distributed.md's verl-style actor update on 2 gloo ranks: an overflow in one rank's
    micro-batch skips the step on both, the scale backs off once, and the logged grad norm is
    the same on both ranks every step (non-finite at the overflow, never missing)."""
    from _recipe_worker import run_recipe

    logs = spawned_results(_SPAWNED, "recipe_actor", run_recipe, tmp_path_factory,
                           _recipe("actor"))
    for log in logs:
        assert [m["actor/skipped"] for m in log] == [False, False, True, False]
        assert [m["actor/loss_scale"] for m in log] == [2.0**16, 2.0**16, 2.0**15, 2.0**15]
        norms = [m["actor/grad_norm"] for m in log]
        assert [math.isfinite(n) for n in norms] == [True, True, False, True]
    assert [repr(m["actor/grad_norm"]) for m in logs[0]] == \
        [repr(m["actor/grad_norm"]) for m in logs[1]]


@needs_gloo
@pytest.mark.exhaustive  # a 4-rank spawn
def test_the_pipeline_recipe_trains_on_a_2x2_mesh(tmp_path_factory):
    """docs/distributed.md's torchtitan-style loop on 4 gloo ranks (2 stages x 2 FSDP2
    shards): the overflow in one microbatch skips the step on all four, every rank logs the
    same norm, the LR schedule counts only the applied steps, the last stage logs the
    unscaled loss."""
    from _recipe_worker import run_recipe

    logs = spawned_results(_SPAWNED, "recipe_pipeline", run_recipe, tmp_path_factory,
                           _recipe("pipeline"), world_size=4)
    for rank, log in enumerate(logs):
        assert [m["skipped"] for m in log] == [step == 3 for step in range(6)]
        assert log[-1]["lr"] == pytest.approx(1e-3 * 0.9**5)
        assert [repr(m["grad_norm"]) for m in log] == [repr(m["grad_norm"]) for m in logs[0]]
        assert [math.isfinite(m["grad_norm"]) for m in log] == [step != 3 for step in range(6)]
        last_stage = rank >= 2
        assert all((m["loss"] is not None) == last_stage for m in log)
        if last_stage:
            assert 0.1 < log[0]["loss"] < 10.0
