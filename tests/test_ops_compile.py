"""The public ops (and an adapter built on them) called from code compiled by
``torch.compile``: each call runs eagerly (a graph break, as GradScaler's methods), with
torch's ops' results. Traced, the Triton launch fails (dynamo cannot trace the launcher)."""

import math

import torch
from _util import assert_all_same, assert_same

from triton_scaler import ops
from triton_scaler.compat import deepspeed

SIZES = [0, 1, 4097, 33]


def _iteration(backend):
    def iteration(grads, found, inv, scale, tracker):
        ops.non_finite_check_and_unscale_(grads, found, inv, backend=backend)
        ops.update_scale_(scale, tracker, found, 2.0, 0.5, 2, backend=backend)
        checked = torch.zeros_like(found)
        ops.non_finite_check_(grads, checked, inv, backend=backend)
        return ops.all_finite(grads, backend=backend), checked
    return iteration


def test_the_ops_in_compiled_code_give_torchs_results(backend):
    compiled = torch.compile(_iteration(backend), backend="aot_eager")
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(n, generator=gen) * 3000 for n in SIZES]
    expected = [g.clone() for g in grads]
    scale, tracker = torch.full((), 2.0**10), torch.zeros((), dtype=torch.int32)
    scale_expected, tracker_expected = scale.clone(), tracker.clone()
    scales = []
    for step in range(6):
        if step in (2, 3):  # inf, then NaN: the first and the last grad
            grads[-1][-1] = expected[-1][-1] = math.inf
            grads[2][0] = expected[2][0] = math.nan if step == 3 else 1.0
        found, found_expected = torch.zeros(()), torch.zeros(())
        inv = scale.double().reciprocal().float()
        finite, checked = compiled(grads, found, inv, scale, tracker)
        torch._amp_foreach_non_finite_check_and_unscale_(expected, found_expected, inv)
        torch._amp_update_scale_(scale_expected, tracker_expected, found_expected, 2.0, 0.5, 2)
        assert_all_same(grads, expected)
        assert_same(found, found_expected)
        assert_same(scale, scale_expected)
        assert_same(tracker, tracker_expected)
        scales.append(scale.item())
        assert bool(finite) == (found_expected.item() == 0) == (checked.item() == 0)
        for g in expected:
            g.nan_to_num_(0.0, 0.0, 0.0)
        for g in grads:
            g.nan_to_num_(0.0, 0.0, 0.0)
    assert scales == [1024.0, 2048.0, 1024.0, 512.0, 512.0, 1024.0]  # grew, backed off twice


def test_a_deepspeed_scaler_in_compiled_code_as_in_eager(backend):
    def run(compile_it):
        param = torch.nn.Parameter(torch.ones(5))
        scaler = deepspeed.DynamicLossScaler(init_scale=2.0**4, scale_window=2, device="cpu",
                                             backend=backend)

        def step():
            overflow = scaler.has_overflow([param])
            scaler.update_scale(overflow)
            return overflow

        step = torch.compile(step, backend="aot_eager") if compile_it else step
        seen = []
        for i in range(6):
            param.grad = torch.full((5,), math.inf if i in (1, 2) else 1.0)
            seen.append((bool(step()), scaler.cur_scale))
        return seen

    eager = run(False)
    assert run(True) == eager
    assert [overflow for overflow, _ in eager] == [False, True, True, False, False, False]
    assert len({scale for _, scale in eager}) > 2  # backed off twice, then grew
