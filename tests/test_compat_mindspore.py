"""triton_scaler.compat.mindspore against MindSpore's documented rules."""

import math

import pytest
import torch
from _peers import MindSporeDynamicLossScaler, overflow_bursts
from _util import count_uploads, sync_errors

from triton_scaler import GradScaler
from triton_scaler.compat.mindspore import (
    DynamicLossScaleManager,
    DynamicLossScaler,
    FixedLossScaleManager,
    StaticLossScaler,
    all_finite,
)
from triton_scaler.diagnostics import count_host_syncs


@pytest.mark.parametrize("factor, window, init", [(2, 3, 2.0**10), (2, 1, 4.0), (4, 5, 2.0**100)])
def test_dynamic_adjust_matches_mindspore(backend, factor, window, init):
    ours = DynamicLossScaler(init, factor, window, device="cpu", backend=backend)
    peer = MindSporeDynamicLossScaler(init, factor, window)
    for overflow in overflow_bursts(300, window, p_start=0.1):
        finite = torch.tensor(not overflow)
        assert ours.adjust(finite) is True and peer.adjust(finite)
        assert ours.scale_value.item() == peer.scale_value.item()
        assert ours.counter.item() == peer.counter.item()
    assert ours.scale_value.item() >= 1.0


def test_adjust_uploads_no_bool_and_reads_nothing(backend):
    """A bool flag is not uploaded (on CUDA an upload from a Python value synchronises)."""
    scaler = DynamicLossScaler(2.0**10, 2, 2, device="cpu", backend=backend)
    scaler.adjust(True)  # the first update ever uploads the policy's parameters once
    flags = (False, True, True, torch.tensor(True), torch.tensor([False]))
    with count_host_syncs() as syncs, count_uploads() as uploads:
        for finite in flags:
            scaler.adjust(finite)
    assert (syncs.count, uploads.count) == (0, 0)
    peer = MindSporeDynamicLossScaler(2.0**10, 2, 2)
    for finite in (True, False, True, True, True, False):
        peer.adjust(torch.tensor(finite))
    assert peer.scale_value.item() == scaler.scale_value.item() == 2.0**9


def test_bool_adjusts_on_the_triton_device_with_no_host_sync(triton_device):
    """The Triton backend on its device (a GPU in a GPU run, there under CUDA's sync debug
    mode "error"), from bools."""
    flags = overflow_bursts(40, 4, p_start=0.2)
    ours = DynamicLossScaler(2.0**10, 2, 3, device=triton_device, backend="triton")
    ours.adjust(True)  # the first launch compiles
    peer = MindSporeDynamicLossScaler(2.0**10, 2, 3)
    peer.adjust(torch.tensor(True))
    scales = []
    with sync_errors(triton_device):
        for overflow in flags:
            ours.adjust(not overflow)
            scales.append(ours.scale_value.clone())
    for step, overflow in enumerate(flags):
        peer.adjust(torch.tensor(not overflow))
        assert scales[step].item() == peer.scale_value.item(), step
    assert len({s.item() for s in scales}) > 2


def test_scale_unscale_and_all_finite(backend):
    scaler = StaticLossScaler(1024.0, device="cpu", backend=backend)
    x = torch.tensor([1.0, -3.0])
    assert torch.equal(scaler.scale(x), x * 1024)
    pair = (torch.tensor([2048.0], dtype=torch.half), torch.tensor([1024.0]))
    out = scaler.unscale(pair)
    assert isinstance(out, tuple) and out[0].dtype == torch.half
    assert out[0].item() == 2.0 and out[1].item() == 1.0 and pair[1].item() == 1024.0
    assert scaler.adjust(torch.tensor(False)) is False and scaler.scale_value.item() == 1024.0
    assert all_finite(x, backend=backend).item()
    big = StaticLossScaler(2.0**20, device="cpu", backend=backend)  # past float16's range
    tiny = torch.tensor([2.0**-20, 2.0**-24], dtype=torch.half)
    assert big.scale(tiny).tolist() == [1.0, 2.0**-4]  # the product in float32, then rounded
    assert not all_finite((x, torch.tensor([math.inf])), backend=backend).item()
    # a 0-d tensor is one input, not a sequence; no inputs: nothing to unscale
    assert not all_finite(torch.tensor(math.nan), backend=backend).item()
    assert all_finite(torch.tensor(1.0), backend=backend).item()
    assert scaler.unscale(torch.tensor(4096.0)).item() == 4.0
    assert scaler.unscale(()) == ()


def test_managers_configure_grad_scalers():
    fixed = FixedLossScaleManager(256.0, drop_overflow_update=False)
    assert (fixed.get_loss_scale(), fixed.get_drop_overflow_update()) == (256.0, False)
    manager = DynamicLossScaleManager(2.0**10, 2, 50)  # MindSpore's getters
    assert (manager.get_loss_scale(), manager.get_drop_overflow_update()) == (2.0**10, True)
    assert (manager.scale_factor, manager.scale_window) == (2, 50)
    scaler = fixed.get_grad_scaler("cpu")
    assert isinstance(scaler, GradScaler) and scaler.get_scale() == 256.0
    state = scaler.state_dict()
    assert state["dynamic"] is False and state["skip_on_overflow"] is False
    dynamic = DynamicLossScaleManager(2.0**10, 2, 50).get_grad_scaler("cpu")
    state = dynamic.state_dict()
    assert (state["growth_interval"], state["backoff_factor"], state["min_scale"]) == \
        (50, 0.5, 1.0)
    assert DynamicLossScaleManager().get_grad_scaler().state_dict()["scale"] == 2.0**24
    state = DynamicLossScaleManager(2.0**10, 4, 50).get_grad_scaler("cpu").state_dict()
    assert (state["growth_factor"], state["backoff_factor"]) == (4.0, 0.25)
    with pytest.raises(ValueError, match="loss_scale must be a finite number >= 1"):
        FixedLossScaleManager(0.5)


@pytest.mark.parametrize("drop", [True, False])
def test_drop_overflow_update(backend, drop):
    scaler = FixedLossScaleManager(8.0, drop_overflow_update=drop).get_grad_scaler(
        "cpu", backend=backend)
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler.scale(p.sum() * torch.tensor([1.0, math.inf]).sum()).backward()
    scaler.step(opt)
    scaler.update()
    assert torch.isfinite(p).all().item() == drop  # taken anyway when not dropping
    assert scaler.get_scale() == 8.0


@pytest.mark.parametrize("kwargs, match", [
    (dict(scale_factor=1), "scale_factor must be an int >= 2; got 1"),
    (dict(scale_factor=2.5), "scale_factor must be an int"),
    (dict(scale_window=0), "scale_window must be an int >= 1; got 0"),
])
def test_bad_arguments_name_mindspores_own_names(kwargs, match):
    args = dict(scale_factor=2, scale_window=10)
    args.update(kwargs)
    with pytest.raises((TypeError, ValueError), match=match):
        DynamicLossScaler(1024.0, device="cpu", **args)
    with pytest.raises((TypeError, ValueError), match=match):
        DynamicLossScaleManager(1024.0, **args)
