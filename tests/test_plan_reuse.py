"""Issue 15: the address-keyed launch plans of the no-bucket path stay exact when the
parameters or their grads' memory change: parameters swapped into ``param_groups``, converted
or resized in place (also with new grads at the old grads' addresses), grads cycling through
memory layouts, empty grads first, grads assigned as views with gaps. Each run against
torch's scaler (which reads every ``.grad`` each step)."""

import gc
import weakref
from collections import Counter

import pytest
import torch
from _util import assert_all_same, view_in

from triton_scaler import GradBuckets, GradScaler, _grads, _stored_plans, kernels


def _guards_of_another_signature(*grads, **kwargs):
    raise TypeError("TensorGuards() got an unexpected keyword argument")


@pytest.fixture(autouse=True, params=["tensor_guards", "python_check", "other_signature"])
def tensor_guards(request, monkeypatch):
    """Every test three times: reused plans checked by torch's TensorGuards from their second
    reuse on; by the Python passes only (a torch without TensorGuards); by the Python passes
    after TensorGuards refused its arguments (a torch whose private API changed). True for
    the first."""
    if request.param == "python_check":
        monkeypatch.setattr(_stored_plans, "TensorGuards", None)
    elif request.param == "other_signature":
        monkeypatch.setattr(_stored_plans, "TensorGuards", _guards_of_another_signature)
    return request.param == "tensor_guards"


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
    so the swapped-in parameter's grad is the one unscaled and checked, through the plans
    stored for that memory (Triton: planned at the first step only)."""
    built = Counter()

    def counted(*args, build=kernels.plan_unscale):
        built["plans"] += 1
        return build(*args)

    monkeypatch.setattr(kernels, "plan_unscale", counted)  # torch's scaler plans nothing
    _assert_matches_torch(_train_swapping_into_the_same_memory, backend, init_scale=2.0**8,
                          growth_interval=2)
    assert built["plans"] == (1 if backend == "triton" else 0)


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
    _assert_matches_torch(_train_converting, backend, **kwargs)
    assert len(slow) == 1  # at the conversion's step only


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
@pytest.mark.parametrize("gapped_from", [1, 2, 3])
@pytest.mark.parametrize("new_list", [False, True], ids=["same_list", "new_list"])
def test_gapped_grad_assigned_at_the_address_and_size_of_the_grad_before_it(
        backend, gapped_from, new_list):
    """A grad assigned as a view with gaps (``p.grad = m[:600:2]``) at exactly the address
    and size of the contiguous grad before it: the reused plan would unscale the first 300
    elements of ``m`` (half of them between the view's elements) and miss its inf; it is
    re-planned (a copy-back launch), equal to torch, the memory between the gapped grad's
    elements included. Assigned at the first reuse of the plans (step 1: the Python check),
    at the second (step 2: torch's TensorGuards from the first) and later; with a new
    parameter list too."""
    def gapped(step, params, memory, opt):
        if step >= gapped_from:
            params[1].grad = memory[1][:600:2].zero_()
        if step == gapped_from and new_list:
            opt.param_groups[0]["params"] = list(opt.param_groups[0]["params"])

    _assert_matches_torch(lambda scaler: _train_in_fixed_memory(scaler, gapped, steps=5),
                          backend, init_scale=8.0, growth_interval=1)


def test_plans_reused_through_one_tensor_guards_check(backend, tensor_guards, monkeypatch):
    """Grads at the same addresses step after step: planned at the first step, checked by the
    Python passes at the second (which builds the TensorGuards), by one TensorGuards check
    at each later step."""
    if backend != "triton" or not tensor_guards:
        pytest.skip("plans are reused on the Triton backend; the guard is torch's")
    counts, real_guards = Counter(), _stored_plans.TensorGuards

    class CountingGuards:
        def __init__(self, *grads, **kwargs):
            counts["built"] += 1
            self.guards = real_guards(*grads, **kwargs)

        def check(self, *grads):
            counts["checked"] += 1
            return self.guards.check(*grads)

    monkeypatch.setattr(_stored_plans, "TensorGuards", CountingGuards)
    monkeypatch.setattr(kernels, "plan_unscale", lambda *args, build=kernels.plan_unscale:
                        (counts.update(["planned"]), build(*args))[1])

    def run(scaler):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(n)) for n in (5, 300, 3)]
        opt = torch.optim.SGD(params, lr=0.1)
        for step in range(6):
            opt.zero_grad(set_to_none=False)
            scaler.scale(sum((p * (i + 1)).square().sum() for i, p in enumerate(params))).backward()
            if step == 4:
                params[0].grad[0] = float("nan")
            scaler.step(opt)
            scaler.update()
        return scaler.get_scale(), [p.detach().clone() for p in params]

    _assert_matches_torch(run, backend, init_scale=8.0, growth_interval=1)
    assert counts == {"planned": 1, "built": 1, "checked": 4}


@pytest.mark.filterwarnings("ignore:grad and param do not obey the gradient layout contract")
@pytest.mark.parametrize("then", ["same", "contiguous", "gapped", "gapped_channels_last"])
def test_channels_last_and_transposed_grads(backend, tensor_guards, then, monkeypatch):
    """Conv weights in channels_last and a transposed weight (their grads too, by torch's
    gradient layout contract), beside a bias: the plans, over their flat memory, are made once
    and reused through TensorGuards (which sees strides), made each step by the Python check
    (contiguous grads only). From step 3 the grads at the same addresses and of the same
    sizes are contiguous, or gapped (every other element; in either layout): re-planned.
    inf / -inf / NaN at the first and last element of the first and last grad, equal to
    torch, the memory between the gapped grads' elements included."""
    shapes = [(8, 3, 3, 3), (5, 7, 3, 3), (7,), (4, 9)]
    planned = Counter()
    monkeypatch.setattr(kernels, "plan_unscale", lambda *args, build=kernels.plan_unscale:
                        (planned.update(["plans"]), build(*args))[1])

    def run(scaler):
        torch.manual_seed(0)
        memory = [torch.zeros(2 * torch.Size(s).numel() + 3) for s in shapes]
        params = [torch.nn.Parameter(view_in(torch.randn(m.numel()), s, "channels_last"))
                  for m, s in zip(memory, shapes)]
        opt = torch.optim.SGD(params, lr=0.1)
        planted = {4: (0, 0, float("inf")), 5: (-1, -1, -float("inf")), 6: (0, -1, float("nan"))}
        for step in range(7):
            layout = "channels_last" if step < 3 or then == "same" else then
            for p, m, s in zip(params, memory, shapes):
                m.fill_(1.0)
                p.grad = view_in(m, s, layout).zero_()
            loss = sum((p * (i + 1)).square().sum() for i, p in enumerate(params))
            scaler.scale(loss).backward()
            if step in planted:
                which, at, value = planted[step]
                grad = params[which].grad
                grad[(at,) * grad.dim()] = value
            scaler.step(opt)
            scaler.update()
        return scaler.get_scale(), [p.detach().clone() for p in params] + memory

    _assert_matches_torch(run, backend, init_scale=8.0, growth_interval=1)
    if backend == "triton" and then == "same":
        assert planned["plans"] == (1 if tensor_guards else 7)
