"""The slips a user coming from ``torch.nn.utils`` or torch's scaler makes first get errors
that say what to pass: the model or its ``parameters()`` where the optimizer goes, an
``unscale_`` after ``clip_grad_norm_``, a CUDA scaler without CUDA; and what torch's scaler
loads (a 0-d tensor scale) loads here too."""

import re
import warnings

import pytest
import torch

from triton_scaler import GradBuckets, GradScaler


def _model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _backward(scaler, model):
    scaler.scale(model(torch.randn(2, 4)).sum()).backward()


@pytest.mark.parametrize("call", ["unscale_", "step", "clip_grad_norm_"])
@pytest.mark.parametrize("slip", ["parameters", "list", "model"])
def test_the_model_or_its_parameters_instead_of_the_optimizer(backend, call, slip):
    model, opt = _model_and_optimizer()
    scaler = GradScaler("cpu", backend=backend)
    _backward(scaler, model)
    passed = {"parameters": model.parameters(), "list": list(model.parameters()),
              "model": model}[slip]
    args = (passed, 1.0) if call == "clip_grad_norm_" else (passed,)
    expected = "not the model" if slip == "model" else r"not model\.parameters\(\)"
    with pytest.raises(TypeError, match=rf"^{call}\(\) takes the optimizer .*: pass the "
                                        rf"optimizer, {expected}"):
        getattr(scaler, call)(*args)
    scaler.step(opt)  # nothing was recorded: the iteration goes on as usual
    scaler.update()


def test_a_disabled_scaler_refuses_the_model_too():
    model, _ = _model_and_optimizer()
    with pytest.raises(TypeError, match=r"^step\(\) takes the optimizer .*not the model"):
        GradScaler("cpu", enabled=False).step(model)


def test_gradbuckets_of_a_model_says_to_pass_the_optimizer():
    model, opt = _model_and_optimizer()
    with pytest.raises(TypeError, match=r"GradBuckets takes an optimizer .*not a model: pass "
                                        r"the optimizer, e\.g\. GradBuckets\(optimizer\); got "
                                        r"a Linear"):
        GradBuckets(model)
    GradBuckets(opt)  # the optimizer itself is taken


@pytest.mark.parametrize("first", ["clip_grad_norm_", "unscale_"])
def test_unscale_after_clip_says_that_clip_unscales(backend, first):
    """torch's words for a second unscale, and, after ``clip_grad_norm_``, that the clip is
    this iteration's unscale (after ``unscale_``, torch's words alone)."""
    model, opt = _model_and_optimizer()
    scaler = GradScaler("cpu", backend=backend)
    _backward(scaler, model)
    if first == "clip_grad_norm_":
        scaler.clip_grad_norm_(opt, 1.0)
    else:
        scaler.unscale_(opt)
    torch_words = "unscale_() has already been called on this optimizer since the last update()."
    with pytest.raises(RuntimeError, match=re.escape(torch_words)) as error:
        scaler.unscale_(opt)
    hint = "clip_grad_norm_() unscales the grads"
    assert (hint in str(error.value)) == (first == "clip_grad_norm_")
    scaler.step(opt)
    scaler.update()
    _backward(scaler, model)  # the next iteration starts afresh
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError) as error:
        scaler.clip_grad_norm_(opt, 1.0)
    assert hint not in str(error.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_cuda_scaler_without_cuda_names_this_class_and_is_off():
    with pytest.warns(UserWarning, match=r"^triton_scaler\.GradScaler\('cuda'\) is enabled, "
                                         r"but CUDA is not available: the scaler is disabled"):
        scaler = GradScaler("cuda")
    assert not scaler.is_enabled()
    loss = torch.ones(())
    assert scaler.scale(loss) is loss
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        GradScaler("cuda", enabled=False)  # said so: no warning


@pytest.mark.parametrize("key", ["scale", "_growth_tracker"])
def test_a_checkpoint_with_a_0d_tensor_loads_as_in_torch(backend, key):
    saved = GradScaler("cpu").state_dict()
    saved[key] = torch.tensor(saved[key] * 2 if key == "scale" else 3)
    ours, torchs = GradScaler("cpu", backend=backend), torch.amp.GradScaler("cpu")
    for scaler in (ours, torchs):
        scaler._lazy_init_scale_growth_tracker(torch.device("cpu"))
        scaler.load_state_dict(dict(saved))
    assert ours.get_scale() == torchs.get_scale()
    assert ours._get_growth_tracker() == torchs._get_growth_tracker()
    ours_saved = ours.state_dict()
    assert all(ours_saved[k] == v for k, v in torchs.state_dict().items())


def test_a_scale_out_of_float32s_range_says_so_readably():
    with pytest.raises(ValueError, match=r"float32's normal range \(about 1\.2e-38 to 3\.4e38"):
        GradScaler("cpu", init_scale=1e39)
