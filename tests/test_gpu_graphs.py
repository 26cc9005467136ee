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


def _train(cuda, buckets: bool, unscale_first: bool, captured: bool):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.GELU(),
                                torch.nn.Linear(48, 5)).to(cuda)
    iteration, opt, scaler, multiplier = warmed_up_training(model, cuda, buckets, unscale_first)
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
    return scales, scaler.skipped_steps, model, opt


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
