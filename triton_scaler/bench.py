"""``python -m triton_scaler bench``: quick microbenchmarks of ``unscale_ + update`` against
``torch.amp.GradScaler``, interleaved in one process, printed as a table (median times, GB/s, ratio).

On CPU the reference backend is measured against torch's CPU ops; on CUDA the Triton kernels
against torch's CUDA ops. The pytest-benchmark suites in ``benchmarks/`` are the full version.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

CASES = [("2000 x 4096 fp32", 2000, 4096, torch.float32),
         ("4 x 4M fp32", 4, 4 * 1024 * 1024, torch.float32),
         ("1 x 16M bf16", 1, 16 * 1024 * 1024, torch.bfloat16)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def interleaved_medians(fns: list[Callable[[], None]], device: torch.device,
                        repeats: int = 31, inner: int = 3) -> list[float]:
    """Median seconds per call of each function, measured alternately (in forward and reverse
    order on alternate repeats) so that machine noise and position hit all of them alike."""
    times: list[list[float]] = [[] for _ in fns]
    for fn in fns:
        fn()
    _sync(device)
    for repeat in range(repeats):
        order = list(enumerate(fns))
        for i, fn in order if repeat % 2 == 0 else order[::-1]:  # no favoured slot
            start = time.perf_counter()
            for _ in range(inner):
                fn()
            _sync(device)
            times[i].append((time.perf_counter() - start) / inner)
    return [statistics.median(t) for t in times]


def scaler_step_pair(n_tensors: int, numel: int, dtype: torch.dtype, device: torch.device
                     ) -> tuple[Callable[[], None], Callable[[], None], int]:
    """(torch_fn, ours_fn, bytes moved): ``scaler.unscale_(opt); scaler.update()`` of
    ``torch.amp.GradScaler`` and of triton_scaler's, each over its own copy of the same grads.
    The scale is 1.0 so repeated unscaling leaves the grads (and the work) unchanged."""
    from .grad_scaler import GradScaler

    def setup(scaler: torch.amp.GradScaler) -> Callable[[], None]:
        gen = torch.Generator(device=device).manual_seed(0)
        params = [torch.nn.Parameter(torch.empty(numel, device=device, dtype=dtype))
                  for _ in range(n_tensors)]
        for p in params:
            p.grad = torch.randn(numel, device=device, generator=gen).to(dtype)
        opt = torch.optim.SGD(params, lr=0.0)
        scaler.scale(torch.ones((), device=device))

        def fn() -> None:
            scaler.unscale_(opt)
            scaler.update()
        return fn

    torch_fn = setup(torch.amp.GradScaler(device.type, init_scale=1.0))
    ours_fn = setup(GradScaler(device.type, init_scale=1.0))
    itemsize = torch.empty((), dtype=dtype).element_size()
    return torch_fn, ours_fn, 2 * n_tensors * numel * itemsize


def main() -> int:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    backend = "triton" if device.type == "cuda" else "reference"
    print(f"unscale_ + update on {device} (triton_scaler backend: {backend}), "
          f"torch {torch.__version__}, median of interleaved runs")
    print(f"{'case':<20}{'torch ms':>10}{'ours ms':>10}{'torch GB/s':>12}{'ours GB/s':>11}"
          f"{'speed ratio':>13}")
    for label, n, numel, dtype in CASES:
        if device.type == "cuda" and dtype is torch.bfloat16:
            print(f"{label:<20}{'n/a':>10}   (torch's CUDA op has no bf16)")
            continue
        torch_fn, ours_fn, nbytes = scaler_step_pair(n, numel, dtype, device)
        t_torch, t_ours = interleaved_medians([torch_fn, ours_fn], device)
        print(f"{label:<20}{t_torch * 1e3:>10.3f}{t_ours * 1e3:>10.3f}"
              f"{nbytes / t_torch / 1e9:>12.1f}{nbytes / t_ours / 1e9:>11.1f}"
              f"{t_torch / t_ours:>13.2f}")
    print("speed ratio = torch time / triton_scaler time (> 1: triton_scaler is faster)")
    return 0
