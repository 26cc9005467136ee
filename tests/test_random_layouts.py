"""GradScaler against torch.amp.GradScaler while the grads' memory layout changes at random
between steps, at fixed addresses (a differential test of planning, which keeps each size
pattern's rows): each grad contiguous, channels_last / transposed, or gapped (every other
element of its memory) in either layout, its memory swapped with a spare buffer now and
then; inf / -inf / NaN planted at a grad's first or last element. Equal after every run: the scale trajectory,
the parameters and all the memory the grads lay in (a stale plan writes where no grad is)."""

import random

import pytest
import torch
from _seeds import length, seeds
from _util import assert_all_same, view_in

from triton_scaler import GradScaler

pytestmark = pytest.mark.filterwarnings(
    "ignore:grad and param do not obey the gradient layout contract")

SEEDS = seeds(12)
STEPS = length(12)
SHAPES = [(4, 3, 3, 3), (6, 5, 1, 1), (7,), (5, 9), (2, 2, 3, 5)]
LAYOUTS = ["contiguous", "channels_last", "gapped", "gapped_channels_last"]
NON_FINITE = [float("inf"), -float("inf"), float("nan")]


def _train(scaler, seed: int, dtype: torch.dtype):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    memory = [torch.zeros(2 * torch.Size(s).numel() + 5, dtype=dtype) for s in SHAPES]
    spare = [torch.zeros_like(m) for m in memory]
    params = [torch.nn.Parameter(torch.randn(s, dtype=dtype)) for s in SHAPES]
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.5)
    layouts = [rng.choice(LAYOUTS[:2]) for _ in SHAPES]
    scales = []
    for _ in range(STEPS):
        for i in range(len(SHAPES)):
            draw = rng.random()
            if draw < 0.15:
                layouts[i] = rng.choice(LAYOUTS)
            elif draw < 0.25:
                memory[i], spare[i] = spare[i], memory[i]
        for p, m, shape, layout in zip(params, memory, SHAPES, layouts):
            m.fill_(1.0)  # what a plan covering more than the grad would change
            p.grad = view_in(m, shape, layout).zero_()
        loss = sum((p.float() * (i + 1)).square().sum() for i, p in enumerate(params))
        scaler.scale(loss).backward()
        if rng.random() < 0.3:
            grad = params[rng.randrange(len(params))].grad
            grad[(rng.choice([0, -1]),) * grad.dim()] = rng.choice(NON_FINITE)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales, [p.detach() for p in params] + memory + spare


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("seed", SEEDS)
def test_random_grad_layouts_at_fixed_addresses(backend, seed, dtype):
    kwargs = dict(init_scale=2.0**6, growth_interval=2)
    expected = _train(torch.amp.GradScaler("cpu", **kwargs), seed, dtype)
    actual = _train(GradScaler("cpu", backend=backend, **kwargs), seed, dtype)
    assert actual[0] == expected[0]
    assert_all_same(actual[1], expected[1])
