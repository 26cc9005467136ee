"""triton_scaler.compat.megatron against Megatron-core's DynamicGradScaler rule (transcribed in
_peers.py, and the real class when megatron-core is installed)."""

import math

import pytest
import torch
from _peers import MegatronDynamicGradScaler, overflow_bursts
from _util import count_uploads, sync_errors

from triton_scaler import ops
from triton_scaler.compat.megatron import (
    ConstantGradScaler,
    DynamicGradScaler,
    MegatronGradScaler,
)
from triton_scaler.diagnostics import count_host_syncs
from triton_scaler.policy import ScalerArgumentError

#: (growth_factor, backoff_factor, min_scale, growth_interval, hysteresis): Megatron's
#: defaults, then factors and floors float32 does not hold exactly.
SETTINGS = [(2.0, 0.5, 1.0, 4, 2), (1.5, 0.3, 0.1, 3, 2), (3.0, 0.7, 3.3, 2, 1),
            (1.1, 0.9, 7.0, 1, 3)]


def _same_state(ours, peer):
    assert torch.equal(ours.scale, peer._scale)  # the float32 bits
    assert ours._growth_tracker.item() == peer._growth_tracker
    assert ours._hysteresis_tracker.item() == peer._hysteresis_tracker


def _follow(ours, peer, flags, as_tensor):
    for step, overflow in enumerate(flags):
        peer.update(overflow)
        ours.update(torch.tensor([float(overflow)]) if as_tensor(step) else overflow)
        assert torch.isfinite(peer._scale).all()  # below Megatron's growth to inf
        _same_state(ours, peer)


@pytest.mark.parametrize("growth, backoff, min_scale, interval, hysteresis", SETTINGS)
def test_update_matches_megatron_bit_for_bit(backend, growth, backoff, min_scale, interval,
                                             hysteresis):
    """Bools and found_inf tensors alternate. (With the factors not rounded to float32
    first, the (1.1, 0.9) row differs from Megatron's at step 14 of seeds 2 and 3.)"""
    for seed in range(4):
        args = (1000.0, min_scale, growth, backoff, interval, hysteresis)
        ours = DynamicGradScaler(*args, device="cpu", backend=backend)
        _follow(ours, MegatronDynamicGradScaler(*args),
                overflow_bursts(300, seed, p_start=0.2), lambda step: step % 2 == 1)


def test_against_the_real_megatron_core_when_installed(backend):
    grad_scaler = pytest.importorskip("megatron.core.optimizer.grad_scaler")
    real_tensor = torch.tensor
    for growth, backoff, min_scale, interval, hysteresis in SETTINGS:
        args = (1000.0, min_scale, growth, backoff, interval, hysteresis)
        with pytest.MonkeyPatch.context() as patch:  # megatron-core hard-codes device="cuda"
            patch.setattr(torch, "tensor", lambda *a, device=None, **k: real_tensor(*a, **k))
            peer = grad_scaler.DynamicGradScaler(*args)
        ours = DynamicGradScaler(*args, device="cpu", backend=backend)
        _follow(ours, peer, overflow_bursts(300, hysteresis, p_start=0.2), lambda step: True)
        state = ours.state_dict()
        assert state.keys() == peer.state_dict().keys()
        assert torch.equal(state["scale"], peer.state_dict()["scale"])


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # the interpreter's numpy
def test_growth_stops_at_the_last_finite_scale(backend):
    """The one difference: Megatron's scale grows to inf (and then stays there)."""
    big = float(torch.finfo(torch.float32).max) / 1.5
    ours = DynamicGradScaler(big, 1.0, 2.0, 0.5, 1, 1, device="cpu", backend=backend)
    peer = MegatronDynamicGradScaler(big, 1.0, 2.0, 0.5, 1, 1)
    ours.update(False)
    peer.update(False)
    assert peer._scale.item() == math.inf
    assert ours.scale.item() == torch.tensor(big).item() and ours._growth_tracker.item() == 0
    peer.update(True)
    ours.update(True)
    assert peer._scale.item() == math.inf and ours.scale.item() == torch.tensor(big / 2).item()


def test_a_megatron_style_training_loop_is_bit_identical(backend):
    """Megatron's prepare_grads: loss * scale, backward, torch's unscale op with
    ``inv_scale`` into found_inf, ``update``; the step only without overflow. Ours passes
    the found_inf tensor itself and unscales with triton_scaler's op."""
    results = []
    for ours in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(9, 13), torch.nn.Tanh(),
                                    torch.nn.Linear(13, 3))
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        args = (2.0**10, 1.0, 1.5, 0.3, 3, 2)
        scaler = DynamicGradScaler(*args, device="cpu", backend=backend) if ours \
            else MegatronDynamicGradScaler(*args)
        found_inf = torch.zeros(1)
        scales, steps = [], 0
        for overflow in overflow_bursts(40, 5, p_start=0.2):
            opt.zero_grad()
            x = torch.randn(5, 9)
            loss = model(x).square().mean() * (math.inf if overflow else 1.0)
            scale = scaler.scale if ours else scaler._scale
            (loss * scale).backward()
            grads = [p.grad for p in model.parameters()]
            found_inf.fill_(0.0)
            inv_scale = scaler.inv_scale if ours else scale.double().reciprocal().float()
            if ours:
                ops.non_finite_check_and_unscale_(grads, found_inf, inv_scale, backend=backend)
                scaler.update(found_inf)
            else:
                torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
                scaler.update(found_inf.item() > 0)
            if found_inf.item() == 0:
                opt.step()
                steps += 1
            scales.append((scaler.scale if ours else scaler._scale).clone())
        results.append((scales, steps, [p.detach().clone() for p in model.parameters()]))
    (scales, steps, params), (our_scales, our_steps, our_params) = results
    assert all(torch.equal(a, b) for a, b in zip(our_scales, scales, strict=True))
    assert our_steps == steps < 40 and len({s.item() for s in scales}) > 2
    assert all(torch.equal(a, b) for a, b in zip(our_params, params, strict=True))


def test_update_reads_nothing_on_the_host_and_uploads_no_bool(backend):
    """A tensor flag is not read; a bool flag (Megatron's) is not uploaded (on CUDA an
    upload from a Python value synchronises)."""
    scaler = DynamicGradScaler(2.0**10, 1.0, 2.0, 0.5, 2, 2, device="cpu", backend=backend)
    flags = (torch.zeros(1), torch.ones(1), torch.tensor(True), torch.zeros(()))
    scaler.update(False)
    scaler.update(True)  # the first update ever uploads the policy's parameters once
    scaler.load_state_dict({"scale": torch.tensor([2.0**10]), "growth_tracker": 0,
                            "hysteresis_tracker": 2})
    with count_host_syncs() as syncs, count_uploads() as uploads:
        for flag in flags:
            scaler.update(flag)
        scaler.update(False)
        _ = scaler.inv_scale
    assert (syncs.count, uploads.count) == (0, 0)
    # backed off at the second overflow (hysteresis 2), grown back after two clean steps
    assert scaler.scale.item() == 2.0**10 and scaler._hysteresis_tracker.item() == 2


def test_on_the_triton_device_with_no_host_sync(triton_device):
    """The Triton backend on its device (a GPU in a GPU run, there under CUDA's sync debug
    mode "error"): bool and tensor flags, the scales compared with Megatron's at the end."""
    args = (1000.0, 0.1, 1.5, 0.3, 3, 2)
    ours = DynamicGradScaler(*args, device=triton_device, backend="triton")
    peer = MegatronDynamicGradScaler(*args)
    found = torch.zeros(1, device=triton_device)
    ours.update(found)  # the first launch compiles
    peer.update(False)
    flags = overflow_bursts(60, 1, p_start=0.2)
    scales = []
    with sync_errors(triton_device):
        for step, overflow in enumerate(flags):
            found.fill_(float(overflow))
            ours.update(found if step % 2 else overflow)
            scales.append(ours.scale.clone())
    for step, overflow in enumerate(flags):
        peer.update(overflow)
        assert torch.equal(scales[step].cpu(), peer._scale), step
    assert len({s.item() for s in scales}) > 2


def test_interface_and_attributes():
    scaler = DynamicGradScaler(2.0**12, 0.1, 1.5, 0.3, 7, 3, device="cpu")
    assert scaler.scale.shape == (1,) and scaler.scale.dtype == torch.float32
    assert torch.equal(scaler.inv_scale, torch.tensor([2.0**-12]))
    for name, value in (("min_scale", 0.1), ("growth_factor", 1.5), ("backoff_factor", 0.3)):
        attribute = getattr(scaler, name)  # one-element float32 tensors, as Megatron's
        assert torch.equal(attribute, torch.tensor([value], dtype=torch.float32))
        with pytest.raises(AttributeError):
            setattr(scaler, name, attribute)
    assert (scaler.growth_interval, scaler.hysteresis) == (7, 3)
    with pytest.raises(TypeError, match="found_inf must be a bool or a one-element float"):
        scaler.update(1)
    with pytest.raises(TypeError, match="found_inf must be a bool or a one-element float"):
        scaler.update(torch.zeros(2))
    constant = ConstantGradScaler(2.0**8, device="cpu")
    constant.update(True)
    constant.load_state_dict({"scale": torch.tensor([4.0]), "growth_tracker": 1,
                              "hysteresis_tracker": 1})  # ignored, as Megatron's
    assert constant.scale.item() == 2.0**8 and constant.state_dict() == {}
    with pytest.raises(TypeError, match="found_inf must be"):
        constant.update("yes")


def test_state_dict_round_trip_with_megatrons_format(backend):
    scaler = DynamicGradScaler(2.0**10, 1.0, 2.0, 0.5, 3, 3, device="cpu", backend=backend)
    for overflow in (True, False, False):
        scaler.update(overflow)
    state = scaler.state_dict()
    assert state == {"scale": state["scale"], "growth_tracker": 2, "hysteresis_tracker": 2}
    assert type(state["growth_tracker"]) is int and type(state["hysteresis_tracker"]) is int
    assert torch.equal(state["scale"], torch.tensor([2.0**10]))
    scaler.update(True)
    scaler.update(True)  # backs off: the saved scale is a copy, unchanged
    assert state["scale"].item() == 2.0**10 and scaler.scale.item() == 2.0**9
    scaler.load_state_dict(state)
    assert scaler.state_dict()["scale"].item() == 2.0**10
    assert scaler._growth_tracker.item() == 2 and scaler._hysteresis_tracker.item() == 2
    megatron = {"scale": torch.tensor([64.0]), "growth_tracker": torch.tensor(1),
                "hysteresis_tracker": -4, "extra": None}  # a tracker may be a tensor
    scaler.load_state_dict(megatron)
    assert (scaler.scale.item(), scaler._growth_tracker.item(),
            scaler._hysteresis_tracker.item()) == (64.0, 1, -4)


@pytest.mark.parametrize("change, error, match", [
    (dict(scale=None), KeyError, r"lacks \['scale'\]"),
    (dict(scale=[2.0]), TypeError, r"state_dict\['scale'\] must be a one-element float"),
    (dict(scale=torch.tensor([math.inf])), ValueError, r"state_dict\['scale'\] must be a finite"),
    (dict(scale=torch.tensor([0.0])), ValueError, r"state_dict\['scale'\] must be a finite"),
    (dict(growth_tracker=1.0), TypeError, r"state_dict\['growth_tracker'\] must be an int"),
    (dict(growth_tracker=-1), ValueError, r"state_dict\['growth_tracker'\] must be"),
    (dict(hysteresis_tracker=3), ValueError, r"hysteresis_tracker'\] must be an int <= "
                                             r"hysteresis \(2\)"),
])
def test_bad_state_dicts_are_refused_and_change_nothing(change, error, match):
    scaler = DynamicGradScaler(2.0**10, 1.0, 2.0, 0.5, 3, 2, device="cpu")
    scaler.update(True)
    state = {"scale": torch.tensor([8.0]), "growth_tracker": 1, "hysteresis_tracker": 1}
    state.update(change)
    state = {k: v for k, v in state.items() if v is not None}
    before = scaler.state_dict()
    with pytest.raises(error, match=match):
        scaler.load_state_dict(state)
    after = scaler.state_dict()
    assert torch.equal(after.pop("scale"), before.pop("scale")) and after == before


@pytest.mark.parametrize("args, error, match", [
    ((0.0, 1.0, 2.0, 0.5, 1, 1), ScalerArgumentError, "initial_scale must be a finite number"),
    ((8.0, 0.0, 2.0, 0.5, 1, 1), ScalerArgumentError, "min_scale must be > 0; got 0.0"),
    ((8.0, 16.0, 2.0, 0.5, 1, 1), ScalerArgumentError, "min_scale must be <= initial_scale"),
    ((8.0, 1.0, 1.0, 0.5, 1, 1), ScalerArgumentError, "growth factor must be > 1.0"),
    ((8.0, 1.0, 1e39, 0.5, 1, 1), ScalerArgumentError,
     r"growth_factor must be finite in float32 \(Megatron holds it in a float32 tensor\); "
     r"got 1e\+39"),
    ((8.0, 1.0, math.inf, 0.5, 1, 1), ScalerArgumentError,
     "growth_factor must be finite and > 1; got inf"),
    ((8.0, 1.0, 2.0, 1.0, 1, 1), ScalerArgumentError, "backoff factor must be < 1.0"),
    ((8.0, 1.0, 2.0, 0.0, 1, 1), ScalerArgumentError, "backoff_factor must be in"),
    ((8.0, 1.0, 2.0, 0.5, 0, 1), ScalerArgumentError, "growth_interval must be an int >= 1"),
    ((8.0, 1.0, 2.0, 0.5, 1, 0), ScalerArgumentError, "hysteresis must be an int >= 1"),
    ((8.0, 1.0, 2.0, 0.5, 1.5, 1), TypeError, "growth_interval must be an int"),
    ((8.0, "1", 2.0, 0.5, 1, 1), TypeError, "min_scale must be a real number"),
])
def test_bad_arguments_name_the_argument(args, error, match):
    """Where Megatron asserts, the error is also an AssertionError."""
    with pytest.raises(error, match=match) as raised:
        DynamicGradScaler(*args, device="cpu")
    assert isinstance(raised.value, AssertionError) == (error is ScalerArgumentError)
    with pytest.raises(ValueError, match="backend"):
        DynamicGradScaler(8.0, 1.0, 2.0, 0.5, 1, 1, device="cpu", backend="cuda")
    with pytest.raises(AssertionError, match="initial_scale must be a finite number"):
        ConstantGradScaler(-1.0, device="cpu")
    DynamicGradScaler(0.1, 0.1, 2.0, 0.5, 1, 1, device="cpu")  # equal, as given: accepted
    with pytest.raises(TypeError, match="abstract"):
        MegatronGradScaler(8.0, device="cpu")  # as Megatron's
