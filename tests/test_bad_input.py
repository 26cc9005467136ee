"""Bad input gets a clear error naming the argument (or state_dict key)
and its accepted values, and changes nothing. Both backends where a backend is involved."""

import copy
import io
import math
import re
import warnings

import pytest
import torch

from triton_scaler import GradBuckets, GradScaler, MinScaleReachedError, ScalePolicy, ops


def _trained(backend, **kwargs):
    scaler = GradScaler("cpu", init_scale=2.0**10, growth_interval=3, backend=backend, **kwargs)
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    for overflow in (False, True, False):
        scaler.scale(p.sum() * (math.inf if overflow else 1.0)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return scaler, p, opt


# ------------------------------------------------------------ load_state_dict
BAD_STATE = [
    ("growth_factor", 0.5, ValueError, r"state_dict\['growth_factor'\]"),
    ("backoff_factor", 2.0, ValueError, r"state_dict\['backoff_factor'\]"),
    ("growth_interval", 0, ValueError, r"state_dict\['growth_interval'\] must be an int >= 1"),
    ("hysteresis", 0, ValueError, r"state_dict\['hysteresis'\] must be an int >= 1"),
    ("min_scale", -1.0, ValueError, r"state_dict\['min_scale'\] must be finite and >= 0"),
    ("min_scale", 1e9, ValueError, r"state_dict\['scale'\] must lie in \[min_scale, max_scale"),
    ("max_scale", 2.0, ValueError, r"state_dict\['scale'\] must lie in \[min_scale, max_scale"),
    ("scale", "abc", TypeError, r"state_dict\['scale'\] must be a real number"),
    ("scale", math.nan, ValueError, r"state_dict\['scale'\] must be a finite number > 0"),
    ("scale", 0.0, ValueError, r"state_dict\['scale'\] must be a finite number > 0"),
    ("scale", math.inf, ValueError, r"state_dict\['scale'\] must be a finite number > 0"),
    ("scale", -1.0, ValueError, r"state_dict\['scale'\] must be a finite number > 0"),
    ("_growth_tracker", -3, ValueError, r"state_dict\['_growth_tracker'\] must be an int in"),
    ("_growth_tracker", 1.5, TypeError, r"state_dict\['_growth_tracker'\] must be an int"),
    ("dynamic", "no", TypeError, r"state_dict\['dynamic'\] must be a bool"),
    ("_hysteresis_tracker", "x", TypeError, r"state_dict\['_hysteresis_tracker'\] must be an int"),
    ("_hysteresis_tracker", 5, ValueError, r"state_dict\['_hysteresis_tracker'\] must be an int <="),
    ("skipped_steps", -1, ValueError, r"state_dict\['skipped_steps'\]"),
    ("skipped_steps", 2**63, ValueError,
     r"state_dict\['skipped_steps'\] must be an int in \[0, 9223372036854775807\]; got"),
    ("_growth_tracker", 2**31, ValueError,
     r"state_dict\['_growth_tracker'\] must be an int in \[0, 2147483647\]; got"),
    ("growth_interval", True, TypeError, r"state_dict\['growth_interval'\] must be an int; got bool"),
    ("hysteresis", False, TypeError, r"state_dict\['hysteresis'\] must be an int; got bool"),
]


@pytest.mark.parametrize("key, value, error, match", BAD_STATE)
def test_load_state_dict_validates_every_key_before_changing_anything(backend, key, value,
                                                                      error, match):
    source, *_ = _trained(backend)
    state = source.state_dict()
    state.update({"growth_factor": 3.0, "backoff_factor": 0.25, "growth_interval": 7,
                  "hysteresis": 2, "min_scale": 1.0, key: value})  # good changes + one bad
    scaler, p, opt = _trained(backend)
    before = scaler.state_dict()
    with pytest.raises(error, match=match):
        scaler.load_state_dict(state)
    assert scaler.state_dict() == before
    assert scaler.get_growth_factor() == 2.0 and scaler.policy == ScalePolicy(growth_interval=3)


def test_missing_keys_are_named_and_unknown_keys_ignored(backend):
    scaler, *_ = _trained(backend)
    with pytest.raises(KeyError, match="lacks"):
        scaler.load_state_dict({"scale": 4.0})
    good = torch.amp.GradScaler("cpu", init_scale=8.0).state_dict()
    scaler.load_state_dict({**good, "from_the_future": object()})
    assert scaler.get_scale() == 8.0


def test_setters_change_nothing_on_error(backend):
    scaler, *_ = _trained(backend)
    for setter, value in (("set_growth_factor", math.nan), ("set_backoff_factor", 0.0),
                          ("set_growth_interval", 2**31)):
        with pytest.raises((TypeError, ValueError)):
            getattr(scaler, setter)(value)
    assert scaler.policy == ScalePolicy(growth_interval=3)


# ------------------------------------------------------------ constructor and calls
@pytest.mark.parametrize("args, kwargs, error, match", [
    (("no-such-device",), {}, ValueError, "device must be a torch device string"),
    ((0,), {}, TypeError, "device must be a device string such as 'cuda' or 'cpu'; got int 0"),
    ((None,), {}, TypeError, "device must be a device string such as 'cuda' or 'cpu'; got None"),
    ((), dict(init_scale=2.0**128), ValueError, "init_scale must be a finite number > 0"),
    ((), dict(hysteresis=2**31), ValueError, "hysteresis must be an int >= 1 and at most"),
    ((), dict(growth_interval=2**31), ValueError, "growth_interval must be an int >= 1 and at"),
    ((), dict(process_group="x"), TypeError, "process_group must be None or a torch.distributed"),
    ((), dict(growth_factor="2"), TypeError, "growth_factor must be a real number"),
    ((), dict(enabled="yes"), TypeError, "enabled must be a bool"),
])
def test_bad_constructor_arguments(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        GradScaler(*(args or ("cpu",)), **kwargs)


def test_scale_rejects_what_is_not_tensors(backend):
    scaler = GradScaler("cpu", backend=backend)
    for bad in ("a string", {"loss": torch.ones(())}, [torch.ones(()), "x"], 3.0):
        with pytest.raises(TypeError, match="must be a Tensor or a"):
            scaler.scale(bad)
    out = scaler.scale(t for t in [torch.ones(()), torch.ones(2)])
    assert isinstance(out, map) and [t.tolist() for t in out] == [65536.0, [65536.0] * 2]
    assert scaler.scale([torch.ones(()), (torch.ones(()),)])[1][0].item() == 65536.0


@pytest.mark.parametrize("bad", [3.0, None, [torch.ones(()), 3.0], (torch.ones(()), [None])])
def test_scale_raises_torchs_error_class_too(backend, bad):
    """What torch's ``scale`` refuses with a ``ValueError``, ours refuses with an error that
    is both a ``TypeError`` and that ``ValueError`` (code written for torch's catches it)."""
    with pytest.raises(ValueError) as theirs:
        list(_leaves(torch.amp.GradScaler("cpu").scale(bad)))
    with pytest.raises(theirs.type, match="must be a Tensor") as ours:
        GradScaler("cpu", backend=backend).scale(bad)
    assert isinstance(ours.value, TypeError)


def test_scale_takes_nested_iterables_as_torch(backend):
    """A generator inside a list (or a generator) is scaled as torch's ``scale`` scales it: a
    lazy ``map`` in its place, the list rebuilt around it."""
    one, two = torch.ones(()), torch.full((2,), 2.0)
    make = [lambda: [one, (t for t in [two, [one]]), (two,)],
            lambda: (t for t in [one, (u for u in [two])])]
    for outputs in make:
        theirs = torch.amp.GradScaler("cpu", init_scale=4.0).scale(outputs())
        ours = GradScaler("cpu", init_scale=4.0, backend=backend).scale(outputs())
        assert type(ours) is type(theirs)
        assert _shape(ours) == _shape(theirs)


def _leaves(value):
    """Every tensor of a scaled (nested, lazy) structure, consuming its maps."""
    if isinstance(value, torch.Tensor):
        yield value
    else:
        for item in value:
            yield from _leaves(item)


def _shape(value):
    """A scaled structure as plain nested lists of (container type, values), maps consumed."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    return (type(value).__name__, [_shape(item) for item in value])


def test_update_new_scale_is_checked(backend):
    scaler, *_ = _trained(backend)
    for bad, error in ((math.nan, ValueError), (0.0, ValueError), ("1", TypeError)):
        with pytest.raises(error, match="new_scale"):
            scaler.update(bad)
    scaler.update(8)  # an int is a number (torch accepts only float)
    assert scaler.get_scale() == 8.0


def test_update_takes_a_tensor_new_scale_as_torch(backend):
    """A tensor ``new_scale`` is taken as it is, as torch's scaler takes it (checking it would
    read it from the device): a negative one then backs off by torch's rule on every backend
    (``min_scale=0.0`` is no floor)."""
    scales = []
    for scaler in (torch.amp.GradScaler("cpu"), GradScaler("cpu", backend=backend)):
        p = torch.nn.Parameter(torch.ones(2))
        opt = torch.optim.SGD([p], lr=0.1)
        scaler.scale(p.sum()).backward()
        scaler.step(opt)
        scaler.update(torch.tensor(-1.0))
        opt.zero_grad()
        scaler.scale(p.sum() * math.inf).backward()
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    assert scales == [-0.5, -0.5]


def test_a_negative_scale_is_reported_as_not_positive_not_as_underflowed(backend):
    """A scale set negative through ``update(new_scale=tensor)`` warns once that it is not a
    positive number; the underflow warning is for positive scales below 2**-126."""
    scaler = GradScaler("cpu", backend=backend)
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler.scale(p.sum()).backward()
    scaler.step(opt)
    scaler.update(torch.tensor(-1.0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert scaler.get_scale() == -1.0
        scaler.get_scale()
    messages = [str(w.message) for w in caught if w.category is RuntimeWarning]
    assert len(messages) == 1, messages
    assert "not a positive number" in messages[0] and "underflowed" not in messages[0]


def test_unscale_without_grads_raises_only_in_step_as_torch(backend):
    for scaler in (torch.amp.GradScaler("cpu"), GradScaler("cpu", backend=backend)):
        p = torch.nn.Parameter(torch.ones(2))
        opt = torch.optim.SGD([p], lr=0.1)
        scaler.scale(p.sum())
        scaler.unscale_(opt)  # no grads: no error here
        with pytest.raises(AssertionError, match="No inf checks were recorded for this"):
            scaler.step(opt)


def test_min_scale_error_leaves_a_usable_scaler(backend):
    scaler = GradScaler("cpu", init_scale=2.0, min_scale=2.0, raise_at_min_scale=True,
                        backend=backend)
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler.scale(p.sum() * math.inf).backward()
    scaler.step(opt)
    with pytest.raises(MinScaleReachedError):
        scaler.update()
    opt.zero_grad()
    scaler.scale(p.sum()).backward()
    scaler.step(opt)  # not "step() has already been called"
    scaler.update()
    assert scaler.skipped_steps == 1 and scaler.get_scale() == 2.0
    assert not torch.equal(p.detach(), torch.ones(2))


# ------------------------------------------------------------ ops: backends agree
def test_grads_argument_forms(backend):
    found, one = torch.zeros(()), torch.ones(())
    with pytest.raises(TypeError, match="not a single tensor"):
        ops.non_finite_check_and_unscale_(torch.ones(()), found, one, backend=backend)
    with pytest.raises(TypeError, match="not a single tensor"):
        ops.all_finite(torch.ones(()), backend=backend)
    with pytest.raises(TypeError, match="must be a list or tuple of tensors; got int"):
        ops.non_finite_check_(3, found, one, backend=backend)
    ops.non_finite_check_((t for t in [torch.ones(2), torch.tensor([math.inf])]), found, one,
                          backend=backend)
    assert found.item() == 1.0
    assert not ops.all_finite(iter([torch.tensor([math.nan])]), backend=backend).item()


@pytest.mark.parametrize("alias", ["same", "transpose", "prefix"])
def test_aliased_grads_are_unscaled_once(backend, alias):
    """torch unscales memory shared by two grads twice (a torch bug); we unscale it once.
    ``prefix``: the shorter alias (the first 5 elements) comes first in the optimizer."""
    results = {}
    for name, scaler in (("torch", torch.amp.GradScaler("cpu", init_scale=4.0)),
                         ("ours", GradScaler("cpu", init_scale=4.0, backend=backend))):
        p1, p2 = torch.nn.Parameter(torch.ones(3, 4)), torch.nn.Parameter(torch.ones(3, 4))
        if alias != "same":
            p2 = torch.nn.Parameter(torch.ones(4, 3) if alias == "transpose" else torch.ones(5))
        first = [p2, p1] if alias == "prefix" else [p1, p2]
        opt = torch.optim.SGD([*first, torch.nn.Parameter(torch.ones(5))], lr=0.1)
        opt.param_groups[0]["params"][2].grad = torch.full((5,), 8.0)
        scaler.scale(p1.sum())
        p1.grad = torch.full((3, 4), 8.0)
        p2.grad = {"same": p1.grad, "transpose": p1.grad.t(),
                   "prefix": p1.grad.view(-1)[:5]}[alias]
        scaler.unscale_(opt)
        results[name] = (p1.grad[0, 0].item(), p1.grad[-1, -1].item())
    assert results == {"torch": (0.5, 0.5 if alias != "prefix" else 2.0), "ours": (2.0, 2.0)}


# ------------------------------------------------------------ buckets and pickled models
def test_a_saved_and_loaded_model_can_get_new_buckets():
    model = torch.nn.Linear(3, 2)
    GradBuckets(torch.optim.SGD(model.parameters(), lr=0.1))
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    for copied in (loaded, copy.deepcopy(model)):
        assert len(GradBuckets(torch.optim.SGD(copied.parameters(), lr=0.1))) == 1
    with pytest.raises(ValueError, match="already belongs to other GradBuckets"):
        GradBuckets(torch.optim.SGD(model.parameters(), lr=0.1))


@pytest.mark.parametrize("version", ["3.2.0", "3.0.0", "2.3.1"])
def test_a_triton_older_than_the_tested_floor_is_refused_by_name(monkeypatch, version):
    """A triton below the suite's floor (pip's bound can be bypassed, e.g. ``--no-deps``) gets
    a clear error at the first Triton launch, naming both versions and the way out."""
    import triton

    from triton_scaler import _backend

    for ok in ("3.3.1", "3.4.0+git0a1b2c3", "3.9.0", "3.10.0", "4.0.0"):
        _backend.check_triton_version(ok)
    monkeypatch.setattr(_backend, "loaded_kernels", None)
    monkeypatch.setattr(triton, "__version__", version)
    with pytest.raises(RuntimeError, match=rf"need triton >= 3\.3 .*triton {re.escape(version)} "
                                           r"is installed.*backend='reference'"):
        ops.non_finite_check_and_unscale_([torch.ones(3)], torch.zeros(()), torch.ones(()),
                                          backend="triton")
