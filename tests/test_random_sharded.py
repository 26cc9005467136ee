"""triton_scaler.ShardedGradScaler against torch's over random call sequences on 2 gloo
ranks (tests/_random_sharded.py): every call's outcome, the scale, the grads, the parameters
and the optimizer state equal on each rank, while rank 1 alone overflows in some steps; and,
with triton_scaler's own settings drawn, the Triton kernels against the reference path."""

from _random_sharded import run_random_sharded
from _seeds import seeds, time_bound
from _spawn import spawned_results

SEEDS = seeds(12)
_results: dict = {}


def test_random_sequences_agree_over_the_group_as_torchs(tmp_path_factory):
    results = spawned_results(_results, "random-sharded", run_random_sharded,
                              tmp_path_factory, list(SEEDS), timeout_s=time_bound(300))
    for rank, result in enumerate(results):
        assert result["failures"] == [], f"rank {rank}"
    assert results[0]["planted"] == 0 and results[1]["planted"] > 0
