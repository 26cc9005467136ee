"""The reference path's own bfloat16 unscale, taken where torch's op has no bfloat16 kernel
(CUDA: ``NotImplementedError``; GPU run of 2026-11-26). Forced here on CPU tensors and compared
bit for bit with torch's CPU op, which has one."""

import math

import pytest
import torch
from _util import assert_all_same, assert_same

from triton_scaler import reference

SPECIALS = [math.inf, -math.inf, math.nan]


@pytest.fixture
def without_torchs_bf16(monkeypatch):
    monkeypatch.setattr(reference, "lacks_bf16_unscale", lambda device: True)


def _mixed(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)

    def rand(n, dtype):
        return (torch.randn(n, generator=gen) * 3000).to(dtype)

    return [rand(7, torch.bfloat16), rand(4097, torch.float32), rand(0, torch.bfloat16),
            rand(33 * 5, torch.bfloat16).view(33, 5).t(), rand(999, torch.float16),
            rand(65537, torch.bfloat16)]


def _torchs(grads, inv):
    expected = [g.clone() for g in grads]
    found = torch.zeros(())
    for dtype in (torch.bfloat16, torch.float32, torch.float16):
        torch._amp_foreach_non_finite_check_and_unscale_(
            [g for g in expected if g.dtype == dtype], found, inv)
    return expected, found


@pytest.mark.parametrize("inv", [1 / 3.0, 2.0**-16, 0.0])
@pytest.mark.parametrize("special, where", [(None, None)] + [
    (s, w) for s in SPECIALS for w in ((0, 0), (0, -1), (-1, 0), (-1, -1), (3, -1))])
def test_bf16_without_torchs_op_matches_torchs_op(without_torchs_bf16, inv, special, where):
    grads = _mixed(seed=1)
    if special is not None:  # grads[3] is a transposed view: its first / last element
        index = (where[1], where[1]) if grads[where[0]].dim() == 2 else where[1]
        grads[where[0]][index] = special
    inv_t = torch.tensor(inv)
    expected, found_expected = _torchs(grads, inv_t)
    found = torch.zeros(())
    reference.non_finite_check_and_unscale_(grads, found, inv_t)
    assert_all_same(grads, expected)
    assert_same(found, found_expected)
    assert found.item() == (special is not None)


def test_bf16_products_past_the_range_are_flagged(without_torchs_bf16):
    """A finite bfloat16 grad whose product overflows (a scale below 1): stored inf, flagged,
    as the reference path's check after torch's op flags it for the other dtypes."""
    grads = [torch.tensor([3.0e38, 1.0], dtype=torch.bfloat16)]
    expected = grads[0].clone()
    torch._amp_foreach_non_finite_check_and_unscale_([expected], torch.zeros(()),
                                                     torch.tensor(4.0))
    found = torch.zeros(())
    reference.non_finite_check_and_unscale_(grads, found, torch.tensor(4.0))
    assert_same(grads[0], expected)
    assert found.item() == 1.0


def test_only_cuda_lacks_torchs_bf16_op():
    assert reference.lacks_bf16_unscale(torch.device("cuda", 0))
    assert not reference.lacks_bf16_unscale(torch.device("cpu"))
