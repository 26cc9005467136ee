"""Issue 15: the address-keyed launch plans of the no-bucket path stay exact when the
parameters or their grads' memory change: parameters swapped into ``param_groups``, converted
or resized in place (also with new grads at the old grads' addresses), grads cycling through
memory layouts, empty grads first. Each run against torch's scaler (which reads every
``.grad`` each step)."""

from collections import Counter

import pytest
import torch
from _util import assert_all_same

from triton_scaler import GradBuckets, GradScaler, kernels


def _assert_matches_torch(run, backend, **kwargs):
    """``run(scaler) -> (scale(s), params)`` gives the same with torch's scaler and ours."""
    expected = run(torch.amp.GradScaler("cpu", **kwargs))
    actual = run(GradScaler("cpu", **kwargs, backend=backend))
    assert actual[0] == expected[0]
    assert_all_same(actual[1], expected[1])


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
    """The cached layout is checked against the optimizer's live parameter objects: a
    parameter swapped into the same list is unscaled and checked (its NaN skips the step).
    With buckets: the swapped-out parameter receives no grad, so the per-parameter path runs
    over the live parameters."""
    kwargs = dict(init_scale=2.0**8, growth_interval=2)
    expected = _train_swapping(torch.amp.GradScaler("cpu", **kwargs))
    actual = _train_swapping(GradScaler("cpu", **kwargs, backend=backend), buckets=buckets)
    assert actual[0] == expected[0]
    assert_all_same(actual[1], expected[1])


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


def test_parameters_converted_in_place_at_the_same_addresses(backend):
    kwargs = dict(init_scale=2.0**8, growth_interval=2)
    _assert_matches_torch(_train_converting, backend, **kwargs)


@pytest.mark.parametrize("sizes", [(0, 5, 9), (0, 0, 7, 3), (4, 0, 6)])
def test_reused_plans_with_empty_grads_first(backend, sizes):
    """A group whose first grads are empty: the launch's base is its first non-empty grad,
    also when the plan is reused at the next steps (same addresses)."""
    def run(scaler):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(n)) for n in sizes]
        opt = torch.optim.SGD(params, lr=0.5)
        for step in range(4):
            opt.zero_grad(set_to_none=False)
            scaler.scale(sum((p * (i + 2)).sum() for i, p in enumerate(params))).backward()
            if step == 2:
                params[-1].grad[-1] = float("inf")
            scaler.step(opt)
            scaler.update()
        return scaler.get_scale(), [p.detach().clone() for p in params]

    _assert_matches_torch(run, backend, init_scale=4.0, growth_interval=1)


@pytest.mark.parametrize("n_layouts", [2, 5])  # 5: more than the plans kept per optimizer
def test_grads_cycling_through_memory_layouts(backend, n_layouts, monkeypatch):
    """Grads whose memory cycles through a few address layouts (an allocator handing back
    the blocks of an earlier step) reuse those layouts' launch plans, and more layouts than
    are kept replan: inf / NaN / -inf planted at the first and last element of the first and
    last grad skip exactly torch's steps, and the parameters equal torch's."""
    sizes = (7, 300, 1, 0, 33)

    def run(scaler):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(n)) for n in sizes]
        opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
        pools = [[torch.empty(n) for n in sizes] for _ in range(n_layouts)]
        planted = {n_layouts + 1: (-1, -1, float("inf")), 2 * n_layouts: (0, 0, float("nan")),
                   2 * n_layouts + 1: (0, -1, -float("inf")), 3 * n_layouts: (-1, 0, float("nan"))}
        scales = []
        for step in range(3 * n_layouts + 2):
            for p, memory in zip(params, pools[step % n_layouts]):
                p.grad = memory.zero_()  # backward accumulates into this layout's memory
            loss = sum((p * (i + 1)).square().sum() for i, p in enumerate(params))
            scaler.scale(loss).backward()
            if step in planted:
                which, at, value = planted[step]
                params[which].grad[at] = value
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        return scales, [p.detach().clone() for p in params]

    built = Counter()

    def counted(*args, build=kernels.plan_unscale):
        built["plans"] += 1
        return build(*args)

    monkeypatch.setattr(kernels, "plan_unscale", counted)  # torch's scaler plans nothing
    _assert_matches_torch(run, backend, init_scale=2.0**8, growth_interval=2)
    if backend == "triton":  # each layout planned once while they fit, every step otherwise
        assert built["plans"] == (n_layouts if n_layouts <= 4 else 3 * n_layouts + 2)


def _train_in_fixed_memory(scaler, before_backward, steps=5):
    """SGD over parameters of 7, 300 and 33 elements whose grads are views at the start of
    three fixed buffers (so each grad starts where it did the step before), with
    ``before_backward(step, params, memory, opt)`` changing things each step. Returns the
    scale, the parameters and the buffers (what a stale launch plan would write past a
    grad's end shows there)."""
    torch.manual_seed(0)
    memory = [torch.zeros(20), torch.zeros(700), torch.zeros(80)]
    params = [torch.nn.Parameter(torch.randn(n)) for n in (7, 300, 33)]
    opt = torch.optim.SGD(params, lr=0.1)
    for step in range(steps):
        for p, m in zip(params, memory):
            m.fill_(1.0)
            p.grad = m.view(p.dtype)[: p.numel()].zero_()
        before_backward(step, params, memory, opt)
        scaler.scale(sum((p * (i + 1)).square().sum() for i, p in enumerate(params))).backward()
        if step == 3 and params[1].numel() >= 300:  # the grown or converted grad's last element
            params[1].grad[-1] = float("inf")
        scaler.step(opt)
        scaler.update()
    return scaler.get_scale(), [p.detach().clone() for p in params] + memory


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

    _assert_matches_torch(lambda scaler: _train_in_fixed_memory(scaler, change), backend,
                          init_scale=8.0, growth_interval=1)


@pytest.mark.filterwarnings("ignore:grad and param do not obey the gradient layout contract")
def test_gapped_grad_assigned_then_a_new_parameter_list(backend):
    """The remedy the README gives for the one change the per-step check does not see: a
    gapped grad assigned at exactly the address and size of the grad before it, then
    ``group["params"] = list(group["params"])``: re-planned (a copy-back launch), equal to
    torch, the memory between the gapped grad's elements included."""
    def gapped(step, params, memory, opt):
        if step >= 2:
            params[1].grad = memory[1][:600:2].zero_()
        if step == 2:
            opt.param_groups[0]["params"] = list(opt.param_groups[0]["params"])

    _assert_matches_torch(lambda scaler: _train_in_fixed_memory(scaler, gapped, steps=4),
                          backend, init_scale=8.0, growth_interval=1)
