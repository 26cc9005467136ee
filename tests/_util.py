"""Exact comparison helpers shared by the tests."""

import torch

_INT_OF = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16,
           torch.float64: torch.int64}


#: torch's error for the inf norm of an empty grad ("infinity norm" from 2.11 on, "inf norm" before)
TORCHS_EMPTY_INF_NORM_ERROR = r"inf(inity)? norm on an empty tensor"


def assert_same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Bit-for-bit equality, except that any NaN equals any NaN (payloads may differ)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if not actual.is_floating_point():
        assert torch.equal(actual, expected), f"{actual} != {expected}"
        return
    nan_a, nan_e = actual.isnan(), expected.isnan()
    assert torch.equal(nan_a, nan_e), "NaN positions differ"
    bits_a = actual.contiguous().view(_INT_OF[actual.dtype])[~nan_a]
    bits_e = expected.contiguous().view(_INT_OF[expected.dtype])[~nan_e]
    if not torch.equal(bits_a, bits_e):
        diff = (bits_a != bits_e).nonzero()[:5].flatten().tolist()
        raise AssertionError(f"values differ at (non-NaN) positions {diff}: "
                             f"{actual[~nan_a][diff].tolist()} vs {expected[~nan_e][diff].tolist()}")


def assert_all_same(actual, expected) -> None:
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        assert_same(a, e)
