"""Which route the Accelerate and Fabric helpers take, without the libraries: stand-ins that
carry only the attributes the helpers read, and whose own clip is the library's route
(unscale through the scaler, then torch's ``clip_grad_norm_``). The fused route is taken
exactly where it gives the library's result; everywhere else the library's own method runs.
``tests/test_integrations.py`` runs the real libraries where they are installed."""

import math
from types import SimpleNamespace

import pytest
import torch

from triton_scaler import GradScaler
from triton_scaler import integrations as ti


def _library_clip(scaler, optimizer, parameters, max_norm, norm_type):
    scaler.unscale_(optimizer)
    return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type)


class Accelerator:
    """What ``accelerate_clip_grad_norm_`` reads of ``accelerate.Accelerator``."""

    def __init__(self, scaler, optimizers, distributed_type="NO", native_amp=True):
        self.scaler, self.native_amp = scaler, native_amp
        self.distributed_type = SimpleNamespace(value=distributed_type)  # an enum's .value
        self._optimizers = [SimpleNamespace(optimizer=opt) for opt in optimizers]  # wrapped
        self.own_calls = 0

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        self.own_calls += 1
        return _library_clip(self.scaler, self._optimizers[0].optimizer, list(parameters),
                             max_norm, norm_type)


class Fabric:
    """What ``fabric_clip_gradients`` reads of ``lightning.Fabric``."""

    def __init__(self, scaler):
        self._precision = SimpleNamespace(scaler=scaler)
        self.own_calls = 0

    def clip_gradients(self, module, optimizer, max_norm, norm_type, error_if_nonfinite):
        self.own_calls += 1
        self.own_arguments = (max_norm, norm_type, error_if_nonfinite)
        inner = ti._inner_optimizer(optimizer)
        return _library_clip(self._precision.scaler, inner, list(module.parameters()),
                             max_norm, norm_type)


def _setup(scaler_kind, backend, overflow=False):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.ReLU(), torch.nn.Linear(12, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = (GradScaler("cpu", init_scale=2.0**12, backend=backend) if scaler_kind == "ours"
              else torch.amp.GradScaler("cpu", init_scale=2.0**12))
    if scaler_kind == "disabled":
        scaler = GradScaler("cpu", enabled=False, backend=backend)
    if isinstance(scaler, GradScaler):  # a fused clip is of the rank's own (DDP: whole) grads
        clip = scaler.clip_grad_norm_
        scaler.clip_grad_norm_ = lambda *a, **k: clip(*a, **k) if k.get("sharded") is False \
            else pytest.fail("the fused clip not given sharded=False")
    loss = model(torch.randn(4, 6)).square().sum() * (math.inf if overflow else 1.0)
    scaler.scale(loss).backward()
    return model, opt, scaler


def _same_result(fused, plain, backend):
    """Norm and grads equal (NaN where NaN): bit for bit on the reference backend (torch's own
    norm arithmetic); to float32 rounding on Triton, whose 2-norm sums in its own order."""
    tolerance = 0 if backend == "reference" else 1e-6
    for a, b in zip([fused[0], *fused[1]], [plain[0], *plain[1]]):
        torch.testing.assert_close(a, b, rtol=tolerance, atol=0, equal_nan=True)


def _accelerate_run(backend, case, overflow=False):
    model, opt, scaler = _setup("torch" if case == "torch scaler" else
                                "disabled" if case == "disabled scaler" else "ours",
                                backend, overflow)
    params = list(model.parameters())
    optimizers = [opt, torch.optim.SGD([torch.nn.Parameter(torch.ones(1))])] \
        if case == "two optimizers" else [opt]
    accelerator = Accelerator(scaler, optimizers,
                              distributed_type="FSDP" if case == "FSDP" else "NO",
                              native_amp=case != "no native amp")
    if case == "no native_amp attribute":
        del accelerator.native_amp
    clipped = params[:2] if case == "some parameters" else params
    norm = ti.accelerate_clip_grad_norm_(accelerator, iter(clipped), 0.5)
    return accelerator.own_calls, (norm, [p.grad.clone() for p in params])


@pytest.mark.parametrize("overflow", [False, True])
def test_accelerate_takes_the_fused_route_with_its_result(backend, overflow):
    own_calls, fused = _accelerate_run(backend, "fused", overflow)
    assert own_calls == 0
    model, opt, scaler = _setup("ours", backend, overflow)  # the same grads, the library's way
    norm = _library_clip(scaler, opt, list(model.parameters()), 0.5, 2.0)
    _same_result(fused, (norm, [p.grad for p in model.parameters()]), backend)


@pytest.mark.parametrize("case", ["torch scaler", "disabled scaler", "FSDP", "no native amp",
                                  "no native_amp attribute", "two optimizers",
                                  "some parameters"])
def test_accelerate_keeps_its_own_route_where_the_fused_one_differs(backend, case):
    own_calls, _ = _accelerate_run(backend, case)
    assert own_calls == 1


def test_accelerates_own_route_gets_every_parameter_of_an_iterator(backend):
    """Parameters given as an iterator (``model.parameters()``) that the fused route does not
    take reach Accelerate's own clip whole, not consumed by the route's check."""
    _, (norm, grads) = _accelerate_run(backend, "some parameters")
    model, opt, scaler = _setup("ours", backend)
    expected = _library_clip(scaler, opt, list(model.parameters())[:2], 0.5, 2.0)
    assert torch.equal(norm, expected)
    assert all(torch.equal(a, p.grad) for a, p in zip(grads, model.parameters()))


def test_fabric_defaults_are_fabrics():
    """``norm_type=2.0`` and ``error_if_nonfinite=True`` when not given, as
    ``Fabric.clip_gradients``; passed on to Fabric's own route."""
    model, opt, scaler = _setup("torch", "reference")
    fabric = Fabric(scaler)
    ti.fabric_clip_gradients(fabric, model, SimpleNamespace(optimizer=opt), 0.5)
    assert fabric.own_arguments == (0.5, 2.0, True)


@pytest.mark.parametrize("case", ["fused", "torch scaler", "other parameters"])
def test_fabric_routes_and_the_fused_result(backend, case):
    def run(use_helper):
        model, opt, scaler = _setup("torch" if case == "torch scaler" else "ours", backend)
        if case == "other parameters":  # the optimizer holds only part of the module
            opt = torch.optim.SGD(list(model.parameters())[:2], lr=0.1)
        fabric = Fabric(scaler)
        wrapped = SimpleNamespace(optimizer=opt)  # as Fabric's _FabricOptimizer
        clip = ti.fabric_clip_gradients if use_helper else Fabric.clip_gradients
        norm = clip(fabric, model, wrapped, 0.5, 2.0, False)
        return fabric.own_calls, (norm, [p.grad.clone() for p in model.parameters()])

    own_calls, result = run(True)
    assert own_calls == (0 if case == "fused" else 1)
    _same_result(result, run(False)[1], backend)
