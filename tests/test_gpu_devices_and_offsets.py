"""GPU tests of where the kernels read and write: grads on a CUDA device that is not the
current one (launches, streams and the step's host read go to the grads' device), one
optimizer over CUDA and CPU parameters (the step, the fused clip), and offsets
past 2^31 elements (table rows that far from the first grad: tests/test_ops_unscale.py, also
through the interpreter). Skipped without CUDA; run with tests/run_gpu.sh."""

import math

import pytest
import torch
from _util import assert_all_same, assert_same
from test_gpu import _cuda_train, _grads

from triton_scaler import GradScaler, ops

pytestmark = pytest.mark.gpu


def test_grads_on_a_device_that_is_not_current(cuda):
    """Launches go to the grads' device (Triton launches on the current one otherwise)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    other = torch.device("cuda", 1)
    with torch.cuda.device(0):
        grads = _grads([1000, 7, 4097], torch.float32, other)
        grads[1][-1] = math.inf
        expected = [g.clone() for g in grads]
        found_t = torch.zeros((), device=other)
        found = torch.zeros((), device=other)
        inv = torch.tensor(0.25, device=other)
        torch._amp_foreach_non_finite_check_and_unscale_(expected, found_t, inv)
        ops.non_finite_check_and_unscale_(grads, found, inv, backend="triton")
        assert_all_same(grads, expected)
        assert_same(found, found_t)
        kwargs = dict(init_scale=2.0**16, growth_interval=5)
        theirs = _cuda_train(torch.amp.GradScaler("cuda", **kwargs), other, fused=False)
        ours = _cuda_train(GradScaler("cuda", **kwargs, backend="triton"), other, fused=False)
    assert ours[0] == theirs[0]
    assert_all_same(ours[1], theirs[1])


def test_the_step_waits_for_the_found_inf_copy_of_a_device_that_is_not_current(cuda):
    """step()'s one read waits for found_inf on the grads' device's stream, not on the
    current device's: a read that waited only there would not wait for the busy stream (a
    sleep before the unscale) and would step on infinite grads."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    other = torch.device("cuda", 1)
    with torch.cuda.device(0):
        param = torch.nn.Parameter(torch.ones(1000, device=other))
        opt = torch.optim.SGD([param], lr=1.0)
        scaler = GradScaler("cuda", backend="triton")
        for _ in range(3):
            scaler.scale((param * math.inf).sum()).backward()
            with torch.cuda.device(other):
                torch.cuda._sleep(100_000_000)  # the unscale and the copy queue behind it
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    assert torch.equal(param.detach(), torch.ones(1000, device=other))


@pytest.mark.parametrize("backend", ["auto", "reference"])
@pytest.mark.parametrize("inf_on", [None, "cuda", "cpu"])
def test_an_optimizer_over_cuda_and_cpu_parameters_steps_as_torchs(cuda, inf_on, backend):
    """One optimizer over a CUDA and a CPU parameter (an offloaded embedding's shape): the CPU
    grads get the scale's CPU replica (``"auto"``: the CUDA grads on Triton, the CPU grads on
    the reference path), found_inf of both devices decides the step on the scale's device,
    and scale trajectory and parameters are torch's; an inf at steps 1 and 2 on ``inf_on``'s
    grad (last element)."""
    results = []
    for scaler in (torch.amp.GradScaler("cuda", init_scale=2.0**10, growth_interval=2),
                   GradScaler("cuda", init_scale=2.0**10, growth_interval=2, backend=backend)):
        gen = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(33, generator=gen).to(cuda)),
                  torch.nn.Parameter(torch.randn(7, generator=gen))]
        opt = torch.optim.SGD(params, lr=0.1)
        scales = []
        for step in range(6):
            opt.zero_grad()
            loss = (params[0] ** 2).sum() + (params[1] ** 2).sum().to(cuda)
            scaler.scale(loss).backward()
            if step in (1, 2) and inf_on is not None:
                params[0 if inf_on == "cuda" else 1].grad[-1] = math.inf
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        results.append((scales, [p.detach().cpu() for p in params]))
    (theirs, their_params), (ours, our_params) = results
    assert ours == theirs
    assert_all_same(our_params, their_params)


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
@pytest.mark.parametrize("inf_on", [None, "cuda", "cpu"])
def test_the_fused_clip_over_cuda_and_cpu_parameters(cuda, norm_type, inf_on):
    """``backend="auto"``: the CUDA grads' read and write passes run on Triton, the CPU
    grads' on torch's ops (tests/test_clip_mixed_backends.py stands in for this on the CPU).
    One norm on the scale's device, within 1e-5 of an fp64 oracle; every grad is
    ``g * inv_scale * coef`` given it, bit for bit; an inf on either device skips the step."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4097, generator=gen).to(cuda)),
              torch.nn.Parameter(torch.randn(33, generator=gen))]
    opt = torch.optim.SGD(params, lr=0.1)
    scaler = GradScaler("cuda", init_scale=1000.0)
    scaler.scale((params[0] ** 2).sum() + (params[1] ** 2).sum().to(cuda)).backward()
    if inf_on is not None:
        params[0 if inf_on == "cuda" else 1].grad[-1] = math.inf
    unscaled = [p.grad.clone() for p in params]
    inv = torch.full((), 1000.0).double().reciprocal().float()
    for g in unscaled:
        torch._amp_foreach_non_finite_check_and_unscale_(
            [g], torch.zeros((), device=g.device), inv.to(g.device))
    before = [p.detach().clone() for p in params]
    total = scaler.clip_grad_norm_(opt, 0.5, norm_type)
    assert total.device.type == "cuda" and total.dtype == torch.float32
    if inf_on is None:
        flat = torch.cat([g.double().cpu() for g in unscaled])
        norm = torch.linalg.vector_norm(flat, norm_type).item()
        assert abs(total.item() - norm) <= 1e-5 * norm
        coef = torch.clamp(0.5 / (total + 1e-6), max=1.0)
        for g in unscaled:
            g.mul_(coef.to(g.device))
        assert_all_same([p.grad.cpu() for p in params], [g.cpu() for g in unscaled])
    else:
        assert not math.isfinite(total.item())
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == (500.0 if inf_on else 1000.0)
    if inf_on is not None:
        assert_all_same([p.detach() for p in params], before)


def test_backend_triton_refuses_an_optimizer_with_cpu_parameters(cuda):
    """backend="triton" runs on CUDA tensors only (outside the interpreter): a CPU grad beside
    a CUDA one raises, naming the backend and the way out, and no grad is touched."""
    params = [torch.nn.Parameter(torch.ones(33, device=cuda)), torch.nn.Parameter(torch.ones(7))]
    opt = torch.optim.SGD(params, lr=0.1)
    scaler = GradScaler("cuda", init_scale=2.0**10, backend="triton")
    scaler.scale((params[0].sum() + params[1].sum().to(cuda)) * 1.0).backward()
    message = "backend='triton' runs on CUDA tensors; got tensors on cpu.*'reference' \\(or 'auto'"
    with pytest.raises(RuntimeError, match=message):
        scaler.unscale_(opt)
    assert all(torch.equal(p.grad.cpu(), torch.full_like(p.grad.cpu(), 2.0**10)) for p in params)


def _free_gib(cuda) -> float:
    free, _ = torch.cuda.mem_get_info(cuda)
    return free / 2**30


def test_a_tensor_of_more_than_2_31_elements(cuda):
    """Offsets past 2^31 elements (int64 program ids, a 64-bit n_elements): the last element
    of a 2^31 + 37 element bucket is checked and unscaled."""
    if _free_gib(cuda) < 20:
        pytest.skip("needs 20 GiB of free GPU memory")
    n = 2**31 + 37
    g = torch.ones(n, device=cuda)
    g[-1] = math.inf
    g[-2] = 3.0
    found = torch.zeros((), device=cuda)
    ops.non_finite_check_and_unscale_([g], found, torch.tensor(0.5, device=cuda),
                                      backend="triton")
    assert found.item() == 1.0
    assert g[-2].item() == 1.5 and g[0].item() == 0.5 and g[2**31].item() == 0.5
    assert math.isinf(g[-1].item())
    del g
    torch.cuda.empty_cache()
