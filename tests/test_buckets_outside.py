"""GradBuckets beside parameters outside them (frozen when the buckets were built, added
since, replaced in place): zero_() clears their grads as torch's zero_grad(), the scaler
sees the ones the optimizer holds now, and the buckets' grads are unscaled and checked
whether the grads outside take the planned or the per-grad path. Each case runs the same loop under
torch's scaler without buckets and under ours, and compares what each call returned or
raised, every parameter and the optimizer state."""

import math

import pytest
import torch
from _bucket_loops import outcome as _outcome
from _bucket_loops import run_both as _run_both

import triton_scaler.buckets as buckets_module
from triton_scaler import GradBuckets, GradScaler


def _middle_one_outside(ours):
    """Three parameters; the middle one, frozen when the buckets were built and then
    unfrozen, lies outside them."""
    params = [torch.nn.Parameter(torch.randn(5)),
              torch.nn.Parameter(torch.randn(3), requires_grad=False),
              torch.nn.Parameter(torch.randn(4))]
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    zero_grad = GradBuckets(opt).zero_ if ours else opt.zero_grad
    params[1].requires_grad_(True)
    return params, opt, zero_grad


def test_zero_sets_none_the_grads_of_parameters_outside_the_buckets(backend):
    """Frozen when the buckets were built and unfrozen later, or added in a new group: the
    buckets do not hold them, and zero_() must still clear them as torch's zero_grad()."""
    def build(ours):
        params = [torch.nn.Parameter(torch.randn(5)),
                  torch.nn.Parameter(torch.randn(3), requires_grad=False)]
        opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
        zero_grad = GradBuckets(opt).zero_ if ours else opt.zero_grad
        params[1].requires_grad_(True)  # frozen when the buckets were built
        params.append(torch.nn.Parameter(torch.randn(4)))
        opt.add_param_group({"params": [params[2]]})
        return params, opt, zero_grad

    def loop(params, opt, scaler, zero_grad):
        for step in range(4):
            loss = sum((p * (i + 1.0)).sum() for i, p in enumerate(params))
            scaler.scale(loss * (math.inf if step == 1 else 1.0)).backward()
            scaler.step(opt)
            scaler.update()
            zero_grad()
        return [scaler.get_scale(), [p.grad for p in params[1:]]]  # those outside

    assert _run_both(backend, build, loop)[1] == [None, None]


def test_a_parameter_outside_the_buckets_replaced_in_place_is_seen(backend):
    """``group["params"][1] = new`` (the same list, of the same length) for a parameter the
    buckets do not hold (frozen when they were built) while they hold the others: the
    scaler's cached layout must see the new parameter by identity, or it would read the old
    one's grad and miss the inf in the new one's."""
    def loop(params, opt, scaler, zero_grad):
        outcomes = []
        for step in range(4):
            if step == 2:
                params[1] = opt.param_groups[0]["params"][1] = torch.nn.Parameter(
                    torch.randn(3))
            loss = sum((p * (i + 1.0)).sum() for i, p in enumerate(params))
            scaler.scale(loss + params[1][-1] * (math.inf if step == 2 else 0.0)).backward()
            outcomes.append(_outcome(lambda: scaler.step(opt)))
            scaler.update()
            outcomes.append(scaler.get_scale())
            zero_grad()
        return outcomes + [params[1].grad]

    expected = ["ok", 8.0, "ok", 16.0, "ok", 8.0, "ok", 8.0, None]
    assert _run_both(backend, _middle_one_outside, loop) == expected


@pytest.mark.parametrize("how", ["new group", "appended to a group's list"])
def test_a_parameter_added_after_zero_has_run_is_cleared_by_the_next_zero(backend, how):
    """zero_() remembers which of the optimizer's parameters lie outside the buckets; a
    parameter added after that (a new param group, or appended in place to a group's list,
    every bucket parameter still receiving a gradient) must be found, or its grad would
    accumulate across steps where torch's zero_grad() clears it."""
    def build(ours):
        params = [torch.nn.Parameter(torch.randn(5)), torch.nn.Parameter(torch.randn(3)),
                  torch.nn.Parameter(torch.randn(4))]  # the last one joins the optimizer later
        opt = torch.optim.SGD(params[:2], lr=0.1, momentum=0.9)
        return params, opt, GradBuckets(opt).zero_ if ours else opt.zero_grad

    def loop(params, opt, scaler, zero_grad):
        outside = []
        for step in range(4):
            if step == 1:
                if how == "new group":
                    opt.add_param_group({"params": [params[2]]})
                else:
                    opt.param_groups[0]["params"].append(params[2])
            active = params if step else params[:2]
            loss = sum((p * (i + 1.0)).sum() for i, p in enumerate(active))
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            zero_grad()
            outside.append(params[2].grad)
        return [scaler.get_scale(), outside]

    assert _run_both(backend, build, loop)[1] == [None] * 4


def test_a_parameter_outside_the_buckets_without_a_gradient(backend):
    """A parameter outside the buckets (frozen when they were built) receives a gradient
    every other step only: at the steps without one, the grads outside are grouped one by
    one, and the buckets' grads must still be unscaled and checked (their inf at step 2)."""
    def loop(params, opt, scaler, zero_grad):
        outcomes = []
        for step in range(5):
            used = params if step % 2 else params[::2]  # the middle one: odd steps only
            loss = sum((p * (i + 1.0)).square().sum() for i, p in enumerate(used))
            scaler.scale(loss * (math.inf if step == 2 else 1.0)).backward()
            outcomes.append(_outcome(lambda: scaler.step(opt)))
            scaler.update()
            outcomes.append(scaler.get_scale())
            zero_grad()
        return outcomes + [params[1].grad]

    expected = ["ok", 8.0, "ok", 16.0, "ok", 8.0, "ok", 8.0, "ok", 16.0, None]
    assert _run_both(backend, _middle_one_outside, loop) == expected


def test_the_parameters_outside_are_looked_up_again_only_when_the_lists_change(monkeypatch):
    """zero_() finds the optimizer's parameters outside the buckets once and keeps them while
    the parameter lists hold the same parameters, also at steps where a bucket's parameter
    received no gradient (its identity pass then finds nothing replaced); it looks again
    when a parameter outside, or one of a bucket's, is replaced in place."""
    lookups = []
    real = buckets_module.param_lists
    monkeypatch.setattr(buckets_module, "param_lists",
                        lambda groups: lookups.append(1) or real(groups))
    params, opt, zero_grad = _middle_one_outside(True)
    scaler = GradScaler("cpu", init_scale=8.0)
    counts = []
    for step in range(8):
        if step in (4, 6):  # the one outside, then a bucket's first one, replaced in place
            i = 1 if step == 4 else 0
            params[i] = opt.param_groups[0]["params"][i] = torch.nn.Parameter(
                torch.randn(params[i].shape))
        used = params[1:] if step in (0, 2) else params  # the first one: no gradient
        scaler.scale(sum((p * (i + 1.0)).sum() for i, p in enumerate(used))).backward()
        scaler.step(opt)
        scaler.update()
        zero_grad()
        counts.append(len(lookups))
    assert counts == [1, 1, 1, 1, 2, 2, 3, 3]
