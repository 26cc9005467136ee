"""GradBuckets where grads are replaced after the backward (assigned, swapped between
parameters, set to None) while the user may hold the old views: each case runs the same
loop under torch's scaler without buckets and under ours and compares every step's scale,
every grad, every parameter and the optimizer state (held views before the backward:
test_buckets_held_views.py)."""

import math

import pytest
import torch
from _bucket_loops import bucketed, run_both


def _changing_grads_loop(change, steps: int):
    """A loop over ``steps`` steps whose grads ``change(params, step)`` alters after each
    backward (what it returns is kept alive until the step is done); outcomes: the scale
    and every grad after each step."""
    def loop(params, opt, scaler, zero_grad):
        outcomes = []
        for step in range(steps):
            scaler.scale(sum((p * (i + 1.0)).sum() for i, p in enumerate(params))).backward()
            kept = change(params, step)  # noqa: F841 (kept alive on purpose)
            scaler.step(opt)
            scaler.update()
            outcomes.append([scaler.get_scale()] + [None if p.grad is None else p.grad.tolist()
                                                     for p in params])
            zero_grad()
        return outcomes
    return loop


@pytest.mark.filterwarnings("ignore:.*no longer views into their GradBucket")
@pytest.mark.parametrize("on_detach", ["reattach", "warn"])
@pytest.mark.parametrize("swap", ["first two", "last two"])
def test_grads_swapped_between_parameters_of_one_shape(backend, on_detach, swap):
    """After the backward the grads of two parameters of one shape are swapped: each grad is
    then the other's view into the bucket. Each parameter steps with the grad it holds, as
    under torch's scaler: copied back (or, with ``"warn"``, left outside) without one copy
    overwriting the other's source. -inf planted in the last grad at the third step."""
    build = bucketed(lambda: [torch.nn.Parameter(torch.randn(n)) for n in (4, 4, 7, 7)],
                     on_detach=on_detach)

    def swap_grads(params, step):
        a, b = (0, 1) if swap == "first two" else (2, 3)
        if step in (1, 2):
            params[a].grad, params[b].grad = params[b].grad, params[a].grad
        if step == 2:
            params[-1].grad[-1] = -math.inf

    run_both(backend, build, _changing_grads_loop(swap_grads, 4))


@pytest.mark.filterwarnings("ignore:.*no longer views into their GradBucket")
@pytest.mark.parametrize("which", [0, -1])
def test_a_first_or_last_grad_replaced_after_the_backward_while_its_view_is_held(backend,
                                                                               which):
    """After the backward (every view received its gradient, the buffer written as often as
    autograd accumulated) the first or the last grad is replaced by a new tensor while a list
    holds the old views, so the storage counts as many views as before: the address of that
    grad tells the scaler, which must unscale and check the new tensor (-inf in it at the
    second step: skipped) as torch's scaler does."""
    def replace_grad(params, step):
        held = [p.grad for p in params]
        params[which].grad = params[which].grad * 3.0
        if step == 1:
            params[which].grad[0] = -math.inf
        return held

    build = bucketed(lambda: [torch.nn.Parameter(torch.randn(n)) for n in (5, 3, 6)])
    run_both(backend, build, _changing_grads_loop(replace_grad, 3))


@pytest.mark.filterwarnings("ignore:.*no longer views into their GradBucket")
@pytest.mark.parametrize("storage_held", [False, True], ids=["no-storage-held", "storage-held"])
def test_a_middle_grad_replaced_after_the_backward_is_seen(backend, storage_held):
    """After the backward a middle grad (not a bucket's first or last, whose addresses are
    checked) is replaced by a new tensor, nothing holding its old view: the storage's count
    of live views drops, which alone tells the scaler to unscale and check the new tensor
    (-inf in it at the second step: skipped). (With its old view held elsewhere the count
    would stay: the one case docs/buckets.md says the checks cannot see.)
    ``storage_held``: the buffer's Python storage object is alive meanwhile, as Triton's
    interpreter leaves it in a reference cycle after each launch; with torch 2.8 a count read
    through a temporary storage object missed the replaced grad then."""
    def replace_grad(params, step):
        held = params[0].grad.untyped_storage() if storage_held else None
        params[1].grad = params[1].grad * 3.0
        if step == 1:
            params[1].grad[-1] = -math.inf
        return held

    build = bucketed(lambda: [torch.nn.Parameter(torch.randn(n)) for n in (5, 3, 6)])
    outcomes = run_both(backend, build, _changing_grads_loop(replace_grad, 3))
    assert [o[0] for o in outcomes] == [8.0, 4.0, 4.0]


@pytest.mark.parametrize("which", [0, -1])
def test_a_first_or_last_grad_set_to_none_after_the_backward_while_its_view_is_held(backend,
                                                                                    which):
    """After the backward the first or the last grad is set to None while a list holds the
    views (-inf written into it first at the second step): torch's scaler neither checks
    nor steps it, and the view's -inf is no overflow."""
    def drop_grad(params, step):
        held = [p.grad for p in params]
        if step == 1:
            params[which].grad[0] = -math.inf
        params[which].grad = None
        return held

    build = bucketed(lambda: [torch.nn.Parameter(torch.randn(n)) for n in (5, 3, 6)])
    outcomes = run_both(backend, build, _changing_grads_loop(drop_grad, 3))
    assert [o[0] for o in outcomes] == [8.0, 16.0, 16.0]
