"""Cases where a step could be silently wrong, and is not. Both backends (Triton
through the interpreter), torch's scaler or torch's op as the oracle, compared exactly."""

import math
import os
import warnings

import pytest
import torch
from _loops import assert_same_optimizer_state
from _util import assert_all_same, assert_same

from triton_scaler import GradBuckets, GradScaler, all_finite, ops
from triton_scaler.compat.mindspore import DynamicLossScaler
from triton_scaler.policy import FP32_TINY


# ------------------------------------------------------------ 1. buckets + non-row-major params
class _Strided(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv2d(3, 5, 3)
        self.leaf_t = torch.nn.Parameter(torch.randn(7, 20).t())  # a transposed leaf
        self.head = torch.nn.Linear(7, 2)

    def forward(self, x):
        h = self.conv(x).flatten(1)[:, :20]
        return self.head(h @ self.leaf_t)


def _train_strided(scaler, use_buckets, steps=4):
    model = _Strided().to(memory_format=torch.channels_last)
    assert not model.conv.weight.is_contiguous() and not model.leaf_t.is_contiguous()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    buckets = GradBuckets(opt) if use_buckets else None
    gen = torch.Generator().manual_seed(3)
    for step in range(steps):
        x = torch.randn(4, 3, 6, 6, generator=gen).to(memory_format=torch.channels_last)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x).float().square().mean() * (math.inf if step == 2 else 1.0)
        scaler.scale(loss).backward()
        for p in model.parameters():
            assert p.grad.stride() == p.stride(), "a grad must have its parameter's strides"
        scaler.step(opt)
        scaler.update()
        buckets.zero_() if buckets else opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()], opt


def test_buckets_give_grads_the_parameters_strides(backend):
    expected, opt_t = _train_strided(torch.amp.GradScaler("cpu", init_scale=2.0**8), False)
    actual, opt_o = _train_strided(GradScaler("cpu", init_scale=2.0**8, backend=backend), True)
    assert_all_same(actual, expected)
    assert_same_optimizer_state(opt_o, opt_t)


# ------------------------------------------------------------ 2. buckets + params without a grad
class _Branchy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.used = torch.nn.Linear(6, 4)
        self.unused = torch.nn.Linear(6, 4)  # never in the graph
        self.late = torch.nn.Linear(4, 3)  # frozen after step 2

    def forward(self, x):
        return self.late(self.used(x))


@pytest.mark.parametrize("zero", ["buckets", "set_to_none_false"])
def test_buckets_skip_parameters_that_received_no_gradient(backend, zero):
    def run(scaler, use_buckets):
        model = _Branchy()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        buckets = GradBuckets(opt) if use_buckets else None
        gen = torch.Generator().manual_seed(1)
        for step in range(5):
            if step == 2:  # frozen mid-training: torch's loop leaves its grad None
                model.late.requires_grad_(False)
                if not use_buckets or zero == "set_to_none_false":
                    for p in model.late.parameters():
                        p.grad = None
            x = torch.randn(5, 6, generator=gen)
            scaler.scale(model(x).square().mean()).backward()
            scaler.step(opt)
            scaler.update()
            assert all(p.grad is None for p in model.unused.parameters())
            if not use_buckets:
                opt.zero_grad()
            elif zero == "buckets":
                buckets.zero_()
            else:
                opt.zero_grad(set_to_none=False)
        return model, opt

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no detach warning either
        theirs, opt_t = run(torch.amp.GradScaler("cpu"), False)
        ours, opt_o = run(GradScaler("cpu", backend=backend), True)
    assert_all_same([p.detach() for p in ours.parameters()],
                    [p.detach() for p in theirs.parameters()])
    assert len(opt_o.state) == len(opt_t.state) == 4  # no state for unused / late
    assert_same_optimizer_state(opt_o, opt_t)


# ------------------------------------------------------------ 3. float64 and complex grads
def test_float64_grads_are_unscaled_exactly_like_torch(backend):
    values = [1 / 3, 1e-310, 1e300, -2.5e-320, 7.0]
    for plant in (None, math.inf, -math.inf, math.nan):
        grads = [torch.tensor(values, dtype=torch.float64), torch.randn(4099).double()]
        if plant is not None:
            grads[1][-1] = plant
        expected = [g.clone() for g in grads]
        found_t, found_o = torch.zeros(()), torch.zeros(())
        inv = torch.tensor(1 / 3.0)
        torch._amp_foreach_non_finite_check_and_unscale_(expected, found_t, inv)
        ops.non_finite_check_and_unscale_(grads, found_o, inv, backend=backend)
        assert_all_same(grads, expected)
        assert_same(found_o, found_t)
    assert grads[0][2].item() != math.inf and grads[0][1].item() != 0.0


def test_float64_model_matches_torchs_scaler(backend):
    def run(scaler):
        torch.manual_seed(0)
        model = torch.nn.Linear(5, 3).double()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _step in range(4):
            loss = model(torch.ones(2, 5, dtype=torch.float64)).sum() * 1e300
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        return [p.detach() for p in model.parameters()], scaler.get_scale()

    expected = run(torch.amp.GradScaler("cpu", init_scale=4.0))
    actual = run(GradScaler("cpu", init_scale=4.0, backend=backend))
    assert actual[1] == expected[1] == 4.0  # 1e300 * 4 is finite in float64: no skip
    assert_all_same(actual[0], expected[0])


def test_complex_grads_raise_naming_the_dtype(backend):
    with pytest.raises(TypeError, match="complex64; gradients must be float32, float16"):
        ops.non_finite_check_and_unscale_([torch.ones(3, dtype=torch.complex64)],
                                          torch.zeros(()), torch.ones(()), backend=backend)
    p = torch.nn.Parameter(torch.ones(2, dtype=torch.complex64))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = GradScaler("cpu", backend=backend)
    scaler.scale((p.abs() ** 2).sum()).backward()
    with pytest.raises(TypeError, match="complex64"):
        scaler.unscale_(opt)


# ------------------------------------------------------------ 4. fused optimizer, scale below 1
@pytest.mark.parametrize("fused", [False, True])
def test_scale_below_one_overflowing_product_skips(backend, fused):
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=1.0, fused=fused)
    scaler = GradScaler("cpu", init_scale=0.5, backend=backend)
    scaler.scale(p.sum())
    p.grad = torch.tensor([3e38, 1.0, -3e38])  # finite, but grad / 0.5 overflows
    scaler.step(opt)
    scaler.update()
    assert torch.equal(p.detach(), torch.ones(3)), "the step must be skipped"
    assert scaler.get_scale() == 0.25 and scaler.skipped_steps == 1


def test_read_only_check_flags_overflowing_products(backend):
    found = torch.zeros(())
    ops.non_finite_check_([torch.tensor([3e38]), torch.ones(3)], found, torch.tensor(2.0),
                          backend=backend)
    assert found.item() == 1.0
    # a float64 grad past float32's range: its product is formed in float64 (finite), as
    # the unscale forms it (torch's op too), so neither flags it
    grads = [torch.ones(3), torch.tensor([1e300, -3.0], dtype=torch.float64)]
    found, unscaled = torch.zeros(()), torch.zeros(())
    ops.non_finite_check_(grads, found, torch.tensor(2.0), backend=backend)
    ops.non_finite_check_and_unscale_(grads, unscaled, torch.tensor(2.0), backend=backend)
    assert found.item() == unscaled.item() == 0.0 and grads[1].tolist() == [2e300, -6.0]


# ------------------------------------------------------------ 5. the read-only check never writes
def test_read_only_check_does_not_write(backend):
    assert all_finite([torch.ones(1).expand(5)], backend=backend).item()
    assert not all_finite([torch.ones(1).expand(5) * math.nan], backend=backend).item()
    payloads = torch.tensor([0x7FC1, 0x7F81, -0x7F, 0x3F80], dtype=torch.int16)
    grad = payloads.clone().view(torch.bfloat16)  # two NaNs with payloads, -nan-ish, 1.0
    found = torch.zeros(())
    ops.non_finite_check_([grad], found, torch.tensor(1.0), backend=backend)
    assert torch.equal(grad.view(torch.int16), payloads) and found.item() == 1.0


def test_backends_agree_on_empty_lists_with_an_infinite_inv_scale(backend):
    for op in (ops.non_finite_check_, ops.non_finite_check_and_unscale_):
        found = torch.zeros(())
        op([], found, torch.tensor(math.inf), backend=backend)
        op([torch.empty(0)], found, torch.tensor(math.inf), backend=backend)
        assert found.item() == 0.0  # no element, no product: nothing to flag


# ------------------------------------------------------------ 6. MindSpore adjust flags
@pytest.mark.parametrize("flag", [1, 0, torch.tensor(1), torch.tensor(1.0), "yes", None,
                                  torch.tensor([True, False])])
def test_mindspore_adjust_rejects_non_bool_flags(backend, flag):
    scaler = DynamicLossScaler(1024.0, 2, 10, device="cpu", backend=backend)
    with pytest.raises(TypeError, match="grads_finite must be a bool or a one-element bool"):
        scaler.adjust(flag)
    assert scaler.scale_value.item() == 1024.0
    scaler.adjust(torch.tensor(True))
    scaler.adjust(False)
    assert scaler.scale_value.item() == 512.0


# ------------------------------------------------------------ 7. scale underflow
def _overflowing_step(scaler, p, opt, factor=math.inf):
    scaler.scale(p.sum() * factor).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()


@pytest.mark.parametrize("fused", [False, True])
def test_scale_underflow_warns_once(backend, fused):
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1, fused=fused)
    scaler = GradScaler("cpu", init_scale=2.0**-125, backend=backend)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            _overflowing_step(scaler, p, opt)  # 2**-126 (normal), then 2**-127: underflowed
        assert not [w for w in caught if "underflowed" in str(w.message)]
        for _ in range(3):
            _overflowing_step(scaler, p, opt)
            scaler.get_scale()
        scaler.state_dict()
    underflow = [w for w in caught if "underflowed" in str(w.message)]
    assert len(underflow) == 1 and "min_scale" in str(underflow[0].message)
    assert underflow[0].filename == __file__  # at the user's line, not inside the scaler


@pytest.mark.parametrize("fused", [False, True])
def test_an_underflowed_scale_skips_every_step_from_2_to_the_minus_128(backend, fused):
    """What the warning says: at 2**-127 (below float32's normal range) finite grads still
    step, and the scale grows back; at 2**-128 inv_scale = 1/scale is inf, so a finite grad's
    product is not finite and every step is skipped (torch's op would step to -inf)."""
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1, fused=fused)
    scaler = GradScaler("cpu", init_scale=2.0**-126, growth_interval=2, backend=backend)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _overflowing_step(scaler, p, opt)
        taken = []
        for _ in range(2):  # at 2**-127: steps, then grows to 2**-126
            before = p.detach().clone()
            _overflowing_step(scaler, p, opt, factor=1.0)  # finite grads
            taken.append(not torch.equal(p.detach(), before))
        assert taken == [True, True] and scaler.get_scale() == 2.0**-126
        for _ in range(2):
            _overflowing_step(scaler, p, opt)  # 2**-127, 2**-128
        assert scaler.get_scale() == 2.0**-128
        before = p.detach().clone()
        _overflowing_step(scaler, p, opt, factor=1.0)
    assert bool(scaler.last_step_skipped) and torch.equal(p.detach(), before)
    assert scaler.get_scale() == 2.0**-129


def test_the_plain_step_warns_of_an_underflowed_scale_it_reads(backend):
    """The plain route's one host read (found_inf, the scale riding along) warns by itself,
    without a ``get_scale()`` call: at the third step, which reads 2**-127, and once."""
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = GradScaler("cpu", init_scale=2.0**-125, backend=backend)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        counts = []
        for _ in range(4):
            _overflowing_step(scaler, p, opt)
            counts.append(len([w for w in caught if "underflowed" in str(w.message)]))
    assert counts == [0, 0, 1, 1]
    assert [w.filename for w in caught if "underflowed" in str(w.message)] == [__file__]


def test_a_warning_goes_to_a_file_beside_the_package_as_user_code():
    """``warn_at_caller`` skips the package's own frames, by directory: a user's file whose
    path merely starts with the package directory's (``.../triton_scaler_user.py``) is not
    one of them."""
    from triton_scaler import _warn
    beside = os.path.dirname(_warn.__file__) + "_user.py"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exec(compile("warn_at_caller('from user code')", beside, "exec"),
             {"warn_at_caller": _warn.warn_at_caller})
    assert [w.filename for w in caught] == [beside]


def test_a_loaded_checkpoint_rearms_the_underflow_warning(backend):
    """After ``load_state_dict`` (a good scale again), a new underflow warns again."""
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = GradScaler("cpu", init_scale=2.0**-126, backend=backend)
    good = GradScaler("cpu", init_scale=2.0**-126).state_dict()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            _overflowing_step(scaler, p, opt)  # 2**-127: underflowed, warned
            scaler.get_scale()
            scaler.load_state_dict(good)
    assert len([w for w in caught if "underflowed" in str(w.message)]) == 2


@pytest.mark.parametrize("kwargs, match", [
    (dict(init_scale=1e-45), "init_scale must be a finite number > 0"),
    (dict(init_scale=2.0**128), "init_scale must be a finite number > 0"),
    (dict(backoff_factor=1e-320), r"backoff_factor must be in \(0, 1\) and at least"),
])
def test_underflowing_settings_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GradScaler("cpu", **kwargs)
    assert FP32_TINY == 2.0**-126
