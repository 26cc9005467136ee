"""GradScaler against torch.amp.GradScaler: same trajectory, bit-identical parameters."""

import pytest
import torch
from _loops import assert_same_optimizer_state, train
from _util import assert_all_same

import triton_scaler

CASES = [
    dict(optimizer_name="sgd_momentum"),
    dict(optimizer_name="sgd_momentum", clip=True),
    dict(optimizer_name="adamw"),
    dict(optimizer_name="adamw", clip=True),
    dict(optimizer_name="adamw_fused"),
    dict(optimizer_name="adamw_fused", clip=True),
    dict(optimizer_name="adamw_foreach", two_optimizers=True),
    dict(optimizer_name="sgd_momentum", two_optimizers=True, clip=True),
    dict(optimizer_name="adamw_fused", two_optimizers=True),
    dict(optimizer_name="adamw", overflow_at=()),
    dict(optimizer_name="adamw", accumulate=3),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_training_parity(backend, case):
    kwargs = dict(init_scale=2.0**10, growth_interval=3)
    expected = train(torch.amp.GradScaler("cpu", **kwargs), **case)
    actual = train(triton_scaler.GradScaler("cpu", **kwargs, backend=backend), **case)
    assert actual[0] == expected[0]
    assert_all_same(actual[1], expected[1])
    for a, b in zip(actual[2], expected[2]):
        assert_same_optimizer_state(a, b)


@pytest.mark.parametrize("optimizer_name", ["sgd_momentum", "adamw_fused"])
def test_calibrates_down_from_2_pow_127(backend, optimizer_name):
    kwargs = dict(init_scale=2.0**127, growth_interval=4)
    expected = train(torch.amp.GradScaler("cpu", **kwargs), optimizer_name, steps=40,
                     overflow_at=())
    actual = train(triton_scaler.GradScaler("cpu", **kwargs, backend=backend), optimizer_name,
                   steps=40, overflow_at=())
    assert actual[0] == expected[0]
    assert actual[0][0][0] < 2.0**127  # it did overflow and back off
    assert_all_same(actual[1], expected[1])


def test_default_arguments_match_torch(backend):
    ours = triton_scaler.GradScaler("cpu", backend=backend)
    theirs = torch.amp.GradScaler("cpu")
    assert ours.state_dict().items() >= theirs.state_dict().items()
    assert isinstance(ours, torch.amp.GradScaler)
