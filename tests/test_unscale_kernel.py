"""``launch_unscale`` (``kernels/unscale.py``) called on its own, over plans of
``triton_scaler._plans``: its defaults, what it returns (nothing, or a norm partial sum of the
grads' precision, also for no elements), and a plan cut in the blocks the kernel is
launched with.

The kernel's results are tested against torch's op through the ops and the scalers
(``test_ops_unscale.py``, ``test_clip*.py``), which always pass ``write`` and read the norm
into their own precision; mutation testing found each of these left unchecked there."""


import pytest
import torch
import triton
from _util import assert_all_same, assert_same
from triton_scaler.kernels import unscale
from triton_scaler.kernels.unscale import launch_unscale as _launch_unscale

from triton_scaler._plans import plan_unscale

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def launch_unscale(grads, *args, **kwargs):
    """The kernel's launch over a new plan of ``grads``."""
    return _launch_unscale(plan_unscale(grads), *args, **kwargs)


def _grads(sizes, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, generator=gen, dtype=torch.float64) * 300).to(dtype).to(device)
            for n in sizes]


def _zeros(device):
    return torch.zeros((), device=device)


def _kernel_block() -> int:
    """The block launch_unscale launches the kernel with (not the plan's, which is tested)."""
    return unscale.INTERPRETER_BLOCK if unscale.is_interpreting() else unscale.GPU_BLOCK


def test_a_plan_is_cut_in_the_blocks_the_kernel_is_launched_with(triton_device):
    """One program per block of the kernel: a plan cut finer would launch more programs than
    needed, one cut coarser would leave elements unread on a GPU."""
    block = _kernel_block()
    for sizes in ([3 * block + 5], [block, 1, 2 * block - 1]):
        grads = _grads(sizes, torch.float32, triton_device)
        expected = sum(triton.cdiv(n, block) for n in sizes)
        assert plan_unscale(grads).grid == expected, sizes


@pytest.mark.parametrize("dtype", DTYPES)
def test_it_writes_by_default_and_returns_nothing(triton_device, dtype):
    """torch's CPU op is the oracle also in a GPU run (its CUDA op has no bfloat16)."""
    grads = _grads([5, 7], dtype, triton_device)
    expected = [g.to("cpu", copy=True) for g in grads]  # a copy on the CPU too
    found_expected = torch.zeros(())
    torch._amp_foreach_non_finite_check_and_unscale_(expected, found_expected,
                                                     torch.tensor(0.25))
    found = _zeros(triton_device)
    assert launch_unscale(grads, found, torch.tensor(0.25).to(triton_device)) is None
    assert_all_same([g.cpu() for g in grads], expected)
    assert_same(found.cpu(), found_expected.cpu())


@pytest.mark.parametrize("grads", [[], [0], [0, 0]], ids=["none", "one_empty", "two_empty"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_no_elements_give_nothing_or_a_zero_norm_of_the_grads_precision(triton_device, grads,
                                                                         dtype):
    grads = [torch.empty(n, dtype=dtype, device=triton_device) for n in grads]
    found, inv = _zeros(triton_device), torch.ones((), device=triton_device)
    assert launch_unscale(grads, found, inv) is None
    assert launch_unscale(grads, found, inv, write=False) is None
    norm = launch_unscale(grads, found, inv, write=False, norm=2)
    wide = torch.float64 if grads and dtype == torch.float64 else torch.float32
    assert_same(norm.cpu(), torch.zeros((), dtype=wide))
    assert found.item() == 0.0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm_type", [2, -1])
def test_the_norm_is_summed_in_the_grads_precision(triton_device, dtype, norm_type):
    """The partials of several blocks, reduced in float32 (float64 for float64 grads), as
    returned to clip_grad_norm_: a float64 sum of float32 partials differs in the last bits."""
    block = _kernel_block()
    grads = _grads([3 * block + 5, 11], dtype, triton_device, seed=3)
    inv = torch.tensor(1 / 3.0, device=triton_device)
    norm = launch_unscale(grads, _zeros(triton_device), inv, write=False, norm=norm_type)
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    assert norm.dtype == wide and norm.shape == ()
    values = [(g.to(wide) * inv.to(wide)).to(dtype).to(wide).cpu() for g in grads]
    if norm_type == -1:
        assert_same(norm.cpu(), max(v.abs().max() for v in values))
    else:  # the blocks' order of summation is the kernel's: within the precision's ulps
        expected = sum((v.double() ** 2).sum() for v in values).to(wide)
        torch.testing.assert_close(norm.cpu(), expected, rtol=1e-6, atol=0)


def test_float64_grads_are_clipped_by_a_float64_coefficient(triton_device):
    """``dtype(dtype(g * inv_scale) * c)`` with ``c`` and the product in float64: a
    coefficient rounded to float32 (the inv_scale's dtype) is off in float64's 30th bit."""
    grads = _grads([17, 3], torch.float64, triton_device, seed=7)
    inv = torch.tensor(0.125, device=triton_device)
    coef = torch.tensor(1 / 3.0, dtype=torch.float64, device=triton_device)
    assert coef.float().double() != coef  # the case this is
    expected = [(g * 0.125) * coef for g in grads]
    launch_unscale(grads, _zeros(triton_device), inv, clip_coef=coef)
    assert_all_same(grads, expected)
