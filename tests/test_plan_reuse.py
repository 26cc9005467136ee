"""The no-bucket path plans each step from the grads it reads (the chunk table's rows kept
per size pattern), and stays exact when the grads' memory changes: grads cycling through
memory layouts or at new addresses every step, empty grads first, grads assigned as views
with gaps, channels_last and transposed grads. Each run against torch's scaler (which reads
every ``.grad`` each step). The parameters changing: ``test_plan_reuse_params.py``."""

import pytest
import torch
from _launch_counting import count_calls
from _plan_reuse import assert_matches_torch, train_in_fixed_memory
from _util import view_in

from triton_scaler import GradScaler, _plans

_F32, _BF16, _F64 = torch.float32, torch.bfloat16, torch.float64


@pytest.mark.parametrize("layout", [
    ((0, _F32), (5, _F32), (9, _F32)), ((0, _F32), (0, _F32), (7, _F32), (3, _F32)),
    ((4, _F32), (0, _F32), (6, _F32)), ((5, _F32), (0, _BF16), (300, _F32)),
    ((5, _F32), (0, _F64), (300, _F32))],
    ids=["empty_first", "two_empty_first", "empty_middle", "empty_bf16_group",
         "empty_fp64_group"])
def test_reused_plans_with_empty_grads(backend, layout):
    """A group whose first grads are empty: the launch's base is its first non-empty grad,
    at every step. A (device, dtype) group whose only grad is empty (a plan without
    elements) beside a float32 group launches nothing."""
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


@pytest.mark.parametrize("n_layouts", [2, 5])
def test_grads_cycling_through_memory_layouts(backend, n_layouts, monkeypatch):
    """Grads whose memory cycles through a few address layouts (an allocator handing back
    the blocks of an earlier step), planned at every step: inf / NaN / -inf planted at the
    first and last element of the first and last grad skip exactly torch's steps, and the
    parameters equal torch's."""
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
    assert built["plans"] == (3 * n_layouts + 2 if backend == "triton" else 0)


def test_groups_of_several_dtypes_pick_their_grads(backend, monkeypatch):
    """Parameters of three dtypes interleaved (float32 at 0 and 2, bfloat16 at 1, float64 at
    3): each (device, dtype) group picks its grads out of the optimizer's list and is
    planned once a step (a group picking the wrong grads would take the per-grad path, whose
    groups plan at their launch). An inf in the bfloat16 grad, a NaN in the last float32
    element: torch's steps are skipped."""
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
    assert built["plans"] == (3 * 6 if backend == "triton" else 0)


@pytest.mark.filterwarnings("ignore:grad and param do not obey the gradient layout contract")
@pytest.mark.parametrize("gapped_from", [1, 2, 3])
@pytest.mark.parametrize("new_list", [False, True], ids=["same_list", "new_list"])
def test_gapped_grad_assigned_at_the_address_and_size_of_the_grad_before_it(
        backend, gapped_from, new_list):
    """A grad assigned as a view with gaps (``p.grad = m[:600:2]``) at exactly the address
    and size of the contiguous grad before it: the reused plan would unscale the first 300
    elements of ``m`` (half of them between the view's elements) and miss its inf; it is
    planned as a copy-back launch, equal to torch, the memory between the gapped grad's
    elements included; from the second, third or fourth step on, with a new parameter list
    too."""
    def gapped(step, params, memory, opt):
        if step >= gapped_from:
            params[1].grad = memory[1][:600:2].zero_()
        if step == gapped_from and new_list:
            opt.param_groups[0]["params"] = list(opt.param_groups[0]["params"])

    assert_matches_torch(lambda scaler: train_in_fixed_memory(scaler, gapped, steps=5),
                          backend, init_scale=8.0, growth_interval=1)


@pytest.mark.filterwarnings("ignore:grad and param do not obey the gradient layout contract")
@pytest.mark.parametrize("then", ["same", "contiguous", "gapped", "gapped_channels_last"])
def test_channels_last_and_transposed_grads(backend, then, monkeypatch):
    """Conv weights in channels_last and a transposed weight (their grads too, by torch's
    gradient layout contract), beside a bias: planned over their flat memory. From step 3
    the grads at the same addresses and of the same sizes are contiguous, or gapped (every
    other element; in either layout): planned as they are.
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
    if backend == "triton":  # one launch a step, planned at its step
        assert planned["plans"] == 7


@pytest.mark.filterwarnings("ignore:grad and param do not obey the gradient layout contract")
@pytest.mark.parametrize("change", ["none", "strides"])
def test_grads_at_new_addresses_every_step(backend, change):
    """Grads at new addresses at every step (views into one buffer, shifted and in another
    order each step: an allocator handing out other blocks): exact, with an inf planted at
    a grad's last element and NaN between the grads; a grad turned transposed at new
    addresses (``strides``) is planned as it is."""
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


def test_a_steady_step_issues_no_tensor_op_besides_its_launch(backend, monkeypatch):
    """Grads of the sizes of the step before, at their addresses or at new ones: the step's
    unscale plans once (the chunk table's rows from the memo of its size pattern, the
    starts an array over the addresses) and issues no tensor op besides its launch; steps as
    torch's."""
    from _launch_counting import _launches, _Ops

    if backend != "triton":
        pytest.skip("planning is the Triton backend's")
    counts = count_calls(monkeypatch, _plans, "plan_unscale")
    issued = []

    def run(scaler):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(n)) for n in (5, 300, 3)]
        opt = torch.optim.SGD(params, lr=0.1)
        with _launches(monkeypatch):
            for step in range(5):
                opt.zero_grad(set_to_none=step < 3)  # at new addresses, then the same
                scaler.scale(sum((p * (i + 1)).square().sum() for i, p in enumerate(params))
                             ).backward()
                if step == 4:
                    params[1].grad[-1] = float("inf")
                if step >= 1 and isinstance(scaler, GradScaler):
                    before = counts["plan_unscale"]
                    with _Ops() as mode:
                        scaler.unscale_(opt)
                    issued.append((sum(mode.ops.values()), counts["plan_unscale"] - before))
                scaler.step(opt)
                scaler.update()
        return scaler.get_scale(), [p.detach().clone() for p in params]

    assert_matches_torch(run, backend, init_scale=8.0, growth_interval=1)
    assert issued == [(0, 1)] * 4, issued
