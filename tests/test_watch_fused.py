"""A watched scaler on the Triton backend reads the watched grads in a pass of its own before
each unscaling call (``unscale_``, the fused-optimizer route's check, ``clip_grad_norm_``; a
gradient bucket's grads through its parameters' views): the calls' own launches as without a
watch, plus that read pass (per dtype group one read-only launch of the unscale kernel and
one summing per tensor); amax and inf / NaN counts exactly torch's and norms within 1e-5, at
sizes over several programs, empty grads, inf and NaN at the edges, every float dtype; the
parameters, scale and skips bit for bit as without a watch."""

import math
from collections import Counter

import pytest
import torch
from _launch_counting import _launches, _Ops, _uncounted
from _util import step_by_route, unscaled_stats

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
        expected.append([unscaled_stats(p.grad, inv) for p in params])
        step_by_route(scaler, opt, {"unscale": "unscale_", "clip": "clip_grad_norm_"}.get(
            route, route))
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_grads_over_hundreds_of_programs_sum_as_the_registered_op_sums(
        triton_device, monkeypatch, dtype):
    """Grads over more programs than one round sums (301, 129 and 257 programs: rounds of
    128; and one program; an inf in one, a NaN in another): a watched ``unscale_``'s numbers
    equal the registered ``watch_stats`` op's bit for bit (the compiled route's), amax and
    counts exactly torch's, norms within 1e-5."""
    from triton_scaler.kernels import unscale

    if unscale.is_interpreting():  # the same rounds over fewer elements
        monkeypatch.setattr(unscale, "BLOCK", 64)
    block = unscale.block()
    sizes = (300 * block + 5, 129 * block, 3, 257 * block - 1)
    gen = torch.Generator().manual_seed(1)
    grads = [(torch.randn(n, generator=gen) * 1e3).to(dtype) for n in sizes]
    grads[2][1] = math.inf
    grads[3][128 * block] = math.nan
    params = [torch.nn.Parameter(torch.zeros(n, dtype=dtype, device=triton_device))
              for n in sizes]
    for p, g in zip(params, grads):
        p.grad = g.to(triton_device)
    scaler = GradScaler(triton_device.type, backend="triton", init_scale=2.0**10)
    watch = scaler.watch([(f"p{i}", p) for i, p in enumerate(params)])
    inv = torch.tensor(2.0**-10, device=triton_device)
    op = torch.ops.triton_scaler.watch_stats([p.grad for p in params], inv, "triton").cpu()
    expected = [(p.grad * inv) for p in params]
    scaler.scale(torch.ones((), device=triton_device))  # the scale made, as a loop's
    scaler.unscale_(torch.optim.SGD(params, lr=0.0))
    report = watch.report()
    for i, (row, unscaled) in enumerate(zip(op.tolist(), expected)):
        name = f"p{i}"
        assert report.nonfinite[name] == (int(row[2]), int(row[3])) == (
            int(torch.isinf(unscaled).sum()), int(torch.isnan(unscaled).sum()))
        if i == 3:  # a NaN: amax and norm NaN
            assert math.isnan(row[0]) and math.isnan(report.amax[name])
            assert math.isnan(row[1]) and math.isnan(report.norm[name])
            continue
        assert row[0] == report.amax[name] == unscaled.abs().max().item()
        assert math.sqrt(row[1]) == report.norm[name] == pytest.approx(
            torch.linalg.vector_norm(unscaled.double()).item(), rel=1e-5)
    assert report.nonfinite["p2"] == (1, 0) and report.nonfinite["p3"] == (0, 1)


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
def test_a_watched_call_adds_its_read_pass_and_update_launches_as_unwatched(
        triton_device, monkeypatch, route, buckets):
    """In a loop's third iteration, the unscaling call (``unscale_``, ``clip_grad_norm_``,
    or the fused route's ``step``) launches what it launches without a watch plus the
    watch's read pass over the one dtype group (one more unscale kernel launch, read-only,
    and one launch summing per tensor) and a few tensor ops (the rows copied into the
    watch's state); ``update()`` launches and issues as without a watch (its one launch
    records the iteration)."""
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
                unscaling = (launches - before, ops.ops)
                if route != "fused":
                    scaler.step(opt)
                before = Counter(launches)
                with _Ops() as ops:
                    scaler.update()
                updating = (launches - before, dict(ops.ops))
        counted[watch] = (unscaling, updating)
    (plain_launches, plain_ops), plain_update = counted[False]
    (launches, ops), update = counted[True]
    assert launches == plain_launches + Counter(unscale=1, finish_stats=1), counted
    assert sum((ops - plain_ops).values()) <= 8, counted
    assert update == plain_update, counted


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
