"""SpikeGuard: ZClip's rule on the device, in the scaler's clip (see docs/stability.md)."""

import math

import pytest
import torch
from _loops import optimizer_for_route
from _util import assert_all_same, assert_same

from triton_scaler import GradBuckets, GradScaler, SpikeGuard
from triton_scaler.diagnostics import count_host_syncs, optimizer_step_uncounted
from triton_scaler.spike_guard import STATS_LAYOUT


class TranscribedZClip:
    """zclip 1.0.0's ``ZClip`` (``zclip/zclip.py``) for a plain module, transcribed: the same
    Python-float arithmetic, for the runs where the zclip package is not installed."""

    def __init__(self, alpha=0.97, z_thresh=2.5, max_grad_norm=1.0, eps=1e-6, warmup_steps=25,
                 mode="zscore", clip_option="adaptive_scaling", clip_factor=1.0,
                 skip_update_on_spike=False):
        self.alpha, self.z_thresh, self.max_grad_norm, self.eps = alpha, z_thresh, \
            max_grad_norm, eps
        self.warmup_steps, self.mode, self.clip_factor = warmup_steps, mode, clip_factor
        self.clip_option = clip_option if mode == "zscore" else None
        self.skip_update_on_spike = skip_update_on_spike
        self.buffer, self.initialized, self.mean, self.var = [], False, None, None

    def _compute_grad_norm(self, model):
        norms = [p.grad.norm(2) for p in model.parameters() if p.grad is not None]
        return torch.sqrt(torch.sum(torch.pow(torch.stack(norms), 2))).item()

    def _compute_clip_val(self, grad_norm):
        std = self.var ** 0.5
        if self.mode == "percentile":
            threshold = self.mean + self.z_thresh * std
            return threshold if grad_norm > threshold else None
        z = (grad_norm - self.mean) / (std + self.eps)
        if z > self.z_thresh:
            if self.clip_option == "adaptive_scaling":
                return (self.mean + (self.z_thresh * std) / (z / self.z_thresh)) * self.clip_factor
            return self.mean
        return None

    def step(self, model):
        total_norm = self._compute_grad_norm(model)
        if not self.initialized:
            self.buffer.append(total_norm)
            if len(self.buffer) >= self.warmup_steps:
                self.mean = sum(self.buffer) / len(self.buffer)
                self.var = sum((x - self.mean) ** 2 for x in self.buffer) / len(self.buffer)
                self.initialized, self.buffer = True, []
            if self.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), self.max_grad_norm)
            return total_norm
        clip_val = self._compute_clip_val(total_norm)
        adaptive = clip_val if clip_val is not None else total_norm
        effective = adaptive if self.max_grad_norm is None else min(adaptive, self.max_grad_norm)
        coef = effective / (total_norm + 1e-6) if total_norm > effective else 1.0
        if coef < 1.0:
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.data.mul_(coef)
        if clip_val is not None and self.skip_update_on_spike:
            return total_norm
        value = clip_val if clip_val is not None else total_norm
        self.mean = self.alpha * self.mean + (1 - self.alpha) * value
        self.var = self.alpha * self.var + (1 - self.alpha) * (value - self.mean) ** 2
        return total_norm


def _zclip_class(oracle):
    if oracle == "zclip":
        return pytest.importorskip("zclip").ZClip
    return TranscribedZClip

SPIKES = {31: 40.0, 37: 8.0, 44: 60.0}  # step -> loss factor (after the warm-up)
OVERFLOWS = (5, 33)  # an inf in the loss: one in the warm-up, one after


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _batch(step):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(6, 8, generator=g), torch.randn(6, 3, generator=g)


def _loss(model, step):
    x, y = _batch(step)
    loss = torch.nn.functional.mse_loss(model(x), y) * SPIKES.get(step, 1.0)
    return loss * math.inf if step in OVERFLOWS else loss


def _zclip_run(oracle, steps, max_norm, skip, **settings):
    """The oracle: torch's scaler, then zclip on the unscaled grads (not on overflow steps,
    which torch's scaler skips); a skip guard's spike skips the optimizer step."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=7)
    zc = _zclip_class(oracle)(max_grad_norm=None if max_norm == math.inf else max_norm,
                              skip_update_on_spike=skip, **settings)
    norms, spikes, scales = [], [], []
    for step in range(steps):
        opt.zero_grad()
        scaler.scale(_loss(model, step)).backward()
        scaler.unscale_(opt)
        overflow = sum(v.item() for v in scaler._found_inf_per_device(opt).values()) > 0
        spike = False
        if not overflow:
            norm = zc._compute_grad_norm(model)
            spike = zc.initialized and zc._compute_clip_val(norm) is not None
            norms.append(zc.step(model))
        else:
            norms.append(math.inf)
        spikes.append(spike)
        if skip and spike:
            scaler.update()  # no step: clean for the scale
        else:
            scaler.step(opt)
            scaler.update()
        scales.append(scaler.get_scale())
    return model, norms, spikes, scales, zc


def _guard_run(steps, max_norm, backend, skip, **settings):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = SpikeGuard(action="skip" if skip else "clip", **settings)
    scaler = GradScaler("cpu", init_scale=2.0**10, growth_interval=7, backend=backend,
                        spike_guard=guard)
    norms, skipped, scales = [], [], []
    for step in range(steps):
        opt.zero_grad()
        scaler.scale(_loss(model, step)).backward()
        norms.append(scaler.clip_grad_norm_(opt, max_norm).item())
        scaler.step(opt)
        scaler.update()
        skipped.append(bool(scaler.last_step_skipped))
        scales.append(scaler.get_scale())
    return model, norms, skipped, scales, guard, scaler


@pytest.mark.parametrize("skip", [False, True], ids=["clip", "skip"])
@pytest.mark.parametrize("settings", [
    dict(warmup_steps=25),
    pytest.param(dict(warmup_steps=25, mode="percentile"), marks=pytest.mark.exhaustive),
    pytest.param(dict(warmup_steps=25, clip_option="mean", alpha=0.9, z_thresh=2.0),
                 marks=pytest.mark.exhaustive),
], ids=["zscore", "percentile", "mean"])
@pytest.mark.parametrize("oracle", ["zclip", "transcribed"])
def test_matches_zclip_after_torch_unscale(backend, settings, skip, oracle):
    """Norms, spikes, skipped steps, scales and parameters match zclip applied to the
    unscaled grads of torch's scaler loop (overflow steps left out of zclip's statistics):
    the statistics to float rounding (zclip keeps Python floats), the decisions exactly. The
    oracle is the zclip package (skipped where it is not installed) or its transcription."""
    steps = 50
    ref_model, ref_norms, ref_spikes, ref_scales, zc = _zclip_run(oracle, steps, 1.0, skip,
                                                                  **settings)
    model, norms, skipped, scales, guard, _ = _guard_run(steps, 1.0, backend, skip, **settings)
    for step, (ours, theirs) in enumerate(zip(norms, ref_norms)):
        if step in OVERFLOWS:
            assert not math.isfinite(ours)
        else:
            assert ours == pytest.approx(theirs, rel=1e-6), step
    stats = guard.statistics()
    assert stats["spikes"] == sum(ref_spikes) >= 2
    assert stats["count"] == settings["warmup_steps"]
    assert stats["mean"] == pytest.approx(zc.mean, rel=1e-6)
    assert stats["var"] == pytest.approx(zc.var, rel=1e-5)
    if skip:
        assert skipped == [s in OVERFLOWS or spike for s, spike in enumerate(ref_spikes)]
    else:
        assert skipped == [s in OVERFLOWS for s in range(steps)]
    assert scales == ref_scales
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode, clip_option, action", [
    ("zscore", "adaptive_scaling", "clip"), ("zscore", "mean", "skip"),
    ("percentile", "adaptive_scaling", "clip"), ("percentile", "mean", "skip")])
def test_kernel_equals_the_reference_bit_for_bit(triton_device, mode, clip_option, action):
    """The Triton kernel's statistics equal the reference path's (torch's ops on the same
    device) after every step, over fp32 and fp64 norms with spikes, inf, NaN and a finite
    max_norm and none."""
    g = torch.Generator().manual_seed(3)
    norms = (1.0 + 0.1 * torch.randn(40, generator=g, dtype=torch.float64)).tolist()
    for i, value in ((3, math.inf), (9, math.nan), (14, 9.0), (20, 30.0), (27, -math.inf)):
        norms[i] = value
    guards = [SpikeGuard(warmup_steps=6, mode=mode, clip_option=clip_option, action=action)
              for _ in range(2)]
    for i, value in enumerate(norms):
        dtype = torch.float64 if i % 3 == 0 else torch.float32
        max_norm = math.inf if i % 4 == 0 else 1.25
        limits = [guard.limit(torch.tensor(value, dtype=dtype, device=triton_device),
                              max_norm, backend)
                  for guard, backend in zip(guards, ("reference", "triton"))]
        assert_same(limits[1], limits[0])
        assert guards[1].state_dict() == guards[0].state_dict()
    assert guards[0].statistics()["spikes"] >= 2


def test_stats_layout_matches_the_kernel():
    """The package's names of the statistics are the kernel's order."""
    from triton_scaler.kernels.guard import STATS_LAYOUT as KERNEL_LAYOUT

    assert STATS_LAYOUT == KERNEL_LAYOUT


def _route_run(route, backend, guard, *, buckets=False, steps=12, max_norm=0.5, loss_at=None,
               compiled=None):
    """A loop over one route (``optimizer_for_route``) with the scaler's clip; ``loss_at``:
    step -> loss factor; ``compiled``: compile the clip and update with fullgraph=True.
    Returns the norms, skipped flags, scales and the parameters."""
    model = _model()
    opt = optimizer_for_route(route, model.parameters())
    held = GradBuckets(opt) if buckets else None
    scaler = GradScaler("cpu", init_scale=2.0**10, growth_interval=3, backend=backend,
                        spike_guard=guard)

    def clip():
        return scaler.clip_grad_norm_(opt, max_norm)

    def update():
        scaler.update()

    if compiled is not None:
        clip, update = (torch.compile(f, fullgraph=True, backend=compiled) for f in (clip, update))
    seen = []
    for step in range(steps):
        x, y = _batch(step)
        loss = torch.nn.functional.mse_loss(model(x), y) * (loss_at or {}).get(step, 1.0)
        scaler.scale(loss).backward()
        norm = clip()
        scaler.step(opt)
        update()
        held.zero_() if held is not None else opt.zero_grad()
        seen.append((norm.clone(), bool(scaler.last_step_skipped), scaler.get_scale()))
    return seen, [p.detach().clone() for p in model.parameters()]


def _assert_runs_same(run, expected):
    """Two :func:`_route_run` results equal: norms bit for bit, skips, scales, parameters."""
    (seen, params), (seen_expected, params_expected) = run, expected
    assert_all_same([norm for norm, _, _ in seen], [norm for norm, _, _ in seen_expected])
    assert [rest for _, *rest in seen] == [rest for _, *rest in seen_expected]
    assert_all_same(params, params_expected)


@pytest.mark.parametrize("route, buckets", [("sgd", False), ("foreach", False), ("fused", False),
                                            ("fused", True), ("sgd", True)])
def test_a_guard_that_does_not_fire_is_the_plain_clip(backend, route, buckets):
    """In its warm-up and after it, a guard that sees no spike leaves the scaler's clip as it
    is, bit for bit: norms, skips, scales and parameters, on every step route."""
    loss_at = {7: math.inf}
    plain = _route_run(route, backend, None, buckets=buckets, loss_at=loss_at)
    for guard in (SpikeGuard(warmup_steps=4, z_thresh=1e6), SpikeGuard(warmup_steps=4,
                                                                       z_thresh=1e6,
                                                                       action="skip")):
        guarded = _route_run(route, backend, guard, buckets=buckets, loss_at=loss_at)
        _assert_runs_same(guarded, plain)
        assert guard.statistics()["count"] == 4 and guard.statistics()["spikes"] == 0


@pytest.mark.parametrize("route, buckets", [("sgd", False), ("fused", False), ("fused", True)])
def test_a_skipped_spike_is_a_skipped_step_but_not_an_overflow(backend, route, buckets):
    """action="skip": a spike leaves parameters (and a fused optimizer's state) as they were,
    counts in last_step_skipped and skipped_steps, and the scale grows on schedule (the step
    is clean for the growth tracker); action="clip" on the same run skips nothing."""
    loss_at = {9: 80.0}
    guard = SpikeGuard(warmup_steps=4, action="skip")
    seen, params = _route_run(route, backend, guard, buckets=buckets, loss_at=loss_at, steps=10)
    before, _ = _route_run(route, backend, SpikeGuard(warmup_steps=4, action="skip"),
                           buckets=buckets, steps=9)
    assert [s for _, s, _ in seen] == [False] * 9 + [True]
    assert_all_same(params, _route_run(route, backend, SpikeGuard(warmup_steps=4),
                                       buckets=buckets, steps=9)[1])
    assert [scale for _, _, scale in seen] == [2.0**10 * 2 ** ((i + 1) // 3) for i in range(10)]
    assert guard.statistics()["spikes"] == 1 and guard.statistics()["last_step"] == 10
    clipped, _ = _route_run(route, backend, SpikeGuard(warmup_steps=4), buckets=buckets,
                            loss_at=loss_at, steps=10)
    assert not any(s for _, s, _ in clipped)
    assert len(before) == 9


@pytest.mark.parametrize("compile_backend", [
    "aot_eager", pytest.param("inductor", marks=pytest.mark.exhaustive)])
@pytest.mark.parametrize("action", ["clip", "skip"])
def test_compiled_equals_eager(backend, compile_backend, action):
    """The guarded clip and update compile with fullgraph=True and give the eager run's
    norms, skips, scales and parameters bit for bit under aot_eager, spikes and an overflow
    included; under inductor, which generates the clip's norm arithmetic, the same decisions
    and the values to rounding."""
    loss_at = {6: 50.0, 8: math.inf, 10: 70.0}
    torch._dynamo.reset()
    try:
        compiled = _route_run("sgd", backend, SpikeGuard(warmup_steps=4, action=action),
                              loss_at=loss_at, compiled=compile_backend)
    finally:
        torch._dynamo.reset()
    eager = _route_run("sgd", backend, SpikeGuard(warmup_steps=4, action=action),
                       loss_at=loss_at)
    if compile_backend == "inductor":
        # inductor generates the clip's norm arithmetic in its own order (docs/compile.md):
        # the decisions are equal, the values to rounding
        assert [rest for _, *rest in compiled[0]] == [rest for _, *rest in eager[0]]
        torch.testing.assert_close(compiled[1], eager[1], rtol=1e-5, atol=1e-7)
    else:
        _assert_runs_same(compiled, eager)
    assert sum(s for _, s, _ in eager[0]) == (3 if action == "skip" else 1)


def test_no_host_read_is_added(backend):
    """The guarded clip, step and update read the host as often as the unguarded ones: the
    clip and update never, the plain route's step once."""
    def reads(guard):
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        scaler = GradScaler("cpu", backend=backend, spike_guard=guard)
        counts = []
        for step in range(8):
            x, y = _batch(step)
            scaler.scale(torch.nn.functional.mse_loss(model(x), y) * (60.0 if step == 6
                                                                    else 1.0)).backward()
            with count_host_syncs() as c, optimizer_step_uncounted(opt, c):
                scaler.clip_grad_norm_(opt, 1.0)
                clip = c.count
                scaler.step(opt)
                scaler.update()
            counts.append((clip, c.count))
            opt.zero_grad()
        return counts

    plain = reads(None)
    assert plain == [(0, 1)] * 8
    assert reads(SpikeGuard(warmup_steps=3)) == plain
    assert reads(SpikeGuard(warmup_steps=3, action="skip")) == plain


@pytest.mark.parametrize("action", ["clip", "skip"])
def test_a_resumed_run_equals_an_uninterrupted_one(backend, action, tmp_path):
    """state_dict() carries the guard's settings and statistics: a run saved mid-way and
    resumed into a scaler made with other guard settings equals the uninterrupted run bit for
    bit; torch's GradScaler loads the checkpoint; a checkpoint without a guard restarts it."""
    loss_at = {9: 60.0, 13: 70.0}

    def run(steps, start=None):
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        scaler = GradScaler("cpu", growth_interval=3, backend=backend,
                            spike_guard=SpikeGuard(warmup_steps=4, action=action)
                            if start is None else SpikeGuard(alpha=0.5, warmup_steps=2))
        first = 0
        if start is not None:
            saved = torch.load(start, weights_only=False)
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["opt"])
            scaler.load_state_dict(saved["scaler"])
            first = saved["step"]
        norms = []
        for step in range(first, steps):
            x, y = _batch(step)
            loss = torch.nn.functional.mse_loss(model(x), y) * loss_at.get(step, 1.0)
            scaler.scale(loss).backward()
            norms.append(scaler.clip_grad_norm_(opt, 0.5))
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            if step == 7 and start is None:
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                            "scaler": scaler.state_dict(), "step": 8}, tmp_path / "ck.pt")
        return norms, [p.detach().clone() for p in model.parameters()], scaler

    norms, params, scaler = run(16)
    resumed_norms, resumed, resumed_scaler = run(16, tmp_path / "ck.pt")
    assert_all_same(resumed_norms, norms[8:])
    assert_all_same(resumed, params)
    assert resumed_scaler.state_dict() == scaler.state_dict()
    assert scaler.state_dict()["spike_guard"]["statistics"][STATS_LAYOUT.index("spikes")] >= 2
    saved = torch.load(tmp_path / "ck.pt", weights_only=False)["scaler"]
    theirs = torch.amp.GradScaler("cpu")
    theirs.load_state_dict(saved)
    assert theirs.get_scale() == saved["scale"]
    restarted = GradScaler("cpu", backend=backend, spike_guard=SpikeGuard(warmup_steps=4))
    restarted.load_state_dict(torch.amp.GradScaler("cpu").state_dict() | {"scale": 8.0})
    assert restarted.state_dict()["spike_guard"]["statistics"] == [0.0] * len(STATS_LAYOUT)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(alpha=1.0), ValueError, "alpha"), (dict(alpha=0), ValueError, "alpha"),
    (dict(alpha="0.9"), TypeError, "alpha"), (dict(z_thresh=0.0), ValueError, "z_thresh"),
    (dict(z_thresh=math.inf), ValueError, "z_thresh"),
    (dict(warmup_steps=0), ValueError, "warmup_steps"),
    (dict(warmup_steps=2.0), TypeError, "warmup_steps"),
    (dict(mode="median"), ValueError, "mode"), (dict(mode=1), TypeError, "mode"),
    (dict(clip_option="max"), ValueError, "clip_option"),
    (dict(clip_factor=-1.0), ValueError, "clip_factor"),
    (dict(action="raise"), ValueError, "action"), (dict(action=None), TypeError, "action"),
])
def test_bad_settings_are_named(kwargs, error, match):
    """Each bad setting raises ValueError or TypeError naming the argument."""
    with pytest.raises(error, match=match):
        SpikeGuard(**kwargs)


def test_misuse_is_refused(backend):
    """A guard that is not a SpikeGuard, a skipping guard with skip_on_overflow=False, a
    second guarded clip in one iteration and a bad checkpoint entry raise, named."""
    with pytest.raises(TypeError, match="spike_guard"):
        GradScaler("cpu", spike_guard=TranscribedZClip())
    with pytest.raises(ValueError, match="skip_on_overflow"):
        GradScaler("cpu", skip_on_overflow=False, spike_guard=SpikeGuard(action="skip"))
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = GradScaler("cpu", backend=backend, spike_guard=SpikeGuard())
    scaler.scale(model(torch.ones(2, 8)).sum()).backward()
    assert torch.isfinite(scaler.clip_grad_norm_(opt, math.inf))  # accepted with a guard
    with pytest.raises(RuntimeError, match="one clip_grad_norm_ per iteration"):
        scaler.clip_grad_norm_(opt, 1.0)
    state = scaler.state_dict()
    state["spike_guard"] = dict(state["spike_guard"], alpha=2.0)
    with pytest.raises(ValueError, match=r"spike_guard.*alpha"):
        scaler.load_state_dict(state)


_SPAWNED: dict = {}


@pytest.mark.skipif(not torch.distributed.is_available()
                    or not torch.distributed.is_gloo_available(), reason="needs gloo")
@pytest.mark.parametrize("engine", ["fsdp2", "ddp", "fsdp1"])
def test_every_rank_decides_alike(backend, engine, tmp_path_factory):
    """Under FSDP2, DDP and FSDP1 (2 gloo ranks, a spike in rank 1's batch only) every rank
    gets the same global norm, spike, skip, scale and guard statistics, and the skipping guard
    leaves every rank's parameters as the clipping guard's were before the spike."""
    from _guard_worker import SPIKE_STEP, run_guarded
    from _spawn import spawned_results

    ranks = spawned_results(_SPAWNED, f"guard_{backend}", run_guarded, tmp_path_factory,
                            backend)
    for action in ("clip", "skip"):
        results = [rank[(engine, action)] for rank in ranks]
        assert all("error" not in r for r in results), results
        first, second = results
        assert first["norms"] == second["norms"] and first["skipped"] == second["skipped"]
        assert first["statistics"] == second["statistics"]
        assert first["scale"] == second["scale"]
        spikes = first["statistics"][STATS_LAYOUT.index("spikes")]
        assert spikes >= 1 and first["statistics"][STATS_LAYOUT.index("last_step")] > SPIKE_STEP
        assert first["skipped"][SPIKE_STEP] == (action == "skip")
        assert_all_same(first["params"], second["params"])


def test_the_watch_reports_spikes_and_counts_skipped_ones_as_skips(backend):
    """A watch's report counts the guard's spikes with the last one's step, norm and
    threshold (in .metrics() too); two skipped spikes in a row exceed max_consecutive_skips=1
    although no gradient overflowed."""
    from triton_scaler import SkippedStepsError

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = SpikeGuard(warmup_steps=4, action="skip")
    scaler = GradScaler("cpu", backend=backend, spike_guard=guard)
    watch = scaler.watch(model, max_consecutive_skips=1)
    assert watch.report().spikes == 0 and watch.report().last_spike is None
    norms = []
    for step in range(9):
        x, y = _batch(step)
        factor = {6: 80.0, 7: 90.0}.get(step, 1.0)
        scaler.scale(torch.nn.functional.mse_loss(model(x), y) * factor).backward()
        norms.append(scaler.clip_grad_norm_(opt, 1.0).item())
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    with pytest.raises(SkippedStepsError, match="2 steps in a row") as raised:
        watch.report()
    report = raised.value.report
    stats = guard.statistics()
    assert report.spikes == 2 and report.skipped_steps == 2 and report.last_overflow is None
    assert report.last_spike.step == 8 and report.last_spike.norm == norms[7]
    assert report.last_spike.threshold == stats["last_threshold"] < norms[7]
    metrics = report.metrics()
    assert metrics["spikes"] == 2.0 and metrics["last_spike_step"] == 8.0
    assert all(isinstance(v, float) for v in metrics.values())


@pytest.mark.parametrize("buckets", [False, True])
def test_one_launch_more_than_the_plain_clip(interpreter, monkeypatch, buckets):
    """On the Triton backend a guarded clip launches what the plain clip launches plus the
    guard's one program; update() stays one launch (a skipping guard's spike recorded in it);
    the device ops outside the kernels grow by a fixed handful, whatever the grads."""
    from _launch_counting import _launches, _Ops

    def counts(guard, n_params):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(5 + 3 * i)) for i in range(n_params)]
        opt = torch.optim.AdamW(params, lr=1e-3, fused=True)
        held = GradBuckets(opt) if buckets else None
        scaler = GradScaler("cpu", backend="triton", spike_guard=guard)
        for _ in range(3):
            scaler.scale(sum(p.square().sum() for p in params)).backward()
            with _launches(monkeypatch) as launched, _Ops() as ops:
                scaler.clip_grad_norm_(opt, 1.0)
            scaler.step(opt)
            with _launches(monkeypatch) as updated, _Ops() as update_ops:
                scaler.update()
            held.zero_() if held is not None else opt.zero_grad()
        assert dict(updated) == {"update": 1}
        return dict(launched), sum(ops.ops.values()), sum(update_ops.ops.values())

    for n_params in (2, 9):
        plain, plain_ops, plain_update_ops = counts(None, n_params)
        for action in ("clip", "skip"):
            guarded, guarded_ops, update_ops = counts(SpikeGuard(action=action), n_params)
            assert guarded == {**plain, "guard": 1}
            assert 0 < guarded_ops - plain_ops <= 6, (plain_ops, guarded_ops)
            assert update_ops == plain_update_ops, (plain_update_ops, update_ops)
