"""The adapters and GradScaler's extensions against each peer's transcribed rule
(tests/_peers.py) over random settings and overflow sequences: scale and trackers after every
step, and (apex) which optimizer steps were skipped."""

import math
import random

import pytest
import torch
from _peers import (
    ApexAmpOracle,
    ApexLossScaler,
    DeepSpeedDynamicLossScaler,
    MegatronDynamicGradScaler,
    MindSporeDynamicLossScaler,
)
from _seeds import length, seeds
from _util import assert_all_same, assert_same
from test_compat_apex import _iteration

from triton_scaler import GradScaler
from triton_scaler.compat.apex import Amp
from triton_scaler.compat.deepspeed import DynamicLossScaler as DeepSpeedScaler
from triton_scaler.compat.megatron import DynamicGradScaler as MegatronAdapter
from triton_scaler.compat.mindspore import DynamicLossScaler

SEEDS = seeds(12)
FP32_MAX = float(torch.finfo(torch.float32).max)
#: below float32's normal range our fp32 scale loses bits and from 2**-128 down its reciprocal
#: is inf, so every step is skipped (docs/exactness.md); the peers' Python floats go on: a sequence ends
FP32_TINY = float(torch.finfo(torch.float32).tiny)


def _flags(rng: random.Random) -> list[bool]:
    p_overflow = rng.choice([0.05, 0.3, 0.7])
    return [rng.random() < p_overflow for _ in range(length(rng.randint(1, 80)))]


@pytest.mark.parametrize("seed", SEEDS)
def test_apex_amp_follows_apex_over_random_settings(backend, seed):
    rng = random.Random(seed)
    min_scale = rng.choice([None, 0.0, 1.0, 2.0**10, 0.25])
    max_scale = rng.choice([2.0**24, 2.0**17, 4.0, math.inf])
    if min_scale is not None and min_scale > max_scale:
        min_scale, max_scale = max_scale, min_scale
    init = max(rng.choice([1.0, 2.0**16, 2.0**30, 3.0, 2.0**-3]), min_scale or 0.0)
    window = rng.randint(1, 6)
    amp = Amp(init_scale=init, min_loss_scale=min_scale, max_loss_scale=max_scale,
              scale_window=window, backend=backend)
    peer = ApexLossScaler(init, window, min_scale, max_scale)
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    for step, overflow in enumerate(_flags(rng)):
        before, last_scale = p.detach().clone(), peer._loss_scale
        _iteration(amp, [p], [opt], overflow)
        peer.update_scale(overflow)
        assert torch.equal(p.detach(), before) == overflow, step
        # apex's Python float grows past float32's maximum; ours stays (docs/migrating.md): then stop
        past_fp32 = peer._loss_scale > FP32_MAX
        assert amp.state_dict()["loss_scaler0"] == {
            "loss_scale": last_scale if past_fp32 else peer._loss_scale,
            "unskipped": peer._unskipped}, step
        if past_fp32 or peer._loss_scale < FP32_TINY:
            break


def _amp_model(seed, n_opts):
    torch.manual_seed(seed)
    params = [[torch.nn.Parameter(torch.randn(n)) for n in (3, 5)] for _ in range(n_opts)]
    opts = [torch.optim.SGD(ps, lr=0.5, momentum=0.5) for ps in params]
    return params + [[torch.nn.Parameter(torch.randn(2))]], opts  # the last: in no optimizer


@pytest.mark.parametrize("seed", SEEDS)
def test_apex_amp_losses_over_shared_optimizers_follow_apex(backend, seed):
    """Random losses over random subsets of optimizers (reaching some of them, or none: a
    parameter outside the optimizers), micro-batches with ``delay_unscale``
    (also where apex mixes a delayed loss into grads an earlier loss unscaled), overflows in
    one parameter's grad, grads set to None or zeroed: every grad after every ``scale_loss``,
    every scale, and the parameters after every step equal apex's (ApexAmpOracle)."""
    rng = random.Random(seed)
    n_opts, n_losses = rng.randint(1, 2), rng.randint(1, 3)
    window = rng.randint(1, 3)
    amp = Amp(num_losses=n_losses, init_scale=2.0**rng.randint(0, 12), scale_window=window,
              backend=backend)
    oracle = ApexAmpOracle(n_losses, amp.loss_scale(), window)
    (ours, ours_opts), (theirs, their_opts) = _amp_model(seed, n_opts), _amp_model(seed, n_opts)
    for step in range(length(8)):
        for loss_id in range(n_losses):
            opt_ids = rng.sample(range(n_opts), rng.randint(1, n_opts))
            coefs = [rng.randint(-3, 3) for _ in range(2)]
            for delay in [True] * rng.choice([0, 0, 1]) + [False]:
                reached = rng.sample(opt_ids, rng.randint(0, len(opt_ids)))
                inf_at = rng.choice(reached) if reached and rng.random() < 0.25 else None
                for side in ("ours", "theirs"):
                    params, opts = (ours, ours_opts) if side == "ours" else (theirs, their_opts)
                    loss = params[-1][0].sum() + sum(c * (params[i][j] ** 2).sum()
                                                     for i in reached for j, c in enumerate(coefs))
                    if inf_at is not None:
                        loss = loss + math.inf * params[inf_at][0][0]
                    chosen = [opts[i] for i in opt_ids]
                    if side == "ours":
                        with amp.scale_loss(loss, chosen, loss_id, delay_unscale=delay) as scaled:
                            scaled.backward()
                    else:
                        (loss * oracle.enter(loss_id, chosen, delay)).backward()
                        oracle.exit(loss_id, chosen, delay)
                for a, b in zip(sum(ours, []), sum(theirs, [])):
                    assert (a.grad is None) == (b.grad is None), step
                    if a.grad is not None:
                        assert_same(a.grad, b.grad)
            assert amp.loss_scale(loss_id) == oracle.scalers[loss_id]._loss_scale, step
        set_to_none = rng.random() < 0.5
        for opt, their_opt in zip(ours_opts, their_opts):
            opt.step()
            oracle.step(their_opt)
            opt.zero_grad(set_to_none=set_to_none)
            their_opt.zero_grad(set_to_none=set_to_none)
        assert_all_same([p.detach() for p in sum(ours, [])],
                        [p.detach() for p in sum(theirs, [])])


@pytest.mark.parametrize("seed", SEEDS)
def test_mindspore_adjust_follows_mindspore_over_random_settings(backend, seed):
    rng = random.Random(seed)
    factor = rng.choice([2, 4, 3, 5, 10])
    init, window = rng.choice([1.0, 2.0**24, 3e38, 7.0, 2.0**127, 1.5]), rng.randint(1, 6)
    ours = DynamicLossScaler(init, factor, window, device="cpu", backend=backend)
    peer = MindSporeDynamicLossScaler(init, factor, window)
    for step, overflow in enumerate(_flags(rng)):
        finite = torch.tensor(not overflow)
        ours.adjust(finite)
        peer.adjust(finite)
        assert ours.scale_value.item() == peer.scale_value.item(), step
        assert ours.counter.item() == peer.counter.item(), step


@pytest.mark.parametrize("seed", SEEDS)
def test_hysteresis_follows_megatron_over_random_settings(backend, seed):
    """Megatron's scale grows to inf (no finiteness check; ours stays at the last finite
    scale, docs/migrating.md): checked where a sequence gets there, which then ends."""
    rng = random.Random(seed)
    min_scale = rng.choice([1.0, 2.0**-5, 2.0**10])
    init = max(rng.choice([2.0**16, 2.0**32, 1.0, 2.0**60]), min_scale)
    hysteresis, window = rng.randint(1, 4), rng.randint(1, 6)
    scaler = GradScaler("cpu", init_scale=init, growth_interval=window, hysteresis=hysteresis,
                        min_scale=min_scale, backend=backend)
    peer = MegatronDynamicGradScaler(init, min_scale, 2.0, 0.5, window, hysteresis)
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    for step, overflow in enumerate(_flags(rng)):
        scaler.scale(p.sum() * (math.inf if overflow else 1.0)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        last_scale = peer._scale.item()
        peer.update(overflow)
        past_fp32 = math.isinf(peer._scale.item())
        assert scaler.get_scale() == (last_scale if past_fp32 else peer._scale.item()), step
        assert scaler._get_growth_tracker() == peer._growth_tracker, step
        if hysteresis > 1:  # (with 1, torch's rule: ours keeps no count, Megatron's goes < 0)
            assert scaler.state_dict()["_hysteresis_tracker"] == peer._hysteresis_tracker, step
        if past_fp32:
            break


@pytest.mark.parametrize("seed", SEEDS)
def test_megatron_adapter_follows_megatron_over_random_settings(backend, seed):
    """compat.megatron.DynamicGradScaler, any factors (float32 does not hold most of them
    exactly), bool and tensor flags: the scale's bits and both trackers after every update.
    Settings whose scale would grow to inf within the steps (Megatron's does, ours not) are
    drawn again."""
    rng = random.Random(seed)
    while True:
        growth = rng.choice([2.0, 1.5, 3.0, 1.01, 1.7, 10.0])
        backoff = rng.choice([0.5, 0.25, 0.3, 0.9, 0.99, 0.1])
        min_scale = rng.choice([1.0, 2.0**-5, 0.1, 3.3, 2.0**10])
        init = max(rng.choice([2.0**16, 1.0, 7.5, 1e20]), min_scale)
        hysteresis, window = rng.randint(1, 4), rng.randint(1, 6)
        flags = _flags(rng)
        # (in logs: a long sequence's growth overflows a Python float)
        if math.log(init) + len(flags) / window * math.log(growth) < math.log(FP32_MAX):
            break
    args = (init, min_scale, growth, backoff, window, hysteresis)
    ours = MegatronAdapter(*args, device="cpu", backend=backend)
    peer = MegatronDynamicGradScaler(*args)
    for step, overflow in enumerate(flags):
        peer.update(overflow)
        ours.update(torch.tensor([float(overflow)]) if rng.random() < 0.5 else overflow)
        assert torch.equal(ours.scale, peer._scale), (step, args)
        assert ours._growth_tracker.item() == peer._growth_tracker, step
        assert ours._hysteresis_tracker.item() == peer._hysteresis_tracker, step


@pytest.mark.parametrize("seed", SEEDS)
def test_deepspeed_scaler_follows_deepspeed_over_random_settings(backend, seed):
    """DeepSpeed's Python-float scale against ours in fp32: every scale here is an exact
    float32 (the factor is 2), where both must agree bit for bit, until DeepSpeed's float
    grows past fp32's maximum (ours stays at the last finite scale, docs/migrating.md: checked, and the
    sequence ends there); the raise at the minimum included."""
    rng = random.Random(seed)
    min_scale = rng.choice([1.0, 0.25, 3.0, 2.0**10, 0.0])
    init = max(rng.choice([2.0**16, 2.0**32, 1.0, 3.0 * 2**5, 2.0**40]), min_scale or 1.0)
    window, shift = rng.randint(1, 6), rng.randint(1, 4)
    consecutive, raises = rng.random() < 0.5, rng.random() < 0.5
    args = (init, window, min_scale, shift, consecutive, raises)
    ours = DeepSpeedScaler(*args, device="cpu", backend=backend)
    peer = DeepSpeedDynamicLossScaler(init, 2.0, window, min_scale, shift, consecutive, raises)
    for step, overflow in enumerate(_flags(rng)):
        flag = torch.tensor(overflow) if rng.random() < 0.5 else overflow
        last_scale = peer.cur_scale
        try:
            peer.update_scale(overflow)
        except Exception as error:
            assert "already at minimum" in str(error)
            with pytest.raises(Exception, match="already at minimum"):
                ours.update_scale(flag)
            break
        ours.update_scale(flag)
        past_fp32 = peer.cur_scale > FP32_MAX
        assert ours.loss_scale == (last_scale if past_fp32 else peer.cur_scale), step
        assert ours.cur_hysteresis == peer.cur_hysteresis, step
        if past_fp32 or peer.cur_scale < FP32_TINY:
            break
