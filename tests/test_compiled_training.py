"""Compiled training with dynamic loss scaling, exact: 16 steps of a compiled model whose
scaler calls are compiled too (``scale`` with ``fullgraph=True``; clip, step and update in one
compiled function), against torch's eager ``GradScaler`` around the *same* compiled optimizer
step (``opt.step = torch.compile(opt.step)``: a compiled optimizer rounds differently from an
eager one, scaler or not). Overflows are planted in the loss and in one grad. Fused, foreach
and for-loop optimizers, GradBuckets or not, clipping or not, both backends; ``aot_eager`` for
every combination, ``inductor`` for those with clipping. The scale trajectory, growth tracker
and skipped steps are equal; the parameters bit for bit under ``aot_eager`` and without
clipping; under inductor with clipping within 1e-6 relative (inductor's generated norm
reduction sums in its own order). After two warm-up steps nothing recompiles."""

import math

import pytest
import torch
from _loops import optimizer_for_route
from _util import assert_all_same, graphs_compiled

from triton_scaler import GradBuckets, GradScaler

STEPS, WARM_UP = 16, 2
LOSS_OVERFLOWS, GRAD_OVERFLOWS = (3, 10), (7,)
KWARGS = dict(init_scale=2.0**12, growth_interval=3)



def _train(ours, backend, compile_backend, kind, buckets, clip):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.GELU(),
                                torch.nn.Linear(32, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    forward = torch.compile(model, backend=compile_backend)
    opt = optimizer_for_route(kind, model.parameters())
    opt.step = torch.compile(opt.step, backend=compile_backend)  # the same for both scalers
    held = GradBuckets(opt) if buckets and ours else None
    if ours:
        scaler = GradScaler("cpu", backend=backend, **KWARGS)
        scale = torch.compile(scaler.scale, fullgraph=True, backend=compile_backend)

        def post():
            if clip:
                scaler.clip_grad_norm_(opt, 1.0)
            scaler.step(opt)
            scaler.update()

        post = torch.compile(post, backend=compile_backend)
    else:
        scaler = torch.amp.GradScaler("cpu", **KWARGS)
        scale = scaler.scale

        def post():
            if clip:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()

    gen = torch.Generator().manual_seed(1)
    seen = []
    for i in range(STEPS):
        if i == WARM_UP:
            warm_graphs = graphs_compiled()
        x = torch.randn(16, 12, generator=gen)
        loss = forward(x).square().mean() * (math.inf if i in LOSS_OVERFLOWS else 1.0)
        scale(loss).backward()
        if i in GRAD_OVERFLOWS:
            model[2].weight.grad[3, 5] = math.inf
        post()
        held.zero_() if held is not None else opt.zero_grad()
        seen.append((scaler.get_scale(), scaler._get_growth_tracker()))
    assert graphs_compiled() == warm_graphs  # the scale changed, nothing recompiled
    skipped = scaler.skipped_steps if ours else None
    return seen, [p.detach().clone() for p in model.parameters()], skipped


CASES = [(cb, kind, buckets, clip) for cb in ("aot_eager", "inductor")
         for kind in ("fused", "foreach", "forloop") for buckets in (False, True)
         for clip in (False, True) if cb == "aot_eager" or clip]
#: In the default tier: each optimizer route once, buckets and clipping each both ways, and
#: inductor; the rest of the sweep is the long tier (``-m exhaustive``).
DEFAULT_TIER = {("aot_eager", "fused", False, False), ("aot_eager", "foreach", True, True),
                ("aot_eager", "forloop", False, True), ("inductor", "fused", True, True)}


@pytest.mark.slow
@pytest.mark.parametrize("compile_backend,kind,buckets,clip", [
    pytest.param(*case, marks=() if case in DEFAULT_TIER else pytest.mark.exhaustive,
                 id=f"{case[0]}-{case[1]}-{'buckets' if case[2] else 'grads'}-"
                    f"{'clip' if case[3] else 'noclip'}")
    for case in CASES])
def test_compiled_training_follows_torchs_scaler(backend, compile_backend, kind, buckets, clip):
    expected = _train(False, backend, compile_backend, kind, buckets, clip)
    actual = _train(True, backend, compile_backend, kind, buckets, clip)
    assert actual[0] == expected[0]
    assert actual[2] == len(LOSS_OVERFLOWS) + len(GRAD_OVERFLOWS)
    scales = [s for s, _ in expected[0]]
    assert len(set(scales)) > 2  # grew and backed off
    if compile_backend == "inductor" and clip:
        for a, e in zip(actual[1], expected[1], strict=True):
            torch.testing.assert_close(a, e, rtol=1e-6, atol=1e-7)
    else:
        assert_all_same(actual[1], expected[1])
