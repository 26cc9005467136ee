"""Issue 15: exactly one kernel launch per gradient group / bucket for unscale_ (or the
fused route's check) and exactly one for update(), no other device op; the O(1) bucket path
and the address-keyed launch plans stay exact when grads are replaced."""

import contextlib
import gc
import weakref
from collections import Counter

import pytest
import torch
from _util import assert_all_same
from torch.utils._python_dispatch import TorchDispatchMode
from triton_scaler.kernels import unscale, update

from triton_scaler import GradBuckets, GradScaler, kernels

_IN_KERNEL = [0]  # the interpreter's own tensor work inside a launch is not counted


class _Ops(TorchDispatchMode):
    """Counts device ops (not views, not host reads) issued outside the kernels."""

    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not _IN_KERNEL[0] and not func.is_view and func.__name__ not in (
                "_local_scalar_dense.default", "empty.memory_format"):
            self.ops[func.__name__] += 1
        return func(*args, **(kwargs or {}))


class _Counted:
    def __init__(self, kernel, name, counts):
        self.kernel, self.name, self.counts = kernel, name, counts

    def __getitem__(self, grid):
        self.counts[self.name] += 1

        def launch(*args, **kwargs):
            _IN_KERNEL[0] += 1
            try:
                self.kernel[grid](*args, **kwargs)  # no compiled kernel back: none is reused
            finally:
                _IN_KERNEL[0] -= 1
        return launch


@contextlib.contextmanager
def _launches(monkeypatch):
    counts = Counter()
    monkeypatch.setattr(unscale, "unscale_kernel",
                        _Counted(unscale.unscale_kernel, "unscale", counts))
    monkeypatch.setattr(update, "update_scale_kernel",
                        _Counted(update.update_scale_kernel, "update", counts))
    yield counts


def _setup(n_params, buckets, fused=False, dtypes=(torch.float32,)):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(7 + 5 * i, dtype=dtypes[i % len(dtypes)]))
              for i in range(n_params)]
    opt = torch.optim.AdamW(params, lr=1e-3, fused=fused)
    if buckets:
        GradBuckets(opt)
    return params, opt


@pytest.mark.parametrize("buckets", [False, True])
@pytest.mark.parametrize("fused", [False, True])
def test_one_launch_per_group_and_one_for_update(monkeypatch, buckets, fused):
    if os_interpreter_missing():
        pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1")
    params, opt = _setup(12, buckets, fused, dtypes=(torch.float32, torch.bfloat16))
    scaler = GradScaler("cpu", backend="triton", init_scale=4.0)
    own_step = opt.step

    def step_uncounted(*args, **kwargs):  # the optimizer's own ops are not the scaler's
        _IN_KERNEL[0] += 1
        try:
            return own_step(*args, **kwargs)
        finally:
            _IN_KERNEL[0] -= 1
    opt.step = step_uncounted
    with _launches(monkeypatch) as counts:
        for step in range(3):
            if buckets:
                opt._triton_scaler_buckets[0].buffer.zero_()  # noqa: SLF001
            sum((p.float() ** 2).sum() for p in params).mul(scaler.scale(torch.ones(()))).backward()
            counts.clear()
            with _Ops() as mode:
                if not fused:
                    scaler.unscale_(opt)
                scaler.step(opt)
                n_unscale, other_ops = counts["unscale"], Counter(mode.ops)
                counts.clear()
                mode.ops.clear()
                scaler.update()
            assert n_unscale == 2, (step, counts)  # one per (device, dtype) group / bucket
            assert counts["update"] == 1 and counts["unscale"] == 0, counts
            assert not mode.ops, mode.ops  # update(): nothing but its one launch
            if step > 0:  # step 0 builds the chunk table (host tensors, one upload on a GPU)
                assert not other_ops, other_ops  # unscale_ / the check and step: launches only
            opt.zero_grad(set_to_none=False)


def os_interpreter_missing():
    import os

    return os.environ.get("TRITON_INTERPRET") != "1"


def _assert_matches_torch(run, backend, **kwargs):
    """``run(scaler) -> (scale(s), params)`` gives the same with torch's scaler and ours."""
    expected = run(torch.amp.GradScaler("cpu", **kwargs))
    actual = run(GradScaler("cpu", **kwargs, backend=backend))
    assert actual[0] == expected[0]
    assert_all_same(actual[1], expected[1])


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
    """The O(1) bucket check and the address-keyed plans see replaced grads: results equal
    torch's scaler (which reads every .grad) whether grads are assigned or set to None."""
    kwargs = dict(init_scale=2.0**8, growth_interval=2)
    overflow = {(3, 0)}
    expected = _train(torch.amp.GradScaler("cpu", **kwargs), 3, 6, overflow,
                      _replaced_after_backward, fresh)
    actual = _train(GradScaler("cpu", **kwargs, backend=backend), 3, 6, overflow,
                    _replaced_after_backward, fresh)
    assert actual[0] == expected[0]
    assert_all_same(actual[1], expected[1])


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


def _train_swapping(scaler, steps=6, swap_at=2, overflow=((4, 1),), buckets=False):
    """SGD over three parameters whose middle one is replaced in place in the optimizer's
    parameter list (same list, same length) by a larger one at ``swap_at``."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n)) for n in (5, 9, 3)]
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    bucketed = GradBuckets(opt) if buckets else None
    for step in range(steps):
        if step == swap_at:
            opt.param_groups[0]["params"][1] = torch.nn.Parameter(torch.randn(21))
        live = opt.param_groups[0]["params"]
        if bucketed is not None:
            bucketed.zero_()  # the buckets' grads; the swapped-in parameter is outside them
        opt.zero_grad(set_to_none=False)
        scaler.scale(sum((p * (i + 1)).square().sum() for i, p in enumerate(live))).backward()
        for at, i in overflow:
            if at == step:
                live[i].grad[-1] = float("nan")
        scaler.step(opt)
        scaler.update()
    return scaler.get_scale(), [p.detach().clone() for p in opt.param_groups[0]["params"]]


@pytest.mark.parametrize("buckets", [False, True])
def test_parameter_replaced_in_place_in_param_groups(backend, buckets):
    """The cached layout is checked against the optimizer's live parameter objects: a
    parameter swapped into the same list is unscaled and checked (its NaN skips the step).
    With buckets: the swapped-out parameter receives no grad, so the per-parameter path runs
    over the live parameters."""
    kwargs = dict(init_scale=2.0**8, growth_interval=2)
    expected = _train_swapping(torch.amp.GradScaler("cpu", **kwargs))
    actual = _train_swapping(GradScaler("cpu", **kwargs, backend=backend), buckets=buckets)
    assert actual[0] == expected[0]
    assert_all_same(actual[1], expected[1])


def test_reused_plans_follow_the_scaler_not_the_optimizer():
    """Two scalers with different backends on one optimizer share its cached layout and
    launch plans: each backend gets what it needs (the reference path, the grads)."""
    if os_interpreter_missing():
        pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1")
    results = []
    for scalers in (["torch"] * 4, ["triton", "reference", "triton", "reference"]):
        params, opt = _setup(4, buckets=False)
        for name in scalers:
            scaler = (torch.amp.GradScaler("cpu", init_scale=8.0) if name == "torch"
                      else GradScaler("cpu", init_scale=8.0, backend=name))
            opt.zero_grad(set_to_none=False)
            scaler.scale(sum(p.square().sum() for p in params)).backward()
            scaler.step(opt)
            scaler.update()
        results.append([p.detach().clone() for p in params])
    assert_all_same(results[1], results[0])


def _train_converting(scaler, steps=5, convert_at=2):
    """Parameters converted in place to bf16 (``param.data = ...``, as ``module.to``) whose
    new grads sit at the addresses of the old fp32 ones (a bf16 view of their memory): the
    case where a cached launch plan would match every address but not the dtype."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n)) for n in (5, 9, 3)]
    opt = torch.optim.SGD(params, lr=0.1)
    for step in range(steps):
        if step == convert_at:
            for p in params:
                old, p.grad = p.grad, None
                p.data = p.data.to(torch.bfloat16)
                p.grad = old.view(torch.bfloat16)[: p.numel()]
        opt.zero_grad(set_to_none=False)
        loss = sum((p.float() * (i + 1)).square().sum() for i, p in enumerate(params))
        scaler.scale(loss).backward()
        if step == 3:
            params[2].grad[-1] = float("inf")
        scaler.step(opt)
        scaler.update()
    return scaler.get_scale(), [p.detach().clone() for p in params]


def test_parameters_converted_in_place_at_the_same_addresses(backend):
    kwargs = dict(init_scale=2.0**8, growth_interval=2)
    _assert_matches_torch(_train_converting, backend, **kwargs)


@pytest.mark.parametrize("sizes", [(0, 5, 9), (0, 0, 7, 3), (4, 0, 6)])
def test_reused_plans_with_empty_grads_first(backend, sizes):
    """A group whose first grads are empty: the launch's base is its first non-empty grad,
    also when the plan is reused at the next steps (same addresses)."""
    def run(scaler):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(n)) for n in sizes]
        opt = torch.optim.SGD(params, lr=0.5)
        for step in range(4):
            opt.zero_grad(set_to_none=False)
            scaler.scale(sum((p * (i + 2)).sum() for i, p in enumerate(params))).backward()
            if step == 2:
                params[-1].grad[-1] = float("inf")
            scaler.step(opt)
            scaler.update()
        return scaler.get_scale(), [p.detach().clone() for p in params]

    _assert_matches_torch(run, backend, init_scale=4.0, growth_interval=1)


@pytest.mark.parametrize("n_layouts", [2, 5])  # 5: more than the plans kept per optimizer
def test_grads_cycling_through_memory_layouts(backend, n_layouts, monkeypatch):
    """Grads whose memory cycles through a few address layouts (an allocator handing back
    the blocks of an earlier step) reuse those layouts' launch plans, and more layouts than
    are kept replan: inf / NaN / -inf planted at the first and last element of the first and
    last grad skip exactly torch's steps, and the parameters equal torch's."""
    sizes = (7, 300, 1, 0, 33)

    def run(scaler):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(n)) for n in sizes]
        opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
        pools = [[torch.empty(n) for n in sizes] for _ in range(n_layouts)]
        planted = {n_layouts + 1: (-1, -1, float("inf")), 2 * n_layouts: (0, 0, float("nan")),
                   2 * n_layouts + 1: (0, -1, -float("inf")), 3 * n_layouts: (-1, 0, float("nan"))}
        scales = []
        for step in range(3 * n_layouts + 2):
            for p, memory in zip(params, pools[step % n_layouts]):
                p.grad = memory.zero_()  # backward accumulates into this layout's memory
            loss = sum((p * (i + 1)).square().sum() for i, p in enumerate(params))
            scaler.scale(loss).backward()
            if step in planted:
                which, at, value = planted[step]
                params[which].grad[at] = value
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        return scales, [p.detach().clone() for p in params]

    built = Counter()

    def counted(*args, build=kernels.plan_unscale):
        built["plans"] += 1
        return build(*args)

    monkeypatch.setattr(kernels, "plan_unscale", counted)  # torch's scaler plans nothing
    _assert_matches_torch(run, backend, init_scale=2.0**8, growth_interval=2)
    if backend == "triton":  # each layout planned once while they fit, every step otherwise
        assert built["plans"] == (n_layouts if n_layouts <= 4 else 3 * n_layouts + 2)


def test_parameter_resized_in_place_then_a_new_parameter_list(backend):
    """The remedy the README gives for the one change the address check cannot see: a
    parameter resized in place (``param.data = ...``) whose new grad starts at its old grad's
    address, then ``group["params"] = list(group["params"])``: re-planned, equal to torch,
    with an inf planted in the last element of the grown grad."""
    def run(scaler):
        torch.manual_seed(0)
        memory = [torch.zeros(7), torch.zeros(400), torch.zeros(33)]
        params = [torch.nn.Parameter(torch.randn(n)) for n in (7, 300, 33)]
        opt = torch.optim.SGD(params, lr=0.1)
        for step in range(5):
            if step == 2:
                params[1].grad = None
                params[1].data = torch.randn(350)  # its grad now starts where it did
                group = opt.param_groups[0]
                group["params"] = list(group["params"])
            for p, m in zip(params, memory):
                p.grad = m[: p.numel()].zero_()
            scaler.scale(sum((p * (i + 1)).square().sum() for i, p in enumerate(params))).backward()
            if step == 3:
                params[1].grad[-1] = float("inf")
            scaler.step(opt)
            scaler.update()
        return scaler.get_scale(), [p.detach().clone() for p in params]

    _assert_matches_torch(run, backend, init_scale=8.0, growth_interval=1)
