"""Exactly one kernel launch per gradient group / bucket for unscale_ (or the
fused route's check) and exactly one for update(), no other device op; the O(1) bucket path
stays exact when grads are replaced (the no-bucket path: test_plan_reuse.py)."""

import gc
import sys
import weakref
from collections import Counter

import pytest
import torch
from _launch_counting import (
    _IN_KERNEL,
    _launches,
    _Ops,
    _setup,
    _uncounted,
    count_calls,
    os_interpreter_missing,
)
from _util import assert_all_same, step_by_route

from triton_scaler import GradBuckets, GradScaler


@pytest.mark.parametrize("buckets", [False, True])
@pytest.mark.parametrize("fused", [False, True])
def test_one_launch_per_group_and_one_for_update(monkeypatch, buckets, fused):
    if os_interpreter_missing():
        pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1")
    params, opt = _setup(12, buckets, fused, dtypes=(torch.float32, torch.bfloat16))
    scaler = GradScaler("cpu", backend="triton", init_scale=4.0)
    opt.step = _uncounted(opt.step)  # the optimizer's own ops are not the scaler's
    with _launches(monkeypatch) as counts:
        for step in range(10):  # past the scaler's 8 found_inf slots: reused every iteration
            if buckets:
                opt._triton_scaler_buckets[0].buffer.zero_()  # noqa: SLF001
            sum((p.float() ** 2).sum() for p in params).mul(scaler.scale(torch.ones(()))).backward()
            counts.clear()
            with _Ops() as mode:
                if not fused:
                    scaler.unscale_(opt)
                scaler.step(opt)
                n_unscale, other_ops, views = counts["unscale"], Counter(mode.ops), \
                    Counter(mode.views)
                counts.clear()
                mode.ops.clear()
                mode.views.clear()
                scaler.update()
            assert n_unscale == 2, (step, counts)  # one per (device, dtype) group / bucket
            assert counts["update"] == 1 and counts["unscale"] == 0, counts
            assert not mode.ops and not mode.views, mode.ops  # update(): its one launch only
            if step > 0:  # step 0 builds the chunk table (host tensors, one upload on a GPU)
                assert not other_ops, other_ops  # unscale_ / the check and step: launches only
                # and no view either (step's host read uses views made once), except the
                # interpreter's int16 view of the bf16 grads (none on a GPU), which dispatch
                # modes see with a detach
                assert views["view.dtype"] == 1 and \
                    set(views) <= {"view.dtype", "detach.default"}, views
            opt.zero_grad(set_to_none=False)


@pytest.mark.parametrize("buckets", [False, True])
@pytest.mark.parametrize("route", ["unscale_", "fused", "clip_grad_norm_"])
def test_a_steady_state_step_runs_no_import_statement(monkeypatch, buckets, route):
    """An ``import`` inside a function costs ~10 us a call with the host's caches cold
    (benchmarks/RESULTS.md, host cost): after the first step, ``scale -> unscale_ (or
    clip_grad_norm_, or the fused check) -> step -> update`` executes none of its own (the
    kernels are reached through ``_backend.triton_kernels()``). The interpreter's work inside
    a launch and the optimizer's own step are not the scaler's."""
    import builtins

    if os_interpreter_missing():
        pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1")
    params, opt = _setup(5, buckets, fused=route == "fused",
                         dtypes=(torch.float32, torch.bfloat16))
    scaler = GradScaler("cpu", backend="triton", init_scale=4.0)
    opt.step, imports, real_import = _uncounted(opt.step), [], builtins.__import__

    def counted_import(name, *args, **kwargs):
        if not _IN_KERNEL[0]:
            imports.append(name)
        return real_import(name, *args, **kwargs)
    with _launches(monkeypatch) as counts:
        monkeypatch.setattr(builtins, "__import__", counted_import)
        for step in range(3):
            opt.zero_grad(set_to_none=False)
            imports.clear()
            scale = scaler.scale(torch.ones(()))
            in_scale = list(imports)
            sum((p.float() ** 2).sum() for p in params).mul(scale).backward()  # torch's imports
            imports.clear()
            step_by_route(scaler, opt, route)
            if step > 0:
                assert not in_scale and not imports, (step, in_scale, imports)
    assert counts["update"] == 3 and counts["unscale"] >= 6, counts  # the kernels did run


def _train(scaler, n_opts, steps, overflow, replace=None, fresh=False):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(33)) for _ in range(n_opts)]
    opts = [torch.optim.SGD([p], lr=0.1, momentum=0.9) for p in params]
    scales = []
    for step in range(steps):
        for opt in opts:
            opt.zero_grad(set_to_none=fresh)
        loss = sum((p * (i + 1)).square().sum() for i, p in enumerate(params))
        scaler.scale(loss).backward()
        for i, p in enumerate(params):
            if (step, i) in overflow:
                p.grad[-1] = float("inf")
            if replace is not None:
                replace(step, i, p)
        for opt in opts:
            scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales, [p.detach().clone() for p in params]


@pytest.mark.parametrize("n_opts", [2, 9])  # 9: more optimizers than found_inf slots
def test_many_optimizers_fold_into_the_one_update(backend, n_opts):
    overflow = {(1, n_opts - 1), (3, 0), (4, 1), (4, n_opts - 1)}
    kwargs = dict(init_scale=2.0**8, growth_interval=2)
    expected = _train(torch.amp.GradScaler("cpu", **kwargs), n_opts, 6, overflow)
    scaler = GradScaler("cpu", **kwargs, backend=backend)
    actual = _train(scaler, n_opts, 6, overflow)
    assert actual[0] == expected[0]
    assert_all_same(actual[1], expected[1])
    assert scaler.skipped_steps == 3


def _replaced_after_backward(step, i, p):
    if step % 2 == 1:
        p.grad = p.grad.clone()  # a new tensor at a new address


@pytest.mark.parametrize("fresh", [False, True])
def test_grads_replaced_after_backward_are_unscaled(backend, fresh):
    """The O(1) bucket check and the per-step planning see replaced grads: results equal
    torch's scaler (which reads every .grad) whether grads are assigned or set to None."""
    kwargs = dict(init_scale=2.0**8, growth_interval=2)
    overflow = {(3, 0)}
    expected = _train(torch.amp.GradScaler("cpu", **kwargs), 3, 6, overflow,
                      _replaced_after_backward, fresh)
    actual = _train(GradScaler("cpu", **kwargs, backend=backend), 3, 6, overflow,
                    _replaced_after_backward, fresh)
    assert actual[0] == expected[0]
    assert_all_same(actual[1], expected[1])


@pytest.mark.filterwarnings("ignore:.*no longer views into their GradBucket")
def test_bucket_fast_path_sees_assignment_after_backward(backend):
    results = []
    for use_buckets in (False, True):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(n)) for n in (5, 9, 3)]
        opt = torch.optim.SGD(params, lr=1.0)
        buckets = GradBuckets(opt) if use_buckets else None
        scaler = GradScaler("cpu", init_scale=4.0, backend=backend)
        for _ in range(2):
            if buckets is not None:
                buckets.zero_()
            else:
                opt.zero_grad()
            scaler.scale(sum(p.sum() for p in params)).backward()
            params[1].grad = torch.full_like(params[1], 8.0)  # assigned after backward
            params[2].grad = None  # set to None after backward: not stepped, as torch
            scaler.step(opt)
            scaler.update()
        results.append([p.detach().clone() for p in params])
    assert_all_same(results[1], results[0])


@pytest.mark.parametrize("zero", ["buckets", "zero_grad(set_to_none=False)"])
@pytest.mark.parametrize("sizes", [(5, 9, 3), (0, 5, 9, 0), (7,)])
def test_the_bucket_fast_path_is_taken_in_the_steady_state(sizes, zero):
    """With every grad its view and every parameter given a gradient, each step's bucket
    check is O(1) (no per-parameter pass): with either way of zeroing, with gradient
    accumulation, and when the first or last parameter is empty (whose view's data_ptr() is
    0, so it cannot be the address checked)."""
    params = [torch.nn.Parameter(torch.randn(n)) for n in sizes]
    opt = torch.optim.SGD(params, lr=0.1)
    buckets = GradBuckets(opt)
    (bucket,) = buckets.buckets
    for step in range(3):
        if zero == "buckets" or step == 0:
            buckets.zero_()
        else:
            opt.zero_grad(set_to_none=False)
        for _ in range(step + 1):  # gradient accumulation
            sum((p * p).sum() for p in params).backward()
        assert bucket.all_views_in_place() and _accumulated_in_views(bucket)
        assert bucket.attach_grads() is bucket.param_ids
        assert bucket.attach_grads() is bucket.param_ids  # a second check (the fused step)
    held = [p.grad for p in params]  # old views alive while zero_grad() replaces the grads
    torch.optim.SGD(params, lr=0.1).zero_grad()
    sum((p * p).sum() for p in params).backward()
    assert not bucket.all_views_in_place() or not any(p.numel() for p in params)
    del held


def test_the_bucket_check_is_o1_again_after_a_step_with_an_unused_parameter(monkeypatch):
    """A step in which a parameter takes no part (the scaler sets its grad None and records
    that it is not its view) costs one per-parameter pass, and ``buckets.zero_()`` one more to
    give it its view back; from then on neither the check nor ``zero_()`` looks at each
    parameter again (counted: the per-parameter test whether a grad is its view)."""
    from triton_scaler._bucket import GradBucket

    params = [torch.nn.Parameter(torch.randn(n)) for n in (5, 9, 3)]
    opt = torch.optim.SGD(params, lr=0.1)
    buckets = GradBuckets(opt)
    (bucket,) = buckets.buckets
    counts = count_calls(monkeypatch, GradBucket, "_is_view")
    per_step = []
    for step in range(4):
        buckets.zero_()
        per_step.append(counts["_is_view"])
        sum((p * p).sum() for i, p in enumerate(params) if step != 1 or i != 1).backward()
        assert bucket.attach_grads() == (bucket.param_ids if step != 1 else
                                         frozenset({id(params[0]), id(params[2])}))
        per_step.append(counts["_is_view"])
    assert per_step == [0, 0, 0, 3, 5, 5, 5, 5]  # (zero_: not for the grad that is None)


def _accumulated_in_views(bucket) -> bool:
    """Every accumulation since the bucket's last check can have gone into a view (each bumps
    the buffer's version; other writes only add); False when one made a new grad."""
    writes, accumulations = bucket._writes_and_accumulations()
    return writes >= accumulations


def test_counting_accumulations_holds_nothing():
    """The bucket counts accumulations between its checks; with no check at all (a disabled
    scaler, zero_grad(set_to_none=False)) that must not hold memory per backward, nor run
    out: after 150 backwards an accumulation that makes a new grad is still counted."""
    p = torch.nn.Parameter(torch.randn(5))
    opt = torch.optim.SGD([p], lr=0.1)
    (bucket,) = GradBuckets(opt).buckets
    counts = []
    for _ in range(150):
        (p * p).sum().backward()
        opt.zero_grad(set_to_none=False)
        counts.append(sys.getrefcount(p))
    assert counts[-1] == counts[0]
    assert _accumulated_in_views(bucket)
    bucket.checked()
    p.grad = None  # the next accumulation makes a new grad: still counted
    (p * p).sum().backward()
    assert not _accumulated_in_views(bucket)


def test_no_grad_is_kept_alive_between_steps(backend):
    """zero_grad(set_to_none=True) must free the grads: the scaler's caches hold addresses
    and tables, never the grad tensors."""
    params, opt = _setup(5, buckets=False)
    scaler = GradScaler("cpu", backend=backend)
    for _ in range(2):
        scaler.scale(sum(p.sum() for p in params)).backward()
        scaler.step(opt)
        scaler.update()
        refs = [weakref.ref(p.grad) for p in params]
        opt.zero_grad(set_to_none=True)
        gc.collect()
        assert all(r() is None for r in refs)


def test_reused_plans_follow_the_scaler_not_the_optimizer(monkeypatch):
    """Two scalers with different backends on one optimizer, in turn: each gets what its
    backend needs (the reference path, the grads), and a reference scaler launches no
    kernel after a Triton scaler stepped the same optimizer."""
    if os_interpreter_missing():
        pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1")
    results, launches = [], []
    with _launches(monkeypatch) as counts:
        for scalers in (["torch"] * 5, ["triton", "triton", "reference", "triton", "reference"]):
            params, opt = _setup(4, buckets=False)
            for name in scalers:
                scaler = (torch.amp.GradScaler("cpu", init_scale=8.0) if name == "torch"
                          else GradScaler("cpu", init_scale=8.0, backend=name))
                opt.zero_grad(set_to_none=False)
                scaler.scale(sum(p.square().sum() for p in params)).backward()
                counts.clear()
                scaler.step(opt)
                launches.append(counts["unscale"])
                scaler.update()
            results.append([p.detach().clone() for p in params])
    assert launches[5:] == [1, 1, 0, 1, 0]  # one launch a Triton step, none a reference one
    assert_all_same(results[1], results[0])
