"""A watched scaler on the Triton backend takes its statistics from the launches that already
read every gradient (``unscale_``, the fused-optimizer route's check, the clip's write pass;
a gradient bucket through its parameters' views) and one small finishing launch per call:
the same unscale launches as without a watch and no other device op in those calls, amax and
inf / NaN counts exactly torch's and norms within 1e-5, at sizes over several programs, empty
grads, inf and NaN at the edges, every float dtype; the parameters, scale and skips bit for
bit as without a watch."""

import math
from collections import Counter

import pytest
import torch
from _launch_counting import _launches, _Ops, _uncounted

from triton_scaler import GradBuckets, GradScaler

# the interpreter's block is 65,536 elements (a GPU's 4,096): several programs, one, none
SIZES = (2 * 65536 + 3, 7, 0, 1, 65536)
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
ROUTES = ["unscale", "clip", "fused"]


def _params(dtype, device):
    return [torch.nn.Parameter(torch.zeros(n, dtype=dtype, device=device)) for n in SIZES]


def _grad(n, dtype, gen, step, device):
    g = (torch.randn(n, generator=gen) * 30).to(dtype=dtype, device=device)
    if step == 1 and n > 1:  # inf and NaN at the edges of the tensor
        g[0], g[-1] = math.nan, -math.inf
    return g


def _run(device, route, dtype, buckets, watch, steps=3):
    """Steps of SGD (fused on the fused route) whose unscaled grads are random; at step 1
    every grad of two or more elements has a NaN first and an -inf last. Returns the
    parameters, the scaler, the watch's reports and torch's numbers of each step."""
    if route != "fused" and dtype == torch.float16:
        pytest.skip("torch's scaler refuses to unscale float16 grads")
    params = _params(dtype, device)
    opt = torch.optim.SGD(params, lr=0.1, fused=route == "fused")
    held = GradBuckets(opt) if buckets else None
    scaler = GradScaler(device.type, backend="triton", init_scale=2.0**6)
    watcher = scaler.watch([(f"p{i}", p) for i, p in enumerate(params)]) if watch else None
    gen = torch.Generator().manual_seed(0)
    reports, expected = [], []
    for step in range(steps):
        held.zero_() if held is not None else opt.zero_grad()
        grads = [_grad(p.numel(), dtype, gen, step, device) for p in params]
        scaler.scale(sum((p * g).sum() for p, g in zip(params, grads))).backward()
        inv = torch.tensor(1.0 / scaler.get_scale(), device=device)
        expected.append([((p.grad * inv).abs().max().item() if p.numel() else 0.0,
                          torch.linalg.vector_norm((p.grad * inv).double()).item(),
                          int(torch.isinf(p.grad * inv).sum()),
                          int(torch.isnan(p.grad * inv).sum())) for p in params])
        if route == "unscale":
            scaler.unscale_(opt)
        elif route == "clip":
            scaler.clip_grad_norm_(opt, 1.0)
        scaler.step(opt)
        scaler.update()
        if watcher is not None:
            reports.append(watcher.report())
    return params, scaler, reports, expected


@pytest.mark.parametrize("buckets", [False, True], ids=["grads", "buckets"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("route", ROUTES)
def test_the_launches_statistics_are_torchs(triton_device, route, dtype, buckets):
    _, _, reports, expected = _run(triton_device, route, dtype, buckets, True)
    for report, numbers in zip(reports, expected):
        for i, (amax, norm, inf, nan) in enumerate(numbers):
            name = f"p{i}"
            assert report.nonfinite[name] == (inf, nan)
            assert report.has_grad[name]
            if nan:
                assert math.isnan(report.amax[name]) and math.isnan(report.norm[name])
                continue
            assert report.amax[name] == amax
            assert report.norm[name] == pytest.approx(norm, rel=1e-5)
    overflow = reports[1].last_overflow
    assert overflow is not None and overflow.step == 1
    assert overflow.tensors == [("p4", 1, 1), ("p1", 1, 1), ("p0", 1, 1)]


@pytest.mark.parametrize("buckets", [False, True], ids=["grads", "buckets"])
@pytest.mark.parametrize("route", ROUTES)
def test_watching_changes_no_result_on_the_triton_backend(triton_device, route, buckets):
    dtype = torch.float16 if route == "fused" else torch.bfloat16
    plain_params, plain, _, _ = _run(triton_device, route, dtype, buckets, False)
    params, watched, _, _ = _run(triton_device, route, dtype, buckets, True)
    for a, b in zip(plain_params, params):
        assert torch.equal(a, b)
    assert plain.get_scale() == watched.get_scale() == 2.0**5
    assert plain.skipped_steps == watched.skipped_steps == 1


@pytest.mark.parametrize("buckets", [False, True], ids=["grads", "buckets"])
@pytest.mark.parametrize("route", ROUTES)
def test_a_watched_call_adds_one_finishing_launch_and_no_other_op(triton_device, monkeypatch,
                                                                  route, buckets):
    """In a loop's third iteration, the unscaling call (``unscale_``, ``clip_grad_norm_``,
    or the fused route's ``step``) launches the unscale kernel as often as without a watch,
    plus one finishing launch, and ``update()`` launches as without a watch (its one launch
    records the iteration); neither issues any other device op than without a watch."""
    counted = {}
    for watch in (False, True):
        params = _params(torch.float32, triton_device)
        opt = torch.optim.SGD(params, lr=0.1, fused=route == "fused")
        opt.step = _uncounted(opt.step)
        held = GradBuckets(opt) if buckets else None
        scaler = GradScaler(triton_device.type, backend="triton")
        if watch:
            scaler.watch([(f"p{i}", p) for i, p in enumerate(params)])
        with _launches(monkeypatch) as launches:
            for _ in range(3):
                held.zero_() if held is not None else opt.zero_grad(set_to_none=False)
                scaler.scale(sum(p.sum() for p in params)).backward()
                before = Counter(launches)
                with _Ops() as ops:
                    if route == "unscale":
                        scaler.unscale_(opt)
                    elif route == "clip":
                        scaler.clip_grad_norm_(opt, 1.0)
                    else:
                        scaler.step(opt)
                unscaling = (launches - before, dict(ops.ops))
                if route != "fused":
                    scaler.step(opt)
                before = Counter(launches)
                with _Ops() as ops:
                    scaler.update()
                updating = (launches - before, dict(ops.ops))
        counted[watch] = (dict(unscaling[0]), unscaling[1], dict(updating[0]), updating[1])
    plain, watched = counted[False], counted[True]
    assert watched[0].pop("finish_stats") == 1
    assert watched == plain, counted


def test_a_watched_call_keeps_no_grad_alive(triton_device):
    """After a watched ``unscale_`` and ``zero_grad()``, the iteration's grads are freed (the
    watch keeps what it needs per layout, never the grads)."""
    import gc
    import weakref

    params = _params(torch.float32, triton_device)
    opt = torch.optim.SGD(params, lr=0.1)
    scaler = GradScaler(triton_device.type, backend="triton")
    scaler.watch([(f"p{i}", p) for i, p in enumerate(params)])
    for _ in range(2):
        scaler.scale(sum(p.sum() for p in params)).backward()
        grads = [weakref.ref(p.grad) for p in params]
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        gc.collect()
        assert all(ref() is None for ref in grads)
