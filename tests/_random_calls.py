"""The two sides of test_random_sequences.py's differential test and the calls drawn for
them: a side holds parameters, optimizers, a scaler (triton_scaler's on a backend, or torch's)
and GradBuckets when drawn; each call takes the side and arguments drawn once for both."""

from __future__ import annotations

import random

import torch

import triton_scaler

OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "sgd_foreach": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, foreach=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
}
#: The kinds the setups draw from (the more-changes test draws from all of OPTIMIZERS)
BASE_OPTIMIZERS = list(OPTIMIZERS)
OPTIMIZERS.update({  # (not fused SGD: torch's keeps a skipped first step's momentum, docs/exactness.md)
    "adam_fused_wd": lambda ps: torch.optim.Adam(ps, lr=1e-2, fused=True, weight_decay=0.1),
    "adamw_amsgrad_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, amsgrad=True, fused=True),
    "adagrad_fused": lambda ps: torch.optim.Adagrad(ps, lr=1e-2, fused=True),
    "rmsprop_foreach": lambda ps: torch.optim.RMSprop(ps, lr=1e-3, foreach=True),
    "nadam": lambda ps: torch.optim.NAdam(ps, lr=1e-3),
    "adam_capturable": lambda ps: torch.optim.Adam(ps, lr=1e-2, capturable=True, foreach=True),
})
NON_FINITE = (float("inf"), float("-inf"), float("nan"))


def new_param(spec: tuple, gen: torch.Generator, device: str) -> torch.nn.Parameter:
    shape, dtype, transposed = spec
    data = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    return torch.nn.Parameter(data.t() if transposed else data)


class Side:
    """One side of the comparison: parameters, optimizers and a scaler built from a setup."""

    def __init__(self, setup: dict, seed: int, backend: str | None,
                 buckets: bool = True, device: str = "cpu") -> None:
        gen = torch.Generator().manual_seed(seed)
        self.device = device
        self.params = [new_param(spec, gen, device) for spec in setup["params"]]
        self.optimizers = [OPTIMIZERS[kind](self.params[a:b])
                           for kind, (a, b) in setup["optimizers"]]
        self.ours, self.backend, self.settings = backend is not None, backend, setup["scaler"]
        self.scaler = self.new_scaler()
        self.buckets = ([triton_scaler.GradBuckets(opt, on_detach=setup["on_detach"])
                         for opt in self.optimizers]
                        if self.ours and buckets and setup["buckets"] else None)

    def new_scaler(self) -> torch.amp.GradScaler:
        if self.ours:
            return triton_scaler.GradScaler(self.device, **self.settings, backend=self.backend)
        return torch.amp.GradScaler(self.device, **self.settings)


# ---- the calls: each takes (side, *arguments drawn once for both sides)

def _backward(side, weights, as_list):
    loss = sum((side.params[i].float() * w.to(side.device)).sum() for i, w in weights)
    scaled = side.scaler.scale([loss] if as_list else loss)
    (scaled[0] if as_list else scaled).backward()
    return scaled[0] if as_list else scaled


def _unscale(side, k):
    side.scaler.unscale_(side.optimizers[k])


def _unscale_and_clip(side, k, fused):
    """``fused`` (float32 grads only): ours on the reference path clips through
    ``scaler.clip_grad_norm_``, bit-identical to torch's unscale_ + clip_grad_norm_."""
    if fused and side.backend == "reference":
        return side.scaler.clip_grad_norm_(side.optimizers[k], 0.5)
    side.scaler.unscale_(side.optimizers[k])
    params = [p for g in side.optimizers[k].param_groups for p in g["params"]]
    return torch.nn.utils.clip_grad_norm_(params, 0.5)


def _step(side, k, closure):
    return side.scaler.step(side.optimizers[k], **({"closure": lambda: 1.0} if closure else {}))


def _update(side, new_scale):
    side.scaler.update(new_scale.to(side.device, copy=True)
                       if isinstance(new_scale, torch.Tensor) else new_scale)


def _zero_grad(side, k, set_to_none):
    if side.buckets is not None and set_to_none == "buckets":
        side.buckets[k].zero_()  # GradBuckets' equivalent of torch's default zero_grad()
    else:  # with GradBuckets: the views are copied back, with a warning (pytestmark)
        side.optimizers[k].zero_grad(set_to_none=set_to_none != "zeros")


#: Further changes, drawn when a setup asks for them (``more_grad_changes``): in place on
#: the grad, its memory replaced on the same tensor object, or a new tensor from an op.
MORE_GRAD_CHANGES = ["mul_", "copy_", "zero_", "data", "set_", "op"]


def change_grad(side, i, how, position, value):
    p = side.params[i]
    if how == "none":
        p.grad = None
    elif how == "clone":  # new memory
        p.grad = p.grad.clone()
    elif how == "detach":  # a new tensor over the same memory
        p.grad = p.grad.detach()
    elif how in MORE_GRAD_CHANGES:
        _change_grad_more(p, how)
    elif p.grad.numel():  # plant a non-finite value
        index = torch.unravel_index(torch.tensor(position % p.grad.numel()), p.grad.shape)
        p.grad[tuple(int(x) for x in index)] = value


def _change_grad_more(p, how):
    grad = p.grad
    if how == "mul_":
        grad.mul_(2.0)
    elif how == "copy_":
        grad.copy_(torch.full_like(grad, 7.0))
    elif how == "zero_":
        grad.zero_()
    elif how == "data":  # (a GradBucket view stays a view object, over other memory)
        grad.data = grad.clone() * 3
    elif how == "set_":
        grad.set_(grad.clone() * 5)
    else:
        p.grad = grad * 0.5


def _set_factor(side, name, value):
    getattr(side.scaler, f"set_{name}")(value)


def _add_param_group(side, k, spec, data_seed):
    side.params.append(new_param(spec, torch.Generator().manual_seed(data_seed), side.device))
    side.optimizers[k].add_param_group({"params": [side.params[-1]]})


def _replace_param(side, i, spec, data_seed, in_place):
    """A new parameter object in place of parameter ``i``, in the optimizer's group: in the
    group's list itself, or in a new list (only the latter with GradBuckets: in place, it is
    seen only between buckets.zero_() and the backward, docs/buckets.md)."""
    old = side.params[i]
    new = new_param(spec, torch.Generator().manual_seed(data_seed), side.device)
    side.params[i] = new
    for group in (g for opt in side.optimizers for g in opt.param_groups):
        params = group["params"] if in_place else list(group["params"])
        for j, p in enumerate(params):
            if p is old:
                params[j] = new
                group["params"] = params


def _resize_param(side, i, spec, data_seed):
    """Parameter ``i`` resized in place (``param.data = ...``, as model surgery does), with
    its grad dropped and its optimizer state reset. Its next grad may land at its old grad's
    address (CPU malloc reuses a freed block of the same size class)."""
    p = side.params[i]
    p.data = new_param(spec, torch.Generator().manual_seed(data_seed), side.device).data
    p.grad = None  # (freed last: the next backward may take its block)
    for opt in side.optimizers:
        opt.state.pop(p, None)


def _checkpoint(side, fresh):
    state = side.scaler.state_dict()
    if fresh:
        side.scaler = side.new_scaler()
    side.scaler.load_state_dict(state)


def draw_call(rng: random.Random, setup: dict, gen: torch.Generator):
    n_opt, n_params = len(setup["optimizers"]), len(setup["params"])
    k = rng.randrange(n_opt)
    kind = rng.choices(["backward", "unscale", "clip", "step", "update", "zero_grad",
                        "change_grad", "set_factor", "checkpoint", "add_group", "replace",
                        "resize"],  # (not with GradBuckets: they fix their views when built)
                       [30, 8, 4, 20, 15, 10, 6, 3, 4, 1, 1, 0 if setup["buckets"] else 2])[0]
    if kind == "resize":
        i = rng.randrange(n_params)
        shape, dtype, transposed = setup["params"][i]
        low = 0 if len(shape) == 1 else 1
        shape = tuple(max(low, n + rng.choice([-2, -1, 1, 2])) for n in shape)
        setup["params"][i] = (shape, dtype, transposed)
        return _resize_param, (i, setup["params"][i], rng.randrange(10**6))
    if kind == "add_group":
        setup["params"].append(((rng.randint(0, 40),), torch.float32, False))
        return _add_param_group, (k, setup["params"][-1], rng.randrange(10**6))
    if kind == "replace":
        i = rng.randrange(n_params)
        return _replace_param, (i, setup["params"][i], rng.randrange(10**6),
                                not setup["buckets"] and rng.random() < 0.5)
    if kind == "backward":
        weights = []
        for i, (shape, _, transposed) in enumerate(setup["params"]):
            if rng.random() < 0.8:
                w = torch.randn(shape[::-1] if transposed else shape, generator=gen)
                if w.numel() and rng.random() < 0.15:
                    position = rng.choice([0, w.numel() - 1, rng.randrange(w.numel())])
                    w.view(-1)[position] = rng.choice(NON_FINITE)
                if w.numel() and setup.get("more_grad_changes") and rng.random() < 0.3 \
                        and not setup["buckets"]:  # (with buckets: docs/buckets.md, test_buckets.py)
                    w.view(-1)[rng.randrange(w.numel())] = -0.0  # a -0.0 in the grad
                weights.append((i, w))
        return _backward, (weights or [(0, torch.zeros(()))], rng.random() < 0.2)
    if kind == "unscale":
        return _unscale, (k,)
    if kind == "clip":
        a, b = setup["optimizers"][k][1]
        fp32 = all(dtype == torch.float32 for _, dtype, _ in setup["params"][a:b])
        return _unscale_and_clip, (k, fp32 and rng.random() < 0.5)
    if kind == "step":
        return _step, (k, rng.random() < 0.03)
    if kind == "update":
        new_scale = rng.choices([None, 2.0**rng.randint(-3, 20), torch.tensor(256.0),
                                 torch.tensor([512.0]), torch.tensor([4.0], dtype=torch.float64)],
                                [12, 2, 1, 1, 1])[0]
        return _update, (new_scale,)
    if kind == "zero_grad":
        return _zero_grad, (k, rng.choice(["buckets", "zeros", "none"]))
    if kind == "change_grad":
        hows = ["none", "clone", "detach", "plant", "plant"]
        return change_grad, (rng.randrange(n_params),
                              rng.choice(hows + MORE_GRAD_CHANGES * 2
                                         if setup.get("more_grad_changes") else hows),
                              rng.randrange(10**6), rng.choice(NON_FINITE))
    if kind == "set_factor":
        name, values = rng.choice([("growth_factor", [2.0, 1.5, 4.0]),
                                   ("backoff_factor", [0.5, 0.25]),
                                   ("growth_interval", [1, 2, 5])])
        return _set_factor, (name, rng.choice(values))
    return _checkpoint, (rng.random() < 0.5,)
