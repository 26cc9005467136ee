"""The same loop under torch's scaler without buckets and under ours with GradBuckets,
compared call by call (tests/test_buckets_lifecycle.py, test_buckets_outside.py,
test_buckets_held_views.py)."""

import torch
from _loops import assert_same_optimizer_state
from _util import assert_same

from triton_scaler import GradBuckets, GradScaler


def run_both(backend, build, loop, enabled=True):
    """``build(ours: bool)`` -> (params, optimizer, zero_grad); ``loop(params, opt, scaler,
    zero_grad)`` returns a list of outcomes. Asserts that both sides agree."""
    sides = []
    for ours in (True, False):
        torch.manual_seed(0)
        params, opt, zero_grad = build(ours)
        settings = dict(init_scale=8.0, growth_interval=2, enabled=enabled)
        scaler = (GradScaler("cpu", **settings, backend=backend) if ours
                  else torch.amp.GradScaler("cpu", **settings))
        sides.append((loop(params, opt, scaler, zero_grad), params, opt))
    (outcomes, params, opt), (expected, params_t, opt_t) = sides
    assert outcomes == expected
    for p, q in zip(params, params_t):
        assert_same(p.detach(), q.detach())
    assert_same_optimizer_state(opt, opt_t)
    return expected


def outcome(call):
    try:
        call()
        return "ok"
    except (AssertionError, RuntimeError, ValueError) as error:
        return f"{type(error).__name__}: {error}"


def bucketed(make_params, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
             on_detach="reattach"):
    def build(ours):
        params = make_params()
        opt = optimizer([p for p in params if p.requires_grad])
        if not ours:
            return params, opt, opt.zero_grad
        return params, opt, GradBuckets(opt, on_detach=on_detach).zero_
    return build
