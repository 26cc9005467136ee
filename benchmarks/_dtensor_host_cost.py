"""Host cost of ``scale -> unscale_ -> step -> update`` with DTensor grads (FSDP2's), on a
one-rank gloo mesh on the CPU: triton_scaler with its launches no-ops (``_host_stubs.py``)
against torch's scaler, whose op runs for real (stubbed, it would skip DTensor's dispatch,
which is the host work to compare; its arithmetic on the local shards is timed apart).

``python benchmarks/_dtensor_host_cost.py 100 1000`` prints the table of RESULTS.md."""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
from _host_stubs import noop_launches

SHAPE = (64, 17)


def _median_step_us(make_scaler, n: int, steps: int = 30) -> float:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    torch.manual_seed(0)
    params = [torch.nn.Parameter(distribute_tensor(torch.randn(SHAPE), mesh, [Shard(0)]))
              for _ in range(n)]
    for p in params:
        p.grad = distribute_tensor(torch.randn(SHAPE), mesh, [Shard(0)])
    opt = torch.optim.SGD(params, lr=0.0)
    opt.step = lambda closure=None: None  # the optimizer's work is not the scaler's
    scaler, loss, times = make_scaler(), torch.ones(()), []
    for _ in range(steps):
        start = time.perf_counter()
        scaler.scale(loss)
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        times.append(time.perf_counter() - start)
    return statistics.median(times[5:]) * 1e6


def _torch_arithmetic_us(n: int) -> float:
    """torch's op on ``n`` plain tensors of the shards' shape: the arithmetic in its step."""
    grads, found, inv = [torch.randn(SHAPE) for _ in range(n)], torch.zeros(()), torch.ones(())
    times = []
    for _ in range(30):
        start = time.perf_counter()
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv)
        times.append(time.perf_counter() - start)
    return statistics.median(times[5:]) * 1e6


def main(sizes: list[int]) -> None:
    from triton_scaler import GradScaler

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29541")
    dist.init_process_group("gloo", rank=0, world_size=1)
    real_op = torch._amp_foreach_non_finite_check_and_unscale_
    print(f"host us per step, DTensor grads {SHAPE} on a 1-rank mesh, torch {torch.__version__}")
    print("| params | ours (launches no-ops) | torch | torch's arithmetic alone | ours / torch |\n"
          "|---|---|---|---|---|")
    try:
        for n in sizes:
            arithmetic = _torch_arithmetic_us(n)
            with noop_launches():
                torch._amp_foreach_non_finite_check_and_unscale_ = real_op
                ours = _median_step_us(lambda: GradScaler("cpu", backend="triton"), n)
                theirs = _median_step_us(lambda: torch.amp.GradScaler("cpu"), n)
            print(f"| {n} | {ours:.0f} | {theirs:.0f} | {arithmetic:.0f} | "
                  f"{ours / theirs:.2f} |", flush=True)
    finally:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the Triton backend on CPU tensors
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("sizes", nargs="*", type=int, default=[100, 1000])
    main(parser.parse_args().sizes)
