"""Sharded overflow agreement: 2 gloo processes on loopback, rank 1 overflows (at the last of
those steps rank 0 too, so that found_inf is agreed by a MAX, exactly 1.0); both ranks
skip exactly those steps and keep identical scales, on the plain and the fused route, with one
all-reduce per iteration (the found_inf agreement, shared by ``unscale_``, ``step`` and
``update``)."""

import pytest
import torch
import torch.distributed as dist
from _dist_worker import run
from _spawn import spawn_bounded, store_file_in

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")


@pytest.mark.parametrize("optimizer_name, unscale_first", [
    ("sgd_momentum", False), ("adamw_fused", False), ("sgd_momentum", True)])
def test_ranks_agree_on_overflow(tmp_path, backend, optimizer_name, unscale_first):
    """With ``unscale_`` called first, its record (``_found_inf_per_device``, read by
    integrators' skip checks) is already agreed on both ranks, as torch's
    ShardedGradScaler's (which all-reduces in ``unscale_``)."""
    overflow_steps = (2, 3, 7)
    spawn_bounded(run, (2, store_file_in(tmp_path), optimizer_name, backend, overflow_steps,
                        str(tmp_path), unscale_first), timeout_s=180)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    for result in results:
        found = result["found_after_unscale"]
        assert found == ([1.0 if s in overflow_steps else 0.0 for s in range(12)]
                         if unscale_first else [])
    assert results[0]["skipped"] == results[1]["skipped"] == list(overflow_steps)
    assert results[0]["scales"] == results[1]["scales"]
    assert results[0]["all_reduces"] == results[1]["all_reduces"] == 12  # one per iteration


def test_a_scaler_agrees_only_over_its_process_group(tmp_path, backend):
    """Each rank's scaler given a group of its own rank: rank 0 skips only where it overflows
    itself, not at rank 1's overflows (the agreement is over ``process_group``, not the
    default group)."""
    overflow_steps = (2, 3, 7)
    spawn_bounded(run, (2, store_file_in(tmp_path), "sgd_momentum", backend, overflow_steps,
                        str(tmp_path), False, True), timeout_s=180)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    assert results[0]["skipped"] == [7] and results[1]["skipped"] == list(overflow_steps)
    assert results[0]["all_reduces"] == results[1]["all_reduces"] == 12
