"""A small mixed-precision training loop, run under any scaler, for parity tests."""

import torch
from _util import assert_same


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, 33), torch.nn.GELU(), torch.nn.Linear(33, 7),
                               torch.nn.LayerNorm(7), torch.nn.Linear(7, 3))


OPTIMIZERS = {
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
}


def train(scaler, optimizer_name="adamw", *, steps=25, clip=False, two_optimizers=False,
          two_groups=False, overflow_at=(3, 4, 11), buckets=None, zero_grad=None, accumulate=1):
    """Returns ((scale, growth_tracker) after every update, params, optimizers).
    ``two_optimizers``: the parameters split over two optimizers; ``two_groups``: over two
    parameter groups of one optimizer."""
    model = make_model()
    params = list(model.parameters())
    groups = [params[:3], params[3:]] if two_optimizers else [params]
    if two_groups:
        groups = [[{"params": params[:3]}, {"params": params[3:]}]]
    optimizers = [OPTIMIZERS[optimizer_name](g) for g in groups]
    if buckets is not None:
        for opt in optimizers:
            buckets(opt)
    gen = torch.Generator().manual_seed(1)
    trajectory = []
    for step in range(steps):
        for _ in range(accumulate):
            x = torch.randn(9, 12, generator=gen)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(x).float().square().mean()
            if step in overflow_at:
                loss = loss * float("inf")
            scaler.scale(loss).backward()
        if clip:
            for opt in optimizers:
                scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(params, 0.5)
        for opt in optimizers:
            scaler.step(opt)
        scaler.update()
        for opt in optimizers:
            (zero_grad or (lambda o: o.zero_grad()))(opt)
        trajectory.append((scaler.get_scale(), scaler._get_growth_tracker()))
    return trajectory, [p.detach().clone() for p in params], optimizers


def assert_same_optimizer_state(a, b):
    """Parameter by parameter: state on both sides or on neither, the same keys, and every
    value the same (tensors bit for bit)."""
    params_a = [p for g in a.param_groups for p in g["params"]]
    params_b = [p for g in b.param_groups for p in g["params"]]
    assert len(params_a) == len(params_b)
    for i, (param_a, param_b) in enumerate(zip(params_a, params_b)):
        pa, pb = a.state.get(param_a), b.state.get(param_b)
        assert (pa is None) == (pb is None), f"optimizer state of parameter {i}: {pa} / {pb}"
        if pa is None:
            continue
        assert pa.keys() == pb.keys()
        for key in pa:
            if isinstance(pa[key], torch.Tensor):  # bit for bit, any NaN equal to any NaN
                try:
                    assert_same(pa[key], pb[key])
                except AssertionError as error:
                    raise AssertionError(f"{key}: {error}") from error
            else:
                assert pa[key] == pb[key], key


def optimizer_for_route(route, params, sgd_lr=0.05):
    """An optimizer of each step route: ``"fused"`` AdamW (the fused-optimizer route),
    ``"foreach"`` AdamW, or (anything else) for-loop SGD with momentum."""
    if route == "fused":
        return torch.optim.AdamW(params, lr=0.01, fused=True)
    if route == "foreach":
        return torch.optim.AdamW(params, lr=0.01, foreach=True)
    return torch.optim.SGD(params, lr=sgd_lr, momentum=0.9, foreach=False)
