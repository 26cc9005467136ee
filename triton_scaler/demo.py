"""``python -m triton_scaler demo``: a mixed-precision training run with triton_scaler beside
``torch.amp.GradScaler``, printing both scale trajectories, skipped steps, speed, host syncs
per step, and whether the two runs differ (they must not, except in speed)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from .diagnostics import count_host_syncs, optimizer_step_uncounted
from .grad_scaler import GradScaler


def _progress(iterable, total: int, desc: str):
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is an optional extra ("demo")
        return iterable
    # disable=None: no bar when the output is not a terminal (a log, a pipe, CI)
    return tqdm(iterable, total=total, desc=desc, leave=False, disable=None)


def _model(device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 256), torch.nn.GELU(),
        torch.nn.Linear(256, 8)).to(device)


def _torch_clip(scaler, opt, model) -> torch.Tensor:
    scaler.unscale_(opt)  # torch's route: unscale, norm, clip (five passes over the grads)
    return torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)


def _fused_clip(scaler, opt, model) -> torch.Tensor:
    return scaler.clip_grad_norm_(opt, 1.0)  # one read pass + one read/write pass


def train_run(scaler: torch.amp.GradScaler, device: torch.device, steps: int,
              overflow_at: set[int], fused: bool, desc: str,
              clip: Callable[..., torch.Tensor] = _torch_clip) -> dict[str, Any]:
    """Train a fresh copy of the demo model; returns trajectory, params and timings."""
    model = _model(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
    autocast_dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(1)
    target_w = torch.randn(64, 8, device=device, generator=gen)
    scales, losses, syncs, elapsed = [], [], 0, 0.0
    previous = scaler.get_scale()
    for step in _progress(range(steps), steps, desc):
        x = torch.randn(128, 64, device=device, generator=gen)
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=autocast_dtype):
            loss = torch.nn.functional.mse_loss(model(x).float(), x @ target_w)
        if step in overflow_at:
            loss = loss * float("inf")
        with count_host_syncs() as counter, optimizer_step_uncounted(opt, counter):
            scaler.scale(loss).backward()
            clip(scaler, opt, model)
            scaler.step(opt)
            scaler.update()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed += time.perf_counter() - start
        syncs += counter.count
        scales.append(scaler.get_scale())
        losses.append(loss.detach())
    skipped = 0  # with hysteresis 1, a step is skipped exactly when the scale backs off
    for scale in scales:
        skipped += scale < previous
        previous = scale
    return {"scales": scales, "params": [p.detach().clone() for p in model.parameters()],
            "final_loss": float(losses[-1]), "skipped": skipped, "ms_per_step":
            1e3 * elapsed / steps, "syncs_per_step": syncs / steps}


def _trajectory(scales: list[float]) -> str:
    changes = [f"step {i}: {s:g}" for i, s in enumerate(scales) if i == 0 or s != scales[i - 1]]
    return ", ".join(changes[:12]) + (" ..." if len(changes) > 12 else "")


def compare(device: torch.device, steps: int, fused: bool) -> list[str]:
    """One pair of runs (torch's scaler, triton_scaler) with one optimizer; prints the table
    and returns what differs other than speed."""
    overflow_at = {20, 21, 150}
    kwargs: dict[str, Any] = dict(init_scale=2.0**24, growth_interval=50)
    backend = "triton" if device.type == "cuda" else "reference"
    print(f"\n== AdamW fused={fused}: {steps} steps on {device}, clipping at norm 1.0 (torch: "
          f"unscale_ + clip_grad_norm_; ours: scaler.clip_grad_norm_), overflows injected at "
          f"{sorted(overflow_at)}")
    runs = [train_run(torch.amp.GradScaler(device.type, **kwargs), device, steps, overflow_at,
                      fused, "torch.amp.GradScaler"),
            train_run(GradScaler(device.type, **kwargs), device, steps, overflow_at, fused,
                      f"triton_scaler ({backend})", clip=_fused_clip)]
    rows = [("final loss", "final_loss", "{:.6f}"), ("final scale", None, "{:g}"),
            ("skipped steps", "skipped", "{}"), ("step time (ms)", "ms_per_step", "{:.3f}"),
            ("host syncs / step", "syncs_per_step", "{:.2f}")]
    print(f"\n{'':<20}{'torch.amp.GradScaler':>24}{'triton_scaler':>24}")
    for label, key, fmt in rows:
        a, b = (run["scales"][-1] if key is None else run[key] for run in runs)
        print(f"{label:<20}{fmt.format(a):>24}{fmt.format(b):>24}")
    print(f"scale trajectory (torch):         {_trajectory(runs[0]['scales'])}")
    print(f"scale trajectory (triton_scaler): {_trajectory(runs[1]['scales'])}")
    differences = []
    if runs[0]["scales"] != runs[1]["scales"]:
        differences.append("scale trajectory")
    if all(torch.equal(a, b) for a, b in zip(runs[0]["params"], runs[1]["params"])):
        print("parameters: bit-identical")
    elif backend == "reference":
        differences.append("parameters")
    else:  # the Triton read pass sums the clip norm in another order: last-bit differences
        worst = max(((a - b).abs().max() / b.abs().max().clamp(min=1e-12)).item()
                    for a, b in zip(runs[1]["params"], runs[0]["params"]))
        print(f"parameters: largest difference {worst:.2e} of the parameter's magnitude (the "
              "clip norm is summed in another order on the GPU; AdamW amplifies last bits)")
    return differences


def main(steps: int = 300) -> int:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"triton_scaler demo: mixed-precision training with torch.amp.GradScaler and "
          f"triton_scaler.GradScaler side by side (torch {torch.__version__})")
    differences = []
    for fused in (False, True):
        differences += [f"{d} (fused={fused})" for d in compare(device, steps, fused)]
    print("\ndifferences (other than speed): " + (", ".join(differences) or
          "none: identical scale trajectories and skipped steps"))
    return 1 if differences else 0
