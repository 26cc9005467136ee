"""Exact fp32 <-> bf16 conversions on raw bits.

Triton's interpreter truncates fp32 -> bf16 casts and mishandles bf16 subnormals, so under
``TRITON_INTERPRET=1`` bf16 tensors are passed as int16 and converted with these helpers.
On the GPU the native casts are exact and these helpers are not used.
"""

import triton
import triton.language as tl


@triton.jit
def bf16_bits_to_fp32(bits):
    """int16 bit patterns of bf16 values -> the exact fp32 values."""
    u = bits.to(tl.uint16, bitcast=True).to(tl.uint32) << 16
    return u.to(tl.float32, bitcast=True)


@triton.jit
def fp32_to_bf16_bits(x):
    """fp32 values -> int16 bit patterns of bf16, rounded to nearest even (NaN -> 0x7FC0)."""
    u = x.to(tl.uint32, bitcast=True)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    rounded = tl.where(x != x, 0x7FC0, rounded)
    return rounded.to(tl.uint16).to(tl.int16, bitcast=True)
