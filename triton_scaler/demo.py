"""``python -m triton_scaler demo``: a mixed-precision training run with triton_scaler beside
``torch.amp.GradScaler``, printing the device, backend and autocast dtype, both scale
trajectories, skipped steps, step time (the two runs interleaved, step by step, with a fixed
number of CPU threads), host syncs per step, and whether the two runs differ (they must not,
except in speed)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch

from ._backend import triton_available
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


class _Run:
    """One training run of the demo model under one scaler, stepped one iteration at a time so
    that two runs can be timed interleaved (machine noise then hits both alike)."""

    def __init__(self, scaler: torch.amp.GradScaler, device: torch.device, fused: bool,
                 clip: Callable[..., torch.Tensor]) -> None:
        self.scaler, self.device, self.clip = scaler, device, clip
        self.model = _model(device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3, fused=fused)
        self.gen = torch.Generator(device=device).manual_seed(1)
        self.target_w = torch.randn(64, 8, device=device, generator=self.gen)
        self.scales: list[float] = []
        self.losses: list[torch.Tensor] = []
        self.syncs = 0
        self.elapsed = 0.0

    def step(self, overflow: bool) -> None:
        """One iteration, timed; a planted overflow multiplies the loss by inf."""
        scaler, opt = self.scaler, self.opt
        x = torch.randn(128, 64, device=self.device, generator=self.gen)
        start = time.perf_counter()
        with torch.autocast(self.device.type, dtype=autocast_dtype(self.device)):
            loss = torch.nn.functional.mse_loss(self.model(x).float(), x @ self.target_w)
        if overflow:
            loss = loss * float("inf")
        with count_host_syncs() as counter, optimizer_step_uncounted(opt, counter):
            scaler.scale(loss).backward()
            self.clip(scaler, opt, self.model)
            scaler.step(opt)
            scaler.update()
        opt.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self.elapsed += time.perf_counter() - start
        self.syncs += counter.count
        self.scales.append(scaler.get_scale())
        self.losses.append(loss.detach())

    def summary(self, initial_scale: float) -> dict[str, Any]:
        skipped, previous = 0, initial_scale  # hysteresis 1: a skip is exactly a backoff
        for scale in self.scales:
            skipped += scale < previous
            previous = scale
        steps = len(self.scales)
        return {"scales": self.scales,
                "params": [p.detach().clone() for p in self.model.parameters()],
                "final_loss": float(self.losses[-1]), "skipped": skipped,
                "ms_per_step": 1e3 * self.elapsed / steps, "syncs_per_step": self.syncs / steps}


def autocast_dtype(device: torch.device) -> torch.dtype:
    """float16 on CUDA (what loss scaling is for), bfloat16 on the CPU (its autocast dtype)."""
    return torch.float16 if device.type == "cuda" else torch.bfloat16


def train_pair(scalers: tuple[torch.amp.GradScaler, torch.amp.GradScaler],
               device: torch.device, steps: int, overflow_at: set[int], fused: bool,
               desc: str) -> list[dict[str, Any]]:
    """Train torch's scaler (``scalers[0]``, torch's clip route) and ours (fused clip) side by
    side, alternating which goes first each iteration; returns each run's summary."""
    runs = [_Run(scalers[0], device, fused, _torch_clip),
            _Run(scalers[1], device, fused, _fused_clip)]
    initial = [scaler.get_scale() for scaler in scalers]
    for step in _progress(range(steps), steps, desc):
        for run in (runs if step % 2 == 0 else runs[::-1]):
            run.step(step in overflow_at)
    return [run.summary(scale) for run, scale in zip(runs, initial)]


def _trajectory(scales: list[float]) -> str:
    changes = [f"step {i}: {s:g}" for i, s in enumerate(scales) if i == 0 or s != scales[i - 1]]
    return ", ".join(changes[:12]) + (" ..." if len(changes) > 12 else "")


def compare(device: torch.device, steps: int, fused: bool) -> list[str]:
    """One pair of runs (torch's scaler, triton_scaler) with one optimizer; prints the table
    and returns what differs other than speed."""
    overflow_at = {20, 21, 150}
    kwargs: dict[str, Any] = dict(init_scale=2.0**24, growth_interval=50)
    backend = demo_backend(device)
    print(f"\n== AdamW fused={fused}: {steps} steps, clipping at norm 1.0 (torch: unscale_ + "
          f"clip_grad_norm_; ours: scaler.clip_grad_norm_), overflows planted at "
          f"{sorted(overflow_at)}")
    init_scale = kwargs["init_scale"]
    print(f"both scalers: init_scale=2**{math.log2(init_scale):g} ({init_scale:g}), "
          f"growth_interval={kwargs['growth_interval']} (not torch's defaults: the scale backs "
          "off and grows within the run)")
    runs = train_pair((torch.amp.GradScaler(device.type, **kwargs),
                       GradScaler(device.type, **kwargs)), device, steps, overflow_at, fused,
                      f"AdamW fused={fused}")
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


def show_telemetry(device: torch.device, steps: int = 30) -> None:
    """A short run with ``scaler.watch(model)``: an inf planted in one layer's gradient at
    step 20; prints the named overflow report and the last step's per-parameter numbers."""
    print(f"\n== gradient telemetry: scaler.watch(model), {steps} steps, an inf planted in "
          "2.weight's gradient at step 20")
    model = _model(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = GradScaler(device.type, init_scale=2.0**16)
    watch = scaler.watch(model)
    gen = torch.Generator(device=device).manual_seed(2)
    for step in range(steps):
        x = torch.randn(128, 64, device=device, generator=gen)
        with torch.autocast(device.type, dtype=autocast_dtype(device)):
            loss = model(x).float().square().mean()
        scaler.scale(loss).backward()
        if step == 20:
            layer = model.get_submodule("2")
            assert isinstance(layer, torch.nn.Linear) and layer.weight.grad is not None
            layer.weight.grad[3, 7] = float("inf")
        scaler.clip_grad_norm_(opt, 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
    report = watch.report()  # the one device-to-host copy
    print(report.last_overflow)
    print(f"last step: total norm {report.total_norm:.4g}, scale {report.scale:g}, skipped "
          f"steps {report.skipped_steps}")
    for name in report.norm:
        print(f"  {name:<10} norm {report.norm[name]:.4g}  amax {report.amax[name]:.4g}")


def demo_backend(device: torch.device) -> str:
    """The backend ``GradScaler(device.type)`` runs with ``backend="auto"``."""
    return "triton" if device.type == "cuda" and triton_available() else "reference"


def main(steps: int = 300, threads: int = 1) -> int:
    """Run the demo; returns 0 when the two scalers agree (1 otherwise). ``threads``: torch's
    intra-op threads while it runs (fixed, so that the step times are comparable)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    backend = demo_backend(device)
    print(f"triton_scaler demo: mixed-precision training with torch.amp.GradScaler and "
          f"triton_scaler.GradScaler side by side\n"
          f"device {device}, backend {backend}, autocast {autocast_dtype(device)}, "
          f"torch {torch.__version__}, {threads} CPU thread(s); the two runs are timed "
          "interleaved, step by step")
    if backend == "reference":
        print("On this device both scalers run torch's own unscale op (the reference "
              "backend): expect the same results and about the same speed. The Triton kernels "
              "run on CUDA.")
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        differences = []
        for fused in (False, True):
            differences += [f"{d} (fused={fused})" for d in compare(device, steps, fused)]
        show_telemetry(device)
    finally:
        torch.set_num_threads(previous_threads)
    print("\ndifferences (other than speed): " + (", ".join(differences) or
          "none: identical scale trajectories and skipped steps"))
    return 1 if differences else 0
