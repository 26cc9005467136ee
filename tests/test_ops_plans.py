"""The ops' launches over grads that come back to the same memory: every call plans from
the grads as they are (one plan per dtype; planning keeps only the rows of each size
pattern), so grads changed at those addresses (dtype, size, strides, shape, device, a sparse
grad) are unscaled as torch's op does, bit for bit, or refused."""

import math

import pytest
import torch
import triton_scaler.kernels
from _util import assert_all_same, assert_same

from triton_scaler import _plans, ops

INV = 1 / 3.0  # not a power of two: every rounding is exercised


@pytest.fixture
def plans(monkeypatch):
    """Counts the plans the ops make (``_plans.plan_unscale`` calls)."""
    made = []
    plan_unscale = _plans.plan_unscale

    def counting(grads, *args, **kwargs):
        made.append(len(grads))
        return plan_unscale(grads, *args, **kwargs)

    monkeypatch.setattr(_plans, "plan_unscale", counting)
    yield made


def _unscale_as_torch(grads, write=True):
    """ops' call on ``grads`` (in place), against torch's CPU op on copies: grads and flag."""
    device = grads[0].device
    expected = [g.detach().cpu().clone() for g in grads]
    found_expected = torch.zeros(())
    torch._amp_foreach_non_finite_check_and_unscale_(expected, found_expected, torch.tensor(INV))
    found = torch.zeros((), device=device)
    call = ops.non_finite_check_and_unscale_ if write else ops.non_finite_check_
    before = [g.detach().cpu().clone() for g in grads]
    call(grads, found, torch.tensor(INV, device=device), backend="triton")
    assert_all_same([g.cpu() for g in grads], expected if write else before)
    assert_same(found.cpu(), found_expected)
    return found.item()


def _fill(grads, seed):
    gen = torch.Generator().manual_seed(seed)
    for g in grads:
        g.copy_((torch.randn(g.shape, generator=gen) * 3000).to(g.dtype))


@pytest.mark.parametrize("write", [True, False])
def test_every_call_at_the_same_addresses_plans_and_sees_a_late_inf(triton_device, plans,
                                                                      write):
    grads = [torch.empty(n, device=triton_device) for n in (0, 1, 4099, 70_001, 5)]
    for call in range(4):
        _fill(grads, seed=call)
        if call == 3:  # an inf at the end of the last grad
            grads[-1][-1] = math.inf
        assert _unscale_as_torch(grads, write) == (call == 3)
    assert plans == [5] * 4
    # new grad tensors over the same memory, as torch's op too
    _fill(grads, seed=9)
    assert _unscale_as_torch([g.view(g.shape) for g in grads], write) == 0


def test_mixed_dtypes_launch_each_dtype_on_its_own_grads(triton_device, plans):
    """One launch per dtype, on the first non-empty grad of its dtype wherever it stands in
    the list (here the fp32 launch's base is the third grad)."""
    dtypes = [torch.float32, torch.float16, torch.float32, torch.bfloat16, torch.float16]
    sizes = [0, 3001, 257, 1, 4100]
    grads = [torch.empty(n, device=triton_device, dtype=d) for n, d in zip(sizes, dtypes)]
    for call in range(4):
        _fill(grads, seed=call)
        if call == 3:
            grads[2][0] = -math.inf
        assert _unscale_as_torch(grads) == (call == 3)
    assert sorted(plans) == [1] * 4 + [2] * 8  # three launches planned in each call


#: Grad lists over two buffers, each grad at its buffer's start: (buffer, dtype, shape, strides)
#: per grad. Each list but ``original`` puts its grads at ``original``'s addresses, laid out
#: otherwise; a plan of ``original`` would miss elements or cover elements outside them.
LAYOUTS = {
    "original": [(0, torch.float32, (4099,), (1,)), (1, torch.float32, (33,), (1,))],
    "dtype": [(0, torch.float16, (4099,), (1,)), (1, torch.float16, (33,), (1,))],
    "size": [(0, torch.float32, (4096,), (1,)), (1, torch.float32, (33,), (1,))],
    "strides": [(0, torch.float32, (4099,), (2,)), (1, torch.float32, (33,), (1,))],
    "shape": [(0, torch.float32, (64, 64), (1, 64)), (1, torch.float32, (33,), (1,))],
}


def _views(buffers, layout):
    return [buffers[i].view(dtype).as_strided(shape, strides)
            for i, dtype, shape, strides in LAYOUTS[layout]]


def _unscale_buffers_as_torch(buffers, layout):
    """ops' call on ``layout``'s grads over ``buffers``; every buffer's memory after it equals
    torch's op on the same views of copies (on the CPU, whose op takes bf16 too)."""
    expected = [b.cpu().clone() for b in buffers]
    found_expected = torch.zeros(())
    torch._amp_foreach_non_finite_check_and_unscale_(_views(expected, layout), found_expected,
                                                     torch.tensor(INV))
    device = buffers[0].device
    found = torch.zeros((), device=device)
    ops.non_finite_check_and_unscale_(_views(buffers, layout), found,
                                      torch.tensor(INV, device=device), backend="triton")
    for (_, dtype, _, _), b, e in zip(LAYOUTS[layout], buffers, expected):
        assert_same(b.cpu().view(dtype), e.view(dtype))  # the grads and the memory around them
    assert_same(found.cpu(), found_expected)
    return found.item()


@pytest.mark.parametrize("change", ["dtype", "size", "strides", "shape"])
def test_grads_changed_at_the_same_addresses_are_unscaled_as_torch(triton_device, change):
    buffers = [torch.empty(2 * 4099 + 8, device=triton_device),
               torch.empty(70, device=triton_device)]
    for call in range(3):
        _fill(buffers, seed=call)
        assert _unscale_buffers_as_torch(buffers, "original") == 0
    _fill(buffers, seed=5)
    changed = _views(buffers, change)
    _fill(changed, seed=6)
    changed[0][(-1,) * changed[0].dim()] = math.nan
    assert _unscale_buffers_as_torch(buffers, change) == 1


def test_a_grad_on_another_device_at_an_earlier_address_is_refused():
    """Empty grads all lie at address 0: a meta grad there after CPU grads is still named."""
    if not triton_scaler.kernels.unscale.is_interpreting():
        pytest.skip("CPU tensors through the interpreter")
    found, inv = torch.zeros(()), torch.tensor(INV)
    for _ in range(3):
        ops.non_finite_check_and_unscale_([torch.empty(0)], found, inv, backend="triton")
    meta = torch.empty(0, device="meta")
    assert meta.data_ptr() == torch.empty(0).data_ptr()
    with pytest.raises(ValueError, match=r"grads\[0\] is on meta but found_inf is on cpu"):
        ops.non_finite_check_and_unscale_([meta], found, inv, backend="triton")


def test_found_inf_on_another_device_than_earlier_grads_is_refused():
    if not triton_scaler.kernels.unscale.is_interpreting():
        pytest.skip("CPU tensors through the interpreter")
    grads = [torch.ones(5), torch.ones(7)]
    for _ in range(3):
        _unscale_as_torch(grads)
    found, inv = torch.zeros((), device="meta"), torch.tensor(INV, device="meta")
    with pytest.raises(ValueError, match=r"grads\[0\] is on cpu but found_inf is on meta"):
        ops.non_finite_check_and_unscale_(grads, found, inv, backend="triton")


def test_a_gapped_grad_in_one_dtype_beside_a_dense_dtype_is_unscaled_as_torch(triton_device):
    """A list whose first dtype's launch needs a copy and whose second's does not."""
    buffer = torch.empty(2 * 301, device=triton_device)
    half = torch.empty(517, device=triton_device, dtype=torch.float16)
    gapped = buffer.as_strided((301,), (2,))
    for call in range(4):
        _fill([buffer, half], seed=call)
        if call == 3:
            gapped[-1] = math.nan
        assert _unscale_as_torch([gapped, half]) == (call == 3)


def test_a_sparse_grad_among_earlier_ones_is_refused(triton_device):
    grads = [torch.ones(5, device=triton_device), torch.ones(7, device=triton_device)]
    for _ in range(3):
        _unscale_as_torch(grads)
    sparse = torch.sparse_coo_tensor([[0]], [1.0], (7,), device=triton_device,
                                     check_invariants=True)
    with pytest.raises(TypeError, match=r"grads\[1\] is sparse"):
        ops.non_finite_check_and_unscale_([grads[0], sparse], torch.zeros((), device=triton_device),
                                          torch.tensor(INV, device=triton_device), backend="triton")
