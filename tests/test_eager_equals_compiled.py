"""Each scaler call gives the same observable result eagerly and under
``torch.compile(backend="aot_eager")``, bit for bit, on both backends: a fused optimizer's own
``grad_scale``, torch's older ``step(grad_scaler=...)`` contract, a fused step after an
``unscale_`` that saw no grads, the clip's norm, GradBuckets with a parameter that received no
gradient, and compiled calls after a compiled call raised a user error."""

import math
import warnings

import pytest
import torch
from _util import assert_all_same

from triton_scaler import GradBuckets, GradScaler


def _maybe_compiled(fn, compiled):
    return torch.compile(fn, backend="aot_eager") if compiled else fn


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _train(backend, compiled, make_opt, steps=4, clip=False, buckets=False, frozen=None,
           overflow_at=2):
    """``scale -> backward -> [clip] -> step -> update``; the scaler's calls after the
    backward compiled together when ``compiled``. Returns params, norms and scales."""
    torch._dynamo.reset()
    model = _model()
    opt = make_opt(model)
    held = GradBuckets(opt) if buckets else None
    scaler = GradScaler("cpu", init_scale=2.0**8, growth_interval=2, backend=backend)
    norms = []

    def post():
        norm = scaler.clip_grad_norm_(opt, 0.5) if clip else None
        scaler.step(opt)
        scaler.update()
        return norm

    post = _maybe_compiled(post, compiled)
    gen = torch.Generator().manual_seed(1)
    scales = []
    for i in range(steps):
        x = torch.randn(5, 6, generator=gen)
        out = model[2](model[1](model[0](x))) if frozen is None else \
            model[2](torch.tanh(x @ torch.ones(6, 8)))  # model[0] receives no gradient
        loss = out.square().mean() * (math.inf if i == overflow_at else 1.0)
        scaler.scale(loss).backward()
        norm = post()
        norms.append(None if norm is None else norm.detach().clone())
        scales.append(scaler.get_scale())
        held.zero_() if held is not None else opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()], norms, scales


def _assert_same_both_ways(backend, **kwargs):
    eager = _train(backend, False, **kwargs)
    compiled = _train(backend, True, **kwargs)
    assert_all_same(compiled[0], eager[0])
    assert compiled[2] == eager[2]
    for a, e in zip(compiled[1], eager[1]):
        if e is not None:
            assert_all_same([a], [e])
    return eager


def _fused_adamw_with_own_grad_scale(model):
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    opt.grad_scale = torch.tensor(0.5)  # torch multiplies it with the scale
    return opt


def test_a_fused_optimizers_own_grad_scale_multiplies_the_scale_both_ways(backend):
    _assert_same_both_ways(backend, make_opt=_fused_adamw_with_own_grad_scale, steps=1)


class _TakesTheScaler(torch.optim.SGD):
    """torch's older fused contract: ``step(grad_scaler=...)``; it unscales by the scale."""

    _step_supports_amp_scaling = True

    def step(self, closure=None, grad_scaler=None):
        assert grad_scaler is not None
        found = sum(v.item() for v in grad_scaler._check_inf_per_device(self).values())
        if found:
            return None
        inv = 1.0 / grad_scaler.get_scale()
        with torch.no_grad():
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad.mul_(inv)
        return super().step()


def test_the_older_grad_scaler_contract_hands_the_optimizer_the_scaler_both_ways(backend):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        eager = _train(backend, False, lambda m: _TakesTheScaler(m.parameters(), lr=0.1))
        compiled = _train(backend, True, lambda m: _TakesTheScaler(m.parameters(), lr=0.1))
    assert_all_same(compiled[0], eager[0])
    assert sum(issubclass(w.category, FutureWarning) for w in caught) >= 2


@pytest.mark.parametrize("compiled", [False, True])
def test_a_fused_step_after_an_unscale_that_saw_no_grads_raises_both_ways(backend, compiled):
    torch._dynamo.reset()
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    scaler = GradScaler("cpu", backend=backend)
    scaler.scale(torch.ones(()))  # the scale exists
    _maybe_compiled(lambda: scaler.unscale_(opt), compiled)()
    scaler.scale(model(torch.ones(2, 6)).sum()).backward()
    with pytest.raises(AssertionError, match="No inf checks were recorded"):
        _maybe_compiled(lambda: scaler.step(opt), compiled)()


def test_the_clip_returns_the_same_norm_and_parameters_both_ways(backend):
    eager = _assert_same_both_ways(
        backend, make_opt=lambda m: torch.optim.SGD(m.parameters(), lr=0.1), clip=True)
    assert math.isnan(eager[1][2].item())  # the planted overflow


@pytest.mark.parametrize("clip", [False, True])
def test_gradbuckets_with_a_parameter_without_gradient_step_the_same_both_ways(backend, clip):
    """AdamW's weight decay would move a parameter whose grad is a zero view: both ways it
    has grad None at the step, as in torch. (AdamW's own step is compiled in both runs: a
    compiled optimizer rounds differently from an eager one, scaler or not.)"""
    def make_opt(model):
        opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.5)
        opt.step = torch.compile(opt.step, backend="aot_eager")
        return opt

    eager = _assert_same_both_ways(backend, make_opt=make_opt, buckets=True, frozen=True,
                                   clip=clip)
    assert_all_same(eager[0][:2], [p.detach() for p in _model().parameters()][:2])


def test_a_compiled_user_error_leaves_later_compiled_calls_as_they_were(backend):
    torch._dynamo.reset()
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler("cpu", backend=backend)
    scaler.scale(model(torch.ones(2, 6)).sum()).backward()
    unscale = torch.compile(lambda: scaler.unscale_(opt), backend="aot_eager")
    unscale()
    with pytest.raises(RuntimeError, match="already been called"):
        unscale()
    opt.zero_grad()
    eager = _train(backend, False, lambda m: torch.optim.SGD(m.parameters(), lr=0.1))
    compiled = _train(backend, True, lambda m: torch.optim.SGD(m.parameters(), lr=0.1))
    assert_all_same(compiled[0], eager[0])
    assert compiled[2] == eager[2]
