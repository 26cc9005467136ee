"""The public ops, an adapter built on them, the scaler's clip and the privates integrators
call, from code compiled by ``torch.compile``, on both backends: the results of eager code and
of torch's ops. (The traced scaler calls themselves: ``tests/test_compile_scaler.py``.)"""

import math
import warnings

import pytest
import torch
from _util import assert_all_same, assert_same

from triton_scaler import GradBuckets, GradScaler, ops
from triton_scaler.compat import deepspeed

SIZES = [0, 1, 4097, 33]


def _iteration(backend):
    def iteration(grads, found, inv, scale, tracker):
        ops.non_finite_check_and_unscale_(grads, found, inv, backend=backend)
        ops.update_scale_(scale, tracker, found, 2.0, 0.5, 2, backend=backend)
        checked = torch.zeros_like(found)
        ops.non_finite_check_(grads, checked, inv, backend=backend)
        return ops.all_finite(grads, backend=backend), checked
    return iteration


def test_the_ops_in_compiled_code_give_torchs_results(backend):
    compiled = torch.compile(_iteration(backend), backend="aot_eager")
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(n, generator=gen) * 3000 for n in SIZES]
    expected = [g.clone() for g in grads]
    scale, tracker = torch.full((), 2.0**10), torch.zeros((), dtype=torch.int32)
    scale_expected, tracker_expected = scale.clone(), tracker.clone()
    scales = []
    for step in range(6):
        if step in (2, 3):  # inf, then NaN: the first and the last grad
            grads[-1][-1] = expected[-1][-1] = math.inf
            grads[2][0] = expected[2][0] = math.nan if step == 3 else 1.0
        found, found_expected = torch.zeros(()), torch.zeros(())
        inv = scale.double().reciprocal().float()
        finite, checked = compiled(grads, found, inv, scale, tracker)
        torch._amp_foreach_non_finite_check_and_unscale_(expected, found_expected, inv)
        torch._amp_update_scale_(scale_expected, tracker_expected, found_expected, 2.0, 0.5, 2)
        assert_all_same(grads, expected)
        assert_same(found, found_expected)
        assert_same(scale, scale_expected)
        assert_same(tracker, tracker_expected)
        scales.append(scale.item())
        assert bool(finite) == (found_expected.item() == 0) == (checked.item() == 0)
        for g in expected:
            g.nan_to_num_(0.0, 0.0, 0.0)
        for g in grads:
            g.nan_to_num_(0.0, 0.0, 0.0)
    assert scales == [1024.0, 2048.0, 1024.0, 512.0, 512.0, 1024.0]  # grew, backed off twice


def test_a_deepspeed_scaler_in_compiled_code_as_in_eager(backend):
    def run(compile_it):
        param = torch.nn.Parameter(torch.ones(5))
        scaler = deepspeed.DynamicLossScaler(init_scale=2.0**4, scale_window=2, device="cpu",
                                             backend=backend)

        def step():
            overflow = scaler.has_overflow([param])
            scaler.update_scale(overflow)
            return overflow

        step = torch.compile(step, backend="aot_eager") if compile_it else step
        seen = []
        for i in range(6):
            param.grad = torch.full((5,), math.inf if i in (1, 2) else 1.0)
            seen.append((bool(step()), scaler.cur_scale))
        return seen

    eager = run(False)
    assert run(True) == eager
    assert [overflow for overflow, _ in eager] == [False, True, True, False, False, False]
    assert len({scale for _, scale in eager}) > 2  # backed off twice, then grew


def _clipped_training(backend, compiled, buckets=False, scaler_cls=GradScaler):
    """Six steps of ``scale -> backward -> clip -> step -> update`` (an overflow at step 2):
    the scales, the norms and the parameters. ``scaler_cls=torch.amp.GradScaler``: torch's
    ``unscale_`` + ``clip_grad_norm_`` in place of ours."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    bucketed = GradBuckets(opt) if buckets else None
    scaler = scaler_cls("cpu", init_scale=2.0**10, growth_interval=2,
                        **({} if scaler_cls is torch.amp.GradScaler else {"backend": backend}))

    def step(x, multiplier):
        if bucketed is not None:
            bucketed.zero_()
        else:
            opt.zero_grad()
        scaler.scale(model(x).square().mean() * multiplier).backward()
        if scaler_cls is torch.amp.GradScaler:
            scaler.unscale_(opt)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        else:
            norm = scaler.clip_grad_norm_(opt, 0.5)
        scaler.step(opt)
        scaler.update()
        return norm

    step = torch.compile(step, backend="aot_eager") if compiled else step
    gen = torch.Generator().manual_seed(1)
    scales, norms = [], []
    for i in range(6):
        norms.append(step(torch.randn(4, 8, generator=gen),
                          torch.tensor(math.inf if i == 2 else 1.0)).detach().clone())
        scales.append(scaler.get_scale())
    return scales, norms, [p.detach().clone() for p in model.parameters()]


def _assert_same_training(actual, expected):
    assert actual[0] == expected[0]
    assert_all_same(actual[1], expected[1])
    assert_all_same(actual[2], expected[2])


@pytest.mark.parametrize("buckets", [False, True])
def test_the_clip_in_compiled_code_as_torchs_route(backend, buckets):
    """``scaler.clip_grad_norm_`` traced: the unscale op, then torch's norm arithmetic, so
    compiled code clips as torch's ``unscale_`` + ``clip_grad_norm_`` on either backend: the
    same scales, norms and parameters within 1e-6 relative (bit for bit with torch 2.13; with
    torch 2.8 the traced norm's last bit can differ). Eager, the reference backend is torch's
    route bit for bit; the Triton read pass sums the squares in its own order."""
    torchs = _clipped_training(backend, compiled=False, scaler_cls=torch.amp.GradScaler)
    compiled = _clipped_training(backend, compiled=True, buckets=buckets)
    assert compiled[0] == torchs[0]
    for got, want in ((compiled[1], torchs[1]), (compiled[2], torchs[2])):
        for a, e in zip(got, want, strict=True):
            torch.testing.assert_close(a, e, rtol=1e-6, atol=0.0, equal_nan=True)
    eager = _clipped_training(backend, compiled=False, buckets=buckets)
    assert eager[0] == compiled[0] == [1024.0, 2048.0, 1024.0, 1024.0, 2048.0, 2048.0]
    assert not math.isfinite(eager[1][2]) and math.isfinite(eager[1][3])
    if backend == "reference":  # torch's arithmetic in eager code too
        _assert_same_training(eager, torchs)
    else:
        for norm, expected in zip(eager[1], torchs[1]):
            assert norm.isnan() == expected.isnan()
            torch.testing.assert_close(norm, expected, rtol=1e-6, atol=0, equal_nan=True)


def test_the_privates_integrators_call_in_compiled_code_as_in_eager(backend):
    """``_unscale_grads_`` and ``_check_inf_per_device`` (torch's run eagerly: dynamo skips
    torch.amp) called from compiled code: the eager results, planted inf and all."""
    def run(compiled):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(n)) for n in (5, 4097, 1)]
        opt = torch.optim.SGD(params, lr=0.1)
        scaler = GradScaler("cpu", init_scale=2.0**10, backend=backend)

        def look(inv):
            checked = scaler._check_inf_per_device(opt)
            found = torch.zeros(())
            unscaled = scaler._unscale_grads_(opt, inv, found, False)
            return [v.clone() for v in checked.values()], [v.clone() for v in unscaled.values()]

        look = torch.compile(look, backend="aot_eager") if compiled else look
        results = []
        for i in range(3):
            scaler.scale(sum(p.sum() for p in params))  # the scale exists
            for j, p in enumerate(params):
                p.grad = torch.full_like(p, 3.0)
                if i == 1 and j == 2:
                    p.grad[-1] = math.inf
            results.append((look(torch.tensor(0.25)), [p.grad.clone() for p in params]))
            scaler._per_optimizer_states.clear()
        return results

    eager = run(False)
    for (flags, grads), (flags_eager, grads_eager) in zip(run(True), eager):
        assert_all_same(flags[0] + flags[1], flags_eager[0] + flags_eager[1])
        assert_all_same(grads, grads_eager)
    assert [float(r[0][0][0]) for r in eager] == [0.0, 1.0, 0.0]


def test_a_warning_from_compiled_code_points_at_the_users_line(backend):
    """The underflow warning of a step called from a compiled function is attributed to the
    function's own ``scaler.step`` line, not to dynamo's frames that run the scaler eagerly."""
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = GradScaler("cpu", init_scale=2.0**-125, backend=backend)

    def train_step(multiplier):
        scaler.scale(p.sum() * multiplier).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()

    compiled = torch.compile(train_step, backend="eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(4):  # 2**-126, 2**-127: the third step reads an underflowed scale
            compiled(torch.tensor(math.inf))
    underflow = [w for w in caught if "underflowed" in str(w.message)]
    assert [(w.filename, w.lineno) for w in underflow] == [
        (__file__, train_step.__code__.co_firstlineno + 2)]


def test_eager_calls_do_not_go_through_dynamo(backend, monkeypatch):
    """In eager code the wrapped calls are the methods themselves: no ``torch._dynamo.disable``
    wrapper per call (its cost is for compiled callers only)."""
    import torch._dynamo

    ours = []  # torch's optimizers wrap their own methods lazily: only ours recorded
    original = torch._dynamo.disable

    def recorded(fn=None, *args, **kwargs):
        if getattr(fn, "__module__", "").startswith("triton_scaler"):
            ours.append(fn.__qualname__)
        return original(fn, *args, **kwargs)

    monkeypatch.setattr(torch._dynamo, "disable", recorded)
    p = torch.nn.Parameter(torch.ones(5))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = GradScaler("cpu", backend=backend)
    for clip in (False, True):
        scaler.scale(p.sum()).backward()
        if clip:
            scaler.clip_grad_norm_(opt, 1.0)
        else:
            scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    scale, tracker = torch.full((), 4.0), torch.zeros((), dtype=torch.int32)
    ops.update_scale_(scale, tracker, torch.zeros(()), 2.0, 0.5, 1, backend=backend)
    assert scale.item() == 8.0
    assert ours == []
