"""A watch under torch's distributed engines, 2 gloo ranks each, rank 1's loss overflowing at
one step: with DDP every rank reports the all-reduced gradients; with FSDP2 (DTensor grads)
and FSDP1 with ShardedGradScaler (plain shards over its process group) every rank reports
the gathered gradients' numbers (amax and counts exactly torch's, norms within 1e-5) and the
same overflow, named by parameter."""

import pytest
import torch


@pytest.mark.slow
def test_a_watched_ddp_run_reports_the_reduced_gradients_on_every_rank(tmp_path, backend):
    """DDP, 2 gloo ranks, rank 1's loss overflowing at one step: every rank reports the same
    overflow (all parameters, as DDP's all-reduce spreads it) and, at the last step, amax and
    counts exactly torch's, norms within 1e-5, of the all-reduced gradients; the ranks'
    parameters stay equal."""
    import torch.distributed as dist
    from _spawn import spawn_bounded, store_file_in
    from _watch_worker import OVERFLOW_STEP, run_watched_ddp

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("needs torch.distributed with gloo")
    spawn_bounded(run_watched_ddp, (2, store_file_in(tmp_path), backend, str(tmp_path)),
                  timeout_s=180)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    for result in results:
        assert result["skipped"] == 1 and result["overflow_step"] == OVERFLOW_STEP
        assert result["overflow_names"] == ["2.bias", "2.weight", "0.bias", "0.weight"]
        for name, (amax, norm, inf, nan) in result["expected"].items():
            assert result["amax"][name] == amax
            assert result["norm"][name] == pytest.approx(norm, rel=1e-5)
            assert result["nonfinite"][name] == (inf, nan) == (0, 0)
    assert results[0]["expected"] == results[1]["expected"]  # the reduced grads: one value
    for a, b in zip(results[0]["params"], results[1]["params"]):
        assert torch.equal(a, b)


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["fsdp2", "fsdp1"])
def test_a_sharded_run_reports_the_whole_gradients_on_every_rank(tmp_path, backend, engine):
    """FSDP2 (DTensor grads) and FSDP1 with ShardedGradScaler (plain shards summed over its
    process group), 2 gloo ranks, rank 1's loss overflowing at one step: every rank reports
    the numbers of the gathered gradients (amax and counts exactly torch's, norms within
    1e-5), the same overflow, named by parameter."""
    import torch.distributed as dist
    from _spawn import spawn_bounded, store_file_in
    from _watch_worker import OVERFLOW_STEP, run_watched_sharded

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("needs torch.distributed with gloo")
    spawn_bounded(run_watched_sharded,
                  (2, store_file_in(tmp_path), engine, backend, str(tmp_path)), timeout_s=180)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    for result in results:  # FSDP1 names its parameters with a prefix outside summon_full_params
        for key in ("amax", "norm", "nonfinite", "has_grad"):
            result[key] = {name.replace("_fsdp_wrapped_module.", ""): value
                           for name, value in result[key].items()}
    for result in results:
        assert result["skipped"] == 1 and result["overflow_step"] == OVERFLOW_STEP
        names = [name for name, _, _ in result["overflow"]]
        assert len(names) == 4 and all(inf + nan > 0 for _, inf, nan in result["overflow"])
        for name, (amax, norm, inf, nan) in result["expected"].items():
            assert result["has_grad"][name]
            assert result["amax"][name] == amax
            assert result["norm"][name] == pytest.approx(norm, rel=1e-5)
            assert result["nonfinite"][name] == (inf, nan) == (0, 0)
    assert results[0]["amax"] == results[1]["amax"] and results[0]["norm"] == results[1]["norm"]
