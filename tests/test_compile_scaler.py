"""GradScaler's calls traced by ``torch.compile``: ``scale``, ``unscale_``, ``clip_grad_norm_``
(2 and inf norms) and ``update`` (torch's rule, hysteresis, min / max, static scaling) compile
with ``fullgraph=True`` on both backends, with and without GradBuckets, and give torch's
eager scaler's results bit for bit; ``step`` compiles with the breaks its optimizer needs, and
a planted overflow leaves every parameter and optimizer-state element as it was. The peers'
adapters update on the device inside a graph too."""

import math

import pytest
import torch
from _loops import optimizer_for_route
from _util import assert_all_same, graphs_compiled

from triton_scaler import GradBuckets, GradScaler
from triton_scaler.compat import deepspeed, megatron, mindspore

COMPILE_BACKENDS = ["aot_eager", "inductor"]
#: clean steps between growths, and where overflows are planted (loss, then one grad)
INTERVAL, LOSS_OVERFLOWS, GRAD_OVERFLOWS = 2, (2, 5), (6,)


@pytest.fixture(params=COMPILE_BACKENDS)
def compile_backend(request):
    torch._dynamo.reset()
    yield request.param
    torch._dynamo.reset()


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _run(scaler, route, compile_backend=None, buckets=False, steps=9, warm=2, fullgraph=True):
    """``scale -> backward -> (unscale_ | clip 2 | clip inf) -> step -> update`` with SGD;
    overflows planted in the loss and in one grad. With ``compile_backend`` the scaler's calls
    (all but ``step``) are compiled with ``fullgraph=True``, and after ``warm`` steps nothing
    may compile again. Returns (scale, growth tracker, norm) per step and the params."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    held = GradBuckets(opt) if buckets else None
    torchs = isinstance(scaler, torch.amp.GradScaler) and not isinstance(scaler, GradScaler)

    def scale(loss):
        return scaler.scale(loss)

    def post():
        if route == "unscale":
            scaler.unscale_(opt)
            return torch.zeros(())
        norm_type = 2.0 if route == "clip2" else math.inf
        if torchs:
            scaler.unscale_(opt)
            return torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5, norm_type)
        return scaler.clip_grad_norm_(opt, 0.5, norm_type)

    def update():
        scaler.update()

    if compile_backend is not None:
        scale, post, update = (torch.compile(f, fullgraph=fullgraph, backend=compile_backend)
                               for f in (scale, post, update))
    gen = torch.Generator().manual_seed(1)
    seen = []
    for i in range(steps):
        if i == warm:
            warm_graphs = graphs_compiled()
        loss = model(torch.randn(4, 8, generator=gen)).square().mean()
        scale(loss * (math.inf if i in LOSS_OVERFLOWS else 1.0)).backward()
        if i in GRAD_OVERFLOWS:
            model[2].weight.grad[-1, -1] = math.nan
        norm = post()
        scaler.step(opt)
        update()
        held.zero_() if held is not None else opt.zero_grad()
        seen.append((scaler.get_scale(), scaler._get_growth_tracker(), norm.detach().clone()))
    if compile_backend is not None and fullgraph:  # the scale changed, nothing recompiled
        assert graphs_compiled() == warm_graphs
    return seen, [p.detach().clone() for p in model.parameters()]


def _assert_same_run(actual, expected, rtol=0.0):
    """Scales and growth trackers equal; norms and parameters bit for bit, or (``rtol``)
    within ``rtol`` relative, NaN where the other has NaN."""
    assert [s[:2] for s in actual[0]] == [s[:2] for s in expected[0]]
    norms = [s[2].float() for s in actual[0]], [s[2].float() for s in expected[0]]
    for got, want in ((norms[0], norms[1]), (actual[1], expected[1])):
        if rtol:
            for a, e in zip(got, want, strict=True):
                torch.testing.assert_close(a, e, rtol=rtol, atol=0.0, equal_nan=True)
        else:
            assert_all_same(got, want)


@pytest.mark.parametrize("route", ["unscale", "clip2", "clipinf"])
@pytest.mark.parametrize("buckets", [False, True])
def test_scale_unscale_clip_update_compile_in_one_graph_each_as_torchs_scaler(
        backend, compile_backend, route, buckets):
    """fullgraph=True for each call; the scale trajectory, growth tracker, norms and
    parameters equal torch's eager scaler (torch's unscale_ + clip), bit for bit, with two
    overflows in the loss and a NaN in a grad; no recompilation as the scale changes. On the
    Triton backend the clip's norm is the fused read pass's, which sums in its own order: there
    the compiled clip equals the same scaler's eager clip bit for bit under aot_eager (torch's
    within 1e-6 relative); over GradBuckets it runs eagerly (a graph break), so that turning
    on torch.compile changes no number. Under inductor the norm's final arithmetic is
    inductor's generated reduction: norms and parameters there within 1e-6 relative."""
    def ours():
        return GradScaler("cpu", init_scale=2.0**10, growth_interval=INTERVAL, backend=backend)

    expected = _run(torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=INTERVAL),
                    route)
    fused_clip = backend == "triton" and route != "unscale"
    actual = _run(ours(), route, compile_backend, buckets, fullgraph=not (fused_clip and buckets))
    inexact = compile_backend == "inductor" and route != "unscale"
    _assert_same_run(actual, expected, rtol=1e-6 if inexact or fused_clip else 0.0)
    if fused_clip:
        torch._dynamo.reset()
        eager = _run(ours(), route, None, buckets)
        _assert_same_run(actual, eager, rtol=1e-6 if compile_backend == "inductor" else 0.0)
    scales = [s[0] for s in expected[0]]
    assert scales[2] < scales[1] and scales[6] < scales[5] < scales[4]  # the three backoffs


SETTINGS = [dict(hysteresis=2), dict(hysteresis=3, consecutive_hysteresis=True),
            dict(min_scale=512.0, max_scale=2048.0), dict(dynamic=False),
            dict(skip_on_overflow=False)]


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: ",".join(s))
def test_update_with_every_extension_compiles_as_eager(backend, settings):
    """Hysteresis (Megatron's and DeepSpeed's refill), min / max scale, static scaling and
    never skipping, traced: the scale, growth and hysteresis trackers, skipped-step count and
    parameters of the same scaler run eagerly."""
    torch._dynamo.reset()

    def run(compiled):
        scaler = GradScaler("cpu", init_scale=2.0**10, growth_interval=INTERVAL,
                            backend=backend, **settings)
        seen, params = _run(scaler, "unscale", "aot_eager" if compiled else None)
        return seen, params, scaler._get_hysteresis_tracker(), scaler.skipped_steps, \
            bool(scaler.last_step_skipped)

    eager, compiled = run(False), run(True)
    _assert_same_run(compiled[:2], eager[:2])
    assert compiled[2:] == eager[2:]
    skips = 0 if settings.get("skip_on_overflow") is False else 3
    assert eager[3] == skips



def _state_of(opt):
    return [(k, v.clone() if isinstance(v, torch.Tensor) else v)
            for state in opt.state.values() for k, v in sorted(state.items())]


@pytest.mark.parametrize("kind", ["fused", "foreach", "forloop"])
@pytest.mark.parametrize("where", ["loss", "grad"])
def test_a_planted_overflow_under_a_compiled_step_changes_no_parameter_or_state(
        backend, kind, where):
    """``scaler.step(opt); scaler.update()`` compiled: a clean step trains; an overflow (in the
    loss, or one grad) leaves every parameter and optimizer-state element bit for bit as it
    was, backs the scale off and counts one skipped step."""
    torch._dynamo.reset()
    model = _model()
    opt = optimizer_for_route(kind, model.parameters(), sgd_lr=0.1)
    scaler = GradScaler("cpu", init_scale=2.0**10, backend=backend)
    post = torch.compile(lambda: (scaler.step(opt), scaler.update()), backend="aot_eager")
    x = torch.randn(4, 8)
    for overflow in (False, True, False):
        before = [p.detach().clone() for p in model.parameters()], _state_of(opt)
        loss = model(x).square().mean()
        scaler.scale(loss * (math.inf if overflow and where == "loss" else 1.0)).backward()
        if overflow and where == "grad":
            model[0].bias.grad[0] = math.inf
        post()
        opt.zero_grad()
        after = [p.detach().clone() for p in model.parameters()], _state_of(opt)
        if overflow:
            assert_all_same(after[0], before[0])
            assert [k for k, _ in after[1]] == [k for k, _ in before[1]]
            assert_all_same([v for _, v in after[1]], [v for _, v in before[1]])
        else:
            assert not all(torch.equal(a, b) for a, b in zip(after[0], before[0]))
    assert scaler.skipped_steps == 1 and scaler.get_scale() == 2.0**9


def _graphs_and_breaks(fn):
    explanation = torch._dynamo.explain(fn)()
    return explanation.graph_count, explanation.graph_break_count


@pytest.mark.parametrize("kind", ["fused", "foreach", "forloop"])
def test_a_compiled_step_breaks_only_around_the_optimizers_step(backend, kind):
    """``torch._dynamo.explain`` of ``unscale_; step; update`` after a backward: torch's
    scaler's calls make no graph (dynamo skips torch.amp: every call eager); ours are traced
    into two graphs, broken only where the optimizer's own step runs (the eager helper that
    hands a fused optimizer its flags, or the plain route's one flag read; dynamo compiles a
    non-fused optimizer's step frame under both scalers)."""
    results = {}
    for name, make in (("torch", lambda: torch.amp.GradScaler("cpu")),
                       ("ours", lambda: GradScaler("cpu", backend=backend))):
        torch._dynamo.reset()
        model = _model()
        opt = optimizer_for_route(kind, model.parameters(), sgd_lr=0.1)
        scaler = make()
        scaler.scale(model(torch.randn(4, 8)).sum()).backward()

        def post(scaler=scaler, opt=opt):
            scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()

        results[name] = _graphs_and_breaks(post)
    ours, torchs = results["ours"], results["torch"]
    # torch's scaler: no graph of its own (the optimizer's step frame, where dynamo compiles
    # it, is the only graph); ours: two more, unscale_ with the agreement, and the update
    assert torchs[0] == (0 if kind == "fused" else 1), results
    assert ours[0] == torchs[0] + 2 and ours[1] <= 2, results


def test_the_update_is_one_op_of_a_graph(backend):
    """The traced ``update`` is the registered ``scaler_update_`` op in a graph."""
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = GradScaler("cpu", backend=backend)
    scaler.scale(p.sum()).backward()
    scaler.unscale_(opt)
    torch.compile(lambda: scaler.update(), fullgraph=True, backend=keep)()
    targets = [str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"]
    assert any(t.startswith("triton_scaler.scaler_update_") for t in targets), targets


def test_what_cannot_be_traced_runs_eagerly_with_eagers_results(backend):
    """``raise_at_min_scale=True`` reads the device in ``update``: under compile the call
    runs eagerly (a graph break) and raises as in eager code."""
    from triton_scaler import MinScaleReachedError

    torch._dynamo.reset()
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = GradScaler("cpu", init_scale=4.0, min_scale=4.0, raise_at_min_scale=True,
                        backend=backend)
    scaler.scale(p.sum() * math.inf).backward()
    step = torch.compile(lambda: (scaler.step(opt), scaler.update()), backend="aot_eager")
    with pytest.raises(MinScaleReachedError):
        step()
    assert scaler.get_scale() == 4.0 and scaler.skipped_steps == 1


def test_the_peers_adapters_update_inside_one_graph(backend):
    """DeepSpeed's ``update_scale``, Megatron's ``update`` and MindSpore's ``adjust`` with a
    device flag compile with ``fullgraph=True`` and follow the eager adapters' scales
    (DeepSpeed's ``raise_error_at_min_scale``, its default, reads the device: off here)."""
    def trajectories(compiled):
        ds = deepspeed.DynamicLossScaler(init_scale=2.0**4, scale_window=2, device="cpu",
                                         raise_error_at_min_scale=False, backend=backend)
        mg = megatron.DynamicGradScaler(initial_scale=2.0**4, min_scale=1.0, growth_factor=2.0,
                                        backoff_factor=0.5, growth_interval=2, hysteresis=2,
                                        device="cpu", backend=backend)
        ms = mindspore.DynamicLossScaler(2.0**4, 2, 2, device="cpu", backend=backend)

        def step(found):
            ds.update_scale(found)
            mg.update(found)
            ms.adjust(found == 0)

        if compiled:
            step = torch.compile(step, fullgraph=True, backend="aot_eager")
        seen = []
        for i in range(7):
            step(torch.tensor(1.0 if i in (1, 2, 5) else 0.0))
            seen.append((ds._scale.item(), mg.scale.item(), ms.scale_value.item()))
        return seen

    torch._dynamo.reset()
    eager = trajectories(False)
    assert trajectories(True) == eager
    assert len({s for s, _, _ in eager}) > 1
