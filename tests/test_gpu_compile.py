"""The whole step with dynamic loss scaling as compiled code and CUDA graphs, on a GPU: a fused
``capturable=True`` AdamW, the scaler's calls compiled, GradBuckets or not, 100 iterations
with overflows, against the same iterations with the scaler eager, bit for bit (scales,
skipped steps, parameters, optimizer state). Skipped without CUDA; run with
tests/run_gpu.sh."""

import math

import pytest
import torch
from _loops import assert_same_optimizer_state
from _util import assert_all_same

from triton_scaler import GradBuckets, GradScaler

pytestmark = pytest.mark.gpu

#: Overflows at irregular steps: backoffs, growth after two clean steps, runs of skips.
OVERFLOWS = [i % 7 == 3 or i % 23 == 11 or 40 <= i < 43 for i in range(100)]


def _setup(cuda, buckets: bool, compiled: str | None):
    """A model, a fused capturable AdamW, the scaler and one iteration ``step(x)``; with
    ``compiled``, ``scaler.scale`` (fullgraph) and ``step -> update`` compiled with that mode."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.GELU(),
                                torch.nn.Linear(48, 5)).to(cuda)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True, capturable=True)
    held = GradBuckets(opt) if buckets else None
    scaler = GradScaler("cuda", init_scale=2.0**10, growth_interval=2)
    multiplier = torch.ones((), device=cuda)

    def scale(loss):
        return scaler.scale(loss)

    def post():
        scaler.step(opt)
        scaler.update()

    if compiled is not None:
        scale = torch.compile(scale, fullgraph=True, mode=compiled)
        post = torch.compile(post, mode=compiled)

    def iteration(x):
        held.zero_() if held is not None else opt.zero_grad(set_to_none=False)
        scale(model(x).square().mean() * multiplier).backward()
        post()

    return iteration, model, opt, scaler, multiplier


def _train(cuda, buckets: bool, compiled: str | None, captured: bool):
    torch._dynamo.reset()
    iteration, model, opt, scaler, multiplier = _setup(cuda, buckets, compiled)
    x = torch.randn(4, 32, device=cuda)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # warm-up (compilation; capture needs it on a side stream)
            iteration(x)
    torch.cuda.current_stream().wait_stream(side)
    step = lambda: iteration(x)  # noqa: E731
    if captured:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            iteration(x)
        step = graph.replay
    scales = []
    for overflow in OVERFLOWS:
        multiplier.fill_(math.inf if overflow else 1.0)
        step()
        scales.append(scaler.get_scale())
    return scales, scaler.skipped_steps, model, opt


def _assert_same(actual, expected):
    assert actual[0] == expected[0]
    assert actual[1] == expected[1] == sum(OVERFLOWS)
    assert len(set(expected[0])) > 3  # the scale backed off and grew again
    assert_all_same([p.detach() for p in actual[2].parameters()],
                    [p.detach() for p in expected[2].parameters()])
    assert_same_optimizer_state(actual[3], expected[3])


@pytest.mark.parametrize("buckets", [False, True])
def test_compiled_scaler_under_reduce_overhead_equals_eager(cuda, buckets):
    """``mode="reduce-overhead"`` (CUDA graph trees) for the scaler's calls: 100 iterations
    equal to the eager scaler's."""
    eager = _train(cuda, buckets, None, captured=False)
    _assert_same(_train(cuda, buckets, "reduce-overhead", captured=False), eager)


@pytest.mark.parametrize("buckets", [False, True])
def test_a_captured_iteration_of_compiled_scaler_calls_replays_as_eager(cuda, buckets):
    """The whole iteration (backward, compiled scale, compiled step and update) captured in
    one ``torch.cuda.graph`` and replayed 100 times, with overflows set through a device
    tensor: the eager scaler's 100 iterations, bit for bit."""
    eager = _train(cuda, buckets, None, captured=False)
    _assert_same(_train(cuda, buckets, "default", captured=True), eager)
