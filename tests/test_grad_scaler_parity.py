"""GradScaler against torch.amp.GradScaler: same trajectory, bit-identical parameters."""

import pytest
import torch
from _loops import assert_same_optimizer_state, train
from _util import assert_all_same

import triton_scaler

CASES = [
    dict(optimizer_name="sgd_momentum"),
    dict(optimizer_name="sgd_momentum", clip=True),
    dict(optimizer_name="adamw"),
    dict(optimizer_name="adamw", clip=True),
    dict(optimizer_name="adamw_fused"),
    dict(optimizer_name="adamw_fused", clip=True),
    dict(optimizer_name="adamw_foreach", two_optimizers=True),
    dict(optimizer_name="sgd_momentum", two_optimizers=True, clip=True),
    dict(optimizer_name="adamw_fused", two_optimizers=True),
    dict(optimizer_name="sgd_momentum", two_groups=True, clip=True),
    dict(optimizer_name="adamw_fused", two_groups=True),
    dict(optimizer_name="adamw", overflow_at=()),
    dict(optimizer_name="adamw", accumulate=3),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_training_parity(backend, case):
    kwargs = dict(init_scale=2.0**10, growth_interval=3)
    expected = train(torch.amp.GradScaler("cpu", **kwargs), **case)
    actual = train(triton_scaler.GradScaler("cpu", **kwargs, backend=backend), **case)
    assert actual[0] == expected[0]
    assert_all_same(actual[1], expected[1])
    for a, b in zip(actual[2], expected[2]):
        assert_same_optimizer_state(a, b)


@pytest.mark.parametrize("optimizer_name", ["sgd_momentum", "adamw_fused"])
def test_calibrates_down_from_2_pow_127(backend, optimizer_name):
    kwargs = dict(init_scale=2.0**127, growth_interval=4)
    expected = train(torch.amp.GradScaler("cpu", **kwargs), optimizer_name, steps=40,
                     overflow_at=())
    actual = train(triton_scaler.GradScaler("cpu", **kwargs, backend=backend), optimizer_name,
                   steps=40, overflow_at=())
    assert actual[0] == expected[0]
    assert actual[0][0][0] < 2.0**127  # it did overflow and back off
    assert_all_same(actual[1], expected[1])


def test_default_arguments_match_torch(backend):
    ours = triton_scaler.GradScaler("cpu", backend=backend)
    theirs = torch.amp.GradScaler("cpu")
    assert ours.state_dict().items() >= theirs.state_dict().items()
    assert isinstance(ours, torch.amp.GradScaler)


def _create_graph_step(scaler, grad_mode, buckets, fused):
    """One step whose backward ran with ``create_graph=True`` (the grads require grad), with
    ``unscale_`` / ``step`` called under ``grad_mode``: (grads after unscale_, grad mode seen
    after each call, parameters after step, the scale after update)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=fused)
    if buckets:
        triton_scaler.GradBuckets(opt)
    scaler.scale(model(torch.randn(7, 5)).pow(2).sum()).backward(create_graph=True)
    assert all(p.grad.requires_grad for p in model.parameters())
    grad_fns = [p.grad.grad_fn for p in model.parameters()]
    modes = []
    with torch.set_grad_enabled(grad_mode):
        if not fused:
            scaler.unscale_(opt)
            modes.append(torch.is_grad_enabled())
            if not buckets:  # nothing recorded in the grads' graph
                assert [p.grad.grad_fn for p in model.parameters()] == grad_fns
        grads = [p.grad.detach().clone() for p in model.parameters()]
        scaler.step(opt)
        modes.append(torch.is_grad_enabled())
    scaler.update()
    return grads, modes, [p.detach().clone() for p in model.parameters()], scaler.get_scale()


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
@pytest.mark.filterwarnings("ignore:.* no longer views into their GradBucket")  # a new grad
@pytest.mark.parametrize("grad_mode", [True, False])
@pytest.mark.parametrize("route", ["plain", "plain-buckets", "fused"])
def test_grads_that_require_grad_are_unscaled_as_torchs(backend, grad_mode, route):
    """A backward with ``create_graph=True`` leaves grads that require grad: unscaled (or
    checked, fused) as torch's scaler does, with nothing recorded in their graph, and the
    caller's grad mode is as it was after each call."""
    buckets, fused = route == "plain-buckets", route == "fused"
    expected = _create_graph_step(torch.amp.GradScaler("cpu", init_scale=4.0), grad_mode,
                                  False, fused)
    actual = _create_graph_step(triton_scaler.GradScaler("cpu", init_scale=4.0,
                                                         backend=backend),
                                grad_mode, buckets, fused)
    assert actual[1] == expected[1] == [grad_mode] * len(expected[1])
    assert_all_same(actual[0], expected[0])
    assert_all_same(actual[2], expected[2])
    assert actual[3] == expected[3]


def test_grad_mode_is_restored_when_unscale_raises(backend):
    param = torch.nn.Parameter(torch.ones(3, dtype=torch.float16))
    opt = torch.optim.SGD([param], lr=0.1)
    scaler = triton_scaler.GradScaler("cpu", backend=backend)
    scaler.scale(param.float().sum()).backward()
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        scaler.unscale_(opt)
    assert torch.is_grad_enabled()


def _gradient_penalty_run(scaler, *, buckets, fused):
    """torch's AMP example "Gradient penalty": the penalty's grads come from
    ``autograd.grad`` of the scaled loss (create_graph), unscaled by ``1 / get_scale()``, and
    the loss plus the penalty is scaled and stepped; one step overflows. Returns the scale
    after every update and the parameters."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-2, fused=fused)
    if buckets:
        triton_scaler.GradBuckets(opt)
    gen = torch.Generator().manual_seed(2)
    trajectory = []
    for step in range(8):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(torch.randn(4, 6, generator=gen)).float().square().mean()
        if step == 3:
            loss = loss * float("inf")
        scaled_grads = torch.autograd.grad(scaler.scale(loss), params, create_graph=True)
        inv_scale = 1.0 / scaler.get_scale()
        penalty = torch.stack([(g * inv_scale).pow(2).sum() for g in scaled_grads]).sum().sqrt()
        scaler.scale(loss + penalty).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=not buckets)
        trajectory.append(scaler.get_scale())
    return trajectory, [p.detach().clone() for p in params]


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
@pytest.mark.parametrize("buckets", [False, True], ids=["grads", "buckets"])
def test_gradient_penalty_recipe_as_torchs(backend, buckets, fused):
    kwargs = dict(init_scale=2.0**12, growth_interval=2)
    expected = _gradient_penalty_run(torch.amp.GradScaler("cpu", **kwargs), buckets=False,
                                     fused=fused)
    actual = _gradient_penalty_run(triton_scaler.GradScaler("cpu", backend=backend, **kwargs),
                                   buckets=buckets, fused=fused)
    assert expected[0][3] == expected[0][2] / 2  # the overflow was seen and backed off
    assert actual[0] == expected[0]
    assert_all_same(actual[1], expected[1])


def _many_optimizers_run(scaler, overflowing):
    """Two iterations over 10 optimizers (past the scaler's 8 found_inf slots), optimizer
    ``overflowing``'s grad non-finite in the first: (params, scale, growth tracker, the
    dtypes of the scale, the growth tracker and every optimizer's found_inf)."""
    params = [torch.nn.Parameter(torch.full((3,), float(i + 1))) for i in range(10)]
    opts = [torch.optim.SGD([p], lr=0.1) for p in params]
    for iteration in range(2):
        loss = sum((p * p).sum() for p in params)
        scaler.scale(loss).backward()
        if iteration == 0 and overflowing is not None:
            params[overflowing].grad[-1] = torch.nan
        for opt in opts:
            scaler.step(opt)
        dtypes = [scaler._scale.dtype, scaler._growth_tracker.dtype] + [
            found_inf.dtype for opt in opts
            for found_inf in scaler._found_inf_per_device(opt).values()]
        scaler.update()
        for opt in opts:
            opt.zero_grad()
    return params, scaler.get_scale(), scaler._get_growth_tracker(), dtypes


@pytest.mark.parametrize("overflowing", [None, 0, 7, 8, 9])
def test_optimizers_past_the_found_inf_slots_as_torchs(backend, overflowing):
    kwargs = dict(init_scale=2.0**10, growth_interval=2)
    expected = _many_optimizers_run(torch.amp.GradScaler("cpu", **kwargs), overflowing)
    actual = _many_optimizers_run(triton_scaler.GradScaler("cpu", **kwargs, backend=backend),
                                  overflowing)
    assert actual[1:] == expected[1:]
    assert_all_same(actual[0], expected[0])


def test_a_float64_default_dtype_leaves_torchs_float32_state(backend):
    """Under ``torch.set_default_dtype(torch.float64)`` (float64 params) the scale and every
    optimizer's found_inf, past the 8 slots too, are float32 as torch's, and the run is
    torch's."""
    kwargs = dict(init_scale=2.0**10, growth_interval=2)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        expected = _many_optimizers_run(torch.amp.GradScaler("cpu", **kwargs), 9)
        actual = _many_optimizers_run(triton_scaler.GradScaler("cpu", **kwargs, backend=backend),
                                      9)
    finally:
        torch.set_default_dtype(default)
    assert expected[0][0].dtype == torch.float64 and expected[3][0] == torch.float32
    assert actual[1:] == expected[1:]
    assert_all_same(actual[0], expected[0])


@pytest.mark.parametrize("device", [torch.device("cpu"), "cpu:0"], ids=["torch.device", "cpu:0"])
def test_a_device_given_as_torch_takes_it(backend, device):
    """``device`` as a ``torch.device``, or a string with an index: taken as torch's scaler
    takes it (not refused), with the same trajectory and parameters."""
    kwargs = dict(init_scale=2.0**10, growth_interval=3)
    expected = train(torch.amp.GradScaler(device, **kwargs), steps=8)
    actual = train(triton_scaler.GradScaler(device, **kwargs, backend=backend), steps=8)
    assert actual[0] == expected[0]
    assert_all_same(actual[1], expected[1])
