"""A captured training iteration replayed 100 times against the same 100 iterations run
eagerly (issue 11): the same scales, skipped steps, parameters and optimizer state, bit for
bit. Skipped without CUDA; run with tests/run_gpu.sh. (Written after the GPU run of
2026-11-26, whose device time was spent: it first runs on the next GPU run.)"""

import math

import pytest
import torch
from _loops import assert_same_optimizer_state
from _util import assert_all_same

from triton_scaler import GradBuckets, GradScaler

pytestmark = pytest.mark.gpu

#: Overflows at irregular steps: backoffs, growth after two clean steps, runs of skips.
OVERFLOWS = [i % 7 == 3 or i % 23 == 11 or 40 <= i < 43 for i in range(100)]


def _train(cuda, buckets: bool, unscale_first: bool, captured: bool):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.GELU(),
                                torch.nn.Linear(48, 5)).to(cuda)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True, capturable=True)
    bucketed = GradBuckets(opt) if buckets else None
    scaler = GradScaler("cuda", init_scale=2.0**10, growth_interval=2, backend="triton")
    x = torch.randn(4, 32, device=cuda)
    multiplier = torch.ones((), device=cuda)

    def iteration():
        if bucketed is not None:
            bucketed.zero_()
        else:
            opt.zero_grad(set_to_none=False)
        scaler.scale(model(x).square().mean() * multiplier).backward()
        if unscale_first:
            scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()

    side = torch.cuda.Stream()  # warm-up on a side stream, as capture needs; both runs alike
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            iteration()
    torch.cuda.current_stream().wait_stream(side)
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
