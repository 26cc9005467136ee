"""A watched scaler's calls trace under ``torch.compile(fullgraph=True)`` (``unscale_``,
``clip_grad_norm_``, ``update``; ``step`` as without a watch) and report what the same calls
report eagerly, bit for bit under ``aot_eager`` (on the Triton backend the compiled calls'
statistics come from a registered op whose launches cut each gradient into the blocks the
eager calls' launches do), with the same parameters, scale and skipped steps."""

import math

import pytest
import torch
from _loops import optimizer_for_route

from triton_scaler import GradBuckets, GradScaler

ROUTES = [("foreach", False, "unscale"), ("foreach", True, "unscale"), ("forloop", False, "clip"),
          ("foreach", True, "clip"), ("fused", False, "none"), ("fused", True, "none")]


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 300), torch.nn.ReLU(), torch.nn.Linear(300, 3),
                               torch.nn.ReLU(), torch.nn.Linear(3, 2)).to(dtype)


def _run(backend, kind, buckets, call, compiled):
    torch._dynamo.reset()
    model = _model()
    opt = optimizer_for_route(kind, model.parameters())
    held = GradBuckets(opt) if buckets else None
    scaler = GradScaler("cpu", init_scale=2.0**10, growth_interval=2, backend=backend)
    watch = scaler.watch(model)

    def unscale():
        scaler.unscale_(opt)

    def clip():
        return scaler.clip_grad_norm_(opt, 0.05)

    def update():
        scaler.update()

    if compiled:
        unscale, clip, update = (torch.compile(fn, backend="aot_eager", fullgraph=True)
                                 for fn in (unscale, clip, update))
    # the optimizer's own step compiled in both runs: a compiled optimizer rounds differently
    # from an eager one, scaler or not
    opt.step = torch.compile(opt.step, backend="aot_eager")
    step = torch.compile(scaler.step, backend="aot_eager") if compiled else scaler.step
    gen = torch.Generator().manual_seed(1)
    for i in range(5):
        loss = model(torch.randn(4, 5, generator=gen)).square().mean()
        scaler.scale(loss).backward()
        if i == 2:
            model[2].weight.grad[1, 2] = math.inf
            model[0].bias.grad[-1] = math.nan
        if call == "unscale":
            unscale()
        elif call == "clip":
            clip()
        step(opt)
        update()
        held.zero_() if held is not None else opt.zero_grad()
    return watch.report(), [p.detach().clone() for p in model.parameters()], scaler


@pytest.mark.parametrize("kind, buckets, call", ROUTES,
                         ids=[f"{k}-{'buckets' if b else 'grads'}-{c}" for k, b, c in ROUTES])
def test_compiled_watched_calls_report_what_eager_calls_report(backend, kind, buckets, call):
    if backend == "triton" and buckets and call == "clip":
        pytest.skip("clip_grad_norm_ over GradBuckets on the Triton backend runs eagerly "
                    "(docs/compile.md), with or without a watch")
    eager, eager_params, eager_scaler = _run(backend, kind, buckets, call, False)
    compiled, params, scaler = _run(backend, kind, buckets, call, True)
    for name in eager.norm:
        for field in ("amax", "norm"):
            a, b = getattr(eager, field)[name], getattr(compiled, field)[name]
            assert a == b or (math.isnan(a) and math.isnan(b)), (field, name, a, b)
    assert compiled.nonfinite == eager.nonfinite and compiled.has_grad == eager.has_grad
    assert compiled.last_overflow == eager.last_overflow is not None
    assert compiled.last_overflow.tensors[0] == ("2.weight", 1, 0)
    assert (compiled.step, compiled.scale, compiled.skipped_steps) == \
        (eager.step, eager.scale, eager.skipped_steps)
    for a, b in zip(eager_params, params):
        assert torch.equal(a, b)
    assert scaler.get_scale() == eager_scaler.get_scale()
