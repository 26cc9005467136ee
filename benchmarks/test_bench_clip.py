"""GradScaler.clip_grad_norm_ against torch's route: scaler.unscale_ + clip_grad_norm_(foreach).

Traffic per gradient byte: torch reads + writes (unscale), reads (norm), reads + writes (clip):
5 passes. Ours on the Triton backend: one read (found_inf + partial norms) and one read + write
(the clip): 3 passes. On CPU the reference backend runs torch's ops (5 passes, as torch).
``ours_guard``: the same with a SpikeGuard deciding the max norm (its one-program launch).
"""

import pytest
import torch
from _bench_common import DEVICE, FULL

from triton_scaler import GradScaler, SpikeGuard

SIZES = ([(1, 10**7), (1, 10**8), (1000, 16384)] if DEVICE.type == "cuda"
         else [(1, 2**22), (1000, 4096)]) if FULL else [(1, 2**12), (10, 1024)]


def _setup(n_tensors, numel, impl):
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(numel, device=DEVICE)) for _ in range(n_tensors)]
    for p in params:
        p.grad = torch.randn(numel, device=DEVICE, generator=gen)
    opt = torch.optim.SGD(params, lr=0.0)
    kwargs = dict(init_scale=1.0, growth_interval=2**30)  # scale 1, max_norm huge: grads stay
    if impl == "torch":
        scaler = torch.amp.GradScaler(DEVICE.type, **kwargs)
    else:  # ours_guard: a SpikeGuard past its warm-up (one more launch per clip on Triton)
        guard = SpikeGuard(warmup_steps=1) if impl == "ours_guard" else None
        scaler = GradScaler(DEVICE.type, spike_guard=guard, **kwargs)
    scaler.scale(torch.ones((), device=DEVICE))
    if impl == "torch":
        def step():
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(params, 1e30, foreach=True)
            scaler.update()
    else:
        def step():
            scaler.clip_grad_norm_(opt, 1e30)
            scaler.update()
    return step


@pytest.mark.parametrize("impl", ["torch", "ours", "ours_guard"])
@pytest.mark.parametrize("n_tensors, numel", SIZES)
def test_clip_grad_norm(run_benchmark, impl, n_tensors, numel):
    step = _setup(n_tensors, numel, impl)
    passes = 3 if impl != "torch" and DEVICE.type == "cuda" else 5
    run_benchmark(step, passes * n_tensors * numel * 4, case="clip", numel=numel,
                  n_tensors=n_tensors, dtype="fp32", impl=impl)
