"""non_finite_check_and_unscale_ / the check-only pass against torch's ops."""

import pytest
import torch
from _bench_common import DEVICE, FULL

from triton_scaler import ops

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
BUCKET_SIZES = ([2**20, 2**22, 2**24, 2**26, 2**28] if DEVICE.type == "cuda"
                else [2**20, 2**22, 2**24, 2**26]) if FULL else [2**12, 2**16]
MANY = ([(n, m) for n in (100, 1000, 10_000) for m in (1024, 16384)]
        + [(2000, 4096), (1000, 65536)] if FULL else [(10, 1024), (100, 64)])


def _torch_supports(dtype):
    return not (DEVICE.type == "cuda" and dtype is torch.bfloat16)  # torch issue 127176


def _grads(n_tensors, numel, dtype):
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    return [torch.randn(numel, device=DEVICE, generator=gen).to(dtype) for _ in range(n_tensors)]


def _unscale_fn(impl, grads):
    found = torch.zeros((), device=DEVICE)
    one = torch.ones((), device=DEVICE)  # scale 1: repeated runs keep the grads unchanged
    if impl == "torch":
        return lambda: torch._amp_foreach_non_finite_check_and_unscale_(grads, found, one)
    return lambda: ops.non_finite_check_and_unscale_(grads, found, one)


def _check(impl, grads, dtype):
    if impl == "torch" and not _torch_supports(dtype):
        pytest.skip("torch's CUDA op does not support bf16 gradients (unsupported)")


@pytest.mark.parametrize("impl", ["torch", "ours"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("numel", BUCKET_SIZES)
def test_unscale_bucket(run_benchmark, impl, dtype, numel):
    grads = _grads(1, numel, DTYPES[dtype])
    _check(impl, grads, DTYPES[dtype])
    run_benchmark(_unscale_fn(impl, grads), 2 * numel * grads[0].element_size(),
                  case="bucket", numel=numel, n_tensors=1, dtype=dtype, impl=impl)


@pytest.mark.parametrize("impl", ["torch", "ours"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("n_tensors, numel", MANY)
def test_unscale_many_tensors(run_benchmark, impl, dtype, n_tensors, numel):
    grads = _grads(n_tensors, numel, DTYPES[dtype])
    _check(impl, grads, DTYPES[dtype])
    run_benchmark(_unscale_fn(impl, grads), 2 * n_tensors * numel * grads[0].element_size(),
                  case="many", numel=numel, n_tensors=n_tensors, dtype=dtype, impl=impl)


@pytest.mark.parametrize("impl", ["torch", "ours"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("n_tensors, numel", [(1, BUCKET_SIZES[-1]), MANY[-1]])
def test_check_only(run_benchmark, impl, dtype, n_tensors, numel):
    """torch's fused-optimizer route runs _check_inf_per_device: a full read+write unscale pass
    with inv_scale = 1. triton_scaler reads only, on both backends (half the traffic)."""
    grads = _grads(n_tensors, numel, DTYPES[dtype])
    _check(impl, grads, DTYPES[dtype])
    found, one = torch.zeros((), device=DEVICE), torch.ones((), device=DEVICE)
    if impl == "torch":
        def fn():
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, one)
        nbytes = 2 * n_tensors * numel * grads[0].element_size()
    else:
        def fn():
            ops.non_finite_check_(grads, found, one)
        nbytes = n_tensors * numel * grads[0].element_size()
    run_benchmark(fn, nbytes, case="check", numel=numel, n_tensors=n_tensors, dtype=dtype,
                  impl=impl)


def test_ours_equals_torch_on_the_benchmarked_data():
    grads = _grads(3, BUCKET_SIZES[0], torch.float32)
    expected = [g.clone() for g in grads]
    found, inv = torch.zeros((), device=DEVICE), torch.tensor(0.3, device=DEVICE)
    torch._amp_foreach_non_finite_check_and_unscale_(expected, found, inv)
    ops.non_finite_check_and_unscale_(grads, found, inv)
    assert all(torch.equal(a, b) for a, b in zip(grads, expected))


@pytest.mark.parametrize("numel", BUCKET_SIZES[-1:])
def test_copy_bandwidth(run_benchmark, numel):
    """The floor: a device-to-device copy of the largest bucket (read + write), to state what
    fraction of the copy bandwidth the flat kernel reaches."""
    src = _grads(1, numel, torch.float32)[0]
    dst = torch.empty_like(src)
    run_benchmark(lambda: dst.copy_(src), 2 * numel * 4, case="copy", numel=numel,
                  n_tensors=1, dtype="fp32", impl="torch_copy")
