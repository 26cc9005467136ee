"""Bad input, third file: the peers' adapters (apex, DeepSpeed, MindSpore) check their
arguments at construction and apex's ``load_state_dict`` before it changes anything, each
error naming the peer's own argument or key and its accepted values."""

import math
import re

import pytest
import torch

from triton_scaler.compat import apex, deepspeed, mindspore


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(scale_window=0), ValueError, "scale_window must be an int >= 1"),
    (dict(min_loss_scale=-1.0), ValueError, "min_loss_scale must be finite and >= 0"),
    (dict(max_loss_scale="x"), TypeError, "max_loss_scale must be a real number"),
    (dict(init_scale=math.nan), ValueError, "init_scale must be a finite number"),
    (dict(loss_scale="static"), ValueError, "loss_scale must be 'dynamic' or a number"),
    (dict(loss_scale=0.0), ValueError, "loss_scale must be a finite number > 0"),
    (dict(num_losses=0), ValueError, "num_losses must be an int >= 1"),
    (dict(backend="gpu"), ValueError, "backend must be one of"),
    (dict(init_scale=0.125, min_loss_scale=0.25), ValueError,  # apex's names for the bounds
     re.escape("init_scale must lie in [min_loss_scale, max_loss_scale] = [0.25, 16777216.0]")),
    (dict(min_loss_scale=8.0, max_loss_scale=4.0), ValueError,
     "min_loss_scale must be <= max_loss_scale"),
])
def test_apex_checks_its_arguments_at_construction(kwargs, error, match):
    with pytest.raises(error, match=match):
        apex.Amp(**kwargs)


def test_apex_load_state_dict_validates_before_changing(backend):
    amp = apex.Amp(backend=backend, num_losses=2)
    good = amp.state_dict()
    for bad, match in (({"loss_scaler0": {"loss_scale": "x", "unskipped": 0}}, "must be a real"),
                       ({"loss_scaler0": {"loss_scale": 8.0, "unskipped": -1}}, "unskipped"),
                       ({"loss_scaler0": {"loss_scale": 2.0**30, "unskipped": 0}},
                        r"must lie in \[min_loss_scale, max_loss_scale\]"),
                       ({"loss_scaler0": {"loss_scale": 8.0}}, "'loss_scale' and 'unskipped'"),
                       ({"loss_scaler0": 5}, r"state_dict\['loss_scaler0'\] must be a dict"),
                       ({"loss_scaler0": ["loss_scale", "unskipped"]},
                        r"state_dict\['loss_scaler0'\] must be a dict")):
        with pytest.raises((TypeError, ValueError), match=match):
            amp.load_state_dict({**good, **bad})
        assert amp.state_dict() == good


def test_apex_load_state_dict_takes_exactly_its_losses_entries():
    amp = apex.Amp(num_losses=2)
    good = amp.state_dict()
    expected = re.escape("state_dict must have exactly the keys ['loss_scaler0', "
                         "'loss_scaler1'] (this Amp has 2 losses); got ")
    for bad in ({"loss_scaler0": good["loss_scaler0"]},  # a loss missing
                {**good, "loss_scaler2": good["loss_scaler0"]},  # one too many
                list(good.items()), None):
        with pytest.raises(ValueError, match=expected):
            amp.load_state_dict(bad)
        assert amp.state_dict() == good


@pytest.mark.parametrize("loss_id", [2, -1, True, "0", 1.0])
def test_apex_loss_id_is_an_int_below_num_losses(loss_id):
    amp = apex.Amp(num_losses=2)
    message = re.escape(f"loss_id must be in [0, 2); got {loss_id!r}")
    with pytest.raises(ValueError, match=message):
        amp.loss_scale(loss_id)
    with pytest.raises(ValueError, match=message):
        with amp.scale_loss(torch.ones(()), [], loss_id=loss_id):
            pass


@pytest.mark.parametrize("build, error, match", [
    (lambda: mindspore.StaticLossScaler("2"), TypeError, "scale_value must be a real number"),
    (lambda: mindspore.StaticLossScaler(True), TypeError, "scale_value must be a real number"),
    (lambda: mindspore.DynamicLossScaleManager("x"), TypeError, "init_loss_scale must be a real"),
    (lambda: mindspore.DynamicLossScaleManager(2.0**24, scale_window=0), ValueError,
     "scale_window must be an int >= 1"),
    (lambda: mindspore.FixedLossScaleManager(128.0, drop_overflow_update="no"), TypeError,
     "drop_overflow_update must be a bool"),
    (lambda: mindspore.FixedLossScaleManager(0.5), ValueError, "loss_scale must be a finite"),
    (lambda: deepspeed.DynamicLossScaler(init_scale=0), ValueError,
     "init_scale must be a finite number > 0"),
    (lambda: deepspeed.LossScaler("abc"), TypeError, "scale must be a real number"),
    (lambda: deepspeed.LossScaler(2**200), ValueError, "scale must be a finite number > 0"),
    (lambda: deepspeed.DynamicLossScaler(raise_error_at_min_scale=1), TypeError,
     "raise_error_at_min_scale must be a bool"),
    (lambda: deepspeed.LossScaler(backend="gpu"), ValueError, "backend must be one of"),
    (lambda: deepspeed.DynamicLossScaler(backend="gpu"), ValueError, "backend must be one of"),
    (lambda: mindspore.StaticLossScaler(2.0, backend="gpu"), ValueError,
     "backend must be one of"),
    (lambda: mindspore.DynamicLossScaler(2.0, 2, 5, backend="gpu"), ValueError,
     "backend must be one of"),
])
def test_peer_adapters_check_early_with_their_own_names(build, error, match):
    with pytest.raises(error, match=match):
        build()
