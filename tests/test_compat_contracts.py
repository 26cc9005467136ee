"""What the peers' classes (DeepSpeed, Megatron, MindSpore) expose beyond their update rule:
the defaults of the peers' signatures, the attributes their callers read, and the refusal of
each malformed flag or state entry with a ``TypeError`` naming it (the constructors' argument
checks are in ``test_bad_input_peers.py``). Each test here kills
mutants of ``triton_scaler/compat`` that the rule's own tests leave alive."""

import re

import pytest
import torch

from triton_scaler.compat import deepspeed, megatron, mindspore


def test_deepspeed_defaults_and_attributes_are_deepspeeds():
    """``deepspeed.runtime.fp16.loss_scaler``'s defaults and the attributes its optimizers
    read (``dynamic``, ``scale_window``, ``min_scale``, ``delayed_shift``, ...)."""
    static = deepspeed.LossScaler()
    assert static.dynamic is False and static.loss_scale == 1.0
    dynamic = deepspeed.DynamicLossScaler()
    assert dynamic.dynamic is True and dynamic.loss_scale == 2.0**32
    assert (dynamic.scale_window, dynamic.min_scale, dynamic.delayed_shift) == (1000, 1.0, 1)
    assert dynamic.consecutive_hysteresis is False and dynamic.raise_error_at_min_scale is True
    assert dynamic.dtype is torch.half and dynamic.cur_hysteresis == 1
    custom = deepspeed.DynamicLossScaler(init_scale=8.0, scale_window=7, min_scale=2.0,
                                         delayed_shift=3, consecutive_hysteresis=True,
                                         dtype=torch.bfloat16)
    assert (custom.scale_window, custom.min_scale, custom.delayed_shift) == (7, 2.0, 3)
    assert custom.consecutive_hysteresis is True and custom.dtype is torch.bfloat16


def test_deepspeed_backward_frees_the_graph_unless_asked_to_retain_it():
    """``backward(loss, retain_graph=False)``, as DeepSpeed's: a second backward through the
    same graph fails unless the first retained it."""
    scaler = deepspeed.LossScaler(4.0)
    p = torch.nn.Parameter(torch.ones(2))
    loss = (p * p).sum()
    scaler.backward(loss, retain_graph=True)
    scaler.backward(loss)
    assert torch.equal(p.grad, torch.full((2,), 16.0))  # 2 * p * 4, twice
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        loss.backward()


def test_megatron_state_dict_keeps_the_two_trackers_apart(backend):
    """``growth_tracker`` and ``hysteresis_tracker`` are read from their own trackers: after
    two clean steps of a hysteresis-3 scaler, 2 and 3; after an overflow, 0 and 2."""
    scaler = megatron.DynamicGradScaler(8.0, 1.0, 2.0, 0.5, 10, 3, backend=backend)
    for _ in range(2):
        scaler.update(False)
    state = scaler.state_dict()
    assert (state["growth_tracker"], state["hysteresis_tracker"]) == (2, 3)
    scaler.update(torch.ones(1))
    state = scaler.state_dict()
    assert (state["growth_tracker"], state["hysteresis_tracker"]) == (0, 2)
    # hysteresis: no backoff yet (the scale on CUDA where there is one, as Megatron's)
    assert torch.equal(state["scale"].cpu(), torch.tensor([8.0]))


@pytest.mark.parametrize("key, value, match", [
    ("growth_tracker", torch.tensor([2, 3]), "state_dict['growth_tracker'] must be an int"),
    ("growth_tracker", torch.tensor([3.0]), "state_dict['growth_tracker'] must be an int"),
    ("hysteresis_tracker", torch.tensor([True]),
     "state_dict['hysteresis_tracker'] must be an int"),
    ("scale", torch.tensor([2.0, 4.0]), "state_dict['scale'] must be a one-element float"),
    ("scale", torch.tensor([8]), "state_dict['scale'] must be a one-element float"),
])
def test_megatron_load_state_dict_names_a_tracker_or_scale_tensor_of_the_wrong_kind(
        backend, key, value, match):
    """A one-element integer tensor is taken as its int (a checkpoint may hold either); two
    elements, a float or a bool tracker, a two-element or integer scale are refused."""
    scaler = megatron.DynamicGradScaler(8.0, 1.0, 2.0, 0.5, 10, 3, backend=backend)
    good = scaler.state_dict()
    with pytest.raises(TypeError, match=re.escape(match)):
        scaler.load_state_dict({**good, key: value})
    assert scaler.state_dict()["growth_tracker"] == 0
    scaler.load_state_dict({**good, "growth_tracker": torch.tensor([4], dtype=torch.int64)})
    assert scaler.state_dict()["growth_tracker"] == 4


@pytest.mark.parametrize("state", [None, [1], "scale"])
def test_megatron_scalers_name_a_state_dict_that_is_not_a_mapping(backend, state):
    for scaler in (megatron.ConstantGradScaler(4.0),
                   megatron.DynamicGradScaler(8.0, 1.0, 2.0, 0.5, 10, 3, backend=backend)):
        with pytest.raises(TypeError, match=f"^state_dict must be a dict; got "
                                            f"{type(state).__name__}$"):
            scaler.load_state_dict(state)


@pytest.mark.parametrize("flag", [torch.zeros(2), torch.zeros((1, 2)), 1, None,
                                  torch.ones(1, dtype=torch.int32)])
def test_megatron_update_names_a_flag_that_is_not_one_float_or_bool_element(backend, flag):
    for scaler in (megatron.ConstantGradScaler(4.0),
                   megatron.DynamicGradScaler(8.0, 1.0, 2.0, 0.5, 10, 3, backend=backend)):
        with pytest.raises(TypeError, match="^found_inf must be a bool or a one-element"):
            scaler.update(flag)


@pytest.mark.parametrize("flag", [1, None, torch.ones(()), torch.tensor([True, True]),
                                  torch.ones((), dtype=torch.int32)])
def test_mindspore_adjust_names_a_flag_that_is_not_one_bool(backend, flag):
    scaler = mindspore.DynamicLossScaler(8.0, 2, 10, backend=backend)
    with pytest.raises(TypeError, match="^grads_finite must be a bool or a one-element bool"):
        scaler.adjust(flag)
    assert scaler.scale_value.item() == 8.0 and scaler.counter.item() == 0


def test_mindspore_defaults_and_attributes_are_mindspores(backend):
    """MindSpore's managers' defaults (128 and dropping overflow updates; 2**24, factor 2,
    window 2000), a fixed scale of exactly 1 accepted, and the scalers' attributes."""
    fixed = mindspore.FixedLossScaleManager()
    assert fixed.get_loss_scale() == 128.0 and fixed.get_drop_overflow_update() is True
    assert mindspore.FixedLossScaleManager(1.0).get_loss_scale() == 1.0
    manager = mindspore.DynamicLossScaleManager()
    assert manager.get_loss_scale() == 2.0**24
    assert (manager.scale_factor, manager.scale_window) == (2, 2000)
    scaler = mindspore.DynamicLossScaler(8.0, 4, 3, backend=backend)
    assert (scaler.scale_factor, scaler.scale_window) == (4, 3)


def test_mindspore_unscale_of_one_tensor_or_a_one_tuple(backend):
    """``unscale`` of a lone tensor gives a tensor, of a 1-tuple a 1-tuple; inputs untouched."""
    scaler = mindspore.StaticLossScaler(4.0, backend=backend)
    x = torch.full((3,), 8.0)
    assert torch.equal(scaler.unscale(x), torch.full((3,), 2.0))
    (y,) = scaler.unscale((x,))
    assert torch.equal(y, torch.full((3,), 2.0)) and torch.equal(x, torch.full((3,), 8.0))
