"""``scaler.watch(model)``: per-parameter amax and inf / NaN counts exactly torch's on the
unscaled gradient before clipping, norms within 1e-5 of ``torch.linalg.vector_norm``, on every
route (fused / foreach / for-loop optimizers, GradBuckets, ``clip_grad_norm_``, both
backends); the last overflow named by parameter; the cap on skipped steps; no host read
before ``report()``; and watching changes no result."""

import math

import pytest
import torch
from _loops import optimizer_for_route

from triton_scaler import GradBuckets, GradScaler, SkippedStepsError, WatchReport
from triton_scaler.diagnostics import count_host_syncs, optimizer_step_uncounted

STEPS = 6
OVERFLOW_STEP = 3


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3),
                               torch.nn.ReLU(), torch.nn.Linear(3, 2))



def _train(backend, kind, buckets, clip, watch, expected_stats=None, unscale=False):
    """Six iterations; at OVERFLOW_STEP one inf and one NaN planted in two grads. With
    ``expected_stats`` (a list), each iteration's torch-computed stats of the unscaled grads
    (before clipping) are appended to it."""
    model = _model()
    opt = optimizer_for_route(kind, model.parameters())
    held = GradBuckets(opt) if buckets else None
    scaler = GradScaler("cpu", init_scale=2.0**10, growth_interval=2, backend=backend)
    watcher = scaler.watch(model) if watch else None
    gen = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        loss = model(torch.randn(4, 5, generator=gen)).square().mean()
        scaler.scale(loss).backward()
        if step == OVERFLOW_STEP:
            model[2].weight.grad[1, 2] = math.inf
            model[0].bias.grad[-1] = math.nan
        if expected_stats is not None:
            inv = torch.tensor(1.0 / scaler.get_scale())
            expected_stats.append({
                name: ((p.grad * inv).abs().max().item(),
                       torch.linalg.vector_norm(p.grad * inv).item(),
                       int(torch.isinf(p.grad * inv).sum()), int(torch.isnan(p.grad * inv).sum()))
                for name, p in model.named_parameters()})
        if clip:
            scaler.clip_grad_norm_(opt, 0.05)
        elif unscale:
            scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        held.zero_() if held is not None else opt.zero_grad()
    return model, scaler, watcher


ROUTES = [("fused", False, False), ("fused", True, False), ("foreach", False, False),
          ("forloop", False, False), ("foreach", True, True), ("forloop", False, True)]


@pytest.mark.parametrize("kind, buckets, clip", ROUTES,
                         ids=[f"{k}-{'buckets' if b else 'grads'}-{'clip' if c else 'noclip'}"
                              for k, b, c in ROUTES])
def test_the_report_is_torchs_numbers_of_the_last_iteration(backend, kind, buckets, clip):
    expected = []
    _, scaler, watch = _train(backend, kind, buckets, clip, True, expected,
                              unscale=kind != "fused")
    report = watch.report()
    assert isinstance(report, WatchReport)
    last = expected[-1]
    for name, (amax, norm, inf, nan) in last.items():
        assert report.amax[name] == amax
        assert report.norm[name] == pytest.approx(norm, rel=1e-5)
        assert report.nonfinite[name] == (inf, nan) == (0, 0)
        assert report.has_grad[name]
    assert report.step == STEPS
    assert report.scale == scaler.get_scale() and report.skipped_steps == scaler.skipped_steps


@pytest.mark.parametrize("kind, buckets, clip", ROUTES,
                         ids=[f"{k}-{'buckets' if b else 'grads'}-{'clip' if c else 'noclip'}"
                              for k, b, c in ROUTES])
def test_watching_changes_no_result(backend, kind, buckets, clip):
    plain = _train(backend, kind, buckets, clip, False, unscale=kind != "fused")
    watched = _train(backend, kind, buckets, clip, True, unscale=kind != "fused")
    for a, b in zip(plain[0].parameters(), watched[0].parameters()):
        assert torch.equal(a, b)
    assert plain[1].get_scale() == watched[1].get_scale()
    assert plain[1].skipped_steps == watched[1].skipped_steps == 1


@pytest.mark.parametrize("kind", ["fused", "foreach"])
def test_the_overflow_is_named_by_parameter_nearest_the_loss_first(backend, kind):
    _, _, watch = _train(backend, kind, False, False, True, unscale=kind != "fused")
    overflow = watch.report().last_overflow
    assert overflow is not None and overflow.step == OVERFLOW_STEP
    assert overflow.tensors == [("2.weight", 1, 0), ("0.bias", 0, 1)]
    assert overflow.scale == 2.0**10 * 2  # grown once (interval 2) before the overflow
    assert str(overflow) == (
        "overflow at step 3 (scale 2048), 2 parameter(s) with non-finite gradients, nearest "
        "the loss first:\n  2.weight: 1 inf, 0 NaN\n  0.bias: 0 inf, 1 NaN")


def test_the_overflow_iteration_reports_its_counts_and_nan_amax(backend):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler("cpu", backend=backend)
    watch = scaler.watch(model.named_parameters())
    scaler.scale(model(torch.randn(2, 5)).sum()).backward()
    model[4].weight.grad[0, 0] = math.nan
    model[4].weight.grad[1, 1] = -math.inf
    model[4].weight.grad[1, 2] = math.inf
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    report = watch.report()
    assert report.nonfinite["4.weight"] == (2, 1)
    assert math.isnan(report.amax["4.weight"]) and math.isnan(report.norm["4.weight"])
    assert report.consecutive_skips == 1 and report.metrics()["nonfinite_params"] == 1.0


def test_no_host_read_before_report(backend):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    scaler = GradScaler("cpu", backend=backend)
    watch = scaler.watch(model, max_consecutive_skips=5)
    for _ in range(3):
        scaler.scale(model(torch.randn(2, 5)).sum()).backward()
        with count_host_syncs() as syncs, optimizer_step_uncounted(opt, syncs):
            scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
        assert syncs.count == 0
        opt.zero_grad()
    with count_host_syncs() as syncs:
        watch.report()
    assert syncs.count == 1


def _skipping_run(scaler, model, opt, steps):
    for _ in range(steps):
        loss = model(torch.randn(2, 5)).sum() * math.inf
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()


def test_too_many_skips_in_a_row_raise_from_report(backend):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler("cpu", backend=backend)
    watch = scaler.watch(model, max_consecutive_skips=3)
    _skipping_run(scaler, model, opt, 3)
    assert watch.report().consecutive_skips == 3  # at the limit: no error
    _skipping_run(scaler, model, opt, 1)
    with pytest.raises(SkippedStepsError, match=r"^4 steps in a row were skipped "
                                                r"\(max_consecutive_skips=3\); the scale is "
                                                r"[\d.e+-]+; the last overflow \(step 3\) was "
                                                r"in: 4\.bias \(\d+ inf, \d+ NaN\)"):
        watch.report()


def test_check_every_raises_from_update(backend):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler("cpu", backend=backend)
    scaler.watch(model, max_consecutive_skips=2, check_every=2)
    _skipping_run(scaler, model, opt, 2)
    with pytest.raises(SkippedStepsError, match="4 steps in a row"):
        _skipping_run(scaler, model, opt, 2)


def test_metrics_are_flat_floats_with_rollups(backend):
    _, _, watch = _train(backend, "foreach", False, False, True, unscale=True)
    report = watch.report()
    metrics = report.metrics("grad/")
    assert all(isinstance(k, str) and isinstance(v, float) for k, v in metrics.items())
    assert metrics["grad/2.weight/amax"] == report.amax["2.weight"]
    assert metrics["grad/total_norm"] == pytest.approx(math.sqrt(sum(
        n * n for n in report.norm.values())))
    modules = report.metrics(rollup="module")
    assert modules["2/norm"] == pytest.approx(math.hypot(report.norm["2.weight"],
                                                         report.norm["2.bias"]))
    layers = report.metrics(rollup=lambda name: "first" if name.startswith("0.") else "rest")
    assert set(k.split("/")[0] for k in layers) >= {"first", "rest"}
    with pytest.raises(ValueError, match="rollup must be"):
        report.metrics(rollup="layer")


def test_a_parameter_without_a_grad_is_shown_as_such(backend):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler("cpu", backend=backend)
    watch = scaler.watch(model)
    model[4].bias.requires_grad_(False)
    model[4].bias.requires_grad_(True)  # still watched, but it gets no grad below
    loss = model[0](torch.randn(2, 5)).sum()
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    report = watch.report()
    assert report.has_grad["0.weight"] and not report.has_grad["4.bias"]
    assert math.isnan(report.norm["4.bias"]) and report.nonfinite["4.bias"] == (0, 0)
    assert "grad/4.bias/norm" not in report.metrics("grad/")


def test_bad_input_and_one_watch_per_scaler():
    model = _model()
    scaler = GradScaler("cpu")
    with pytest.raises(TypeError, match=r"model must be an nn\.Module or \(name, parameter\) "
                                        r"pairs.*pass model\.named_parameters\(\), not "
                                        r"model\.parameters\(\)"):
        scaler.watch(model.parameters())
    with pytest.raises(TypeError, match=r"model must be an nn\.Module .*got int"):
        scaler.watch(3)
    with pytest.raises(ValueError, match="max_consecutive_skips must be"):
        scaler.watch(model, max_consecutive_skips=-1)
    watch = scaler.watch(model)
    with pytest.raises(RuntimeError, match="already has a watch; call its close"):
        scaler.watch(model)
    watch.close()
    scaler.watch(model)  # after close(), a new one
    with pytest.raises(RuntimeError, match="closed"):
        watch.report()


def test_a_watched_parameter_no_optimizer_holds_is_warned_about(backend):
    model = _model()
    other = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler("cpu", backend=backend)
    scaler.watch([*model.named_parameters(), ("other.weight", other.weight)])
    scaler.scale(model(torch.randn(2, 5)).sum()).backward()
    scaler.step(opt)
    with pytest.warns(UserWarning, match=r"no optimizer stepped by this scaler holds .*"
                                         r"other\.weight"):
        scaler.update()


def test_a_checkpoint_with_a_watch_loads_in_torchs_scaler_and_back(backend):
    _, scaler, _ = _train(backend, "foreach", False, False, True, unscale=True)
    torchs = torch.amp.GradScaler("cpu")
    torchs.load_state_dict(scaler.state_dict())
    assert torchs.get_scale() == scaler.get_scale()
    again = GradScaler("cpu", backend=backend)
    again.load_state_dict(torchs.state_dict())
    assert again.get_scale() == scaler.get_scale()


def test_a_watched_scaler_pickles_without_its_watch(backend):
    """A watch is not the scaler's state: a watched scaler with GradBuckets pickles (as torch's
    scaler does at the start of an iteration), and the copy has no watch."""
    import pickle

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    GradBuckets(opt)
    scaler = GradScaler("cpu", backend=backend)
    watch = scaler.watch(model)
    for _ in range(2):
        scaler.scale(model(torch.randn(2, 5)).sum()).backward()
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
    copy = pickle.loads(pickle.dumps(scaler))
    assert copy.get_scale() == scaler.get_scale()
    copy.watch(model).close()  # no watch came along: a new one can be made
    assert watch.report().step == 2


def test_parameters_of_other_tensor_subclasses_are_refused_clearly():
    """A watch takes plain and DTensor parameters; another subclass (FSDP1's FlatParameter
    without use_orig_params, say) is refused, naming it, rather than watched wrongly."""

    class Flat(torch.nn.Parameter):
        pass

    with pytest.raises(NotImplementedError, match=r"'w' is a Flat: a watch takes plain"):
        GradScaler("cpu").watch([("w", Flat(torch.ones(3)))])


def test_mixed_dtypes_empty_grads_and_bf16_overflows(backend):
    """bf16 grads with an inf and a NaN beside float32 ones and an empty parameter: each
    dtype's numbers as torch computes them (bf16's inf counted as inf, not as NaN), the norm
    accumulated in float32."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)),
              torch.nn.Parameter(torch.randn(40, dtype=torch.bfloat16)),
              torch.nn.Parameter(torch.randn(0)), torch.nn.Parameter(torch.randn(7))]
    names = ["a", "b", "empty", "d"]
    opt = torch.optim.SGD(params, lr=0.0)
    scaler = GradScaler("cpu", init_scale=8.0, backend=backend)
    watch = scaler.watch(list(zip(names, params)))
    loss = sum(p.float().sum() * (i + 1) for i, p in enumerate(params))
    scaler.scale(loss).backward()
    params[1].grad[3] = math.inf
    params[1].grad[5] = -math.inf
    params[1].grad[9] = math.nan
    inv = torch.tensor(1 / 8.0)
    expected = {n: ((p.grad * inv).abs().max().item() if p.numel() else 0.0,
                    torch.linalg.vector_norm((p.grad * inv).float()).item(),
                    int(torch.isinf(p.grad * inv).sum()), int(torch.isnan(p.grad * inv).sum()))
                for n, p in zip(names, params)}
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    report = watch.report()
    for name, (amax, norm, inf, nan) in expected.items():
        assert report.nonfinite[name] == (inf, nan)
        if name == "b":
            assert math.isnan(report.amax[name]) and math.isnan(report.norm[name])
        else:
            assert report.amax[name] == amax
            assert report.norm[name] == pytest.approx(norm, rel=1e-5)
    assert report.nonfinite["b"] == (2, 1) and report.has_grad["empty"]
    assert report.last_overflow.tensors == [("b", 2, 1)]


def test_a_disabled_scalers_watch_reports_no_overflow_at_scale_one(backend):
    """``GradScaler(..., enabled=False)`` (the usual ``enabled=use_amp`` toggle): its watch
    reports before and after steps, no overflow, scale 1.0, every metric a float."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler("cpu", enabled=False, backend=backend)
    watch = scaler.watch(model)
    reports = [watch.report()]
    for _ in range(2):
        scaler.scale(model(torch.randn(2, 5)).sum()).backward()
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        reports.append(watch.report())
    for report in reports:
        assert report.last_overflow is None and report.scale == 1.0
        assert report.skipped_steps == 0 and report.consecutive_skips == 0
        metrics = report.metrics("grad/")
        assert metrics["grad/scale"] == 1.0
        assert all(isinstance(v, float) for v in metrics.values())


def test_the_skips_error_says_how_many_more_parameters_overflowed(backend):
    """With more overflowing parameters than the message lists (8), it says how many more."""
    model = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(12)])  # 24 parameters
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler("cpu", backend=backend)
    watch = scaler.watch(model, max_consecutive_skips=0)
    scaler.scale(model(torch.randn(2, 2)).sum()).backward()
    for p in model.parameters():
        p.grad.fill_(math.inf)
    scaler.step(opt)
    scaler.update()
    with pytest.raises(SkippedStepsError) as info:
        watch.report()
    message = str(info.value)
    assert message.count(" inf, ") == 8 and message.endswith(
        " and 16 more (report().last_overflow lists all)")
    assert len(info.value.report.last_overflow.tensors) == 24
