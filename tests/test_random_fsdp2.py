"""triton_scaler's GradScaler against torch's over random call sequences on an FSDP2 model
(DTensor grads) on 2 gloo ranks (tests/_random_fsdp2.py): every call's outcome, the scale,
the local parameter, grad and optimizer-state shards equal on each rank, while an inf / NaN
reaches only some ranks' shards; both backends (Triton through the interpreter)."""

from _random_fsdp2 import run_random_fsdp2
from _spawn import spawned_results

SEEDS = range(16)
_results: dict = {}


def test_random_sequences_on_fsdp2_match_torch(tmp_path_factory):
    results = spawned_results(_results, "random-fsdp2", run_random_fsdp2, tmp_path_factory,
                              list(SEEDS), timeout_s=300)
    for rank, result in enumerate(results):
        assert result["failures"] == [], f"rank {rank}:\n" + "\n".join(result["failures"])
