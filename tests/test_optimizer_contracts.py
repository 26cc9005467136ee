"""The optimizers the scaler takes, as torch's does: a ``step`` taking ``grad_scaler`` (torch's
deprecated fused contract), an optimizer-like object with ``__slots__`` (no ``__dict__``, no
weak reference), and the step signature asked once per step function, not at every step."""

import inspect
import math
import warnings

import pytest
import torch

from triton_scaler import GradScaler


class _GradScalerKwargSGD(torch.optim.SGD):
    """torch's deprecated fused contract: ``step`` takes the scaler as ``grad_scaler`` and
    checks the grads itself (apex-style)."""

    _step_supports_amp_scaling = True

    def step(self, closure=None, grad_scaler=None):
        self.events.append("grad_scaler" if grad_scaler is not None else "none")
        if grad_scaler is not None:
            grad_scaler._check_inf_per_device(self)


@pytest.mark.parametrize("make", [torch.amp.GradScaler, GradScaler])
def test_a_step_taking_grad_scaler_is_asked_again_when_replaced(make, monkeypatch):
    """A ``step(grad_scaler=...)`` gets the scaler and a FutureWarning at every step, as from
    torch's scaler (the oracle: both scalers run this test); a ``step`` replaced by one
    without that parameter gets ``grad_scale`` / ``found_inf`` instead, and the class's
    ``step`` back gets the scaler again (the remembered signature follows ``step``). torch
    asks ``inspect.signature`` at every step; ours once per step function."""
    asked = []
    signature = inspect.signature
    monkeypatch.setattr(inspect, "signature",
                        lambda f, *args, **kwargs: asked.append(f) or signature(f, *args, **kwargs))
    p = torch.nn.Parameter(torch.ones(3))
    opt = _GradScalerKwargSGD([p], lr=0.1)
    opt.events = []
    scaler = make("cpu", init_scale=4.0)

    def new_contract_step(closure=None):
        opt.events.append(("found_inf", float(opt.found_inf)))

    seen, counts = [], []
    for i in range(5):
        if i == 2:
            opt.step = new_contract_step
        if i == 4:
            del opt.step  # the class's step again
        scaler.scale(p.sum() * (math.inf if i == 3 else 1.0)).backward()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            scaler.step(opt)
        seen.append([w.filename for w in caught if w.category is FutureWarning])
        counts.append(sum(getattr(f, "__self__", None) is opt or f is new_contract_step
                          for f in asked))
        scaler.update()
        opt.zero_grad()
    assert opt.events == ["grad_scaler", "grad_scaler", ("found_inf", 0.0), ("found_inf", 1.0),
                          "grad_scaler"]
    at = __file__  # once, at the user's line
    if make is torch.amp.GradScaler and seen[0] == [torch.amp.grad_scaler.__file__]:
        at = seen[0][0]  # torch 2.8's warning gives no stacklevel: its own line
    assert seen == [[at], [at], [], [], [at]]
    assert scaler.get_scale() == 2.0
    assert counts == ([1, 2, 3, 4, 5] if make is torch.amp.GradScaler else [1, 1, 2, 2, 3])


@pytest.mark.parametrize("make", [torch.amp.GradScaler, GradScaler])
def test_a_second_step_taking_grad_scaler_raises_as_torchs(make):
    """A ``step(grad_scaler=...)`` counts as the iteration's step: a second ``scaler.step``
    before ``update()`` raises torch's error, and the optimizer's step ran once."""
    p = torch.nn.Parameter(torch.ones(3))
    opt = _GradScalerKwargSGD([p], lr=0.1)
    opt.events = []
    scaler = make("cpu", init_scale=4.0)
    scaler.scale(p.sum()).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        scaler.step(opt)
        with pytest.raises(RuntimeError,
                           match=r"^step\(\) has already been called since the last update\(\)\.$"):
            scaler.step(opt)
    assert opt.events == ["grad_scaler"]


class _SlotsOptimizer:
    """An optimizer-like object with ``__slots__``: no ``__dict__``, no weak reference. torch's
    scaler needs only ``param_groups`` and ``step`` (and, fused, to set ``grad_scale`` and
    ``found_inf``). Records what each step sees."""

    __slots__ = ("param_groups", "state", "grad_scale", "found_inf", "seen")

    def __init__(self, params):
        self.param_groups = [{"params": list(params)}]
        self.state = {}
        self.seen = []

    def step(self):
        seen = [p.grad.clone() for p in self.param_groups[0]["params"]]
        if getattr(self, "_step_supports_amp_scaling", False):
            seen += [None if self.grad_scale is None else self.grad_scale.clone(),
                     self.found_inf.clone()]
        self.seen.append(seen)
        return f"step {len(self.seen)}"


class _SlotsFusedOptimizer(_SlotsOptimizer):
    __slots__ = ()
    _step_supports_amp_scaling = True


@pytest.mark.parametrize("optimizer_type", [_SlotsOptimizer, _SlotsFusedOptimizer])
def test_an_optimizer_like_object_with_slots_steps_as_torchs(backend, optimizer_type):
    """Overflow at iteration 1, ``unscale_`` first at 2: what every step saw (grads, and
    fused the scale and found_inf handed over), what ``scaler.step`` returned (the step's
    value; None when skipped on the host) and the scales equal torch's scaler's."""
    results = []
    for scaler in (torch.amp.GradScaler("cpu", init_scale=4.0),
                   GradScaler("cpu", init_scale=4.0, backend=backend)):
        params = [torch.nn.Parameter(torch.full((n,), 1.0)) for n in (3, 1)]
        opt = optimizer_type(params)
        scales, returned = [], []
        for i in range(4):
            scaler.scale(sum(p.sum() for p in params) * (math.inf if i == 1 else 1.0)).backward()
            if i == 2:
                scaler.unscale_(opt)
            returned.append(scaler.step(opt))
            scaler.update()
            scales.append(scaler.get_scale())
            for p in params:
                p.grad = None
        results.append((opt.seen, scales, returned))
    (theirs, their_scales, their_returned), (ours, our_scales, our_returned) = results
    assert our_scales == their_scales
    assert our_returned == their_returned
    assert len(ours) == len(theirs) == (4 if optimizer_type is _SlotsFusedOptimizer else 3)
    for a, b in zip(ours, theirs):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert (x is None and y is None) or torch.equal(x, y)
