"""GradScaler.clip_grad_norm_ when some grad groups run on the Triton kernels and others on
torch's ops: with ``backend="auto"`` on a GPU machine, grads on the CPU (offloaded
parameters) beside CUDA ones. Here, on the CPU, the float32 group stands for the CUDA one
(Triton, through the interpreter) and the bfloat16 group for the CPU one (torch's ops). The
norm of both is one norm, each grad is ``dtype(dtype(g * inv_scale) * clip_coef)``, and an
overflow in either group skips the step, as torch's ``unscale_`` + ``clip_grad_norm_``.

In a GPU run (``triton_device`` CUDA) every grad is a CUDA one, the bfloat16 group still on
torch's ops, and torch's scaler unscales CPU copies: its CUDA op has no bfloat16. The clip's
product is then formed on the grads' device with the op that group uses (``_foreach_mul_``
by the float32 coefficient, as torch's ``clip_grad_norm_``): on the H200 (torch 2.11) it
gave 1 bfloat16 ulp more than the CPU's at some elements of a bfloat16 grad (2026-12-04;
torch's CUDA source sends a coefficient of another dtype to its per-tensor route, which
reads it as bfloat16). Only this test sends a CUDA group to torch's ops: with ``"auto"``
that route takes CPU grads. The SGD step's rate is a power of two, so its product is exact
and the step rounds once on either device (fused multiply-add or not)."""

import math

import pytest
import torch
from _util import assert_all_same

from triton_scaler import GradScaler, _clip

SCALE = 1000.0  # not a power of two: the unscaled bf16 grads are rounded
FP32_SIZES = (7, 4099)  # on Triton
BF16_SIZES = {"bf16": (33, 0, 1, 300), "bf16 empty": (0,)}  # on torch's ops


def _backward(scaler, bf16_sizes, plant, device):
    """fp32, the bf16 parameters, fp32; an inf at the end of that route's last grad."""
    gen = torch.Generator().manual_seed(0)
    sizes = [(FP32_SIZES[0], torch.float32), *[(n, torch.bfloat16) for n in bf16_sizes],
             (FP32_SIZES[1], torch.float32)]
    params = [torch.nn.Parameter(torch.randn(n, generator=gen).to(device, dtype))
              for n, dtype in sizes]
    targets = [(torch.randn(p.shape, generator=gen) * 3).to(device) for p in params]
    scaler.scale(sum((p.float() * t).sum() for p, t in zip(params, targets))).backward()
    if plant is not None:
        dtype = torch.float32 if plant == "triton" else torch.bfloat16
        with torch.no_grad():
            [p for p in params if p.dtype == dtype][-1].grad[-1] = math.inf
    return params, torch.optim.SGD(params, lr=0.125)


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
@pytest.mark.parametrize("plant", [None, "triton", "torch"])
@pytest.mark.parametrize("bf16", list(BF16_SIZES))
def test_groups_on_triton_and_on_torchs_ops_clip_as_one(monkeypatch, norm_type, plant, bf16,
                                                        triton_device):
    """An empty grad counts for nothing in the inf norm (torch's max of no element raises);
    a group of only empty grads adds nothing to the norm. In a GPU run every grad is a CUDA
    one; the bfloat16 group still goes to torch's ops."""
    if plant == "torch" and bf16 == "bf16 empty":
        pytest.skip("no element to plant an inf in")
    routes = []
    monkeypatch.setattr(_clip, "_on_triton", lambda group, backend: routes.append(
        group.grads[0].dtype) or group.grads[0].dtype == torch.float32)
    ours = GradScaler(triton_device.type, init_scale=SCALE, backend="triton")
    theirs = torch.amp.GradScaler("cpu", init_scale=SCALE)
    params, opt = _backward(ours, BF16_SIZES[bf16], plant, triton_device)
    expected_params, expected_opt = _backward(theirs, BF16_SIZES[bf16], plant,
                                              torch.device("cpu"))
    max_norm = 0.5
    total = ours.clip_grad_norm_(opt, max_norm, norm_type)
    assert sorted(routes, key=str) == [torch.bfloat16, torch.float32]  # one group each
    assert total.dtype == torch.float32 and total.shape == ()
    theirs.unscale_(expected_opt)
    unscaled = [p.grad.clone() for p in expected_params]
    if plant is None:
        flat = torch.cat([g.double().reshape(-1) for g in unscaled])
        norm = torch.linalg.vector_norm(flat, norm_type).item()
        assert abs(total.item() - norm) <= 1e-5 * norm
        clipped = [g.to(triton_device) for g in unscaled]  # clipped as torch clips there
        torch._foreach_mul_(clipped, torch.clamp(max_norm / (total + 1e-6), max=1.0))
        assert_all_same([p.grad for p in params], clipped)
        for p, g in zip(expected_params, clipped):
            p.grad = g.cpu()  # torch's step on the same clipped grads
    else:
        assert not math.isfinite(total.item())
    for scaler, optimizer in ((ours, opt), (theirs, expected_opt)):
        scaler.step(optimizer)
        scaler.update()
    assert ours.get_scale() == theirs.get_scale() == (SCALE / 2 if plant else SCALE)
    assert_all_same([p.detach().cpu() for p in params], [p.detach() for p in expected_params])
