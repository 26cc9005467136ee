"""GradScaler against torch.amp.GradScaler over random call sequences (a differential test).

Each seed draws a setup (parameter shapes, dtypes and layouts, one or two optimizers of
several kinds, the scaler's arguments, GradBuckets or not) and a sequence of calls from the
scaler's whole contract, the calls torch refuses included. Both sides get the same calls; after
every call they must agree exactly: the error raised (type and message), the value returned,
the scale, the growth tracker, every parameter, every grad and the optimizer state.

Two pairs of sides: triton_scaler (each backend) against torch.amp.GradScaler with torch's
settings; and, with triton_scaler's own settings drawn too (hysteresis, min / max scale,
raise at the minimum, static scaling, no skipping), the Triton kernels against the
reference path, which is their oracle.
"""

from __future__ import annotations

import math
import os
import random

import pytest
import torch
from _loops import assert_same_optimizer_state
from _util import assert_same

import triton_scaler

pytestmark = pytest.mark.filterwarnings("ignore:.*no longer views into their GradBucket",
                                        "ignore:.*scale has underflowed")

SEEDS = range(40)
CALLS = 60

OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "sgd_foreach": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, foreach=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
}
NON_FINITE = (float("inf"), float("-inf"), float("nan"))


def _draw_extensions(rng: random.Random, init_scale: float) -> dict:
    """triton_scaler's own settings (no torch oracle: the reference path is the Triton
    kernels' oracle)."""
    min_scale = rng.choice([0.0, 1.0, 2.0**-3])
    return {"hysteresis": rng.choice([1, 2, 3]), "consecutive_hysteresis": rng.random() < 0.5,
            "min_scale": min_scale,
            "max_scale": rng.choice([math.inf, init_scale * 4, init_scale * 2.0**10]),
            "raise_at_min_scale": min_scale > 0 and rng.random() < 0.5,
            "dynamic": rng.random() < 0.8, "skip_on_overflow": rng.random() < 0.8}


def _draw_setup(rng: random.Random, bf16: bool = True) -> dict:
    """``bf16=False``: no bfloat16 parameters (torch's CUDA op has no bf16 kernel)."""
    params = []
    for _ in range(rng.randint(1, 7)):
        shape = rng.choice([(rng.randint(0, 70),), (rng.randint(1, 9), rng.randint(1, 9))])
        dtype = rng.choices([torch.float32, torch.bfloat16, torch.float16], [14, 2 * bf16, 1])[0]
        params.append((shape, dtype, len(shape) == 2 and rng.random() < 0.5))
    cut = rng.randint(1, len(params) - 1) if len(params) > 1 and rng.random() < 0.4 else None
    slices = [(0, len(params))] if cut is None else [(0, cut), (cut, len(params))]
    return {
        "params": params,
        "optimizers": [(rng.choice(list(OPTIMIZERS)), s) for s in slices],
        "buckets": rng.random() < 0.35,
        "on_detach": rng.choice(["reattach", "warn"]),
        "scaler": {"init_scale": rng.choice([2.0**16, 2.0**3, 1000.0, 2.0**100]),
                   "growth_factor": rng.choice([2.0, 1.5, 3.0]),
                   "backoff_factor": rng.choice([0.5, 0.25, 0.7]),
                   "growth_interval": rng.choice([1, 2, 3, 2000])},
    }


def _new_param(spec: tuple, gen: torch.Generator, device: str) -> torch.nn.Parameter:
    shape, dtype, transposed = spec
    data = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    return torch.nn.Parameter(data.t() if transposed else data)


class _Side:
    """One side of the comparison: parameters, optimizers and a scaler built from a setup."""

    def __init__(self, setup: dict, seed: int, backend: str | None,
                 buckets: bool = True, device: str = "cpu") -> None:
        gen = torch.Generator().manual_seed(seed)
        self.device = device
        self.params = [_new_param(spec, gen, device) for spec in setup["params"]]
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


def _change_grad(side, i, how, position, value):
    p = side.params[i]
    if how == "none":
        p.grad = None
    elif how == "clone":  # new memory
        p.grad = p.grad.clone()
    elif how == "detach":  # a new tensor over the same memory
        p.grad = p.grad.detach()
    elif p.grad.numel():  # plant a non-finite value
        index = torch.unravel_index(torch.tensor(position % p.grad.numel()), p.grad.shape)
        p.grad[tuple(int(x) for x in index)] = value


def _set_factor(side, name, value):
    getattr(side.scaler, f"set_{name}")(value)


def _add_param_group(side, k, spec, data_seed):
    side.params.append(_new_param(spec, torch.Generator().manual_seed(data_seed), side.device))
    side.optimizers[k].add_param_group({"params": [side.params[-1]]})


def _replace_param(side, i, spec, data_seed, in_place):
    """A new parameter object in place of parameter ``i``, in the optimizer's group: in the
    group's list itself, or in a new list (only the latter with GradBuckets: in place, it is
    seen only between buckets.zero_() and the backward, README)."""
    old = side.params[i]
    new = _new_param(spec, torch.Generator().manual_seed(data_seed), side.device)
    side.params[i] = new
    for group in (g for opt in side.optimizers for g in opt.param_groups):
        params = group["params"] if in_place else list(group["params"])
        for j, p in enumerate(params):
            if p is old:
                params[j] = new
                group["params"] = params


def _checkpoint(side, fresh):
    state = side.scaler.state_dict()
    if fresh:
        side.scaler = side.new_scaler()
    side.scaler.load_state_dict(state)


def _draw_call(rng: random.Random, setup: dict, gen: torch.Generator):
    n_opt, n_params = len(setup["optimizers"]), len(setup["params"])
    k = rng.randrange(n_opt)
    kind = rng.choices(["backward", "unscale", "clip", "step", "update", "zero_grad",
                        "change_grad", "set_factor", "checkpoint", "add_group", "replace"],
                       [30, 8, 4, 20, 15, 10, 6, 3, 4, 1, 1])[0]
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
        return _change_grad, (rng.randrange(n_params),
                              rng.choice(["none", "clone", "detach", "plant", "plant"]),
                              rng.randrange(10**6), rng.choice(NON_FINITE))
    if kind == "set_factor":
        name, values = rng.choice([("growth_factor", [2.0, 1.5, 4.0]),
                                   ("backoff_factor", [0.5, 0.25]),
                                   ("growth_interval", [1, 2, 5])])
        return _set_factor, (name, rng.choice(values))
    return _checkpoint, (rng.random() < 0.5,)


def _outcome(call, side, args):
    try:
        return "returned", call(side, *args)
    except Exception as error:  # noqa: BLE001 (the errors are what is compared)
        return "raised", error


#: (torch's error, ours) where triton_scaler raises a clearer error on purpose: a fused
#: optimizer stepped after an unscale_() that saw no grads, with grads made since.
DELIBERATE = {("AttributeError", "'int' object has no attribute 'device'"):
              ("AssertionError", "No inf checks were recorded for this optimizer.")}


def _assert_same_outcome(ours, theirs, where) -> bool:
    """Asserts that both sides returned the same or raised the same; True for a DELIBERATE
    difference."""
    if theirs[0] == ours[0] == "raised":
        pair = DELIBERATE.get((type(theirs[1]).__name__, str(theirs[1])))
        if pair is not None:
            assert (type(ours[1]).__name__, str(ours[1])) == pair, where
            return True
    assert ours[0] == theirs[0], f"{where}: ours {ours[0]} {ours[1]!r}, torch {theirs[0]} {theirs[1]!r}"
    if ours[0] == "raised":
        assert isinstance(ours[1], type(theirs[1])) and str(ours[1]) == str(theirs[1]), where
    elif isinstance(theirs[1], torch.Tensor):
        assert_same(ours[1], theirs[1])
    else:
        assert ours[1] == theirs[1], where
    return False


def _assert_same_sides(ours: _Side, theirs: _Side, where: str) -> None:
    assert ours.scaler.get_scale() == theirs.scaler.get_scale(), where
    assert ours.scaler._get_growth_tracker() == theirs.scaler._get_growth_tracker(), where
    for i, (p, q) in enumerate(zip(ours.params, theirs.params)):
        assert_same(p.detach(), q.detach())
        if q.grad is None and ours.buckets is not None and p.grad is not None:
            # GradBuckets: a parameter that received no gradient since buckets.zero_() has a
            # zero view, which becomes None before the step (README, "Flat gradient buckets")
            assert not p.grad.any(), f"{where}: grad {i}"
        elif q.grad is None or p.grad is None:
            assert p.grad is None and q.grad is None, f"{where}: grad {i}"
        else:
            assert_same(p.grad, q.grad)
    for a, b in zip(ours.optimizers, theirs.optimizers):
        assert_same_optimizer_state(a, b)
    if theirs.ours:  # two backends of ours: their own records too
        assert ours.scaler.state_dict() == theirs.scaler.state_dict(), where
        assert torch.equal(ours.scaler.last_step_skipped, theirs.scaler.last_step_skipped)


@pytest.mark.parametrize("seed", SEEDS)
def test_random_call_sequence_matches_torch(backend, seed):
    rng = random.Random(seed)
    setup = _draw_setup(rng)
    _run(rng, setup, seed, _Side(setup, seed, backend), _Side(setup, seed, None))


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("seed", SEEDS)
def test_random_call_sequence_with_extensions_triton_matches_reference(seed, device):
    """Hysteresis, min / max scale, raise at the minimum, static scaling, no skipping: the
    Triton kernels (with GradBuckets when drawn) against the reference path (without), on
    CPU tensors through the interpreter, or on the GPU in a GPU run."""
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1")
    if device == "cuda" and (os.environ.get("TRITON_INTERPRET") == "1"
                             or not torch.cuda.is_available()):
        pytest.skip("a GPU run: CUDA, without the interpreter")
    rng = random.Random(seed)
    setup = _draw_setup(rng)
    setup["scaler"].update(_draw_extensions(rng, setup["scaler"]["init_scale"]))
    _run(rng, setup, seed, _Side(setup, seed, "triton", device=device),
         _Side(setup, seed, "reference", buckets=False, device=device))


@pytest.mark.parametrize("seed", SEEDS)
def test_random_call_sequence_on_cuda_matches_torch(cuda, seed):
    """The Triton kernels compiled for the GPU against torch's CUDA scaler (a GPU run)."""
    rng = random.Random(seed)
    setup = _draw_setup(rng, bf16=False)
    _run(rng, setup, seed, _Side(setup, seed, "triton", device="cuda"),
         _Side(setup, seed, None, device="cuda"))


def _run(rng: random.Random, setup: dict, seed: int, ours: _Side, theirs: _Side) -> None:
    gen = torch.Generator().manual_seed(seed)
    for n in range(CALLS):
        call, args = _draw_call(rng, setup, gen)
        if call is _change_grad and theirs.params[args[0]].grad is None:
            continue  # (GradBuckets: ours may hold a zero view where torch holds None)
        where = f"call {n}: {call.__name__}{tuple(a if not isinstance(a, list) else '…' for a in args)}"
        if _assert_same_outcome(_outcome(call, ours, args), _outcome(call, theirs, args),
                                where):
            return  # torch's failed step left half-made optimizer state: not comparable
        try:
            _assert_same_sides(ours, theirs, where)
        except AssertionError as error:
            raise AssertionError(f"after {where}: {error}") from error
