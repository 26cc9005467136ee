"""update_scale_ against torch._amp_update_scale_ and the peers' policies."""

import math
import random
import struct

import pytest
import torch
from _peers import DeepSpeedDynamicLossScaler, MegatronDynamicGradScaler, overflow_bursts
from _util import assert_same

from triton_scaler import ScalePolicy, ops


def _state(scale):
    return (torch.tensor(scale, dtype=torch.float32), torch.zeros((), dtype=torch.int32))


@pytest.mark.parametrize("growth, backoff, interval, init", [
    (2.0, 0.5, 3, 2.0**16),
    (1.7, 0.37, 2, 1000.0),          # non-power-of-two factors: fp64 math or drift
    (3.1, 0.9, 1, 2.0**120),         # growth past fp32 max is refused
    (1.0001, 0.999, 5, 1e-30),
])
def test_matches_torch_over_random_steps(backend, growth, backoff, interval, init):
    gen = torch.Generator().manual_seed(int(interval * 1000 + growth * 10))
    ours, theirs = _state(init), _state(init)
    for step in range(300):
        found = torch.tensor(float(torch.rand((), generator=gen) < 0.2), dtype=torch.float32)
        if step % 97 == 5:
            found = torch.tensor(2.0)  # torch's scaler passes sums over devices
        returned = ops.update_scale_(*ours, found, growth, backoff, interval, backend=backend)
        assert returned is ours[0]  # as torch's op, which returns its scale argument
        assert torch._amp_update_scale_(*theirs, found, growth, backoff, interval) is theirs[0]
        assert_same(ours[0], theirs[0])
        assert_same(ours[1], theirs[1])


def test_growth_refused_at_fp32_max_keeps_tracker_reset(backend):
    scale, tracker = _state(torch.finfo(torch.float32).max / 1.5)
    ops.update_scale_(scale, tracker, torch.zeros(()), 2.0, 0.5, 1, backend=backend)
    assert scale.item() == pytest.approx(torch.finfo(torch.float32).max / 1.5)
    assert tracker.item() == 0


def test_a_hysteresis_tracker_with_the_default_hysteresis_is_torchs_update(backend):
    """``hysteresis`` defaults to 1: a hysteresis tracker passed alone refills to 1 at growth,
    so every overflow backs off at once, as torch's op (an overflow right after a growth)."""
    scale, tracker = _state(4.0)
    expected_scale, expected_tracker = _state(4.0)
    hysteresis_tracker = torch.ones((), dtype=torch.int32)
    for found in (0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0):
        ops.update_scale_(scale, tracker, torch.tensor(found), 2.0, 0.5, 2,
                          hysteresis_tracker=hysteresis_tracker, backend=backend)
        torch._amp_update_scale_(expected_scale, expected_tracker, torch.tensor(found), 2.0,
                                 0.5, 2)
        assert_same(scale, expected_scale)
        assert_same(tracker, expected_tracker)
    assert hysteresis_tracker.item() == -1  # two overflows since the last refill to 1


@pytest.mark.parametrize("hysteresis", [1, 2, 3])
@pytest.mark.parametrize("min_scale", [0.0, 1.0, 64.0])
@pytest.mark.parametrize("seed", [0, 1])
def test_hysteresis_matches_megatron(backend, hysteresis, min_scale, seed):
    peer = MegatronDynamicGradScaler(2.0**12, min_scale, 2.0, 0.5, 4, hysteresis)
    _follow_megatron(peer, hysteresis, min_scale, overflow_bursts(400, seed, p_start=0.15),
                     backend)


def _follow_megatron(peer, hysteresis, min_scale, flags, backend):
    """Drive update_scale_ beside a Megatron DynamicGradScaler (initial scale 2**12, growth
    interval 4) and compare the scale and both trackers after every update."""
    scale, tracker = _state(2.0**12)
    hyst = torch.tensor(hysteresis, dtype=torch.int32)
    for overflow in flags:
        peer.update(overflow)
        ops.update_scale_(scale, tracker, torch.tensor(float(overflow)), 2.0, 0.5, 4,
                          hysteresis_tracker=hyst, hysteresis=hysteresis,
                          min_scale=min_scale, backend=backend)
        assert scale.item() == peer._scale.item()
        assert tracker.item() == peer._growth_tracker
        assert hyst.item() == peer._hysteresis_tracker


@pytest.mark.parametrize("delayed_shift", [1, 2, 3])
def test_consecutive_hysteresis_backoff_matches_deepspeed(backend, delayed_shift):
    """DeepSpeed's consecutive hysteresis: only runs of ``delayed_shift`` overflows back off.
    (Its growth timing differs by one step; the DeepSpeed adapter handles that.)"""
    peer = DeepSpeedDynamicLossScaler(2.0**20, 2.0, 10**9, 1.0, delayed_shift, True, False)
    scale, tracker = _state(2.0**20)
    hyst = torch.tensor(delayed_shift, dtype=torch.int32)
    for overflow in overflow_bursts(300, delayed_shift, p_start=0.2):
        peer.update_scale(overflow)
        ops.update_scale_(scale, tracker, torch.tensor(float(overflow)), 2.0, 0.5, 10**9,
                          hysteresis_tracker=hyst, hysteresis=delayed_shift,
                          consecutive_hysteresis=True, min_scale=1.0, backend=backend)
        assert scale.item() == peer.cur_scale


@pytest.mark.parametrize("init, min_scale, max_scale", [
    (8.0, 2.0, 100.0),  # the floor reached exactly (4 -> 2 -> floored 1), the cap at 128
    (3.0, 2.0, 5.0),  # 1.5 is floored to 2.0 (above half the floor), 8.0 capped at 5.0
    (1000.0, 300.0, 1500.0),
    # one bound only (torch's fast path applies neither: a floor without a cap, a cap
    # without a floor must still take the bounded path)
    (3.0, 1.0, math.inf),  # 1.5 -> 0.75 floored to 1.0 (DeepSpeed's min_loss_scale)
    (3.0, 0.0, 5.0),
])
def test_min_and_max_scale(backend, init, min_scale, max_scale):
    """Each step's scale: ``max(scale * backoff, min_scale)`` after an overflow, ``min(scale *
    growth, max_scale)`` at the growth interval (Megatron's and DeepSpeed's rule), checked
    after every step, with bounds a backed-off or grown scale crosses by less than a factor."""
    scale, tracker = _state(init)
    expected = init
    for found in [1.0] * 6 + [0.0] * 6 + [1.0, 0.0, 2.0, 1.0, 0.0, 0.0, 0.0]:
        ops.update_scale_(scale, tracker, torch.tensor(found), 2.0, 0.5, 1,
                          min_scale=min_scale, max_scale=max_scale, backend=backend)
        expected = max(expected * 0.5, min_scale) if found else min(expected * 2.0, max_scale)
        assert scale.item() == expected


@pytest.mark.parametrize("init", [-1.0, -3.0e-30, -65536.0])
def test_min_scale_zero_is_no_floor_as_torch(backend, init):
    """A negative scale (``update(new_scale=tensor)`` takes any value, as torch's) backs off
    and grows by torch's rule: the default ``min_scale=0.0`` is no floor, also with
    hysteresis (the kernel once floored it at 0.0, away from torch and the reference)."""
    ours, theirs = _state(init), _state(init)
    for found in (1.0, 0.0, 1.0, 2.0, 0.0, 0.0):
        ops.update_scale_(*ours, torch.tensor(found), 2.0, 0.5, 2, backend=backend)
        torch._amp_update_scale_(*theirs, torch.tensor(found), 2.0, 0.5, 2)
        assert_same(ours[0], theirs[0])
        assert_same(ours[1], theirs[1])
    scale, tracker = _state(init)
    hysteresis = torch.full((), 2, dtype=torch.int32)
    for _ in range(3):  # the second overflow backs off, the third too
        ops.update_scale_(scale, tracker, torch.ones(()), 2.0, 0.5, 2, backend=backend,
                          hysteresis_tracker=hysteresis, hysteresis=2)
    assert scale.item() == _state(init)[0].item() / 4  # (exact: a power of two)


def _random_update_args(rng: random.Random) -> tuple:
    """(scale, growth tracker, first found_inf, growth, backoff, interval): any float32 scale
    (negative, signed zeros, subnormal, inf, NaN, random bits), int32 trackers at the edges,
    found_inf NaN / negative / above 1, factors torch accepts."""
    bits = struct.unpack("f", struct.pack("I", rng.getrandbits(32)))[0]
    scale = rng.choice([65536.0, 3.0, 2.0**-24, 1e-45, 3.4e38, math.inf, -math.inf, 0.0,
                        -0.0, -1.0, math.nan, bits, bits])
    tracker = rng.choice([0, 1, 1999, 2**31 - 2, 2**31 - 1, -3, rng.randrange(-2**31, 2**31)])
    found = rng.choice([0.0, 1.0, 2.0, math.nan, math.inf, -1.0, 1e-45])
    return (scale, tracker, found, rng.choice([2.0, 1.5, 1.0001, 1e30, rng.uniform(1, 10)]),
            rng.choice([0.5, 0.999, 1e-30, 1 / 3, rng.uniform(0.01, 0.99)]),
            rng.choice([1, 2, 3, 2000, 2**31 - 1]))


@pytest.mark.parametrize("seed", range(4))
def test_random_states_match_torch(backend, seed):
    """Random states, edge values included, a few steps each: bit for bit torch's op (this
    is how the min_scale floor at 0.0 was found)."""
    rng = random.Random(seed)
    for _ in range(50):
        scale, tracker, found, growth, backoff, interval = _random_update_args(rng)
        ours, theirs = ((torch.tensor(scale, dtype=torch.float32),
                         torch.tensor(tracker, dtype=torch.int32)) for _ in range(2))
        for step in range(rng.randint(1, 6)):
            flag = torch.tensor(found if step == 0 else rng.choice([0.0, 1.0]))
            ops.update_scale_(*ours, flag.clone(), growth, backoff, interval, backend=backend)
            torch._amp_update_scale_(*theirs, flag, growth, backoff, interval)
            for a, b in zip(ours, theirs):
                try:
                    assert_same(a, b)
                except AssertionError as error:
                    raise AssertionError(f"{(scale, tracker, found, growth, backoff, interval)}"
                                         f", step {step}: {error}") from error


def test_triton_reads_factors_from_the_params_buffer(triton_device):
    scale, tracker = (t.to(triton_device) for t in _state(1.0))
    params = ScalePolicy(growth_interval=1).kernel_params(triton_device).clone()
    found = torch.zeros((), device=triton_device)
    ops.update_scale_(scale, tracker, found, 2.0, 0.5, 1, backend="triton", params=params)
    params[0] = 3.0  # a captured graph would see this change
    ops.update_scale_(scale, tracker, found, 2.0, 0.5, 1, backend="triton", params=params)
    assert scale.item() == 6.0


@pytest.mark.parametrize("kwargs, match", [
    (dict(growth_factor=1.0), "growth_factor must be finite and > 1"),
    (dict(growth_factor=math.inf), "growth_factor must be finite and > 1"),
    (dict(backoff_factor=0.0), r"backoff_factor must be in \(0, 1\)"),
    (dict(backoff_factor=1.0), r"backoff_factor must be in \(0, 1\)"),
    (dict(growth_interval=0), "growth_interval must be an int >= 1"),
    (dict(hysteresis=0), "hysteresis must be an int >= 1"),
    (dict(min_scale=-1.0), "min_scale must be finite and >= 0"),
    (dict(min_scale=4.0, max_scale=2.0), "min_scale must be <= max_scale"),
])
def test_bad_policy_arguments(kwargs, match):
    args = dict(growth_factor=2.0, backoff_factor=0.5, growth_interval=10)
    args.update(kwargs)
    scale, tracker = _state(1.0)
    with pytest.raises(ValueError, match=match):
        ops.update_scale_(scale, tracker, torch.zeros(()), args.pop("growth_factor"),
                          args.pop("backoff_factor"), args.pop("growth_interval"), **args)


@pytest.mark.parametrize("name, bad, accepted", [
    ("scale", torch.full((), 4.0, dtype=torch.float64), "torch.float32"),
    ("scale", torch.full((2,), 4.0), "torch.float32"),
    ("scale", 4.0, "torch.float32"),
    ("growth_tracker", torch.zeros((), dtype=torch.int64), "torch.int32"),
    ("growth_tracker", torch.zeros(()), "torch.int32"),
    ("found_inf", torch.ones((), dtype=torch.float16), "torch.float32"),
    ("found_inf", torch.ones((), dtype=torch.bool), "torch.float32"),
    ("hysteresis_tracker", torch.full((), 2, dtype=torch.int64), "torch.int32"),
    ("hysteresis_tracker", torch.full((1, 2), 2, dtype=torch.int32), "torch.int32"),
])
def test_bad_state_tensors_are_named_and_nothing_changes(backend, name, bad, accepted):
    """Each state tensor of the wrong dtype or size (or not a tensor) is refused by name before
    anything is written: the found_inf of 1.0 would back the scale off."""
    state = dict(scale=torch.full((), 4.0), growth_tracker=torch.full((), 3, dtype=torch.int32),
                 found_inf=torch.ones(()), hysteresis_tracker=torch.ones((), dtype=torch.int32))
    state[name] = bad
    before = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    with pytest.raises(TypeError, match=f"^{name} must be a one-element {accepted} tensor"):
        ops.update_scale_(state["scale"], state["growth_tracker"], state["found_inf"], 2.0, 0.5,
                          5, hysteresis_tracker=state["hysteresis_tracker"], hysteresis=2,
                          backend=backend)
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            assert_same(v, before[k])


def test_a_bad_growth_interval_is_named():
    with pytest.raises(TypeError, match="growth_interval must be an int"):
        ops.update_scale_(*_state(1.0), torch.zeros(()), 2.0, 0.5, 1.5)


def test_against_the_real_megatron_core_when_installed(backend):
    grad_scaler = pytest.importorskip("megatron.core.optimizer.grad_scaler")
    real_tensor = torch.tensor
    for hysteresis, min_scale in ((1, 1.0), (2, 1.0), (3, 64.0)):
        with pytest.MonkeyPatch.context() as patch:  # megatron-core hard-codes device="cuda"
            patch.setattr(torch, "tensor", lambda *a, device=None, **k: real_tensor(*a, **k))
            peer = grad_scaler.DynamicGradScaler(initial_scale=2.0**12, min_scale=min_scale,
                                                 growth_factor=2.0, backoff_factor=0.5,
                                                 growth_interval=4, hysteresis=hysteresis)
        _follow_megatron(peer, hysteresis, min_scale,
                         overflow_bursts(300, hysteresis, p_start=0.15), backend)


def test_tracker_past_the_interval_never_grows_like_torch(backend):
    """torch compares with equality: after set_growth_interval() lowers the interval below
    the tracker, the tracker keeps counting and the scale does not grow."""
    ours, theirs = _state(8.0), _state(8.0)
    ours[1].fill_(5)
    theirs[1].fill_(5)
    for _ in range(4):
        ops.update_scale_(*ours, torch.zeros(()), 2.0, 0.5, 3, backend=backend)
        torch._amp_update_scale_(*theirs, torch.zeros(()), 2.0, 0.5, 3)
        assert_same(ours[0], theirs[0])
        assert_same(ours[1], theirs[1])
    assert ours[0].item() == 8.0 and ours[1].item() == 9
