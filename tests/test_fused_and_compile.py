"""Fused-optimizer route details, torch.compile, and LR-scheduler skipping (the optimizer
contracts themselves: test_optimizer_contracts.py)."""

import math

import pytest
import torch
from _loops import make_model

from triton_scaler import GradBuckets, GradScaler
from triton_scaler.diagnostics import count_host_syncs, optimizer_step_uncounted
from triton_scaler.schedulers import SkipAwareScheduler


class RecordingFusedSGD(torch.optim.SGD):
    """An optimizer that takes the fused route and records what the scaler hands it."""

    _step_supports_amp_scaling = True

    def __init__(self, params):
        super().__init__(params, lr=0.1)
        self.seen = []

    def step(self, closure=None):
        grad_scale = self.grad_scale  # None after unscale_ (an optimizer without its own)
        found_inf = self.found_inf  # torch's scaler hands the int 0 when there are no grads
        self.seen.append((grad_scale if grad_scale is None else grad_scale.clone(),
                          found_inf.clone() if torch.is_tensor(found_inf) else found_inf))


@pytest.mark.parametrize("overflow", [False, True])
def test_fused_route_gets_a_0d_found_inf_of_exactly_0_or_1(backend, overflow):
    p = torch.nn.Parameter(torch.ones(3))
    opt = RecordingFusedSGD([p])
    scaler = GradScaler("cpu", init_scale=8.0, backend=backend)
    scaler.scale(p.sum() * (math.inf if overflow else 1.0)).backward()
    scaler.step(opt)
    scaler.update()
    grad_scale, found_inf = opt.seen[0]
    assert found_inf.shape == () and found_inf.dtype == torch.float32
    assert found_inf.item() == (1.0 if overflow else 0.0)
    assert grad_scale.item() == 8.0
    assert torch.equal(p.grad, torch.full((3,), 8.0 * (math.inf if overflow else 1.0)))
    assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")


@pytest.mark.parametrize("unscale_first", [False, True])
def test_a_fused_step_without_grads_is_handed_0_as_torchs(backend, unscale_first):
    """No grads at all (and ``unscale_`` first or not): the fused optimizer steps, handed the
    scale (none after ``unscale_``) and found_inf 0 (torch's the int 0), as from torch's
    scaler; ``update()`` then raises torch's error."""
    for scaler in (torch.amp.GradScaler("cpu", init_scale=8.0),
                   GradScaler("cpu", init_scale=8.0, backend=backend)):
        opt = RecordingFusedSGD([torch.nn.Parameter(torch.ones(3))])
        scaler.scale(torch.ones(()))  # initialises the scale
        if unscale_first:
            scaler.unscale_(opt)
        scaler.step(opt)
        (grad_scale, found_inf), = opt.seen
        assert (grad_scale is None if unscale_first else float(grad_scale) == 8.0)
        assert float(found_inf) == 0.0
        with pytest.raises(AssertionError, match="^No inf checks were recorded prior to update.$"):
            scaler.update()


@pytest.mark.parametrize("unscale_first", [False, True])
def test_fused_route_never_skips_with_skip_on_overflow_false(backend, unscale_first):
    """``skip_on_overflow=False``: the fused optimizer is handed found_inf = 0 at an overflow
    and steps, as the plain route steps; the scale still backs off."""
    results = []
    for opt_class in (RecordingFusedSGD, lambda ps: torch.optim.SGD(ps, lr=0.1, fused=True),
                      lambda ps: torch.optim.SGD(ps, lr=0.1)):
        p = torch.nn.Parameter(torch.ones(3))
        opt = opt_class([p])
        scaler = GradScaler("cpu", init_scale=8.0, skip_on_overflow=False, backend=backend)
        scaler.scale(p.sum() * torch.tensor([1.0, math.inf, 1.0]).sum()).backward()
        if unscale_first:
            scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        assert scaler.get_scale() == 4.0 and scaler.skipped_steps == 0
        if isinstance(opt, RecordingFusedSGD):
            assert [f.item() for _, f in opt.seen] == [0.0]
        else:
            results.append(p.detach().clone())
    assert results[0].isinf().all() and torch.equal(results[0], results[1])


class _OwnGradScaleSGD(RecordingFusedSGD):
    grad_scale = torch.tensor(0.25)  # the optimizer's own factor (a class attribute)


@pytest.mark.parametrize("unscale_first", [False, True])
def test_an_optimizers_own_grad_scale_is_multiplied_in_as_torch(backend, unscale_first):
    """torch hands a fused optimizer that has its own ``grad_scale`` the product ``scale *
    grad_scale``, or (after ``unscale_``) its own ``grad_scale`` alone, and deletes the
    instance attribute after the step (the class's stays)."""
    seen = []
    for scaler in (torch.amp.GradScaler("cpu", init_scale=8.0),
                   GradScaler("cpu", init_scale=8.0, backend=backend)):
        p = torch.nn.Parameter(torch.ones(3))
        opt = _OwnGradScaleSGD([p])
        for _ in range(2):
            scaler.scale(p.sum()).backward()
            if unscale_first:
                scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
        assert opt.grad_scale is _OwnGradScaleSGD.grad_scale and "grad_scale" not in vars(opt)
        seen.append([(g.item(), f.item()) for g, f in opt.seen])
    assert seen[1] == seen[0] == [(0.25 if unscale_first else 2.0, 0.0)] * 2


@pytest.mark.parametrize("name", ["adamw_fused", "sgd_fused", "adam_fused"])
def test_skipped_fused_step_leaves_params_and_state_bit_identical(backend, name):
    model = make_model()
    opt = {"adamw_fused": lambda: torch.optim.AdamW(model.parameters(), fused=True),
           "adam_fused": lambda: torch.optim.Adam(model.parameters(), fused=True),
           "sgd_fused": lambda: torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9,
                                                fused=True)}[name]()
    scaler = GradScaler("cpu", backend=backend)
    scaler.scale(model(torch.randn(3, 12)).sum()).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    params = [p.detach().clone() for p in model.parameters()]
    state = [{k: v.clone() for k, v in s.items()} for s in opt.state.values()]
    scaler.scale(model(torch.randn(3, 12)).sum() * math.inf).backward()
    scaler.step(opt)
    scaler.update()
    assert scaler.last_step_skipped.item()
    for a, p in zip(params, model.parameters()):
        assert torch.equal(a, p.detach())
    for before, after in zip(state, opt.state.values()):
        for k, v in before.items():  # includes "step"
            assert torch.equal(v, after[k]), k


def _compiled_run(scaler_factory, compile_backend, steps=6):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    scaler = scaler_factory()

    def train_step(x, multiplier):
        loss = model(x).square().mean() * multiplier
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        return loss.detach()

    step_fn = torch.compile(train_step, backend=compile_backend) if compile_backend else train_step
    gen = torch.Generator().manual_seed(2)
    scales = []
    for i in range(steps):
        step_fn(torch.randn(5, 8, generator=gen), torch.tensor(math.inf if i == 2 else 1.0))
        scales.append(scaler.get_scale())
    return scales, [p.detach().clone() for p in model.parameters()]


def test_torch_compile_matches_eager():
    """Graph breaks happen where dynamo skips torch.amp code (GradScaler.scale and the
    helpers inherited from torch) and at the optimizer boundary; the results are unchanged."""
    torch._dynamo.reset()
    factory = lambda: GradScaler("cpu", init_scale=2.0**10, growth_interval=2)  # noqa: E731
    eager = _compiled_run(factory, None)
    compiled = _compiled_run(factory, "aot_eager")
    assert compiled[0] == eager[0]
    for a, b in zip(compiled[1], eager[1]):
        assert torch.equal(a, b)


def test_torch_compile_inductor_matches_torch_scaler():
    torch._dynamo.reset()
    kwargs = dict(init_scale=2.0**10, growth_interval=2)
    ours = _compiled_run(lambda: GradScaler("cpu", **kwargs), "inductor", steps=4)
    torch._dynamo.reset()
    theirs = _compiled_run(lambda: torch.amp.GradScaler("cpu", **kwargs), "inductor", steps=4)
    assert ours[0] == theirs[0]
    for a, b in zip(ours[1], theirs[1]):
        assert torch.equal(a, b)


def _bucketed_compiled_run(scaler, buckets, compile_backend, compiled_autograd=False):
    """A compiled model (its backward too), optionally compiled autograd, trained with
    GradBuckets (``buckets.zero_()``) or without (``zero_grad()``); an overflow at step 2.
    Every step checks that the grads are still views into the bucket (no copy back)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    held = GradBuckets(opt) if buckets else None
    forward = torch.compile(model, backend=compile_backend)
    gen = torch.Generator().manual_seed(2)
    scales = []
    for i in range(5):
        loss = forward(torch.randn(5, 8, generator=gen)).square().mean()
        loss = loss * (math.inf if i == 2 else 1.0)
        if compiled_autograd:
            from torch._dynamo.compiled_autograd import _enable

            with _enable(torch.compile(backend="aot_eager")):
                scaler.scale(loss).backward()
        else:
            scaler.scale(loss).backward()
        if held is not None:
            buffer = held.buckets[0].buffer.untyped_storage().data_ptr()
            assert all(p.grad.untyped_storage().data_ptr() == buffer for p in model.parameters())
        scaler.step(opt)
        scaler.update()
        held.zero_() if held is not None else opt.zero_grad()
        scales.append(scaler.get_scale())
    return scales, [p.detach().clone() for p in model.parameters()]


@pytest.mark.filterwarnings("error:.*GradBucket")  # a grad copied back would warn
@pytest.mark.parametrize("compile_backend, compiled_autograd",
                         [("aot_eager", False), ("aot_eager", True), ("inductor", False)])
def test_grad_buckets_under_a_compiled_model(compile_backend, compiled_autograd):
    """The compiled backward (and compiled autograd) accumulate into the bucket views as eager
    autograd does: the scale trajectory and parameters equal torch's scaler without buckets
    over the same compiled model."""
    kwargs = dict(init_scale=2.0**10, growth_interval=2)
    torch._dynamo.reset()
    theirs = _bucketed_compiled_run(torch.amp.GradScaler("cpu", **kwargs), False, compile_backend)
    torch._dynamo.reset()
    ours = _bucketed_compiled_run(GradScaler("cpu", **kwargs), True, compile_backend,
                                  compiled_autograd)
    assert ours[0] == theirs[0] == [2.0**10, 2.0**11, 2.0**10, 2.0**10, 2.0**11]
    for a, b in zip(ours[1], theirs[1]):
        assert torch.equal(a, b)


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")
def test_scheduler_steps_only_on_applied_steps_without_sync(backend):
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1.0, fused=True)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    wrapped = SkipAwareScheduler(scheduler, GradScaler("cpu", backend=backend))
    scaler = wrapped.scaler
    overflow_at = {1, 2, 5}
    for i in range(8):
        scaler.scale(model(torch.randn(2, 12)).sum() * (math.inf if i in overflow_at else 1))\
            .backward()
        with count_host_syncs() as counter, optimizer_step_uncounted(opt, counter):
            scaler.step(opt)
            scaler.update()
            wrapped.step()
        assert counter.count == 0
        opt.zero_grad()
    wrapped.flush()
    assert scheduler.last_epoch == 8 - len(overflow_at)
    assert opt.param_groups[0]["lr"] == 0.5 ** (8 - len(overflow_at))


def test_scheduler_state_dict_counts_pending_steps_and_loads_into_a_new_wrapper(backend):
    """``state_dict`` first applies every pending flag (``flush``), so a checkpoint counts all
    applied steps; ``load_state_dict`` restores the wrapped scheduler and drops what was
    pending."""
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=1.0)
    scaler = GradScaler("cpu", backend=backend)
    wrapped = SkipAwareScheduler(torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5), scaler)
    for overflow in (False, True, False, False):
        scaler.scale(p.sum() * (math.inf if overflow else 1.0)).backward()
        scaler.step(opt)
        scaler.update()
        wrapped.step()
        opt.zero_grad()
    state = wrapped.state_dict()
    assert state["last_epoch"] == 3 and state == wrapped.scheduler.state_dict()
    fresh_opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=1.0)
    fresh = SkipAwareScheduler(torch.optim.lr_scheduler.StepLR(fresh_opt, 1, gamma=0.5),
                               GradScaler("cpu", backend=backend))
    fresh._pending.append((torch.zeros((), dtype=torch.bool), None))  # an applied step, pending
    fresh.load_state_dict(state)
    fresh.flush()  # nothing left to apply
    assert fresh.scheduler.last_epoch == 3


@pytest.mark.parametrize("fused", [False, True])
def test_dynamo_traces_a_step_with_few_graph_breaks(fused):
    """Under compile the scaler's calls are traced; the graph breaks are the backward, the
    plain route's one host read (an eager frame and the call it makes) and the optimizer's own
    step: at most four."""
    torch._dynamo.reset()
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters(), fused=fused)
    scaler = GradScaler("cpu")

    def train_step(x):
        scaler.scale(model(x).square().mean()).backward()
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()

    explanation = torch._dynamo.explain(train_step)(torch.randn(3, 8))
    assert explanation.graph_break_count <= 4
