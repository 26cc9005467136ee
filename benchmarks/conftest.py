"""Benchmark settings.

``TRITON_SCALER_BENCH_SIZES=full`` selects the published sizes; the default ``small`` keeps the
suites quick enough to run as plain tests in CI (``--benchmark-disable``). On CPU triton_scaler
runs its reference backend against torch's CPU ops; on CUDA its Triton kernels against torch's
CUDA ops. Every case is benchmarked as ``impl=torch`` and ``impl=ours`` in the same pytest run;
``benchmarks/plot.py`` turns the saved JSON into GB/s, ratios, tables and plots.
"""

import pytest
from _bench_common import DEVICE, sync


@pytest.fixture
def run_benchmark(benchmark):
    """benchmark(fn) with device synchronisation, recording the bytes it moves."""

    def go(fn, nbytes, **info):
        benchmark.extra_info.update(bytes=nbytes, device=str(DEVICE), **info)

        def timed():
            fn()
            sync()

        benchmark.pedantic(timed, rounds=1 if not benchmark.enabled else 20,
                           iterations=1, warmup_rounds=0 if not benchmark.enabled else 2)
    return go
