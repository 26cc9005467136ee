"""Sharded overflow agreement: 2 gloo processes on loopback, only rank 1 overflows; both ranks
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


@pytest.mark.parametrize("optimizer_name", ["sgd_momentum", "adamw_fused"])
def test_ranks_agree_on_overflow(tmp_path, backend, optimizer_name):
    overflow_steps = (2, 3, 7)
    spawn_bounded(run, (2, store_file_in(tmp_path), optimizer_name, backend, overflow_steps, str(tmp_path)),
                  timeout_s=180)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    assert results[0]["skipped"] == results[1]["skipped"] == list(overflow_steps)
    assert results[0]["scales"] == results[1]["scales"]
    assert results[0]["all_reduces"] == results[1]["all_reduces"] == 12  # one per iteration
