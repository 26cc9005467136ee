"""GradScaler's contract: errors, arguments, state_dict both ways, pickling, skip signal."""

import copy
import math
import pickle

import pytest
import torch
from _loops import train
from _util import assert_all_same

import triton_scaler
from triton_scaler import GradScaler, MinScaleReachedError, ScalePolicy, ScalerArgumentError


def _setup(scaler, dtype=torch.float32, fused=False):
    p = torch.nn.Parameter(torch.ones(4, dtype=dtype))
    opt = torch.optim.SGD([p], lr=0.1, fused=fused)
    scaler.scale((p.float() * 2).sum()).backward()
    return p, opt


def _overflow_step(scaler, p, opt, overflow):
    opt.zero_grad()
    loss = (p * 2).sum() * (math.inf if overflow else 1.0)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()


@pytest.mark.parametrize("first, second, match", [
    ("unscale_", "unscale_", r"unscale_\(\) has already been called on this optimizer since"),
    ("step", "unscale_", r"unscale_\(\) is being called after step\(\)"),
    ("step", "step", r"step\(\) has already been called since the last update\(\)"),
])
@pytest.mark.parametrize("fused", [False, True])  # (the fused route steps on its own path)
def test_misuse_errors_match_torch(backend, first, second, match, fused):
    for scaler in (torch.amp.GradScaler("cpu"), GradScaler("cpu", backend=backend)):
        p, opt = _setup(scaler, fused=fused)
        getattr(scaler, first)(opt)
        with pytest.raises(RuntimeError, match=match):
            getattr(scaler, second)(opt)


def test_closure_and_fp16_and_missing_scale(backend):
    scaler = GradScaler("cpu", backend=backend)
    p, opt = _setup(scaler)
    with pytest.raises(RuntimeError, match="Closure use is not currently supported"):
        scaler.step(opt, closure=lambda: 0)
    p16, opt16 = _setup(scaler := GradScaler("cpu", backend=backend), torch.float16)
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients."):
        scaler.unscale_(opt16)
    with pytest.raises(AssertionError, match="Attempted update but _scale is None"):
        GradScaler("cpu", backend=backend).update()
    for name in ("unscale_", "step", "_check_inf_per_device"):  # grads, but scale() not called
        with pytest.raises(AssertionError, match=f"Attempted {name} but _scale is None"):
            getattr(GradScaler("cpu", backend=backend), name)(opt)
    with pytest.raises(AssertionError, match="No inf checks were recorded prior to update."):
        s = GradScaler("cpu", backend=backend)
        s.scale(torch.ones(()))
        s.update()


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(growth_factor=1.0), AssertionError, "The growth factor must be > 1.0"),
    (dict(growth_factor=0.5), ValueError, "The growth factor must be > 1.0"),
    (dict(backoff_factor=1.5), AssertionError, "The backoff factor must be < 1.0"),
    (dict(backoff_factor=0.0), ValueError, r"backoff_factor must be in \(0, 1\)"),
    (dict(init_scale=0.0), ValueError, "init_scale must be a finite number > 0"),
    (dict(init_scale=math.inf), ValueError, "init_scale must be a finite number > 0"),
    (dict(init_scale=math.nan), ValueError, "init_scale must be a finite number > 0"),
    (dict(growth_interval=0), ValueError, "growth_interval must be an int >= 1"),
    (dict(growth_interval=2.5), TypeError, "growth_interval must be an int"),
    (dict(hysteresis=0), ValueError, "hysteresis must be an int >= 1"),
    (dict(min_scale=-1.0), ValueError, "min_scale must be finite and >= 0"),
    (dict(min_scale=8.0, max_scale=4.0), ValueError, "min_scale must be <= max_scale"),
    (dict(init_scale=1.0, min_scale=2.0), ValueError, r"init_scale must lie in \[min_scale"),
    (dict(backend="cuda"), ValueError, "backend must be one of 'auto', 'reference', 'triton'"),
    (dict(dynamic="no"), TypeError, "dynamic must be a bool"),
])
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        GradScaler("cpu", **kwargs)


def test_torch_rejects_the_same_values_with_the_same_type():
    for kwargs in (dict(growth_factor=1.0), dict(backoff_factor=1.0)):
        with pytest.raises(AssertionError):
            torch.amp.GradScaler("cpu", **kwargs)
        with pytest.raises(ScalerArgumentError):
            GradScaler("cpu", **kwargs)


def test_setters_validate_and_reach_the_device(backend):
    scaler = GradScaler("cpu", init_scale=1.0, growth_interval=1, backend=backend)
    p, opt = _setup(scaler)
    with pytest.raises(ValueError, match="growth_factor must be finite and > 1"):
        scaler.set_growth_factor(0.5)
    assert scaler.get_growth_factor() == 2.0
    scaler.set_growth_factor(3.0)
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 3.0
    # torch's getters and state_dict read the attributes the setters change, as torch's
    scaler.set_backoff_factor(0.25)
    scaler.set_growth_interval(7)
    settings = (scaler.get_growth_factor(), scaler.get_backoff_factor(),
                scaler.get_growth_interval())
    assert settings == (3.0, 0.25, 7)
    assert tuple(scaler.state_dict()[k] for k in ("growth_factor", "backoff_factor",
                                                  "growth_interval")) == settings
    scaler._growth_interval = 5  # torch's attribute, assigned as torch's __init__ does
    assert scaler.policy.growth_interval == scaler.get_growth_interval() == 5


def test_set_factors_float32_cannot_carry_update_as_torchs(backend):
    """1.1 and 0.3, set mid-run, reach the update in float64 (the policy's float64 buffer,
    filled in place), as torch's op takes them: the same scale bits as torch's scaler."""
    scales = []
    for scaler in (torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1),
                   GradScaler("cpu", init_scale=2.0**10, growth_interval=1, backend=backend)):
        p, opt = _setup(scaler)
        scaler.step(opt)
        scaler.update()
        scaler.set_growth_factor(1.1)
        scaler.set_backoff_factor(0.3)
        for overflow in (False, True, False, False, True):
            _overflow_step(scaler, p, opt, overflow)
            scales.append(scaler._scale.clone())
    theirs, ours = scales[:5], scales[5:]
    assert_all_same(ours, theirs)
    assert len({s.item() for s in theirs}) == 5


def test_disabled_is_a_pass_through(backend):
    scaler = GradScaler("cpu", enabled=False, backend=backend)
    loss = torch.ones(())
    assert scaler.scale(loss) is loss
    outputs = iter([loss])  # anything, unchecked and unconsumed, as torch's
    assert scaler.scale(outputs) is outputs and next(outputs) is loss
    assert scaler.scale("not a tensor") == "not a tensor"
    assert scaler.state_dict() == {} and scaler.get_scale() == 1.0
    torch.amp.GradScaler("cpu", enabled=False).load_state_dict({})  # a no-op, as here:
    scaler.load_state_dict({})
    assert not scaler.last_step_skipped.item()
    p, opt = _setup(scaler)
    scaler.unscale_(opt)  # a no-op, as torch's
    assert torch.equal(p.grad, torch.full((4,), 2.0))
    scaler.step(opt)
    scaler.update()
    assert scaler.skipped_steps == 0


def test_torch_state_dict_loads_into_ours_and_back(backend):
    expected_traj, *_ = train(torch.amp.GradScaler("cpu", growth_interval=3), steps=20)
    theirs = torch.amp.GradScaler("cpu", growth_interval=3)
    first, *_ = train(theirs, steps=10)
    ours = GradScaler("cpu", growth_interval=3, backend=backend)
    ours.load_state_dict(theirs.state_dict())
    assert ours.get_scale() == theirs.get_scale()
    again = torch.amp.GradScaler("cpu")
    again.load_state_dict(ours.state_dict())
    assert again.state_dict() == theirs.state_dict()
    assert ours.state_dict()["hysteresis"] == 1 and ours.state_dict()["skipped_steps"] == 0
    # torch's dict has no extension keys: this scaler keeps its own settings (docstring)
    kept = GradScaler("cpu", hysteresis=3, min_scale=1.0, skip_on_overflow=False,
                      backend=backend)
    kept.load_state_dict(theirs.state_dict())
    assert kept.policy == ScalePolicy(growth_interval=3, hysteresis=3, min_scale=1.0,
                                      skip_on_overflow=False)


def test_extension_state_survives_a_checkpoint(backend):
    scaler = GradScaler("cpu", init_scale=2.0**8, hysteresis=3, min_scale=4.0, max_scale=2.0**9,
                        consecutive_hysteresis=True, growth_interval=2, backend=backend)
    p, opt = _setup(scaler)
    scaler.step(opt)
    scaler.update()
    for overflow in (True, True, False, True):
        _overflow_step(scaler, p, opt, overflow)
    state = scaler.state_dict()
    assert state["skipped_steps"] == 3 and state["_hysteresis_tracker"] == 2
    restored = GradScaler("cpu", backend=backend)
    restored.load_state_dict(state)
    assert restored.state_dict() == state
    clone = pickle.loads(pickle.dumps(scaler))
    assert clone.state_dict() == state
    # as torch's, the pickle holds values, no tensors (a CUDA scaler's loads without the GPU)
    held = [(k, v) for k, v in scaler.__getstate__().items()
            if isinstance(v, torch.Tensor) or (isinstance(v, list) and v)]
    assert held == []
    copied = copy.deepcopy(scaler)
    assert copied.state_dict() == state
    for s in (scaler, restored, clone, copied):  # copies update their own state tensors
        p2, opt2 = _setup(s)
        s.step(opt2)
        s.update()
    assert restored.state_dict() == clone.state_dict() == copied.state_dict() == \
        scaler.state_dict()


def test_pickling_mid_iteration_is_refused_as_torch():
    scaler = GradScaler("cpu")
    p, opt = _setup(scaler)
    scaler.unscale_(opt)
    with pytest.raises(AssertionError, match="may only be pickled at the beginning"):
        pickle.dumps(scaler)


def test_skip_signal(backend):
    scaler = GradScaler("cpu", backend=backend)
    assert scaler.last_step_skipped.dtype == torch.bool  # before the first step: False
    assert not scaler.last_step_skipped.item()
    p, opt = _setup(scaler)
    assert scaler.last_step_skipped.dtype == torch.bool
    scaler.step(opt)
    scaler.update()
    assert not scaler.last_step_skipped.item()
    before = p.detach().clone()
    _overflow_step(scaler, p, opt, True)
    assert scaler.last_step_skipped.item() and scaler.skipped_steps == 1
    assert torch.equal(p.detach(), before)
    _overflow_step(scaler, p, opt, False)
    assert not scaler.last_step_skipped.item() and scaler.skipped_steps == 1


def test_found_inf_is_the_flag_step_reads_and_zero_without_grads(backend):
    """found_inf(opt): the agreed flag after unscale_ (1.0 at a planted inf, 0.0 clean), zero
    for an optimizer whose parameters got no gradient (its step and update then pass), and a
    RuntimeError before unscale_."""
    scaler = GradScaler("cpu", backend=backend)
    p = torch.nn.Parameter(torch.ones(5))
    frozen = torch.optim.SGD([torch.nn.Parameter(torch.ones(3))], lr=0.1)
    opt = torch.optim.SGD([p], lr=0.1)
    for planted, expected in ((math.inf, 1.0), (1.0, 0.0)):
        with pytest.raises(RuntimeError, match="unscale_"):
            scaler.found_inf(opt)
        scaler.scale((p * torch.tensor([1.0, 1, 1, 1, planted])).sum()).backward()
        scaler.unscale_(opt)
        scaler.unscale_(frozen)
        assert torch.equal(scaler.found_inf(opt), torch.tensor(expected))
        assert torch.equal(scaler.found_inf(frozen), torch.tensor(0.0))
        before = p.detach().clone()
        scaler.step(opt)
        scaler.step(frozen)
        scaler.update()
        assert torch.equal(p.detach(), before) == (expected == 1.0)
        opt.zero_grad()


def test_static_scale_skips_but_never_changes(backend):
    scaler = GradScaler("cpu", init_scale=128.0, growth_interval=1, dynamic=False,
                        backend=backend)
    p, opt = _setup(scaler)
    scaler.step(opt)
    scaler.update()
    for overflow in (True, False, False, True):
        before = p.detach().clone()
        _overflow_step(scaler, p, opt, overflow)
        assert torch.equal(p.detach(), before) == overflow
    assert scaler.get_scale() == 128.0 and scaler.skipped_steps == 2


def test_raise_at_min_scale(backend):
    scaler = GradScaler("cpu", init_scale=4.0, min_scale=2.0, raise_at_min_scale=True,
                        backend=backend)
    p, opt = _setup(scaler)
    scaler.step(opt)
    scaler.update()
    _overflow_step(scaler, p, opt, True)
    assert scaler.get_scale() == 2.0
    with pytest.raises(MinScaleReachedError, match="already at minimum"):
        _overflow_step(scaler, p, opt, True)


def test_hysteresis_through_the_scaler(backend):
    scaler = GradScaler("cpu", init_scale=64.0, hysteresis=2, backend=backend)
    p, opt = _setup(scaler)
    scaler.step(opt)
    scaler.update()
    scales = []
    for overflow in (True, True, True, False, True):
        _overflow_step(scaler, p, opt, overflow)
        scales.append(scaler.get_scale())
    assert scales == [64.0, 32.0, 16.0, 16.0, 8.0]  # refilled only on growth (Megatron)


def test_sparse_grads(backend):
    emb = torch.nn.Embedding(10, 3, sparse=True)
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    results = []
    for scaler in (torch.amp.GradScaler("cpu"), GradScaler("cpu", backend=backend)):
        emb.weight.data.fill_(1.0)
        opt.zero_grad()
        scaler.scale(emb(torch.tensor([1, 2, 2])).sum()).backward()
        scaler.step(opt)
        scaler.update()
        results.append(emb.weight.detach().clone())
    assert torch.equal(*results)


def test_lazy_init_for_accelerate():
    """torch's ``_lazy_init_scale_growth_tracker`` (which Accelerate calls) makes the whole
    state: the scale, ``_get_scale_async`` returning it, and an iteration that runs on it."""
    scaler = GradScaler("cpu", hysteresis=2)
    scaler._lazy_init_scale_growth_tracker(torch.device("cpu"))
    assert scaler._scale.item() == 2.0**16
    assert scaler._get_scale_async() is scaler._scale
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler.scale(p.sum() * math.inf).backward()
    scaler.step(opt)
    scaler.update()  # one overflow, hysteresis 2: the scale holds
    assert scaler.get_scale() == 2.0**16 and scaler.state_dict()["_hysteresis_tracker"] == 1


def test_import_does_not_import_triton():
    import subprocess
    import sys

    code = "import triton_scaler, sys; assert 'triton' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
    assert triton_scaler.__version__


def test_a_checkpoint_loaded_mid_run_sets_the_hysteresis_tracker_in_place(backend):
    """Loaded into a scaler that has already stepped (its device state exists), the saved
    tracker is the one the next overflow decrements: saved at 1, that overflow backs off."""
    saver = GradScaler("cpu", init_scale=64.0, hysteresis=3, backend=backend)
    p, opt = _setup(saver)
    for overflow in (False, True, True):  # the tracker: 3, 2, 1
        _overflow_step(saver, p, opt, overflow)
    state = saver.state_dict()
    assert state["_hysteresis_tracker"] == 1 and state["scale"] == 64.0
    scaler = GradScaler("cpu", init_scale=64.0, hysteresis=3, backend=backend)
    p, opt = _setup(scaler)
    _overflow_step(scaler, p, opt, False)  # its tracker stays 3
    scaler.load_state_dict(state)
    _overflow_step(scaler, p, opt, True)
    assert scaler.get_scale() == 32.0 and scaler.state_dict()["_hysteresis_tracker"] == 0
    # torch's dict has no tracker: this scaler's is kept (here 1 again), not refilled
    scaler.load_state_dict(state)
    scaler.load_state_dict(torch.amp.GradScaler("cpu", init_scale=16.0).state_dict())
    _overflow_step(scaler, p, opt, True)
    assert scaler.get_scale() == 8.0


def test_without_hysteresis_the_saved_tracker_stays_1(backend):
    """hysteresis=1 (torch's rule): overflows back off at once and no tracker is counted
    down; the state_dict's ``_hysteresis_tracker`` stays 1."""
    scaler = GradScaler("cpu", init_scale=64.0, backend=backend)
    p, opt = _setup(scaler)
    for overflow in (True, True, False, True):
        _overflow_step(scaler, p, opt, overflow)
    state = scaler.state_dict()
    assert (state["scale"], state["_hysteresis_tracker"], state["skipped_steps"]) == (8.0, 1, 3)


def test_state_dict_keys_are_torchs_plus_the_extensions():
    from triton_scaler._state import EXTENSION_KEYS

    ours = GradScaler("cpu").state_dict()
    theirs = torch.amp.GradScaler("cpu").state_dict()
    assert list(ours) == list(theirs) + list(EXTENSION_KEYS)
