"""The address-keyed launch plans of the no-bucket path stay exact when the grads'
memory changes: grads cycling through memory layouts, empty grads first, grads assigned as
views with gaps, channels_last and transposed grads; plans reused through one TensorGuards
check. Each run against torch's scaler (which reads every ``.grad`` each step). The
parameters changing: ``test_plan_reuse_params.py``."""

from collections import Counter

import _plan_reuse
import pytest
import torch
from _launch_counting import count_calls
from _plan_reuse import assert_matches_torch, train_in_fixed_memory
from _util import view_in

from triton_scaler import GradScaler, _plan_store, _plans

tensor_guards = _plan_reuse.tensor_guards  # autouse: every test three ways


_F32, _BF16, _F64 = torch.float32, torch.bfloat16, torch.float64


@pytest.mark.parametrize("layout", [
    ((0, _F32), (5, _F32), (9, _F32)), ((0, _F32), (0, _F32), (7, _F32), (3, _F32)),
    ((4, _F32), (0, _F32), (6, _F32)), ((5, _F32), (0, _BF16), (300, _F32)),
    ((5, _F32), (0, _F64), (300, _F32))],
    ids=["empty_first", "two_empty_first", "empty_middle", "empty_bf16_group",
         "empty_fp64_group"])
def test_reused_plans_with_empty_grads(backend, layout):
    """A group whose first grads are empty: the launch's base is its first non-empty grad,
    also when the plan is reused at the next steps (same addresses). A (device, dtype) group
    whose only grad is empty (a plan without elements) beside a float32 group is reused
    too (the fast path looks up its base by the plan's index)."""
    def run(scaler):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(n, dtype=dtype)) for n, dtype in layout]
        opt = torch.optim.SGD(params, lr=0.5)
        for step in range(4):
            opt.zero_grad(set_to_none=False)
            scaler.scale(sum((p.float() * (i + 2)).sum()
                             for i, p in enumerate(params))).backward()
            if step == 2:
                params[-1].grad[-1] = float("inf")
            scaler.step(opt)
            scaler.update()
        return scaler.get_scale(), [p.detach().clone() for p in params]

    assert_matches_torch(run, backend, init_scale=4.0, growth_interval=1)


# in a store of 4 entries of each kind, 4: as many layouts as it keeps; 5: more
@pytest.mark.parametrize("n_layouts", [2, 4, 5])
def test_grads_cycling_through_memory_layouts(backend, n_layouts, monkeypatch):
    """Grads whose memory cycles through a few address layouts (an allocator handing back
    the blocks of an earlier step) reuse those layouts' launch plans, and more layouts than
    are kept replan: inf / NaN / -inf planted at the first and last element of the first and
    last grad skip exactly torch's steps, and the parameters equal torch's."""
    monkeypatch.setattr(_plan_store, "CAPACITY", 4)
    _plan_store.clear()
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

    built = count_calls(monkeypatch, _plans, "plan_unscale", key="plans")
    assert_matches_torch(run, backend, init_scale=2.0**8, growth_interval=2)
    if backend == "triton":  # each layout planned once while they fit, every step otherwise
        assert built["plans"] == (n_layouts if n_layouts <= 4 else 3 * n_layouts + 2)


def test_plans_reused_for_groups_of_several_dtypes(backend, monkeypatch):
    """Parameters of three dtypes interleaved (float32 at 0 and 2, bfloat16 at 1, float64 at
    3): each (device, dtype) group picks its grads out of the optimizer's list, and each
    group's plan is made at the first step and reused at the others (a group picking the
    wrong grads would be replanned every step through the per-grad path). An inf in the
    bfloat16 grad, a NaN in the last float32 element: torch's steps are skipped."""
    def run(scaler):
        torch.manual_seed(0)
        dtypes = (torch.float32, torch.bfloat16, torch.float32, torch.float64)
        params = [torch.nn.Parameter(torch.randn(n, dtype=d))
                  for n, d in zip((5, 7, 300, 3), dtypes)]
        opt = torch.optim.SGD(params, lr=0.1)
        for step in range(6):
            opt.zero_grad(set_to_none=False)
            scaler.scale(sum((p.float() * (i + 1)).square().sum()
                             for i, p in enumerate(params))).backward()
            if step == 2:
                params[1].grad[0] = float("inf")
            if step == 4:
                params[2].grad[-1] = float("nan")
            scaler.step(opt)
            scaler.update()
        return scaler.get_scale(), [p.detach().clone() for p in params]

    built = count_calls(monkeypatch, _plans, "plan_unscale", key="plans")
    assert_matches_torch(run, backend, init_scale=8.0, growth_interval=1)
    assert built["plans"] == (3 if backend == "triton" else 0)


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

    assert_matches_torch(lambda scaler: train_in_fixed_memory(scaler, gapped, steps=5),
                          backend, init_scale=8.0, growth_interval=1)


def test_plans_reused_through_one_tensor_guards_check(backend, tensor_guards, monkeypatch):
    """Grads at the same addresses step after step: planned at the first step (which builds
    the TensorGuards over them), then one TensorGuards check at each later step."""
    if backend != "triton" or not tensor_guards:
        pytest.skip("plans are reused on the Triton backend; the guard is torch's")
    counts, real_guards = Counter(), _plan_store.TensorGuards

    class CountingGuards:
        def __init__(self, *grads, **kwargs):
            counts["built"] += 1
            self.guards = real_guards(*grads, **kwargs)

        def check(self, *grads):
            counts["checked"] += 1
            return self.guards.check(*grads)

    monkeypatch.setattr(_plan_store, "TensorGuards", CountingGuards)
    count_calls(monkeypatch, _plans, "plan_unscale", counts, "planned")

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

    assert_matches_torch(run, backend, init_scale=8.0, growth_interval=1)
    assert counts == {"planned": 1, "built": 1, "checked": 5}


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
    planned = count_calls(monkeypatch, _plans, "plan_unscale", key="plans")

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

    assert_matches_torch(run, backend, init_scale=8.0, growth_interval=1)
    if backend == "triton" and then == "same":
        assert planned["plans"] == (1 if tensor_guards else 7)


@pytest.mark.filterwarnings("ignore:grad and param do not obey the gradient layout contract")
@pytest.mark.parametrize("change", ["none", "strides"])
def test_grads_at_new_addresses_every_step(backend, change):
    """Grads at new addresses at every step (views into one buffer, shifted and in another
    order each step: an allocator handing out other blocks), each step planned against the
    layout the last planning checked: exact, with an inf planted at a grad's last element and
    NaN between the grads; a grad turned transposed at new addresses (``strides``) is checked
    and planned anew."""
    def run(scaler):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(shape)) for shape in ((7,), (20, 15), (33,))]
        opt = torch.optim.SGD(params, lr=0.1)
        memory = torch.zeros(2000)
        for step in range(6):
            memory.fill_(float("nan"))  # between the grads: what a plan reading past one sees
            at = 16 * step + 3
            for i in ((0, 1, 2) if step % 2 else (2, 0, 1)):
                p = params[i]
                grad = memory[at:at + p.numel()]
                if p.dim() == 2 and change == "strides" and step >= 3:
                    grad = grad.view(15, 20).t()
                p.grad = grad.view(p.shape) if grad.dim() == 1 else grad
                p.grad.zero_()
                at += p.numel() + 5
            scaler.scale(sum((p * (i + 1)).square().sum() for i, p in enumerate(params))
                         ).backward()
            if step == 4:
                params[1].grad[-1, -1] = float("inf")
            scaler.step(opt)
            scaler.update()
        return scaler.get_scale(), [p.detach().clone() for p in params]

    assert_matches_torch(run, backend, init_scale=8.0, growth_interval=1)


def test_grads_planned_again_at_the_same_addresses_issue_no_tensor_op(backend, tensor_guards,
                                                                       monkeypatch):
    """Grads at their addresses of the step before, planned again where the kept plans'
    check fails (here under a TorchDispatchMode, which torch's TensorGuards see): the chunk
    table comes from the store, so the step's unscale issues no tensor op besides its
    launch, and steps as torch's."""
    from _launch_counting import _launches, _Ops

    if backend != "triton" or not tensor_guards:
        pytest.skip("plans are kept on the Triton backend; the guard is torch's")
    counts = count_calls(monkeypatch, _plans, "plan_unscale")
    issued = []

    def run(scaler):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(n)) for n in (5, 300, 3)]
        opt = torch.optim.SGD(params, lr=0.1)
        with _launches(monkeypatch):
            for step in range(4):
                opt.zero_grad(set_to_none=False)
                scaler.scale(sum((p * (i + 1)).square().sum() for i, p in enumerate(params))
                             ).backward()
                if step == 3:
                    params[1].grad[-1] = float("inf")
                if step >= 2 and isinstance(scaler, GradScaler):
                    before = counts["plan_unscale"]
                    with _Ops() as mode:
                        scaler.unscale_(opt)
                    issued.append((sum(mode.ops.values()), counts["plan_unscale"] - before))
                scaler.step(opt)
                scaler.update()
        return scaler.get_scale(), [p.detach().clone() for p in params]

    assert_matches_torch(run, backend, init_scale=8.0, growth_interval=1)
    assert issued == [(0, 1), (0, 0)], issued  # planned again once, under the mode
