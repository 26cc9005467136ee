"""triton_scaler's scalers against torch's over random call sequences on 2 gloo ranks
(tests/_random_fsdp.py): GradScaler on an FSDP2 model (DTensor grads), ShardedGradScaler on an
FSDP1 one (flat shards), GradScaler (with GradBuckets when drawn) on a DDP one. Every call's
outcome, the scale, the local parameter, grad and optimizer-state shards equal on each rank,
while an inf / NaN reaches only some ranks' shards; both backends (Triton through the
interpreter)."""

import pytest
from _random_fsdp import run_random_fsdp
from _seeds import seeds, time_bound
from _spawn import spawned_results

pytestmark = pytest.mark.exhaustive  # the long tier: the engines' own tests are in the default

SEEDS = {"fsdp2": seeds(16), "fsdp1": seeds(10), "ddp": seeds(10)}
_results: dict = {}


def test_random_sequences_on_fsdp2_fsdp1_and_ddp_match_torch(tmp_path_factory):
    results = spawned_results(_results, "random-fsdp", run_random_fsdp, tmp_path_factory,
                              {engine: list(drawn) for engine, drawn in SEEDS.items()},
                              timeout_s=time_bound(300))
    for rank, result in enumerate(results):
        assert result["failures"] == [], f"rank {rank}:\n" + "\n".join(result["failures"])
