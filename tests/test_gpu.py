"""GPU tests: the same exact oracles on CUDA tensors, sync-free routes checked with CUDA's
sync debug mode, and CUDA-graph capture. Skipped without CUDA; run all with tests/run_gpu.sh."""

import gc
import math

import pytest
import torch
from _util import assert_all_same, assert_same, sync_errors

from triton_scaler import GradBuckets, GradScaler, ops

pytestmark = pytest.mark.gpu
SIZES = [0, 1, 7, 4095, 4097, 1_000_003]


def _grads(sizes, dtype, device, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    return [(torch.randn(n, device=device, generator=gen) * 3000).to(dtype) for n in sizes]


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("bad", ["cpu", "int64"])
def test_a_bad_grad_after_good_cuda_ones_is_named_and_nothing_is_written(cuda, backend, bad):
    """On CUDA, where torch's op unscales grads one by one until it meets one it refuses, a
    grad on the CPU or of an int dtype after good ones raises by name with every grad and
    found_inf as they were, on both backends."""
    good = [torch.full((5,), 8.0, device=cuda), torch.full((3,), math.inf, device=cuda)]
    other = torch.ones(2) if bad == "cpu" else torch.ones(2, dtype=torch.int64, device=cuda)
    found = torch.zeros((), device=cuda)
    with pytest.raises((TypeError, ValueError), match=r"grads\[2\]"):
        ops.non_finite_check_and_unscale_([*good, other], found,
                                          torch.full((), 0.5, device=cuda), backend=backend)
    assert torch.equal(good[0].cpu(), torch.full((5,), 8.0))
    assert torch.equal(good[1].cpu(), torch.full((3,), math.inf))
    assert found.item() == 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
@pytest.mark.parametrize("special", [math.inf, -math.inf, math.nan, None])
@pytest.mark.parametrize("n_tensors", [1, 3, 300])
def test_unscale_matches_torch_cuda(cuda, dtype, special, n_tensors):
    middle = (SIZES * (n_tensors // len(SIZES) + 1))[:max(n_tensors - 2, 0)]
    sizes = [1_000_003] if n_tensors == 1 else [7, *middle, 1_000_003]
    grads = _grads(sizes, dtype, cuda)
    if special is not None:  # first element of the first tensor, last of the last
        grads[0][0] = special
        grads[-1][-1] = special
    expected = [g.clone() for g in grads]
    found_expected = torch.zeros((), device=cuda)
    inv = torch.tensor(1 / 3.0, device=cuda)
    torch._amp_foreach_non_finite_check_and_unscale_(expected, found_expected, inv)
    found = torch.zeros((), device=cuda)
    ops.non_finite_check_and_unscale_(grads, found, inv, backend="triton")
    assert_all_same(grads, expected)
    assert_same(found, found_expected)


def test_bf16_matches_the_cpu_oracle(cuda):
    """torch's CUDA op has no bf16; its CPU op is the oracle."""
    grads = _grads(SIZES, torch.bfloat16, cuda)
    grads[-1][-1] = math.nan
    expected = [g.cpu() for g in grads]
    found_expected = torch.zeros(())
    torch._amp_foreach_non_finite_check_and_unscale_(expected, found_expected,
                                                     torch.tensor(1 / 3.0))
    found = torch.zeros((), device=cuda)
    ops.non_finite_check_and_unscale_(grads, found, torch.tensor(1 / 3.0, device=cuda))
    assert_all_same([g.cpu() for g in grads], expected)
    assert found.item() == 1.0 == found_expected.item()


def test_non_contiguous_and_check_only(cuda):
    base = _grads([640 * 33], torch.float32, cuda)[0].view(640, 33)
    grads = [base.t(), _grads([999], torch.float16, cuda)[0]]
    before = [g.clone() for g in grads]
    found = torch.zeros((), device=cuda)
    ops.non_finite_check_(grads, found, torch.tensor(0.5, device=cuda))
    assert_all_same(grads, before)
    assert found.item() == 0.0
    expected = [g.clone() for g in grads]
    for g in expected:
        torch._amp_foreach_non_finite_check_and_unscale_([g], torch.zeros((), device=cuda),
                                                         torch.tensor(0.5, device=cuda))
    ops.non_finite_check_and_unscale_(grads, found, torch.tensor(0.5, device=cuda))
    assert_all_same(grads, expected)


@pytest.mark.parametrize("growth, backoff, interval", [(2.0, 0.5, 3), (1.7, 0.37, 2)])
def test_update_matches_torch_cuda(cuda, growth, backoff, interval):
    gen = torch.Generator().manual_seed(0)
    ours = [torch.tensor(1000.0, device=cuda), torch.zeros((), dtype=torch.int32, device=cuda)]
    theirs = [t.clone() for t in ours]
    for _ in range(300):
        found = torch.tensor(float(torch.rand((), generator=gen) < 0.2), device=cuda)
        ops.update_scale_(*ours, found, growth, backoff, interval, backend="triton")
        torch._amp_update_scale_(*theirs, found, growth, backoff, interval)
        assert_same(ours[0], theirs[0])
        assert_same(ours[1], theirs[1])


def _cuda_train(scaler, device, fused, steps=30, overflow_at=(3, 4, 17), buckets=False):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(),
                                torch.nn.Linear(128, 8)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
    if buckets:
        GradBuckets(opt)
    gen = torch.Generator(device=device).manual_seed(1)
    trajectory = []
    for step in range(steps):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(torch.randn(32, 64, device=device, generator=gen)).float().square().mean()
        scaler.scale(loss * (math.inf if step in overflow_at else 1.0)).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=not buckets)  # buckets: the grads stay their views
        trajectory.append((scaler.get_scale(), scaler._get_growth_tracker()))
    return trajectory, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("fused", [False, True])
def test_training_parity_cuda(cuda, fused):
    kwargs = dict(init_scale=2.0**16, growth_interval=5)
    expected = _cuda_train(torch.amp.GradScaler("cuda", **kwargs), cuda, fused)
    actual = _cuda_train(GradScaler("cuda", **kwargs, backend="triton"), cuda, fused)
    assert actual[0] == expected[0]
    assert_all_same(actual[1], expected[1])


@pytest.mark.parametrize("fused, buckets", [(False, False), (False, True), (True, True)])
def test_direct_launches_keep_torchs_training_run(cuda, monkeypatch, fused, buckets):
    """kernels/launcher.py on: repeated launches call the compiled launchers themselves, and
    the run is still torch's, bit for bit."""
    from triton_scaler.kernels import launcher

    monkeypatch.setattr(launcher, "DIRECT", True)
    launcher.clear()
    direct = []
    run = launcher._run
    monkeypatch.setattr(launcher, "_run", lambda *args: (direct.append(args[1]), run(*args)))
    kwargs = dict(init_scale=2.0**16, growth_interval=5)
    expected = _cuda_train(torch.amp.GradScaler("cuda", **kwargs), cuda, fused)
    actual = _cuda_train(GradScaler("cuda", **kwargs, backend="triton"), cuda, fused,
                         buckets=buckets)
    launcher.clear()
    assert actual[0] == expected[0]
    assert_all_same(actual[1], expected[1])
    assert len(direct) >= 29  # at least the update of each of the 30 steps but the first


def test_grads_at_new_addresses_launch_directly(cuda, monkeypatch):
    """kernels/launcher.py keys a launch on what Triton specialises (alignment, dtypes,
    values), not on addresses: grads of the sizes seen before at new, aligned addresses
    launch through the compiled launcher, and are unscaled as torch's op unscales them."""
    from triton_scaler.kernels import launcher

    monkeypatch.setattr(launcher, "DIRECT", True)
    launcher.clear()
    direct = []
    run = launcher._run
    monkeypatch.setattr(launcher, "_run", lambda *args: (direct.append(args[1]), run(*args)))
    inv = torch.full((), 0.5, device=cuda)
    keep = []
    for step in range(3):
        keep.append(torch.empty(4096 * (step + 1), device=cuda))  # the next grads lie elsewhere
        grads = [torch.randn(n, device=cuda) for n in (1000, 77, 5000)]
        grads[1][76] = math.inf
        expected = [g.clone() for g in grads]
        found, torch_found = torch.zeros((), device=cuda), torch.zeros((), device=cuda)
        torch._amp_foreach_non_finite_check_and_unscale_(expected, torch_found, inv)
        before = len(direct)
        ops.non_finite_check_and_unscale_(grads, found, inv, backend="triton")
        assert_all_same(grads, expected)
        assert torch.equal(found, torch_found)
        if step:
            assert len(direct) == before + 1  # the unscale launch: the compiled launcher's
    launcher.clear()


@pytest.mark.filterwarnings("ignore:grad and param do not obey the gradient layout contract")
def test_scaler_grads_at_new_addresses_every_step_cuda(cuda):
    """A scaler whose grads lie at new addresses every step (views into one buffer, shifted
    and in another order, NaN between them; one turned transposed at step 3): each step
    planned against the last planned layout, its table uploaded anew; every step as torch's
    scaler, with an inf planted at step 4."""
    def run(scaler):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(shape, device=cuda))
                  for shape in ((7,), (200, 150), (4099,))]
        opt = torch.optim.SGD(params, lr=0.1)
        memory = torch.empty(80_000, device=cuda)
        for step in range(6):
            memory.fill_(math.nan)
            at = 16 * step + 4
            for i in ((0, 1, 2) if step % 2 else (2, 0, 1)):
                p = params[i]
                grad = memory[at:at + p.numel()]
                grad = grad.view(150, 200).t() if p.dim() == 2 and step >= 3 else \
                    grad.view(p.shape)
                p.grad = grad.zero_()
                at += p.numel() + 36
            scaler.scale(sum((p * (i + 1)).square().sum() for i, p in enumerate(params))
                         ).backward()
            if step == 4:
                params[1].grad[-1, -1] = math.inf
            scaler.step(opt)
            scaler.update()
        return scaler.get_scale(), [p.detach().clone() for p in params]

    expected = run(torch.amp.GradScaler("cuda", init_scale=8.0, growth_interval=1))
    actual = run(GradScaler("cuda", init_scale=8.0, growth_interval=1, backend="triton"))
    assert actual[0] == expected[0]
    assert_all_same(actual[1], expected[1])


def test_fused_route_never_synchronises(cuda):
    model = torch.nn.Linear(64, 64).to(cuda)
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    GradBuckets(opt)
    scaler = GradScaler("cuda")
    x = torch.randn(8, 64, device=cuda)
    for _ in range(3):  # first iterations allocate and compile
        scaler.scale(model(x).sum()).backward()
        scaler.step(opt)
        scaler.update()
    with sync_errors(cuda):
        scaler.scale(model(x).sum()).backward()
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()


def _evict_chunk_tables(cuda):
    """What a long run does after a capture: other grad layouts push the captured chunk table
    out of planning's memo, and the freed device blocks are reused and overwritten."""
    from triton_scaler import _grads, _plans

    found, one = torch.zeros((), device=cuda), torch.ones((), device=cuda)
    for i in range(40):
        ops.non_finite_check_([torch.ones(5 + i, device=cuda), torch.ones(3, device=cuda)],
                              found, one, backend="triton")
    _plans.clear()
    _grads._layouts.clear()
    gc.collect()
    # small blocks, the size class of a chunk table, so that freed tables are reused
    junk = [torch.full((64,), -1, dtype=torch.int64, device=cuda) for _ in range(4096)]
    torch.cuda.synchronize()
    return junk


def warmed_up_training(model, cuda, buckets: bool, unscale_first: bool, watch: bool = False):
    """A capturable ``scale -> backward -> (unscale_) -> step -> update`` iteration of
    ``model`` (fused capturable AdamW, GradBuckets or grads reset in place, the loss times the
    device tensor ``multiplier``: inf for an overflow), run 3 times on a side stream, as
    capture needs; ``watch``: the scaler watches ``model``. Returns the iteration, the
    optimizer, the scaler and ``multiplier``."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True, capturable=True)
    bucketed = GradBuckets(opt) if buckets else None
    scaler = GradScaler("cuda", init_scale=2.0**10, growth_interval=2, backend="triton")
    if watch:
        scaler.watch(model)
    x = torch.randn(4, 32, device=cuda)
    multiplier = torch.ones((), device=cuda)

    def iteration():
        if bucketed is not None:
            bucketed.zero_()
        else:
            opt.zero_grad(set_to_none=False)
        scaler.scale(model(x).square().mean() * multiplier).backward()
        if unscale_first:  # no host copy may be recorded into the graph
            scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            iteration()
    torch.cuda.current_stream().wait_stream(side)
    return iteration, opt, scaler, multiplier


@pytest.mark.parametrize("buckets, unscale_first", [(True, False), (False, False),
                                                    (False, True)])
def test_cuda_graph_capture_and_replay(cuda, buckets, unscale_first):
    """scale -> backward -> (unscale_) -> step -> update captured once, replayed with overflows
    injected. Without buckets the captured launch reads a chunk table: evicted from the
    cache and its memory reused after the capture, the replays must still see the overflow."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)).to(cuda)
    iteration, _, scaler, multiplier = warmed_up_training(model, cuda, buckets, unscale_first)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        iteration()
    junk = _evict_chunk_tables(cuda) if not buckets else []
    # warm-up: 1024 -> 2048 (tracker 1); the replays continue from there
    scales = []
    for overflow in (False, False, True, False, False):
        multiplier.fill_(math.inf if overflow else 1.0)
        graph.replay()
        scales.append(scaler.get_scale())
    assert scales == [4096.0, 4096.0, 2048.0, 2048.0, 4096.0]
    assert not scaler.last_step_skipped.item() and scaler.skipped_steps == 1
    scaler.set_growth_factor(4.0)  # read from device memory by the captured update kernel
    multiplier.fill_(1.0)
    graph.replay()
    graph.replay()
    assert scaler.get_scale() == 4096.0 * 4.0
    assert all(bool((j == -1).all()) for j in junk)  # the replays wrote nothing there


def test_sizes_first_planned_in_a_capture_are_planned_again_outside_it(cuda):
    """A chunk table's rows first uploaded while a CUDA graph captures are written when the
    graph replays: an eager call over grads of the same sizes at other addresses before any
    replay (an inf planted in its last grad) matches torch's op, and the replay then
    unscales the captured grads."""
    from triton_scaler import _plans

    _plans.clear()
    sizes = [4097, 3, 5000]
    inv = torch.full((), 0.5, device=cuda)
    warm = [torch.ones(n, device=cuda) for n in (7, 9)]  # compiles the table launch
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ops.non_finite_check_and_unscale_(warm, torch.zeros((), device=cuda), inv,
                                          backend="triton")
    torch.cuda.current_stream().wait_stream(stream)
    captured = [torch.full((n,), 2.0, device=cuda) for n in sizes]
    found = torch.zeros((), device=cuda)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.non_finite_check_and_unscale_(captured, found, inv, backend="triton")
    eager = _grads(sizes, torch.float32, cuda, seed=3)
    eager[-1][-1] = math.inf
    expected = [g.clone() for g in eager]
    expected_found = torch.zeros((), device=cuda)
    torch._amp_foreach_non_finite_check_and_unscale_(expected, expected_found, inv)
    eager_found = torch.zeros((), device=cuda)
    ops.non_finite_check_and_unscale_(eager, eager_found, inv, backend="triton")
    assert_all_same(eager, expected)
    assert_same(eager_found, expected_found)
    graph.replay()
    assert all(bool((g == 1.0).all()) for g in captured) and found.item() == 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
@pytest.mark.parametrize("sizes", [[1_000_003], [7, 1, 4097, 300, 65536]])
def test_clip_grad_norm_cuda(cuda, dtype, norm_type, sizes):
    """The fused clip on the GPU: norm within 1e-5 of an fp64 oracle, grads bit-equal to
    dtype(dtype(g * inv_scale) * coef) given the returned norm, and no host sync. float64
    grads: coef is formed from the float64 norm (as torch's), not the returned float32 one,
    so from the oracle's: bit-equal for the inf norm (a max), within 1e-13 for the 2-norm."""
    params = [torch.nn.Parameter(torch.zeros(n, device=cuda, dtype=dtype)) for n in sizes]
    opt = torch.optim.SGD(params, lr=0.1)
    scaler = GradScaler("cuda", init_scale=1024.0)
    scaler.scale(torch.ones((), device=cuda))
    for p, g in zip(params, _grads(sizes, dtype, cuda)):
        p.grad = g
    scaled = [p.grad.clone() for p in params]
    with sync_errors(cuda):
        total = scaler.clip_grad_norm_(opt, 0.5, norm_type)
    inv = torch.tensor(1024.0, device=cuda).double().reciprocal().float()
    unscaled = [g.clone() for g in scaled]
    for g in unscaled:
        g.copy_((g.to(torch.float64 if dtype == torch.float64 else torch.float32) * inv)
                .to(dtype))
    expected = torch.linalg.vector_norm(torch.cat([g.double() for g in unscaled]), norm_type)
    assert abs(total.item() - expected.item()) <= 1e-5 * expected.item()
    wide = dtype == torch.float64
    coef = torch.clamp(0.5 / ((expected if wide else total) + 1e-6), max=1.0)
    for g in unscaled:
        g.copy_((g.to(torch.float64 if wide else torch.float32) * coef).to(dtype))
    if wide and norm_type == 2.0:  # the kernel's sum of squares, in its order
        for p, g in zip(params, unscaled):
            torch.testing.assert_close(p.grad, g, rtol=1e-13, atol=0)
    else:
        assert_all_same([p.grad for p in params], unscaled)
