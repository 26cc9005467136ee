"""The no-bucket path, which plans each step from the grads it reads, stays exact when the
parameters change: swapped into ``param_groups`` (also with its grad in the old grad's memory),
swapped out (freed), converted or resized in place (also with new grads at the old grads'
addresses). Each run against torch's scaler (which reads every ``.grad`` each step). The
grads' memory changing: ``test_plan_reuse.py``."""

import gc
import weakref

import pytest
import torch
from _launch_counting import count_calls
from _plan_reuse import assert_matches_torch, train_in_fixed_memory
from _util import assert_all_same

from triton_scaler import GradBuckets, GradScaler, _grads, _plans


def _train_swapping(scaler, steps=6, swap_at=2, overflow=((4, 1),), buckets=False):
    """SGD over three parameters whose middle one is replaced in place in the optimizer's
    parameter list (same list, same length) by a larger one at ``swap_at``."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n)) for n in (5, 9, 3)]
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    bucketed = GradBuckets(opt) if buckets else None
    for step in range(steps):
        if step == swap_at:
            opt.param_groups[0]["params"][1] = torch.nn.Parameter(torch.randn(21))
        live = opt.param_groups[0]["params"]
        if bucketed is not None:
            bucketed.zero_()  # the buckets' grads; the swapped-in parameter is outside them
        opt.zero_grad(set_to_none=False)
        scaler.scale(sum((p * (i + 1)).square().sum() for i, p in enumerate(live))).backward()
        for at, i in overflow:
            if at == step:
                live[i].grad[-1] = float("nan")
        scaler.step(opt)
        scaler.update()
    return scaler.get_scale(), [p.detach().clone() for p in opt.param_groups[0]["params"]]


@pytest.mark.parametrize("buckets", [False, True])
def test_parameter_replaced_in_place_in_param_groups(backend, buckets):
    """Without buckets each step reads the grads of the optimizer's own list; with buckets the
    cached layout is checked against its live parameter objects: either way a parameter
    swapped into the same list is unscaled and checked (its NaN skips the step).
    With buckets: the swapped-out parameter receives no grad, so the per-parameter path runs
    over the live parameters."""
    kwargs = dict(init_scale=2.0**8, growth_interval=2)
    expected = _train_swapping(torch.amp.GradScaler("cpu", **kwargs))
    actual = _train_swapping(GradScaler("cpu", **kwargs, backend=backend), buckets=buckets)
    assert actual[0] == expected[0]
    assert_all_same(actual[1], expected[1])


def _train_swapping_into_the_same_memory(scaler, steps=6, swap_at=2):
    """SGD over three parameters whose grads are the same three buffers every step; the
    middle parameter is swapped, in the optimizer's list, for a new one of its shape at
    ``swap_at``, whose grad is then the same buffer: the grads' addresses, dtypes, shapes and
    strides are those the stored plans were made for. NaN at the first element of the new
    parameter's grad, -inf at the last element of the last grad."""
    torch.manual_seed(0)
    memory = [torch.zeros(n) for n in (5, 9, 3)]
    opt = torch.optim.SGD([torch.nn.Parameter(torch.randn(n)) for n in (5, 9, 3)], lr=0.1,
                          momentum=0.9)
    live = opt.param_groups[0]["params"]
    for step in range(steps):
        if step == swap_at:
            live[1].grad = None  # the buffer is the new parameter's grad only
            live[1] = torch.nn.Parameter(torch.randn(9))
        for p, m in zip(live, memory):
            p.grad = m.zero_()
        scaler.scale(sum((p * (i + 1)).square().sum() for i, p in enumerate(live))).backward()
        if step == 3:
            live[1].grad[0] = float("nan")
        if step == 4:
            live[2].grad[-1] = -float("inf")
        scaler.step(opt)
        scaler.update()
    return scaler.get_scale(), [p.detach().clone() for p in live] + memory


def test_parameter_swapped_in_with_its_grad_in_the_old_grads_memory(backend, monkeypatch):
    """The layout keeps no parameter: each step reads the grads of the optimizer's own list,
    so the swapped-in parameter's grad is the one unscaled and checked (Triton: one plan a
    step, from the grads it reads)."""
    built = count_calls(monkeypatch, _plans, "plan_unscale", key="plans")
    assert_matches_torch(_train_swapping_into_the_same_memory, backend, init_scale=2.0**8,
                          growth_interval=2)
    assert built["plans"] == (6 if backend == "triton" else 0)


@pytest.mark.parametrize("impl", ["torch", "ours"])
def test_a_parameter_swapped_out_of_the_optimizer_is_freed(backend, impl):
    """Without buckets the scaler holds no parameter (nor its grad): one swapped out of the
    optimizer's list is freed as with torch's scaler."""
    params = [torch.nn.Parameter(torch.randn(n)) for n in (5, 9)]
    opt = torch.optim.SGD(params, lr=0.1)
    scaler = (torch.amp.GradScaler("cpu") if impl == "torch"
              else GradScaler("cpu", backend=backend))
    for step in range(3):
        if step == 2:
            gone = weakref.ref(params[1])
            opt.param_groups[0]["params"][1] = torch.nn.Parameter(torch.randn(9))
            opt.state.pop(params[1], None)
            del params
        live = opt.param_groups[0]["params"]
        scaler.scale(sum(p.square().sum() for p in live)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    gc.collect()
    assert gone() is None


def _train_converting(scaler, steps=5, convert_at=2):
    """Parameters converted in place to bf16 (``param.data = ...``, as ``module.to``) whose
    new grads sit at the addresses of the old fp32 ones (a bf16 view of their memory): the
    case where a cached launch plan would match every address but not the dtype."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n)) for n in (5, 9, 3)]
    opt = torch.optim.SGD(params, lr=0.1)
    for step in range(steps):
        if step == convert_at:
            for p in params:
                old, p.grad = p.grad, None
                p.data = p.data.to(torch.bfloat16)
                p.grad = old.view(torch.bfloat16)[: p.numel()]
        opt.zero_grad(set_to_none=False)
        loss = sum((p.float() * (i + 1)).square().sum() for i, p in enumerate(params))
        scaler.scale(loss).backward()
        if step == 3:
            params[2].grad[-1] = float("inf")
        scaler.step(opt)
        scaler.update()
    return scaler.get_scale(), [p.detach().clone() for p in params]


def test_parameters_converted_in_place_at_the_same_addresses(backend, monkeypatch):
    """... and from the step after the conversion the grads are grouped as bf16 without the
    per-parameter path (the layout is rebuilt once, not found stale at every step)."""
    slow = []
    groups_slow = _grads._groups_slow
    monkeypatch.setattr(_grads, "_groups_slow", lambda *a: slow.append(1) or groups_slow(*a))
    kwargs = dict(init_scale=2.0**8, growth_interval=2)
    assert_matches_torch(_train_converting, backend, **kwargs)
    assert len(slow) == 1  # at the conversion's step only


@pytest.mark.parametrize("new_list", [False, True], ids=["same_list", "new_list"])
@pytest.mark.parametrize("new_size, dtype", [(350, torch.float32), (250, torch.float32),
                                             (300, torch.bfloat16)],
                         ids=["grown", "shrunk", "to_bf16"])
def test_parameter_changed_in_place(backend, new_size, dtype, new_list):
    """A parameter (not its group's first) resized or converted in place (``param.data =
    ...``) whose new grad starts at its old grad's address, with or without a new
    ``group["params"]`` list: re-planned through the grads' sizes and dtypes, equal to torch.
    Grown or converted: an inf in the grad's last element (a stale plan misses it, or reads
    the bf16 grad as float32). Shrunk: an inf just past the shrunk grad's end (a stale plan
    sees it and writes there); the memory around the grads must also be what torch leaves."""
    def change(step, params, memory, opt):
        if step == 2:
            params[1].data = torch.randn(new_size, dtype=dtype)  # its grad starts where it did
            params[1].grad = memory[1].view(dtype)[:new_size].zero_()
            if new_list:
                group = opt.param_groups[0]
                group["params"] = list(group["params"])
        if step == 3 and new_size < 300:
            memory[1][new_size] = float("inf")

    assert_matches_torch(lambda scaler: train_in_fixed_memory(scaler, change), backend,
                          init_scale=8.0, growth_interval=1)
