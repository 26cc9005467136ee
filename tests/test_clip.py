"""GradScaler.clip_grad_norm_ against unscale_ + torch.nn.utils.clip_grad_norm_ and an fp64
oracle, on both backends (Triton through the interpreter)."""

import math

import pytest
import torch
from _util import TORCHS_EMPTY_INF_NORM_ERROR, assert_all_same, assert_same

from triton_scaler import GradBuckets, GradScaler

SCALE = 2.0**10


def _setup(backend, sizes, dtype, *, buckets=False, seed=0, plant=None, scale=SCALE):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(n, generator=gen).to(dtype)) for n in sizes]
    opt = torch.optim.SGD(params, lr=0.1)
    if buckets:
        GradBuckets(opt)
    scaler = GradScaler("cpu", init_scale=scale, backend=backend)
    targets = [(torch.randn(p.shape, generator=gen) * 3).to(dtype) for p in params]
    loss = sum((p.float() * t.float()).sum() for p, t in zip(params, targets))
    scaler.scale(loss).backward()  # grads: t * scale, exact when a power of two
    if plant is not None:
        with torch.no_grad():
            params[-1].grad.view(-1)[-1] = plant
    return params, opt, scaler


def _oracle_norm(scaled_grads, norm_type, scale=SCALE):
    """fp64 norm of the unscaled grads as torch's unscale_ stores them."""
    unscaled = [g.clone() for g in scaled_grads]
    inv = torch.full((), scale).double().reciprocal().float()
    for g in unscaled:
        torch._amp_foreach_non_finite_check_and_unscale_([g], torch.zeros(()), inv)
    flat = torch.cat([g.double().reshape(-1) for g in unscaled])
    return torch.linalg.vector_norm(flat, norm_type).item(), unscaled


CASES = [((7, 1, 4099, 33), torch.float32), ((7, 1, 4099, 33), torch.bfloat16),
         ((1,), torch.float32), ((300,) + tuple(range(1, 300)), torch.float32)]


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
@pytest.mark.parametrize("sizes, dtype", CASES, ids=["fp32", "bf16", "size1", "300tensors"])
@pytest.mark.parametrize("buckets", [False, True])
@pytest.mark.parametrize("scale", [SCALE, 1000.0])  # 1000: unscaled bf16 grads are rounded
def test_norm_and_grads_match_the_formula(backend, norm_type, sizes, dtype, buckets, scale):
    params, opt, scaler = _setup(backend, sizes, dtype, buckets=buckets, scale=scale)
    scaled = [p.grad.clone() for p in params]
    max_norm = 0.5
    total = scaler.clip_grad_norm_(opt, max_norm, norm_type)
    assert total.dtype == torch.float32 and total.shape == () and total.device.type == "cpu"
    expected_norm, unscaled = _oracle_norm(scaled, norm_type, scale)
    assert abs(total.item() - expected_norm) <= 1e-5 * expected_norm
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    torch._foreach_mul_(unscaled, coef)  # dtype(dtype(g * inv_scale) * clip_coef)
    assert_all_same([p.grad for p in params], unscaled)


@pytest.mark.parametrize("scale", [0.0, 2.0**-130], ids=["0", "2^-130"])
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_scale_without_a_finite_reciprocal_gives_torchs_norm(backend, scale, norm_type,
                                                                 dtype):
    """inv_scale inf: every non-zero grad unscales to +-inf and torch's norm is inf (not
    NaN): the lanes past a grad's end in its last block count for nothing, though 0 * inf is
    NaN. (With GradBuckets the Triton norm is NaN: docs/buckets.md says why.)"""
    results = []
    for impl in ("torch", "ours"):
        gen = torch.Generator().manual_seed(4)
        params = [torch.nn.Parameter(torch.zeros(n, dtype=dtype)) for n in (7, 1, 4099, 33)]
        for p in params:  # non-zero grads, as after an overflowing backward at this scale
            p.grad = (torch.rand(p.shape, generator=gen) + 0.5).to(dtype)
        opt = torch.optim.SGD(params, lr=0.1)
        scaler = torch.amp.GradScaler("cpu") if impl == "torch" else \
            GradScaler("cpu", backend=backend)
        scaler.scale(torch.ones(()))
        scaler.update(new_scale=torch.tensor(scale))
        if impl == "torch":
            scaler.unscale_(opt)
            total = torch.nn.utils.clip_grad_norm_(params, 1.0, norm_type, foreach=True)
        else:
            total = scaler.clip_grad_norm_(opt, 1.0, norm_type)
        results.append((total, [p.grad for p in params]))
    assert_same(results[1][0], results[0][0].float())
    assert results[0][0].item() == math.inf
    assert_all_same(results[1][1], results[0][1])


def test_bf16_norm_is_accumulated_in_fp32(backend):
    params, opt, scaler = _setup(backend, (100_003,), torch.bfloat16)
    expected, _ = _oracle_norm([p.grad.clone() for p in params], 2.0)
    total = scaler.clip_grad_norm_(opt, 1e9)
    assert abs(total.item() - expected) <= 1e-5 * expected  # a bf16 result would miss this


@pytest.mark.parametrize("plant", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("fused", [False, True])
def test_overflow_skips_the_step_and_backs_off(backend, plant, fused):
    params, _, scaler = _setup(backend, (5, 9), torch.float32, plant=plant)
    opt = torch.optim.AdamW(params, lr=0.1, fused=fused)
    before = [p.detach().clone() for p in params]
    total = scaler.clip_grad_norm_(opt, 1.0)
    assert not total.isfinite().item()
    scaler.step(opt)
    scaler.update()
    assert_all_same([p.detach() for p in params], before)
    assert scaler.get_scale() == SCALE / 2 and scaler.skipped_steps == 1


def test_counts_as_unscale(backend):
    params, opt, scaler = _setup(backend, (5,), torch.float32)
    scaler.clip_grad_norm_(opt, 1.0)
    with pytest.raises(RuntimeError, match="unscale_\\(\\) has already been called"):
        scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="unscale_\\(\\) has already been called"):
        scaler.clip_grad_norm_(opt, 1.0)
    scaler.step(opt)
    with pytest.raises(RuntimeError, match="unscale_\\(\\) is being called after step"):
        scaler.clip_grad_norm_(opt, 1.0)


def _train(scaler, clip, optimizer="adamw", steps=12, overflow_at=(3, 4, 9)):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 33), torch.nn.GELU(), torch.nn.Linear(33, 5))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=optimizer == "adamw_fused")
    gen = torch.Generator().manual_seed(1)
    trajectory, norms = [], []
    for step in range(steps):
        loss = model(torch.randn(9, 12, generator=gen)).square().mean() * 50
        scaler.scale(loss * (math.inf if step in overflow_at else 1.0)).backward()
        norms.append(clip(scaler, opt, model).item())
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=step % 3 == 0)  # kept grads: the launch plans are reused
        trajectory.append((scaler.get_scale(), scaler._get_growth_tracker()))
    return trajectory, norms, [p.detach().clone() for p in model.parameters()]


def _torch_clip(scaler, opt, model, max_norm):
    scaler.unscale_(opt)
    return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, foreach=True)


@pytest.mark.parametrize("optimizer", ["adamw", "adamw_fused"])
@pytest.mark.parametrize("max_norm", [0.05, 1e9])
def test_training_matches_unscale_then_clip(backend, optimizer, max_norm):
    kwargs = dict(init_scale=2.0**12, growth_interval=3)
    expected = _train(torch.amp.GradScaler("cpu", **kwargs),
                      lambda s, o, m: _torch_clip(s, o, m, max_norm), optimizer)
    actual = _train(GradScaler("cpu", backend=backend, **kwargs),
                    lambda s, o, m: s.clip_grad_norm_(o, max_norm), optimizer)
    assert actual[0] == expected[0]  # scale trajectory and skipped steps
    for ours, theirs in zip(actual[1], expected[1]):
        assert (math.isfinite(ours), math.isfinite(theirs)) == (True, True) or \
            not math.isfinite(ours) and not math.isfinite(theirs)
        if math.isfinite(theirs):
            assert abs(ours - theirs) <= 1e-5 * theirs
    if max_norm == 1e9 or backend == "reference":  # torch's own norm arithmetic: bit-equal
        assert_all_same(actual[2], expected[2])
        assert list(map(str, actual[1])) == list(map(str, expected[1])) or backend != "reference"
    else:  # clipped by a norm that may differ in the last bit from torch's summation order
        for a, b in zip(actual[2], expected[2]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_other_norms_and_disabled_scaler_equal_torch(backend):
    for norm_type in (1.0, 3.0):
        params, opt, scaler = _setup(backend, (7, 40), torch.float32)
        ref_params, ref_opt, ref_scaler = _setup(backend, (7, 40), torch.float32)
        total = scaler.clip_grad_norm_(opt, 0.5, norm_type)
        ref_scaler.unscale_(ref_opt)
        expected = torch.nn.utils.clip_grad_norm_(ref_params, 0.5, norm_type)
        assert torch.equal(total, expected.float())
        assert_all_same([p.grad for p in params], [p.grad for p in ref_params])
    params, opt, _ = _setup(backend, (7, 40), torch.float32)
    ref_params, _, _ = _setup(backend, (7, 40), torch.float32)
    total = GradScaler("cpu", enabled=False, backend=backend).clip_grad_norm_(opt, 0.5)
    assert torch.equal(total, torch.nn.utils.clip_grad_norm_(ref_params, 0.5))
    assert_all_same([p.grad for p in params], [p.grad for p in ref_params])


def test_no_grads_and_fp16_and_error_if_nonfinite(backend):
    scaler = GradScaler("cpu", backend=backend)
    scaler.scale(torch.ones(()))
    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    total = scaler.clip_grad_norm_(opt, 1.0)  # no grads: as torch, norm 0, none recorded
    assert torch.equal(total, torch.zeros(())) and total.dtype == torch.float32
    with pytest.raises(RuntimeError, match="unscale_\\(\\) has already been called"):
        scaler.clip_grad_norm_(opt, 1.0)
    with pytest.raises(AssertionError, match="No inf checks were recorded for this optimizer"):
        scaler.step(opt)
    params, opt16, scaler = _setup(backend, (5,), torch.float16)
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients."):
        scaler.clip_grad_norm_(opt16, 1.0)
    params, opt, scaler = _setup(backend, (5,), torch.float32, plant=math.inf)
    with pytest.raises(RuntimeError, match="is non-finite, so it cannot be clipped"):
        scaler.clip_grad_norm_(opt, 1.0, error_if_nonfinite=True)


def test_sparse_grads_raise_as_in_torch(backend):
    embedding = torch.nn.Embedding(10, 3, sparse=True)
    opt = torch.optim.SGD(embedding.parameters(), lr=0.1)
    scaler = GradScaler("cpu", backend=backend)
    scaler.scale(embedding(torch.tensor([1, 1, 2])).sum()).backward()
    before = embedding.weight.grad.clone()
    with pytest.raises(NotImplementedError, match="dense gradients only"):
        scaler.clip_grad_norm_(opt, 1.0)
    assert torch.equal(embedding.weight.grad.to_dense(), before.to_dense())
    scaler.unscale_(opt)  # nothing was recorded: unscale_ may still run


@pytest.mark.parametrize("norm_type", [1.0, 3.0])
def test_other_norm_types_match_unscale_then_clip(backend, norm_type):
    params, opt, scaler = _setup(backend, (7, 1, 4099), torch.float32)
    theirs = [torch.nn.Parameter(torch.zeros_like(p)) for p in params]
    for mine, their in zip(params, theirs):
        their.grad = mine.grad.clone()
    torch._amp_foreach_non_finite_check_and_unscale_([p.grad for p in theirs], torch.zeros(()),
                                                     torch.full((), 1 / SCALE))
    expected = torch.nn.utils.clip_grad_norm_(theirs, 0.5, norm_type)
    total = scaler.clip_grad_norm_(opt, 0.5, norm_type)
    assert torch.equal(total, expected)
    assert_all_same([p.grad for p in params], [p.grad for p in theirs])


@pytest.mark.parametrize("buckets", [False, True])
@pytest.mark.parametrize("plant", [math.inf, 1e38])  # an overflow; a finite grad, inf norm
def test_error_if_nonfinite_leaves_the_grads_as_torch_does(backend, plant, buckets):
    """torch's route raises after unscale_ and before clipping: the grads stay unscaled and
    unclipped, and step goes on (skipping on an overflow)."""
    params, opt, scaler = _setup(backend, (7, 4099), torch.float32, buckets=buckets,
                                 plant=plant)  # 1e38 / SCALE is finite, its square is not
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for mine, their in zip(params, theirs):
        their.grad = mine.grad.clone()
    their_opt = torch.optim.SGD(theirs, lr=0.1)
    torch_scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    torch_scaler.scale(torch.ones(()))
    torch_scaler.unscale_(their_opt)
    with pytest.raises(RuntimeError, match="is non-finite, so it cannot be clipped"):
        torch.nn.utils.clip_grad_norm_(theirs, 1.0, error_if_nonfinite=True)
    with pytest.raises(RuntimeError, match="is non-finite, so it cannot be clipped"):
        scaler.clip_grad_norm_(opt, 1.0, error_if_nonfinite=True)
    assert_all_same([p.grad for p in params], [p.grad for p in theirs])
    for s, o in ((scaler, opt), (torch_scaler, their_opt)):
        s.step(o)
        s.update()
    assert_all_same([p.detach() for p in params], [p.detach() for p in theirs])
    assert scaler.get_scale() == torch_scaler.get_scale()


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_a_bucketed_parameter_without_a_gradient_is_not_counted(backend, norm_type):
    """GradBuckets: a parameter that received no gradient since ``zero_`` has grad None at the
    clip (its view is not a grad), as after torch's ``zero_grad()``: the norm and the step are
    those of torch's unscale_ + clip without it."""
    gen = torch.Generator().manual_seed(3)
    fulls = [torch.randn(n, generator=gen) for n in (7, 4099, 33)]
    ours = [torch.nn.Parameter(f.clone()) for f in fulls]
    theirs = [torch.nn.Parameter(f.clone()) for f in fulls]
    opt, their_opt = torch.optim.SGD(ours, lr=0.1), torch.optim.SGD(theirs, lr=0.1)
    buckets = GradBuckets(opt)
    scaler = GradScaler("cpu", init_scale=SCALE, backend=backend)
    torch_scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    for step in range(2):  # step 1: the middle parameter takes no part
        used = (0, 1, 2) if step == 0 else (0, 2)
        for params, s in ((ours, scaler), (theirs, torch_scaler)):
            s.scale(sum((params[i] * params[i]).sum() for i in used)).backward()
        total = scaler.clip_grad_norm_(opt, 0.5, norm_type)
        torch_scaler.unscale_(their_opt)
        expected = torch.nn.utils.clip_grad_norm_(theirs, 0.5, norm_type)
        assert [p.grad is None for p in ours] == [p.grad is None for p in theirs]
        if backend == "reference":
            assert torch.equal(total, expected), step
        else:
            assert abs(total.item() - expected.item()) <= 1e-6 * expected.item(), step
        for s, o in ((scaler, opt), (torch_scaler, their_opt)):
            s.step(o)
            s.update()
        buckets.zero_()
        their_opt.zero_grad()
    if backend == "reference":
        assert_all_same([p.detach() for p in ours], [p.detach() for p in theirs])


@pytest.mark.parametrize("buckets", [False, True])
def test_an_empty_grad_is_left_out_of_the_inf_norm(backend, buckets):
    """torch's clip raises for the inf norm of an empty grad (a max has no identity); the
    fused clip leaves empty grads out of it (docs/exactness.md: differs on purpose). Its norm and grads
    are those of torch's unscale_ + clip over the non-empty grads; only empty grads: 0."""
    params, opt, scaler = _setup(backend, (7, 0, 4099, 0), torch.float32, buckets=buckets)
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for mine, their in zip(params, theirs):
        their.grad = mine.grad.clone()
    torch_scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    torch_scaler.scale(torch.ones(()))
    torch_scaler.unscale_(torch.optim.SGD(theirs, lr=0.1))
    with pytest.raises(RuntimeError, match=TORCHS_EMPTY_INF_NORM_ERROR):
        torch.nn.utils.clip_grad_norm_(theirs, 0.5, math.inf)
    expected = torch.nn.utils.clip_grad_norm_([p for p in theirs if p.numel()], 0.5, math.inf)
    total = scaler.clip_grad_norm_(opt, 0.5, math.inf)
    assert torch.equal(total, expected)
    assert_all_same([p.grad for p in params], [p.grad for p in theirs])

    params, opt, scaler = _setup(backend, (0, 0), torch.float32, buckets=buckets)
    total = scaler.clip_grad_norm_(opt, 0.5, math.inf)
    assert torch.equal(total, torch.zeros(()))
    assert [p.grad.shape for p in params] == [(0,), (0,)]
    scaler.step(opt)
    scaler.update()
    assert scaler.skipped_steps == 0 and scaler.get_scale() == SCALE
