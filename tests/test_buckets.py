"""GradBuckets: one contiguous buffer per (device, dtype), one launch per bucket, exact."""

import copy
import math
import warnings

import pytest
import torch
from _bucket_loops import bucketed, outcome, run_both
from _loops import make_model, train
from _util import assert_all_same, step_by_route

from triton_scaler import GradBuckets, GradScaler


def _zero_buckets(opt):
    for bucket in opt._triton_scaler_buckets:
        bucket.buffer.zero_()


@pytest.mark.parametrize("optimizer_name", ["sgd_momentum", "adamw", "adamw_fused"])
@pytest.mark.parametrize("clip", [False, True])
def test_bucketed_training_matches_torch_without_buckets(backend, optimizer_name, clip):
    kwargs = dict(init_scale=2.0**10, growth_interval=3)
    expected = train(torch.amp.GradScaler("cpu", **kwargs), optimizer_name, clip=clip)
    actual = train(GradScaler("cpu", **kwargs, backend=backend), optimizer_name, clip=clip,
                   buckets=GradBuckets, zero_grad=lambda o: o.zero_grad(set_to_none=False))
    assert actual[0] == expected[0]
    assert_all_same(actual[1], expected[1])


def test_gradient_accumulation_into_buckets(backend):
    kwargs = dict(init_scale=2.0**10, growth_interval=3)
    expected = train(torch.amp.GradScaler("cpu", **kwargs), "adamw", accumulate=3)
    actual = train(GradScaler("cpu", **kwargs, backend=backend), "adamw", accumulate=3,
                   buckets=GradBuckets, zero_grad=_zero_buckets)
    assert actual[0] == expected[0]
    assert_all_same(actual[1], expected[1])


def test_set_to_none_is_reattached_exactly_with_one_warning(backend):
    kwargs = dict(init_scale=2.0**10, growth_interval=3)
    expected = train(torch.amp.GradScaler("cpu", **kwargs), "sgd_momentum")
    with pytest.warns(UserWarning, match="no longer views into their GradBucket.*They are "
                      "copied back into the bucket each step") as record:
        actual = train(GradScaler("cpu", **kwargs, backend=backend), "sgd_momentum",
                       buckets=GradBuckets)  # default zero_grad(): set_to_none=True
    assert len([w for w in record if "GradBucket" in str(w.message)]) == 1
    assert actual[0] == expected[0]
    assert_all_same(actual[1], expected[1])
    assert all(p.grad is None for p in actual[2][0].param_groups[0]["params"])  # as zero_grad


def test_set_to_none_warn_mode_takes_the_per_tensor_path(backend):
    kwargs = dict(init_scale=2.0**10, growth_interval=3)
    expected = train(torch.amp.GradScaler("cpu", **kwargs), "adamw")
    with pytest.warns(UserWarning, match="take the per-tensor path"):
        actual = train(GradScaler("cpu", **kwargs, backend=backend), "adamw",
                       buckets=lambda o: GradBuckets(o, on_detach="warn"))
    assert actual[0] == expected[0]
    assert_all_same(actual[1], expected[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_layout_one_storage_aligned_views(dtype):
    """Every grad a view of one buffer, each starting at the first 16-byte boundary after the
    previous one (no more padding than that), and the buffer's size a multiple of 16
    elements (the flat launch then specialises aligned)."""
    model = make_model().to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    buckets = GradBuckets(opt)
    assert len(buckets) == 1
    (bucket,) = buckets
    storage = bucket.buffer.untyped_storage().data_ptr()
    for p in model.parameters():
        assert p.grad.untyped_storage().data_ptr() == storage
        assert p.grad.data_ptr() % 16 == 0 and p.grad.shape == p.shape
    per_16_bytes = 16 // dtype.itemsize
    padded = [-(-p.numel() // per_16_bytes) * per_16_bytes for p in bucket.params]
    assert [p.grad.storage_offset() for p in bucket.params] == \
        [sum(padded[:i]) for i in range(len(padded))]
    assert sum(padded) % 16 != 0 and bucket.buffer.numel() == -(-sum(padded) // 16) * 16
    model(torch.randn(2, 12, dtype=dtype)).sum().backward()
    assert all(p.grad.untyped_storage().data_ptr() == storage for p in model.parameters())
    buckets.zero_()
    assert not bucket.buffer.any()


def _count_launches(monkeypatch):
    from triton_scaler.kernels import unscale

    launches = []
    kernel = unscale.unscale_kernel

    class Counting:
        def __getitem__(self, grid):
            launches.append(grid)

            def launch(*args, **kwargs):  # no compiled kernel back: none is reused
                kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(unscale, "unscale_kernel", Counting())
    return launches


@pytest.mark.parametrize("fused", [False, True])
def test_one_launch_per_bucket(monkeypatch, fused, triton_device):
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(20)])  # 40 params
    model.to(triton_device)
    opt = torch.optim.AdamW(model.parameters(), fused=fused)
    scaler = GradScaler(triton_device.type, backend="triton")
    scaler.scale(model(torch.randn(2, 16, device=triton_device)).sum()).backward()
    plain_launches = _count_launches(monkeypatch)
    scaler.step(opt)  # unscale_ or, for the fused optimizer, the read-only check
    assert len(plain_launches) == 1  # chunk-table path: one launch per (device, dtype)
    scaler.update()
    monkeypatch.undo()
    GradBuckets(opt)
    scaler.scale(model(torch.randn(2, 16, device=triton_device)).sum()).backward()
    bucket_launches = _count_launches(monkeypatch)
    scaler.step(opt)
    assert len(bucket_launches) == 1


def test_bucket_overflow_is_detected_and_skips(backend):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    buckets = GradBuckets(opt)
    scaler = GradScaler("cpu", backend=backend)
    before = [p.detach().clone() for p in model.parameters()]
    scaler.scale(model(torch.randn(2, 12)).sum() * math.inf).backward()
    scaler.step(opt)
    scaler.update()
    assert scaler.last_step_skipped.item()
    assert_all_same([p.detach() for p in model.parameters()], before)
    buckets.zero_()


@pytest.mark.parametrize("route", ["unscale_", "step"])
def test_a_bucket_of_fp16_grads_raises_as_torch(backend, route):
    """An fp16 parameter, held in its own bucket: ``unscale_`` and ``step`` raise torch's
    "Attempting to unscale FP16 gradients." and leave grads, parameters and optimizer state as torch's,
    which holds the same parameters without buckets (``run_both``)."""
    build = bucketed(lambda: [torch.nn.Parameter(torch.randn(4)),
                              torch.nn.Parameter(torch.randn(3, dtype=torch.float16))])

    def loop(params, opt, scaler, zero_grad):
        scaler.scale(params[0].sum() + params[1].float().sum()).backward()
        return [outcome(lambda: step_by_route(scaler, opt, route)),
                [p.grad.tolist() for p in params]]

    assert run_both(backend, build, loop)[0] == "ValueError: Attempting to unscale FP16 gradients."


def test_float64_buckets_match_torch_without_buckets(backend):
    """float64 parameters (GradScaler takes their grads, unscaled in float64) get their own
    bucket; training, an overflow step included, equals torch's without buckets."""
    build = bucketed(lambda: [torch.nn.Parameter(torch.randn(7, dtype=torch.float64)),
                              torch.nn.Parameter(torch.randn(3, 5, dtype=torch.float64)),
                              torch.nn.Parameter(torch.randn(4))],
                     optimizer=lambda ps: torch.optim.AdamW(ps, lr=0.1))

    def loop(params, opt, scaler, zero_grad):
        outcomes = []
        for step in range(4):
            zero_grad()
            loss = sum((p.double() ** 2).sum() for p in params)
            scaler.scale(loss * (math.inf if step == 1 else 1.0)).backward()
            outcomes.append(outcome(lambda: scaler.step(opt)))
            scaler.update()
            outcomes.append(scaler.get_scale())
        return outcomes

    assert run_both(backend, build, loop)[2:4] == ["ok", 4.0]


def test_mixed_dtypes_frozen_shared_and_rejected_params():
    a = torch.nn.Parameter(torch.ones(3))
    b = torch.nn.Parameter(torch.ones(5, dtype=torch.bfloat16))
    c = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))  # GradScaler takes float64 too
    frozen = torch.nn.Parameter(torch.ones(2), requires_grad=False)
    opt = torch.optim.SGD([a, b, c, frozen], lr=0.1)
    buckets = GradBuckets(opt)
    assert len(buckets) == 3 and frozen.grad is None
    assert sorted(str(bk.dtype) for bk in buckets) == ["torch.bfloat16", "torch.float32",
                                                        "torch.float64"]
    shared = torch.nn.Parameter(torch.ones(4))
    assert len(GradBuckets([shared, shared]).buckets[0].params) == 1  # listed twice: once
    with pytest.raises(ValueError, match="already belongs to other GradBuckets"):
        GradBuckets([a])
    with pytest.raises(TypeError, match="dtype torch.complex64; buckets hold float32, float16"):
        GradBuckets([torch.nn.Parameter(torch.ones(2, dtype=torch.complex64))])
    with pytest.raises(ValueError, match="on_detach must be 'reattach' or 'warn'"):
        GradBuckets([torch.nn.Parameter(torch.ones(1))], on_detach="ignore")


def test_params_added_later_take_the_per_tensor_path(backend):
    a = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([a], lr=0.1)
    GradBuckets(opt)
    late = torch.nn.Parameter(torch.ones(4))
    opt.add_param_group({"params": [late]})
    scaler = GradScaler("cpu", init_scale=4.0, backend=backend)
    scaler.scale(a.sum() + late.sum() * math.inf).backward()
    scaler.step(opt)
    scaler.update()
    assert scaler.last_step_skipped.item()  # the late param's inf was seen


def test_checkpoint_round_trip_with_buckets(backend):
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    buckets = GradBuckets(opt)
    scaler = GradScaler("cpu", backend=backend)
    for _ in range(2):
        scaler.scale(model(torch.randn(2, 12)).sum()).backward()
        scaler.step(opt)
        scaler.update()
        buckets.zero_()
    state = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(),
                           "scaler": scaler.state_dict()})
    model2 = make_model(seed=5)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    GradBuckets(opt2)
    model2.load_state_dict(state["model"])
    opt2.load_state_dict(state["opt"])
    scaler2 = GradScaler("cpu", backend=backend)
    scaler2.load_state_dict(state["scaler"])
    x = torch.randn(2, 12)
    for m, o, s in ((model, opt, scaler), (model2, opt2, scaler2)):
        s.scale(m(x).sum()).backward()
        s.step(o)
        s.update()
    assert_all_same([p.detach() for p in model2.parameters()],
                    [p.detach() for p in model.parameters()])


def test_two_optimizers_over_one_model_each_with_buckets(backend):
    kwargs = dict(init_scale=2.0**10, growth_interval=3)
    expected = train(torch.amp.GradScaler("cpu", **kwargs), "adamw", two_optimizers=True,
                     clip=True)
    actual = train(GradScaler("cpu", **kwargs, backend=backend), "adamw", two_optimizers=True,
                   clip=True, buckets=GradBuckets, zero_grad=_zero_buckets)
    assert actual[0] == expected[0]
    assert_all_same(actual[1], expected[1])


def test_release_frees_params_for_a_rebuilt_optimizer():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    buckets = GradBuckets(opt)
    (released,) = buckets.buckets
    model(torch.randn(2, 12)).sum().backward()
    model[0].bias.grad = None  # released as it is
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    buckets.release()
    assert opt._triton_scaler_buckets == [] and len(buckets) == 0
    assert model[0].bias.grad is None
    storages = {p.grad.untyped_storage().data_ptr() for p in model.parameters()
                if p.grad is not None}
    assert len(storages) == len(grads)  # each grad has its own storage again
    assert_all_same([p.grad for p in model.parameters() if p.grad is not None], grads)
    released.received.clear()
    model(torch.randn(2, 12)).sum().backward()
    assert not released.received  # its hooks are gone
    opt2 = torch.optim.SGD(model.parameters(), lr=0.1)
    assert len(GradBuckets(opt2)) == 1


def test_buckets_built_between_the_backward_and_the_step_keep_its_grads(backend):
    """GradBuckets built after the backward (the grads already there) copy each grad into its
    view and count it as this iteration's gradient: both steps are torch's."""
    results = []
    for ours in (False, True):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(n)) for n in (5, 3)]
        opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
        scaler = GradScaler("cpu", backend=backend) if ours else torch.amp.GradScaler("cpu")
        for step in range(2):
            scaler.scale(sum((p * p).sum() for p in params)).backward()
            if ours and step == 0:
                buckets = GradBuckets(opt)
            scaler.step(opt)
            scaler.update()
            buckets.zero_() if ours else opt.zero_grad()
        results.append([p.detach().clone() for p in params])
    assert_all_same(results[1], results[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_grads_accumulated_into_the_views_keep_negative_zeros(dtype):
    """Autograd adds into a bucket view (grad += g); the buckets are filled with -0.0, so a -0.0
    in g stays -0.0 (0.0 + -0.0 is 0.0), bit for bit a fresh grad as after torch's default
    zero_grad(): after the buckets are built, after buckets.zero_(), and accumulated. (The
    -0.0s of a grad reach the parameters: an SGD step moves a -0.0 parameter by -lr * g.)"""
    weight = torch.tensor([-0.0, 1.0, -2.0, 0.0, -0.0], dtype=dtype)

    def run(buckets, backwards):
        p = torch.nn.Parameter(torch.tensor([-0.0, 3.0, 1.0, -0.0, 2.0], dtype=dtype))
        opt = torch.optim.SGD([p], lr=0.5)
        held = GradBuckets(opt) if buckets else None
        seen = []
        for i in range(2):
            if i:  # the first backward goes into the buckets as built (torch: grad None)
                held.zero_() if held else opt.zero_grad()
            for _ in range(backwards):
                (p * weight).sum().backward()
            seen.append(p.grad.clone())
            opt.step()
            seen.append(p.detach().clone())
        return seen

    for backwards in (1, 2):
        expected = run(False, backwards)
        assert expected[0][0].item() == 0 and expected[0][0].signbit()  # a -0.0 to keep
        assert_all_same(run(True, backwards), expected)


@pytest.mark.parametrize("route", ["unscale_", "step", "clip_grad_norm_", "fused_step"])
def test_the_detached_grads_warning_points_at_the_users_line(backend, route):
    """Whichever call first finds grads that are no longer bucket views (``unscale_``,
    ``clip_grad_norm_``, ``step`` on the plain or the fused route), the one warning is
    attributed to the user's line, not to a frame inside the scaler."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=route == "fused_step")
    GradBuckets(opt)
    scaler = GradScaler("cpu", init_scale=4.0, backend=backend)
    x = torch.randn(5, 12)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            scaler.scale(model(x).square().mean()).backward()
            step_by_route(scaler, opt, route)
            opt.zero_grad()  # set_to_none=True: the grads leave their buckets
    detached = [w for w in caught if "no longer views" in str(w.message)]
    # at the line that called the scaler (in the helper), not inside the scaler
    assert [w.filename for w in detached] == [step_by_route.__code__.co_filename]
