"""Bad input a coverage run of the suite found untested: tensors on different devices handed
to the public ops, a state_dict that is not one, scale settings misspelt or out of range, a
ShardedGradScaler with no group to agree over, a grad that is a view into another buffer under
GradBuckets, a parameter that is not a tensor, apex state of the wrong shape. Each raises
naming the argument, and changes nothing. No GPU: the "other device" is ``meta``, on which
nothing runs."""

import math
import re

import pytest
import torch

from triton_scaler import GradBuckets, GradScaler, ScalePolicy, ops, policy
from triton_scaler.compat.apex import Amp
from triton_scaler.sharded import NoDefaultGroupError, ShardedGradScaler


def _grads():
    return [torch.tensor([1.0, math.inf, 3.0]), torch.full((5,), 2.0)]


@pytest.mark.parametrize("op", [ops.non_finite_check_and_unscale_, ops.non_finite_check_])
def test_ops_name_an_inv_scale_on_another_device(backend, op):
    grads, found_inf = _grads(), torch.zeros(())
    with pytest.raises(ValueError, match="inv_scale is on meta but found_inf is on cpu"):
        op(grads, found_inf, torch.ones((), device="meta"), backend=backend)
    assert torch.equal(grads[0], _grads()[0]) and torch.equal(grads[1], _grads()[1])
    assert found_inf.item() == 0.0


@pytest.mark.parametrize("name", ["growth_tracker", "found_inf", "hysteresis_tracker"])
def test_update_scale_names_the_state_tensor_on_another_device(backend, name):
    state = {"scale": torch.full((), 1024.0), "growth_tracker": torch.zeros((), dtype=torch.int32),
             "found_inf": torch.ones(()), "hysteresis_tracker": torch.ones((), dtype=torch.int32)}
    state[name] = state[name].to("meta")
    with pytest.raises(ValueError, match=f"^{name} is on meta but scale is on cpu; scale, "
                                         "growth_tracker, found_inf and hysteresis_tracker"):
        ops.update_scale_(state["scale"], state["growth_tracker"], state["found_inf"], 2.0, 0.5,
                          10, hysteresis_tracker=state["hysteresis_tracker"], hysteresis=2,
                          backend=backend)
    assert state["scale"].item() == 1024.0


def test_load_state_dict_refuses_what_is_not_a_dict_and_an_empty_one_as_torch(backend):
    scaler = GradScaler("cpu", init_scale=64.0, backend=backend)
    with pytest.raises(TypeError, match="^state_dict must be a dict; got list$"):
        scaler.load_state_dict([("scale", 2.0)])
    with pytest.raises(RuntimeError) as ours:
        scaler.load_state_dict({})
    with pytest.raises(RuntimeError) as torchs:
        torch.amp.GradScaler("cpu").load_state_dict({})
    assert str(ours.value) == str(torchs.value)  # "... saved from a disabled instance ..."
    assert scaler.get_scale() == 64.0


@pytest.mark.parametrize("max_scale", [0.0, -1.0, -math.inf])
def test_max_scale_must_be_positive(max_scale):
    with pytest.raises(ValueError, match=r"^max_scale must be > 0 \(inf for no cap\); got "):
        GradScaler("cpu", max_scale=max_scale)


def test_a_misspelt_scale_setting_is_named_with_the_accepted_ones():
    with pytest.raises(TypeError, match=r"unknown scale settings \['growth_factr'\]; accepted: "
                                        r"\('growth_factor', 'backoff_factor'"):
        ScalePolicy.create({"growth_factr": 3.0})


def test_policies_of_many_settings_stay_right_and_their_cache_bounded(backend):
    """``ops.update_scale_`` keeps the validated settings of its recent calls (at most 257);
    past that the cache starts again, and every call still uses its own settings."""
    policy._policy_cache.clear()
    for interval in range(1, 301):
        scale, tracker = torch.full((), 8.0), torch.tensor(interval - 1, dtype=torch.int32)
        ops.update_scale_(scale, tracker, torch.zeros(()), 2.0, 0.5, interval, backend=backend)
        assert (scale.item(), tracker.item()) == (16.0, 0), interval  # grew at its own interval
        assert len(policy._policy_cache) <= 257
    assert len(policy._policy_cache) < 300


def test_sharded_scaler_without_a_group_raises_before_a_grad_changes(backend):
    assert not torch.distributed.is_initialized()
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = ShardedGradScaler("cpu", init_scale=8.0, backend=backend)
    scaler.scale(p.sum()).backward()
    for call in (scaler.unscale_, scaler.step):
        with pytest.raises(NoDefaultGroupError, match="call torch.distributed.init_process_group"):
            call(opt)
        assert torch.equal(p.grad, torch.full((3,), 8.0))  # still scaled: nothing unscaled
        assert torch.equal(p.detach(), torch.ones(3))
    with pytest.raises(ValueError):  # torch's ShardedGradScaler raises a ValueError there
        scaler.unscale_(opt)


def test_a_grad_viewing_another_buffer_is_refused_under_grad_buckets(backend):
    """A grad that is a view into a buffer other than its GradBucket's (DDP's
    ``gradient_as_bucket_view=True`` does this) would be unscaled outside the bucket's one
    launch: refused, naming the two ways out, before anything is unscaled."""
    p, q = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([p, q], lr=0.1)
    GradBuckets(opt)
    scaler = GradScaler("cpu", init_scale=8.0, backend=backend)
    scaler.scale(p.sum() + q.sum()).backward()
    other = torch.full((10,), 8.0)
    p.grad = other[2:5]
    with pytest.raises(RuntimeError, match="a gradient is a view into another buffer, not into "
                                           "its GradBucket.*gradient_as_bucket_view=False"):
        scaler.unscale_(opt)
    assert torch.equal(other, torch.full((10,), 8.0))
    assert torch.equal(q.grad, torch.full((4,), 8.0))


def test_grad_buckets_name_a_parameter_that_is_not_a_tensor_and_claim_none():
    p = torch.nn.Parameter(torch.ones(2))
    with pytest.raises(TypeError, match="^parameter 1 is a str, not a tensor$"):
        GradBuckets([p, "weight"])
    assert len(GradBuckets([p]).buckets) == 1  # the failed call left p unclaimed


def test_grad_buckets_refuse_a_tensor_subclass_parameter_and_claim_none():
    """A parameter of a tensor subclass (FSDP2's DTensor, FSDP1's FlatParameter: one
    process, this subclass stands for them) is refused by its index and type, with the way
    out (GradScaler without GradBuckets); the plain parameter before it stays unclaimed."""
    class ShardedParameter(torch.nn.Parameter):
        pass

    p = torch.nn.Parameter(torch.ones(2))
    expected = ("^parameter 1 is a ShardedParameter, not a plain tensor: GradBuckets needs "
                "plain dense parameters on one rank.*use GradScaler without GradBuckets there")
    with pytest.raises(TypeError, match=expected):
        GradBuckets([p, ShardedParameter(torch.ones(3))])
    assert len(GradBuckets([p]).buckets) == 1


def test_apex_load_state_dict_names_the_keys_it_needs(backend):
    amp = Amp(num_losses=2, backend=backend)
    before = amp.state_dict()
    expected = r"state_dict must have exactly the keys \['loss_scaler0', 'loss_scaler1'\] " \
               r"\(this Amp has 2 losses\); got "
    with pytest.raises(ValueError, match=expected + r"\['loss_scaler0'\]$"):
        amp.load_state_dict({"loss_scaler0": {"loss_scale": 2.0, "unskipped": 0}})
    with pytest.raises(ValueError, match=expected + r"\[1, 2\]$"):
        amp.load_state_dict([1, 2])
    with pytest.raises(ValueError, match=expected + r"None$"):
        amp.load_state_dict(None)
    assert amp.state_dict() == before


@pytest.mark.parametrize("loss_id", [-1, 2, True, 0.0, 1.5, "0"])
def test_apex_names_a_loss_id_out_of_range_or_not_an_int(backend, loss_id):
    """``loss_scale`` and ``scale_loss`` refuse a ``loss_id`` that is not an int in
    [0, num_losses): -1 does not read the last loss, a bool or a float is not an index."""
    amp = Amp(num_losses=2, backend=backend)
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.5)
    match = rf"^loss_id must be in \[0, 2\); got {re.escape(repr(loss_id))}$"
    with pytest.raises(ValueError, match=match):
        amp.loss_scale(loss_id)
    with pytest.raises(ValueError, match=match):
        with amp.scale_loss(p.sum(), opt, loss_id=loss_id):
            pass
    assert p.grad is None and "step" not in vars(opt)

