"""Bad input, second file: the scale settings themselves (:class:`ScalePolicy`, built
directly or by the scaler): numpy scalars taken as numbers, every value validated and
normalised, each accepted range inclusive of its ends, the per-step policy cache."""

import dataclasses
import math

import numpy as np
import pytest
import torch

from triton_scaler import GradScaler, ScalePolicy
from triton_scaler.policy import cached_policy


def test_numpy_scalars_are_numbers():
    scaler = GradScaler("cpu", init_scale=np.float32(1024.0), growth_factor=np.float64(2.0),
                        backoff_factor=np.float32(0.5), growth_interval=np.int64(10),
                        hysteresis=np.int32(2))
    assert scaler.policy == ScalePolicy(growth_interval=10, hysteresis=2)
    assert type(scaler.get_growth_interval()) is int


def test_a_policy_built_directly_is_validated_and_normalised(monkeypatch):
    """``ScalePolicy(...)`` (public) checks and normalises its values as the scaler does;
    ``cached_policy`` (``ops.update_scale_``'s per-step path) validates settings once."""
    from triton_scaler import policy as policy_module

    for cache in ("_policy_cache", "_params_cache"):  # none near its bound from other tests
        monkeypatch.setattr(policy_module, cache, {})
    with pytest.raises(ValueError, match="The growth factor must be > 1.0"):
        ScalePolicy(growth_factor=0.5)
    with pytest.raises(TypeError, match="hysteresis must be an int"):
        ScalePolicy(hysteresis=2.0)
    policy = ScalePolicy(growth_interval=np.int64(10), min_scale=1, max_scale=np.float32(2.0**20))
    with pytest.raises(dataclasses.FrozenInstanceError):  # a change builds a new one
        policy.growth_factor = 0.5
    assert policy == ScalePolicy(growth_interval=10, min_scale=1.0, max_scale=2.0**20)
    assert type(policy.growth_interval) is int
    assert type(policy.min_scale) is float and type(policy.max_scale) is float
    first = cached_policy(growth_interval=7, hysteresis=2)
    assert cached_policy(growth_interval=5) is not first
    assert cached_policy(hysteresis=2, growth_interval=7) is first
    # the kernel's parameter buffer: made once per device and values (no copy per call)
    params = first.kernel_params("cpu")
    assert params.dtype == torch.float64 and params.tolist() == [2.0, 0.5, 7.0, 0.0, math.inf,
                                                                 2.0]
    assert ScalePolicy(growth_interval=7, hysteresis=2).kernel_params(torch.device("cpu")) \
        is params
    assert first.replace(hysteresis=3).kernel_params("cpu") is not params
    assert first.kernel_params("cpu") is params  # kept beside another policy's
    # the defaults are torch's GradScaler's
    theirs = torch.amp.GradScaler("cpu")
    assert (ScalePolicy().growth_factor, ScalePolicy().backoff_factor,
            ScalePolicy().growth_interval) == (theirs.get_growth_factor(),
                                               theirs.get_backoff_factor(),
                                               theirs.get_growth_interval())


def test_every_bound_is_inclusive():
    """The accepted ranges include their ends: a scale of float32's smallest normal or
    largest value, min_scale == max_scale, an int32 hysteresis tracker at either end."""
    tiny, big = float(torch.finfo(torch.float32).tiny), float(torch.finfo(torch.float32).max)
    for scale in (tiny, big):
        assert GradScaler("cpu", init_scale=scale).get_scale() == scale
    assert ScalePolicy(min_scale=4.0, max_scale=4.0).min_scale == 4.0
    assert GradScaler("cpu", init_scale=4.0, min_scale=4.0, max_scale=4.0).get_scale() == 4.0
    assert ScalePolicy(min_scale=big).min_scale == big
    assert ScalePolicy(backoff_factor=tiny).backoff_factor == tiny
    assert ScalePolicy(max_scale=tiny).max_scale == tiny  # any cap > 0
    scaler = GradScaler("cpu", hysteresis=3)
    state = scaler.state_dict()
    for tracker in (-(2**31), 3):
        scaler.load_state_dict({**state, "_hysteresis_tracker": tracker})
        assert scaler.state_dict()["_hysteresis_tracker"] == tracker
    with pytest.raises(ValueError, match=r"_hysteresis_tracker'\] must be an int <= hysteresis"):
        scaler.load_state_dict({**state, "_hysteresis_tracker": -(2**31) - 1})


@pytest.mark.parametrize("value, name", [([2.0], "growth_factor"), ({"x": 1}, "backoff_factor"),
                                         ([10], "growth_interval"), ({0.5}, "min_scale")])
def test_an_unhashable_setting_of_update_scale_is_named(backend, value, name):
    """``ops.update_scale_``'s per-step policy cache is keyed by the settings: an unhashable
    one (a list, a dict, a set) gets the same error naming the argument as any other bad
    type, not Python's "unhashable type", and nothing changes."""
    from triton_scaler import ops

    scale, tracker, found = torch.full((), 8.0), torch.zeros((), dtype=torch.int32), torch.ones(())
    settings = dict(growth_factor=2.0, backoff_factor=0.5, growth_interval=10)
    with pytest.raises(TypeError, match=f"{name} must be a"):
        ops.update_scale_(scale, tracker, found, **{**settings, name: value}, backend=backend)
    assert scale.item() == 8.0 and tracker.item() == 0


def test_the_settings_caches_stay_bounded():
    """Per-step callers with ever-new settings (a schedule of growth intervals) do not grow
    the policy cache or the kernel parameter cache without bound."""
    from triton_scaler import policy as policy_module

    for interval in range(1, 400):
        cached_policy(growth_interval=interval).kernel_params("cpu")
    assert len(policy_module._policy_cache) <= 257
    assert len(policy_module._params_cache) <= 65
