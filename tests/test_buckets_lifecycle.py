"""GradBuckets and the fused route where grads come and go: parameters outside the buckets,
grads set to None, parameters replaced, steps without grads. Each case runs the same loop
under torch's scaler without buckets and under ours, and compares what each call returned or
raised, every parameter and the optimizer state. (Found by tests/test_random_sequences.py.)
"""

import math

import pytest
import torch
from _loops import assert_same_optimizer_state
from _util import assert_same

from triton_scaler import GradBuckets, GradScaler


def _run_both(backend, build, loop):
    """``build(ours: bool)`` -> (params, optimizer, zero_grad); ``loop(params, opt, scaler,
    zero_grad)`` returns a list of outcomes. Asserts that both sides agree."""
    sides = []
    for ours in (True, False):
        torch.manual_seed(0)
        params, opt, zero_grad = build(ours)
        scaler = (GradScaler("cpu", init_scale=8.0, growth_interval=2, backend=backend) if ours
                  else torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=2))
        sides.append((loop(params, opt, scaler, zero_grad), params, opt))
    (outcomes, params, opt), (expected, params_t, opt_t) = sides
    assert outcomes == expected
    for p, q in zip(params, params_t):
        assert_same(p.detach(), q.detach())
    assert_same_optimizer_state(opt, opt_t)
    return expected


def _outcome(call):
    try:
        call()
        return "ok"
    except (AssertionError, RuntimeError, ValueError) as error:
        return f"{type(error).__name__}: {error}"


def _bucketed(make_params, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)):
    def build(ours):
        params = make_params()
        opt = optimizer([p for p in params if p.requires_grad])
        if not ours:
            return params, opt, opt.zero_grad
        return params, opt, GradBuckets(opt).zero_
    return build


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


def test_unscale_then_zero_then_step_leaves_parameters_without_grads_alone(backend):
    build = _bucketed(lambda: [torch.nn.Parameter(torch.randn(6)),
                               torch.nn.Parameter(torch.randn(2, 3))])

    def loop(params, opt, scaler, zero_grad):
        outcomes = []
        for _ in range(2):  # the second step: momentum would move every parameter
            scaler.scale(sum(p.sum() for p in params)).backward()
            scaler.unscale_(opt)
            if outcomes:
                zero_grad()  # after unscale_: torch's optimizer sees grad None, skips all
            outcomes.append(_outcome(lambda: scaler.step(opt)))
            scaler.update()
        return outcomes

    assert _run_both(backend, build, loop) == ["ok", "ok"]


@pytest.mark.parametrize("zero", ["set_to_none", "buckets"])
def test_a_step_without_grads_raises_as_torch(backend, zero):
    build = _bucketed(lambda: [torch.nn.Parameter(torch.randn(4)),
                               torch.nn.Parameter(torch.randn(3, dtype=torch.float16))])

    def loop(params, opt, scaler, zero_grad):
        scaler.scale(params[0].sum() + params[1].float().sum()).backward()
        (opt.zero_grad if zero == "set_to_none" else zero_grad)()
        step = _outcome(lambda: scaler.step(opt))  # no grads: not even the fp16 error
        return [step, _outcome(scaler.update)]

    assert _run_both(backend, build, loop) == [
        "AssertionError: No inf checks were recorded for this optimizer.",
        "AssertionError: No inf checks were recorded prior to update."]


def test_a_parameter_replaced_by_a_new_list_leaves_its_old_grad_out(backend):
    """The replaced parameter's grad (still a view of the bucket) holds an inf: the
    optimizer no longer holds it, so it must not skip the step."""
    build = _bucketed(lambda: [torch.nn.Parameter(torch.randn(5)),
                               torch.nn.Parameter(torch.randn(3))])

    def loop(params, opt, scaler, zero_grad):
        scaler.scale(params[0].sum() + params[1].sum() * math.inf).backward()
        new = torch.nn.Parameter(torch.randn(3))
        opt.param_groups[0]["params"] = [params[0], new]  # before the step
        params[1] = new
        scaler.scale(params[0].sum() + new.sum()).backward()
        step = _outcome(lambda: scaler.step(opt))
        scaler.update()
        return [step, scaler.get_scale(), scaler._get_growth_tracker()]

    assert _run_both(backend, build, loop) == ["ok", 8.0, 1]  # not skipped


@pytest.mark.parametrize("unscale_first", [False, True])
def test_fused_step_without_grads_steps_over_nothing_as_torch(backend, unscale_first):
    def build(ours):
        params = [torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(2))]
        opt = torch.optim.AdamW(params[1:], lr=0.1, fused=True)  # params[1] gets no grad
        return params, opt, opt.zero_grad

    def loop(params, opt, scaler, zero_grad):
        scaler.scale(params[0].sum()).backward()
        if unscale_first:
            scaler.unscale_(opt)
        return [_outcome(lambda: scaler.step(opt)), _outcome(scaler.update)]

    assert _run_both(backend, build, loop) == [
        "ok", "AssertionError: No inf checks were recorded prior to update."]


def test_fused_step_after_an_unscale_that_saw_no_grads_raises(backend):
    """unscale_() found no grads, backward made some since: torch's fused step fails inside
    the optimizer (found_inf is the int 0); ours raises the plain route's error instead of
    stepping with scaled grads."""
    param = torch.nn.Parameter(torch.randn(4))
    opt = torch.optim.AdamW([param], lr=0.1, fused=True)
    scaler = GradScaler("cpu", backend=backend)
    scaler.scale(torch.ones(()))  # initialises the scale
    scaler.unscale_(opt)
    scaler.scale(param.sum()).backward()
    before = param.detach().clone()
    with pytest.raises(AssertionError, match="No inf checks were recorded for this optimizer"):
        scaler.step(opt)
    assert torch.equal(param.detach(), before) and not opt.state


def test_a_parameter_replaced_in_place_is_seen_from_the_next_zero(backend):
    """``group["params"][i] = new`` keeps the list: the buckets see the replacement at the
    next buckets.zero_() (the old parameter received no gradient), as the README says."""
    build = _bucketed(lambda: [torch.nn.Parameter(torch.randn(5)),
                               torch.nn.Parameter(torch.randn(3))])

    def loop(params, opt, scaler, zero_grad):
        outcomes = []
        for step in range(4):
            if step == 1:
                params[1] = opt.param_groups[0]["params"][1] = torch.nn.Parameter(
                    torch.randn(3))
            inf = math.inf if step == 2 else 1.0
            scaler.scale(params[0].sum() + params[1].sum() * inf).backward()
            outcomes.append(_outcome(lambda: scaler.step(opt)))
            scaler.update()
            zero_grad()
        return outcomes + [scaler.get_scale(), params[1].grad]

    assert _run_both(backend, build, loop) == ["ok"] * 4 + [8.0, None]


def test_a_new_param_list_at_a_freed_lists_address_is_seen(backend):
    """Two list replacements in a row: CPython hands the second new list the first list's
    freed memory, so a cache keyed on the list's id would take it for the old one."""
    build = _bucketed(lambda: [torch.nn.Parameter(torch.randn(5)),
                               torch.nn.Parameter(torch.randn(3))])

    def loop(params, opt, scaler, zero_grad):
        scaler.scale(params[0].sum() + params[1].sum()).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=False)  # the buckets' views stay (nothing re-plans)
        group = opt.param_groups[0]
        group["params"] = list(group["params"])  # the first list is freed here (no cache
        params[1] = torch.nn.Parameter(torch.randn(3))  # holding it), the next takes its id
        group["params"] = [params[0], params[1]]
        scaler.scale(params[0].sum() + params[1].sum() * math.inf).backward()
        step = _outcome(lambda: scaler.step(opt))
        scaler.update()
        return [step, scaler.get_scale()]

    assert _run_both(backend, build, loop) == ["ok", 4.0]  # the new grad's inf was seen



@pytest.mark.parametrize("route", ["unscale_", "clip_inf", "clip_2", "fused"])
@pytest.mark.parametrize("written", [math.inf, math.nan, 1e3])
def test_what_is_written_into_the_view_of_a_parameter_without_gradient_does_not_count(
        backend, route, written):
    """With buckets, a parameter that received no gradient still shows its (zero) view as
    ``.grad`` until the scaler sets it to None; torch's grad is None there. A value written
    into that view (gradient-processing code over every ``p.grad``) is no grad: it must not
    flag an overflow, enter the clip's norm or reach the parameter (found by a random sweep
    of clip_grad_norm_ with GradBuckets)."""
    fused = route == "fused"
    build = _bucketed(lambda: [torch.nn.Parameter(torch.randn(n)) for n in (5, 4099, 3, 33)],
                      lambda ps: torch.optim.AdamW(ps, lr=0.1, fused=fused))

    def loop(params, opt, scaler, zero_grad):
        outcomes = []
        for step in range(3):
            used = (0, 1, 3) if step == 1 else (0, 1, 2, 3)  # step 1: the third unused
            scaler.scale(sum((params[i] * params[i]).sum() for i in used)).backward()
            if params[2].grad is not None and step == 1:  # ours only: torch's is None
                params[2].grad.view(-1)[-1] = written
            if route == "unscale_":
                scaler.unscale_(opt)
            elif route != "fused":
                norm_type = math.inf if route == "clip_inf" else 2.0
                if isinstance(scaler, GradScaler):
                    norm = scaler.clip_grad_norm_(opt, 1e9, norm_type)
                else:
                    scaler.unscale_(opt)
                    norm = torch.nn.utils.clip_grad_norm_(
                        [p for p in params if p.grad is not None], 1e9, norm_type)
                outcomes.append(float(f"{norm.item():.6g}"))  # the Triton 2-norm's order
            scaler.step(opt)
            scaler.update()
            outcomes.append((scaler.get_scale(), [p.grad is None for p in params]))
            zero_grad()
        return outcomes

    outcomes = [o for o in _run_both(backend, build, loop) if isinstance(o, tuple)]
    assert outcomes[1] == (16.0, [False, False, True, False])  # step 1 not skipped


def test_a_held_view_does_not_hide_a_grad_the_scaler_set_to_none(backend):
    """The user holds a grad (a loop variable, a list for logging); the parameter then takes
    no part in a step (the scaler sets its grad None), ``zero_grad(set_to_none=False)`` keeps
    None, and the next backward gives it a new grad outside the bucket. The held view keeps
    the storage's count of live views as before: the scaler must still see the new grad and
    unscale it (found by a random sweep of clip_grad_norm_ with GradBuckets)."""
    build = _bucketed(lambda: [torch.nn.Parameter(torch.randn(n)) for n in (5, 37)])

    def loop(params, opt, scaler, zero_grad):
        held, outcomes = None, []
        for step in range(4):
            used = (1,) if step == 1 else (0, 1)
            scaler.scale(sum((params[i] * params[i]).sum() for i in used)).backward()
            if step == 1:
                held = params[0].grad  # noqa: F841 (ours: its view; kept alive on purpose)
            scaler.unscale_(opt)
            outcomes.append([None if p.grad is None else p.grad.abs().max().item()
                             for p in params])
            scaler.step(opt)
            scaler.update()
            if step == 0:
                zero_grad()  # ours: buckets.zero_(); torch: zero_grad() (None)
            else:
                opt.zero_grad(set_to_none=False)  # keeps None
        return outcomes

    outcomes = _run_both(backend, build, loop)
    assert outcomes[1][0] is None and outcomes[2][0] is not None


@pytest.mark.filterwarnings("ignore:.*no longer views into their GradBucket")
@pytest.mark.parametrize("n_params", [1, 3])
def test_grads_replaced_while_a_list_holds_the_old_views_are_seen(backend, n_params):
    """``zero_grad()`` (set_to_none=True) detaches every view while a list made after
    ``unscale_`` (for logging) holds them into the next step: the storage then counts as many
    live views as before, but every grad is new. The scaler must still unscale them (it
    copies them back into the bucket and warns)."""
    build = _bucketed(lambda: [torch.nn.Parameter(torch.randn(5 + i)) for i in range(n_params)])

    def loop(params, opt, scaler, zero_grad):
        logged, outcomes = None, []  # noqa: F841 (kept alive on purpose)
        for _ in range(3):
            scaler.scale(sum((p * p).sum() for p in params)).backward()
            scaler.unscale_(opt)
            outcomes.append([p.grad.abs().max().item() for p in params])
            logged = [p.grad for p in params]  # noqa: F841
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        return outcomes

    _run_both(backend, build, loop)


def test_zero_gives_back_the_view_of_a_grad_the_scaler_set_to_none(backend):
    """A middle parameter takes no part in a step (the scaler sets its grad None) while the
    user holds its old view; ``buckets.zero_()`` must give it its view back, or the next
    backward makes it a new grad outside the bucket that the O(1) check, fooled by the held
    view, would leave scaled (found by the random clip sweep)."""
    build = _bucketed(lambda: [torch.nn.Parameter(torch.randn(n)) for n in (41, 37, 37)])

    def loop(params, opt, scaler, zero_grad):
        held, outcomes = None, []
        for step in range(3):
            used = (0, 2) if step == 1 else (0, 1, 2)
            scaler.scale(sum((params[i] * params[i]).sum() for i in used)).backward()
            if step == 0:
                held = params[1].grad  # noqa: F841 (kept alive on purpose)
            scaler.unscale_(opt)
            outcomes.append([None if p.grad is None else p.grad.abs().max().item()
                             for p in params])
            scaler.step(opt)
            scaler.update()
            zero_grad()  # ours: buckets.zero_(); torch: zero_grad()
        return outcomes

    assert _run_both(backend, build, loop)[1][1] is None


@pytest.mark.filterwarnings("ignore:.*no longer views into their GradBucket")
@pytest.mark.parametrize("accumulate", [1, 3])
def test_a_middle_grad_set_to_none_while_its_view_is_held_is_seen(backend, accumulate):
    """The user sets a middle parameter's grad to None before the backward while holding its
    old view: the storage keeps its count of live views and the first and last grads are
    views, but the backward's accumulation made a new grad, which does not bump the buffer's
    version as an accumulation into a view does. The scaler must unscale it."""
    build = _bucketed(lambda: [torch.nn.Parameter(torch.randn(n)) for n in (41, 37, 37)])

    def loop(params, opt, scaler, zero_grad):
        held, outcomes = None, []
        for step in range(3):
            if step == 1:
                held = params[1].grad  # noqa: F841 (kept alive on purpose)
                params[1].grad = None
            for _ in range(accumulate):
                scaler.scale(sum((p * p).sum() for p in params)).backward()
            scaler.unscale_(opt)
            outcomes.append([p.grad.abs().max().item() for p in params])
            scaler.step(opt)
            scaler.update()
            zero_grad()
        return outcomes

    _run_both(backend, build, loop)


@pytest.mark.filterwarnings("ignore:.*no longer views into their GradBucket")
def test_a_grad_left_none_is_seen_when_a_later_backward_makes_it(backend):
    """A held view, ``zero_grad()`` (views detached), a step in which one parameter takes no
    part (its grad stays None), then ``zero_grad(set_to_none=False)`` (the others zeroed in
    place: version bumps as accumulations would make) and a step that gives it a new grad
    outside the bucket: the held view keeps the storage's count, the first and last grads
    are views, so only knowing that its grad was None at the last check finds it (found by
    the random clip sweep)."""
    build = _bucketed(lambda: [torch.nn.Parameter(torch.randn(n)) for n in (41, 37, 20, 37)])

    def loop(params, opt, scaler, zero_grad):
        held, outcomes = None, []
        for step in range(3):
            used = (0, 1, 3) if step == 1 else (0, 1, 2, 3)
            scaler.scale(sum((params[i] * params[i]).sum() for i in used)).backward()
            if step == 0:
                held = params[1].grad  # noqa: F841 (kept alive on purpose)
            scaler.unscale_(opt)
            outcomes.append([None if p.grad is None else p.grad.abs().max().item()
                             for p in params])
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=step == 0)
        return outcomes

    assert _run_both(backend, build, loop)[1][2] is None
