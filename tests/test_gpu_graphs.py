"""A captured training iteration replayed 100 times against the same 100 iterations run
eagerly: the same scales, skipped steps, parameters and optimizer state, bit for bit.
Skipped without CUDA; run with tests/run_gpu.sh."""

import math

import pytest
import torch
from _loops import assert_same_optimizer_state
from _util import assert_all_same
from test_gpu import warmed_up_training

pytestmark = pytest.mark.gpu

#: Overflows at irregular steps: backoffs, growth after two clean steps, runs of skips.
OVERFLOWS = [i % 7 == 3 or i % 23 == 11 or 40 <= i < 43 for i in range(100)]


def _train(cuda, buckets: bool, unscale_first: bool, captured: bool, watch: bool = False):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.GELU(),
                                torch.nn.Linear(48, 5)).to(cuda)
    iteration, opt, scaler, multiplier = warmed_up_training(model, cuda, buckets, unscale_first,
                                                            watch)
    step = iteration
    if captured:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            iteration()
        step = graph.replay
    scales = []
    for overflow in OVERFLOWS:
        multiplier.fill_(math.inf if overflow else 1.0)
        step()
        scales.append(scaler.get_scale())
    return scales, scaler.skipped_steps, model, opt, scaler


@pytest.mark.parametrize("buckets, unscale_first", [(True, False), (False, False),
                                                    (False, True)])
def test_100_replays_equal_100_eager_iterations(cuda, buckets, unscale_first):
    eager = _train(cuda, buckets, unscale_first, captured=False)
    replayed = _train(cuda, buckets, unscale_first, captured=True)
    assert replayed[0] == eager[0]
    assert replayed[1] == eager[1] == sum(OVERFLOWS)
    assert len(set(eager[0])) > 3  # the scale backed off and grew again
    assert_all_same([p.detach() for p in replayed[2].parameters()],
                    [p.detach() for p in eager[2].parameters()])
    assert_same_optimizer_state(replayed[3], eager[3])


@pytest.mark.parametrize("buckets, unscale_first", [(True, False), (False, False),
                                                    (False, True)])
def test_a_watched_iteration_replays_as_it_runs_eagerly(cuda, buckets, unscale_first):
    """A whole iteration of a watched scaler captured in one CUDA graph and replayed 100
    times reports what 100 eager iterations report (the last overflow by parameter, its
    step, the skipped steps and their longest run, every statistic), bit for bit."""
    eager = _train(cuda, buckets, unscale_first, captured=False, watch=True)
    replayed = _train(cuda, buckets, unscale_first, captured=True, watch=True)
    assert replayed[0] == eager[0] and replayed[1] == eager[1]
    eager_report, replayed_report = (run[4]._watch.report() for run in (eager, replayed))
    for field in ("amax", "norm", "nonfinite", "has_grad", "last_overflow", "step",
                  "skipped_steps", "consecutive_skips", "most_consecutive_skips"):
        # repr: NaN statistics compare equal as text
        assert repr(getattr(replayed_report, field)) == repr(getattr(eager_report, field)), field
    assert eager_report.last_overflow is not None and eager_report.step == 3 + len(OVERFLOWS)
