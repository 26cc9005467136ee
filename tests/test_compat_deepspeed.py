"""triton_scaler.compat.deepspeed against DeepSpeed's DynamicLossScaler rule."""

import io
import math
import pathlib
import subprocess
import sys

import pytest
import torch
from _peers import DeepSpeedDynamicLossScaler, overflow_bursts
from _util import assert_all_same, count_uploads, sync_errors

from triton_scaler import GradScaler
from triton_scaler.compat.deepspeed import CreateLossScaler, DynamicLossScaler, LossScaler
from triton_scaler.diagnostics import count_host_syncs


def _drive(ours, peer, flags, as_tensor):
    for overflow in flags:
        peer.update_scale(overflow)
        ours.update_scale(torch.tensor(overflow) if as_tensor else overflow)
        assert ours.loss_scale == peer.cur_scale
        assert ours.cur_hysteresis == peer.cur_hysteresis


@pytest.mark.parametrize("delayed_shift", [1, 2, 3])
@pytest.mark.parametrize("consecutive", [False, True])
@pytest.mark.parametrize("window", [2, 3, 7])
def test_trajectory_matches_deepspeed(backend, delayed_shift, consecutive, window):
    """(DeepSpeed's scale is a Python float; ours is fp32 and never grows past its max, so the
    sequences stay below 2**128.)"""
    args = (2.0**8, window, 4.0, delayed_shift, consecutive)
    ours = DynamicLossScaler(*args, raise_error_at_min_scale=False, device="cpu",
                             backend=backend)
    peer = DeepSpeedDynamicLossScaler(2.0**8, 2.0, window, 4.0, delayed_shift, consecutive,
                                      False)
    _drive(ours, peer, overflow_bursts(200, window * 10 + delayed_shift, p_start=0.1), window > 2)


def test_raises_at_min_scale_like_deepspeed(backend):
    ours = DynamicLossScaler(8.0, 100, 2.0, 1, False, device="cpu", backend=backend)
    peer = DeepSpeedDynamicLossScaler(8.0, 2.0, 100, 2.0, 1, False, True)
    _drive(ours, peer, [True, True], False)
    assert ours.loss_scale == 2.0
    with pytest.raises(Exception, match="already at minimum"):
        peer.update_scale(True)
    with pytest.raises(Exception, match="already at minimum"):
        ours.update_scale(True)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # the interpreter's numpy
def test_growth_stops_at_the_last_finite_scale(backend):
    """The difference that remains (docs/migrating.md): DeepSpeed's Python float grows past fp32's
    maximum; ours stays at the last finite scale, and the next overflow backs off from it."""
    ours = DynamicLossScaler(2.0**127, 1, 1.0, 1, False, raise_error_at_min_scale=False,
                             device="cpu", backend=backend)
    peer = DeepSpeedDynamicLossScaler(2.0**127, 2.0, 1, 1.0, 1, False, False)
    _drive(ours, peer, [False], False)  # (DeepSpeed's first clean step after none grows not)
    peer.update_scale(False)
    ours.update_scale(False)
    assert peer.cur_scale == 2.0**128 > torch.finfo(torch.float32).max
    assert ours.loss_scale == 2.0**127 and ours.cur_hysteresis == peer.cur_hysteresis
    peer.update_scale(True)
    ours.update_scale(True)
    assert peer.cur_scale == 2.0**127 and ours.loss_scale == 2.0**126


def _iterations_of(scaler):
    """``iteration(overflow)``: one training iteration under ``scaler``, overflowing or not."""
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)

    def iteration(overflow):
        opt.zero_grad()
        scaler.scale(p.sum() * (math.inf if overflow else 1.0)).backward()
        scaler.step(opt)
        scaler.update()
    return iteration


@pytest.mark.parametrize("delayed_shift", [1, 2, 3])
@pytest.mark.parametrize("consecutive", [False, True])
@pytest.mark.parametrize("through", ["compat", "GradScaler"])
def test_raises_at_min_scale_with_hysteresis_like_deepspeed(backend, delayed_shift, consecutive,
                                                            through):
    """With hysteresis DeepSpeed raises only at an overflow that would back off (its counter
    at 1), not at every overflow at the minimum: the compat scaler's ``update_scale`` and
    ``GradScaler(raise_at_min_scale=True)``'s ``update()`` raise at the same step."""
    for seed in range(4):
        flags = overflow_bursts(60, seed, p_start=0.3)
        peer = DeepSpeedDynamicLossScaler(2.0**3, 2.0, 1000, 1.0, delayed_shift, consecutive,
                                          True)
        if through == "compat":
            ours = DynamicLossScaler(2.0**3, 1000, 1.0, delayed_shift, consecutive,
                                     device="cpu", backend=backend)
            update = ours.update_scale
        else:
            ours = GradScaler("cpu", init_scale=2.0**3, growth_interval=1000, min_scale=1.0,
                              hysteresis=delayed_shift, consecutive_hysteresis=consecutive,
                              raise_at_min_scale=True, backend=backend)
            update = _iterations_of(ours)
        raised = []
        for step, overflow in enumerate(flags):
            for scaler, call in ((peer, peer.update_scale), (ours, update)):
                try:
                    call(overflow)
                except Exception as error:  # noqa: BLE001 - DeepSpeed raises Exception
                    assert "already at minimum" in str(error)
                    raised.append((step, scaler is ours))
            if raised:
                break
        assert raised == [(raised[0][0], False), (raised[0][0], True)], (seed, raised)
        assert sum(flags[:raised[0][0] + 1]) >= 3 + delayed_shift - 1  # not at the first


def test_has_overflow_backward_and_hooks(backend):
    scaler = DynamicLossScaler(2.0**4, 10, 1.0, 1, False, device="cpu", backend=backend)
    p = torch.nn.Parameter(torch.ones(3))
    scaler.backward((p * 2).sum())
    assert torch.equal(p.grad, torch.full((3,), 32.0))
    flag = scaler.has_overflow([p])
    assert flag.dtype == torch.bool and flag.shape == () and not flag.item()
    unused = torch.nn.Parameter(torch.ones(2))  # grad None: skipped, as DeepSpeed's check
    assert not scaler.has_overflow([unused, p]).item()
    p.grad[1] = math.nan
    assert scaler.has_overflow([p]).item() and scaler.has_overflow([p, unused]).item()
    sparse = torch.nn.Parameter(torch.ones(5))  # a sparse grad: its values are checked
    sparse.grad = torch.sparse_coo_tensor([[1, 3]], [1.0, 2.0], (5,), check_invariants=True)
    assert not scaler.has_overflow([sparse]).item()
    sparse.grad = torch.sparse_coo_tensor([[1, 3]], [1.0, math.inf], (5,),
                                          check_invariants=True)
    assert scaler.has_overflow([sparse]).item()
    grads = scaler.scale_gradient(None, (torch.ones(2, dtype=torch.half), None), None)
    assert grads[0].dtype == torch.half and grads[0].tolist() == [16.0, 16.0] and grads[1] is None
    assert scaler.scale_loss(torch.tensor(2.0)).item() == 32.0


def test_static_scaler_and_factory():
    static = LossScaler(128.0, device="cpu")
    static.update_scale(True)
    assert static.loss_scale == 128.0 and not static.dynamic
    args = dict(init_scale=2.0**16, scale_window=1000, delayed_shift=2,
                consecutive_hysteresis=False, min_scale=1.0)
    dynamic = CreateLossScaler(torch.half, 1.0, True, args, device="cpu")
    assert isinstance(dynamic, DynamicLossScaler) and dynamic.loss_scale == 2.0**16
    for dtype in (torch.bfloat16, torch.float32):
        scaler = CreateLossScaler(dtype, 64.0, True, args, device="cpu")
        assert type(scaler) is LossScaler and scaler.loss_scale == 1.0
    assert CreateLossScaler(torch.half, 64.0, False, None, device="cpu").loss_scale == 64.0
    with pytest.raises(ValueError, match="Dynamic loss scaling parameters must be defined"):
        CreateLossScaler(torch.half, 1.0, True, None)
    with pytest.raises(ValueError, match="scale must be a finite number > 0"):
        LossScaler(0.0)


def test_against_the_real_deepspeed_when_installed(monkeypatch):
    loss_scaler = pytest.importorskip("deepspeed.runtime.fp16.loss_scaler")
    monkeypatch.setattr(loss_scaler.dist, "get_rank", lambda: 0)
    for delayed_shift, consecutive in ((1, False), (2, False), (3, True)):
        peer = loss_scaler.DynamicLossScaler(2.0**16, 4, 1.0, delayed_shift, consecutive,
                                             raise_error_at_min_scale=False)
        ours = DynamicLossScaler(2.0**16, 4, 1.0, delayed_shift, consecutive,
                                 raise_error_at_min_scale=False, device="cpu")
        _drive(ours, peer, overflow_bursts(150, delayed_shift), False)
        peer.cur_scale = ours.cur_scale = 2.0**5  # as ZeRO's loss_scale setter does
        _drive(ours, peer, overflow_bursts(50, delayed_shift), False)


def test_cur_scale_is_settable_as_deepspeeds_zero_optimizers_set_it(backend):
    """ZeRO's ``optimizer.loss_scale = v`` writes ``loss_scaler.cur_scale``: the device scale
    is filled (no host read) and the trajectory goes on as DeepSpeed's from that value."""
    ours = DynamicLossScaler(2.0**8, 3, 1.0, 2, False, raise_error_at_min_scale=False,
                             device="cpu", backend=backend)
    peer = DeepSpeedDynamicLossScaler(2.0**8, 2.0, 3, 1.0, 2, False, False)
    flags = overflow_bursts(80, 3, p_start=0.15)
    _drive(ours, peer, flags[:40], True)
    with count_host_syncs() as syncs:
        ours.cur_scale = 48.0
    assert syncs.count == 0
    peer.cur_scale = 48.0
    _drive(ours, peer, flags[40:], True)
    static = LossScaler(4.0, device="cpu")
    static.cur_scale = 2**10
    assert static.loss_scale == 1024.0
    for bad, error in ((0.0, ValueError), (math.inf, ValueError), ("8", TypeError)):
        with pytest.raises(error, match="cur_scale must be a"):
            ours.cur_scale = bad
    assert ours.loss_scale == peer.cur_scale  # unchanged by the refused values


def test_host_reads_and_uploads_per_update(backend):
    """A bool flag (as DeepSpeed's optimizers pass it) is not uploaded; a clean step given as
    False reads nothing; ``loss_scale`` reads the device once after an update, and not at
    all after the setter; a possible backoff reads once (the minimum-scale check)."""
    scaler = DynamicLossScaler(2.0**6, 2, 1.0, 2, False, device="cpu", backend=backend)
    scaler.update_scale(False)  # the first update ever uploads the policy's parameters once
    with count_host_syncs() as syncs, count_uploads() as uploads:
        scaler.update_scale(False)
    assert (syncs.count, uploads.count) == (0, 0)
    with count_host_syncs() as syncs:
        reads = [scaler.loss_scale, scaler.cur_scale, scaler.loss_scale]
    assert syncs.count == 1 and reads == [64.0] * 3
    scaler.update_scale(False)  # DeepSpeed's first growth: the window's third clean step
    with count_host_syncs() as syncs, count_uploads() as uploads:
        assert scaler.loss_scale == 128.0
        scaler.update_scale(True)
    assert (syncs.count, uploads.count) == (2, 0)
    scaler.cur_scale = 3.3  # held as float32
    with count_host_syncs() as syncs:
        read = scaler.loss_scale
    assert syncs.count == 0 and read == torch.tensor(3.3).item() == scaler._scale.item()


def test_bool_updates_on_the_triton_device_with_no_host_sync(triton_device):
    """The Triton backend on its device (a GPU in a GPU run, there under CUDA's sync debug
    mode "error"): updates from bools, as DeepSpeed's optimizers give them."""
    flags = overflow_bursts(40, 2, p_start=0.2)
    ours = DynamicLossScaler(2.0**8, 3, 1.0, 2, False, raise_error_at_min_scale=False,
                             device=triton_device, backend="triton")
    ours.update_scale(False)  # the first launch compiles
    peer = DeepSpeedDynamicLossScaler(2.0**8, 2.0, 3, 1.0, 2, False, False)
    peer.update_scale(False)
    scales = []
    with sync_errors(triton_device):
        for overflow in flags:
            ours.update_scale(overflow)
            scales.append(ours._scale.clone())
    for step, overflow in enumerate(flags):
        peer.update_scale(overflow)
        assert scales[step].item() == peer.cur_scale, step
    assert len({s.item() for s in scales}) > 2


def test_a_saved_scaler_object_goes_on_as_the_original(backend):
    """ZeRO's checkpoints hold the loss scaler object itself (torch.save of the object)."""
    scaler = DynamicLossScaler(2.0**6, 2, 1.0, 2, False, device="cpu", backend=backend)
    for overflow in (True, False, True):
        scaler.update_scale(overflow)
    buffer = io.BytesIO()
    torch.save({"loss_scaler": scaler}, buffer)
    buffer.seek(0)
    restored = torch.load(buffer, weights_only=False)["loss_scaler"]
    for overflow in overflow_bursts(40, 2, p_start=0.2):
        scaler.update_scale(overflow)
        restored.update_scale(overflow)
        assert (restored.loss_scale, restored.cur_hysteresis) == \
            (scaler.loss_scale, scaler.cur_hysteresis)


def _engine_run(stage, scaler, folder):
    folder.mkdir()
    script = pathlib.Path(__file__).with_name("_deepspeed_engine.py")
    subprocess.run([sys.executable, str(script), str(folder), str(stage), scaler], check=True,
                   timeout=300, capture_output=True)
    return torch.load(folder / "result.pt", weights_only=False)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_in_the_real_deepspeed_zero_engine_when_installed(backend, stage, tmp_path):
    """DeepSpeed's own ZeRO engine (CPU accelerator) with this adapter in place of its loss
    scaler: the same scales and parameters, through overflows, ZeRO's ``loss_scale`` setter
    and a checkpoint saved and loaded into a new engine (which restores the scaler object),
    with at most one host read a step more than DeepSpeed's own scaler."""
    pytest.importorskip("deepspeed.runtime.fp16.loss_scaler")
    theirs = _engine_run(stage, "deepspeed", tmp_path / "deepspeed")
    ours = _engine_run(stage, backend, tmp_path / backend)
    assert theirs["scaler_types"] == ["deepspeed.runtime.fp16.loss_scaler"]
    assert ours["scaler_types"] == ["triton_scaler.compat.deepspeed"]
    assert ours["scales"] == theirs["scales"] and len(set(theirs["scales"])) > 3
    assert_all_same(ours["params"], theirs["params"])
    # DeepSpeed's optimizers read loss_scale several times a step: the device once (after the
    # update), not at each read (then 7 more reads a step than with DeepSpeed's own scaler)
    assert all(o <= t + 1 for o, t in zip(ours["syncs"], theirs["syncs"], strict=True)), \
        (ours["syncs"], theirs["syncs"])


@pytest.mark.parametrize("kwargs, match", [
    (dict(scale_window=0), "scale_window must be an int >= 1; got 0"),
    (dict(delayed_shift=0), "delayed_shift must be an int >= 1; got 0"),
    (dict(min_scale=-1.0), r"min_scale must be finite and >= 0"),
    (dict(min_scale=2.0**20), r"init_scale must lie in \[min_scale, max_scale\]"),
])
def test_bad_arguments_name_deepspeeds_own_names(kwargs, match):
    args = dict(init_scale=2.0**16, scale_window=1000, min_scale=1.0, delayed_shift=1,
                consecutive_hysteresis=False)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        DynamicLossScaler(**args, device="cpu")
