"""User code over triton_scaler's public API, type-checked by tests/test_typing.py as a user's
project would be (``mypy --strict`` against the installed package). Never run: each
``assert_type`` states what a call's type must be, and nothing here may need an ignore."""

from __future__ import annotations

from typing import Any

import torch
from torch.amp.grad_scaler import GradScaler as TorchGradScaler
from typing_extensions import assert_type

import triton_scaler
from triton_scaler import (
    GradBuckets,
    GradScaler,
    MinScaleReachedError,
    ScalePolicy,
    ScalerArgumentError,
    ShardedGradScaler,
    ops,
)
from triton_scaler.compat import apex, deepspeed, megatron, mindspore
from triton_scaler.diagnostics import count_host_syncs
from triton_scaler.schedulers import SkipAwareScheduler


def train_step(model: torch.nn.Module, x: torch.Tensor, opt: torch.optim.Optimizer,
               scaler: GradScaler) -> None:
    with torch.autocast("cuda", dtype=torch.float16):
        loss: torch.Tensor = model(x).sum()
    scaled = scaler.scale(loss)
    assert_type(scaled, torch.Tensor)
    scaled.backward()
    assert_type(scaler.scale([loss, loss]), list[torch.Tensor])
    assert_type(scaler.scale((loss,)), tuple[torch.Tensor, ...])
    assert_type(scaler.unscale_(opt), None)
    assert_type(scaler.clip_grad_norm_(opt, 1.0), torch.Tensor)
    scaler.clip_grad_norm_(opt, max_norm=1.0, norm_type="inf", error_if_nonfinite=True,
                           sharded=False)
    assert_type(scaler.step(opt), float | None)
    assert_type(scaler.update(), None)
    scaler.update(1024.0)
    scaler.update(torch.tensor(1024.0))
    assert_type(scaler.last_step_skipped, torch.Tensor)
    assert_type(scaler.skipped_steps, int)


def build(model: torch.nn.Module) -> None:
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    scaler = GradScaler("cuda", 2.0**16, 2.0, 0.5, 2000, True, hysteresis=2,
                        consecutive_hysteresis=False, min_scale=1.0, max_scale=2.0**24,
                        raise_at_min_scale=True, dynamic=True, skip_on_overflow=True,
                        backend="triton", process_group=None)
    as_torch: TorchGradScaler = scaler
    sharded = ShardedGradScaler("cuda", 2.0**16, 0.5, 2.0, 2000, True, None, hysteresis=2)
    as_torch = sharded
    del as_torch
    assert_type(sharded.scale(torch.ones(())), torch.Tensor)
    assert_type(sharded.scale([torch.ones(())]), list[torch.Tensor])
    buckets = GradBuckets(opt, on_detach="warn")
    assert_type(buckets.zero_(), None)
    buckets.release()
    GradBuckets(model.parameters())
    assert_type(scaler.get_scale(), float)
    scaler.get_growth_interval()  # torch's own methods: typed as torch types them
    scaler.set_growth_factor(4.0)
    state = scaler.state_dict()
    assert_type(state, dict[str, Any])
    scaler.load_state_dict(state)
    assert_type(scaler.policy, ScalePolicy)
    assert_type(scaler.policy.replace(hysteresis=3), ScalePolicy)
    scheduler = SkipAwareScheduler(torch.optim.lr_scheduler.StepLR(opt, 10), scaler)
    scheduler.step()
    with count_host_syncs() as counter:
        assert_type(counter.count, int)
    try:
        scaler.update()
    except (MinScaleReachedError, ScalerArgumentError) as error:
        assert_type(error, MinScaleReachedError | ScalerArgumentError)


def low_level(grads: list[torch.Tensor]) -> None:
    found_inf, inv_scale = torch.zeros(()), torch.ones(())
    assert_type(ops.non_finite_check_and_unscale_(grads, found_inf, inv_scale, backend="auto"),
                None)
    ops.non_finite_check_(grads, found_inf, inv_scale)
    scale, tracker = torch.ones(()), torch.zeros((), dtype=torch.int32)
    assert_type(ops.update_scale_(scale, tracker, found_inf, 2.0, 0.5, 2000), torch.Tensor)
    ops.update_scale_(scale, tracker, found_inf, 2.0, 0.5, 2000,
                      hysteresis_tracker=torch.ones((), dtype=torch.int32), hysteresis=2,
                      consecutive_hysteresis=True, min_scale=1.0, max_scale=2.0**24,
                      backend="reference")
    assert_type(triton_scaler.all_finite(grads), torch.Tensor)


def peers(params: list[torch.nn.Parameter], opt: torch.optim.Optimizer,
          loss: torch.Tensor) -> None:
    ds = deepspeed.DynamicLossScaler(init_scale=2.0**16, scale_window=1000, min_scale=1.0,
                                     delayed_shift=2, backend="reference", device="cpu")
    ds.backward(loss)
    assert_type(ds.has_overflow(params), torch.Tensor)
    ds.update_scale(ds.has_overflow(params))
    ds.update_scale(False)
    assert_type(ds.cur_scale, float)
    assert_type(deepspeed.CreateLossScaler(torch.half, 128.0, False, None), deepspeed.LossScaler)
    amp = apex.Amp(num_losses=2, backend="reference")
    with amp.scale_loss(loss, opt, loss_id=1) as scaled:
        assert_type(scaled, torch.Tensor)
    assert_type(amp.loss_scale(1), float)
    amp.load_state_dict(amp.state_dict())
    ms = mindspore.DynamicLossScaler(2.0**16, 2, 1000, backend="reference")
    assert_type(ms.scale(loss), torch.Tensor)
    assert_type(ms.unscale((loss, loss)), tuple[torch.Tensor, ...])
    assert_type(ms.adjust(mindspore.all_finite((loss,))), bool)
    manager = mindspore.DynamicLossScaleManager(2.0**24, 2, 1000)
    assert_type(manager.get_grad_scaler("cpu"), GradScaler)
    mg = megatron.DynamicGradScaler(2.0**16, 1.0, 2.0, 0.5, 1000, 2, backend="reference")
    assert_type(mg.scale, torch.Tensor)
    assert_type(mg.inv_scale, torch.Tensor)
    mg.update(False)
    mg.update(torch.zeros(1))
    mg.load_state_dict(mg.state_dict())
    assert_type(mg.state_dict(), dict[str, Any])
    assert_type(mg.growth_interval, int)
    constant: megatron.MegatronGradScaler = megatron.ConstantGradScaler(2.0**8)
    constant.update(True)
