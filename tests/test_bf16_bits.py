"""``kernels/bits.py``: the raw-bit float32 <-> bfloat16 conversions the kernels use for
bfloat16 under Triton's interpreter, against torch's own conversions, over every bfloat16 bit
pattern and float32 patterns that reach every rounding case: ties to even, carries into the
exponent, overflow to inf, subnormals, signed zeros and NaNs of every payload (a NaN whose
upper half alone reads as inf must stay NaN)."""

import pytest
import torch
import triton
import triton.language as tl
from _util import assert_same
from triton_scaler.kernels.bits import bf16_bits_to_fp32, fp32_to_bf16_bits

_BLOCK = 4096
# low halves of float32 patterns: zero (exact), the smallest, just below / at / just above
# the half-way point, the largest
_LOW_HALVES = (0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF)


@triton.jit
def _convert(src, dst, n, TO_BF16: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(src + offsets, mask=mask)
    y = fp32_to_bf16_bits(x) if TO_BF16 else bf16_bits_to_fp32(x)
    tl.store(dst + offsets, y, mask=mask)


def _run(src: torch.Tensor, to_bf16: bool) -> torch.Tensor:
    dst = torch.empty(src.shape, dtype=torch.int16 if to_bf16 else torch.float32,
                      device=src.device)
    _convert[(triton.cdiv(src.numel(), _BLOCK),)](src, dst, src.numel(), TO_BF16=to_bf16,
                                                  BLOCK=_BLOCK)
    return dst


def _every_bf16_pattern(device: torch.device) -> torch.Tensor:
    return torch.arange(-(2**15), 2**15, dtype=torch.int32, device=device).to(torch.int16)


def test_every_bfloat16_widens_to_torchs_float32(triton_device):
    """All 65,536 patterns, NaN payloads included: the same float32 bits as torch's."""
    bits = _every_bf16_pattern(triton_device)
    ours = _run(bits, to_bf16=False)
    assert torch.equal(ours.view(torch.int32), bits.view(torch.bfloat16).float().view(torch.int32))


@pytest.mark.parametrize("source", ["every upper half", "random"])
def test_float32_rounds_to_torchs_bfloat16(triton_device, source):
    """Each bfloat16 pattern as the upper half of a float32 with each of the low halves that
    decide the rounding (tie, one below, one above, zero, the largest), and random patterns:
    the bits of torch's rounding to nearest even, a NaN wherever torch's is (torch's NaN
    payload depends on its vectorised path: any NaN equals any NaN)."""
    if source == "random":
        gen = torch.Generator().manual_seed(0)
        patterns = torch.randint(-(2**31), 2**31, (200_003,), generator=gen, dtype=torch.int64)
        patterns = patterns.to(torch.int32).to(triton_device)
    else:
        upper = _every_bf16_pattern(triton_device).to(torch.int32) << 16
        low = torch.tensor(_LOW_HALVES, dtype=torch.int32, device=triton_device)
        patterns = (upper[:, None] | low[None, :]).flatten()
    x = patterns.view(torch.float32)
    ours = _run(x, to_bf16=True).view(torch.bfloat16)
    assert_same(ours, x.to(torch.bfloat16))
