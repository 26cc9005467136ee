"""The CPU path against torch's, interleaved in one process, one thread: the table of
RESULTS.md. The cases are ``test_bench_cpu_path.py``'s at full sizes: ``ops`` calls over
many small grads and a few large ones (fp32 / fp16 / bf16), and a scaler's whole step.

``python benchmarks/cpu_path.py`` prints torch's time / ours per case (> 1: ours faster)."""

from __future__ import annotations

import statistics
import time

import torch

from triton_scaler import GradScaler, ops

SHAPES = [(100, 64), (1000, 64), (4, 2**20)]
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
INV = 0.99999994  # just below 1: every product rounds, none overflows


def _interleaved(a, b, seconds: float = 1.0) -> tuple[float, float]:
    """Median seconds of ``a()`` and ``b()``, called in turn for about ``seconds``."""
    for fn in (a, b, a, b):
        fn()
    times: tuple[list[float], list[float]] = ([], [])
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(times[0]) < 5:
        for fn, out in zip((a, b), times):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return statistics.median(times[0]), statistics.median(times[1])


def _ops_ratios(grads: list[torch.Tensor]) -> tuple[float, float]:
    """torch's time / ours: the unscale (inv_scale just below 1), and the read-only check
    against torch's op by 1.0."""
    found, inv, one = torch.zeros(()), torch.tensor(INV), torch.tensor(1.0)
    unscale = _interleaved(
        lambda: torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv),
        lambda: ops.non_finite_check_and_unscale_(grads, found, inv))
    check = _interleaved(
        lambda: torch._amp_foreach_non_finite_check_and_unscale_(grads, found, one),
        lambda: ops.non_finite_check_(grads, found, inv))
    return unscale[0] / unscale[1], check[0] / check[1]


def ops_rows() -> list[str]:
    rows = []
    for n, numel in SHAPES:
        for name, dtype in DTYPES.items():
            gen = torch.Generator().manual_seed(0)
            unscale, check = _ops_ratios([torch.randn(numel, generator=gen).to(dtype)
                                          for _ in range(n)])
            rows.append(f"| {n} x {numel} | {name} | {unscale:.2f} | {check:.2f} |")
    return rows


def _step(impl: str, kind: str, n: int):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(64)) for _ in range(n)]
    for p in params:
        p.grad = torch.randn(64)
    opt = (torch.optim.SGD(params, lr=1e-3, foreach=False) if kind == "for-loop SGD" else
           torch.optim.AdamW(params, lr=1e-3, **({"foreach": True} if kind == "foreach AdamW"
                                                 else {"fused": True})))
    scaler = (torch.amp.GradScaler if impl == "torch" else GradScaler)("cpu", init_scale=1.0)
    loss = torch.ones(())

    def step():
        scaler.scale(loss)
        scaler.step(opt)
        scaler.update()
    return step


def step_rows() -> list[str]:
    rows = []
    for n in (100, 1000):
        for kind in ("for-loop SGD", "foreach AdamW", "fused AdamW"):
            theirs, ours = _interleaved(_step("torch", kind, n), _step("ours", kind, n))
            rows.append(f"| {n} x 64 | {kind} | {theirs * 1e6:.0f} | {ours * 1e6:.0f} | "
                        f"{theirs / ours:.2f} |")
    return rows


def main() -> None:
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, one thread; torch's time / ours, medians, interleaved")
    print("| grads | dtype | non_finite_check_and_unscale_ | non_finite_check_ (torch: its op"
          " by 1.0) |\n|---|---|---|---|")
    print("\n".join(ops_rows()), flush=True)
    print("\n| params | optimizer | torch us | ours us | torch / ours |\n|---|---|---|---|---|")
    print("\n".join(step_rows()))


if __name__ == "__main__":
    main()
