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
from _random_calls import BASE_OPTIMIZERS, OPTIMIZERS, Side, change_grad, draw_call
from _seeds import length, seeds
from _util import assert_same

pytestmark = pytest.mark.filterwarnings("ignore:.*no longer views into their GradBucket",
                                        "ignore:.*scale has underflowed")

SEEDS = seeds(40)
CALLS = length(60)


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
        "optimizers": [(rng.choice(BASE_OPTIMIZERS), s) for s in slices],
        "buckets": rng.random() < 0.35,
        "on_detach": rng.choice(["reattach", "warn"]),
        "scaler": {"init_scale": rng.choice([2.0**16, 2.0**3, 1000.0, 2.0**100]),
                   "growth_factor": rng.choice([2.0, 1.5, 3.0]),
                   "backoff_factor": rng.choice([0.5, 0.25, 0.7]),
                   "growth_interval": rng.choice([1, 2, 3, 2000])},
    }


def _outcome(call, side, args):
    try:
        return "returned", call(side, *args)
    except Exception as error:  # noqa: BLE001 (the errors are what is compared)
        return "raised", error


#: (torch's error, ours) where triton_scaler raises a clearer error on purpose: a fused
#: optimizer stepped after an unscale_() that saw no grads, with grads made since.
DELIBERATE = {("AttributeError", "'int' object has no attribute 'device'"):
              ("AssertionError", "No inf checks were recorded for this optimizer.")}


#: What ours adds after torch's words when the iteration's unscale was a clip_grad_norm_
#: (tests/test_slips.py pins it); the sides here unscale through either route.
CLIP_HINT = (" clip_grad_norm_() unscales the grads (it counts as this iteration's unscale_()): "
             "call one of the two per optimizer and iteration.")


def _message(error: Exception) -> str:
    return str(error).removesuffix(CLIP_HINT)


def _assert_same_outcome(ours, theirs, where) -> bool:
    """Asserts that both sides returned the same or raised the same; True for a DELIBERATE
    difference."""
    if theirs[0] == "raised" and "but _scale is None" in str(theirs[1]) and \
            (ours[0], _message(ours[1]) if ours[0] == "raised" else None) != \
            ("raised", str(theirs[1])):
        # ours with a process_group (the sharded scaler's default) made its scale on first
        # use (docs/distributed.md, pipeline stages); test_pipeline.py pins torch's error
        # without one
        return True
    if theirs[0] == ours[0] == "raised":
        pair = DELIBERATE.get((type(theirs[1]).__name__, str(theirs[1])))
        if pair is not None:
            assert (type(ours[1]).__name__, str(ours[1])) == pair, where
            return True
    assert ours[0] == theirs[0], f"{where}: ours {ours[0]} {ours[1]!r}, torch {theirs[0]} {theirs[1]!r}"
    if ours[0] == "raised":
        assert isinstance(ours[1], type(theirs[1])) and _message(ours[1]) == _message(
            theirs[1]), where
    elif isinstance(theirs[1], torch.Tensor):
        assert_same(ours[1], theirs[1])
    else:
        assert ours[1] == theirs[1], where
    return False


def _assert_same_sides(ours: Side, theirs: Side, where: str) -> None:
    assert ours.scaler.get_scale() == theirs.scaler.get_scale(), where
    assert ours.scaler._get_growth_tracker() == theirs.scaler._get_growth_tracker(), where
    for i, (p, q) in enumerate(zip(ours.params, theirs.params)):
        assert_same(p.detach(), q.detach())
        if q.grad is None and ours.buckets is not None and p.grad is not None:
            # GradBuckets: a parameter that received no gradient since buckets.zero_() has a
            # zero view, which becomes None before the step (docs/buckets.md)
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
    _run(rng, setup, seed, Side(setup, seed, backend), Side(setup, seed, None))


@pytest.mark.parametrize("seed", seeds(20))
def test_random_call_sequence_with_a_disabled_scaler_matches_torch(backend, seed):
    """``enabled=False`` on both sides: every call is torch's no-op or pass-through, and
    GradBuckets still give grad None where no gradient came."""
    rng = random.Random(seed)
    setup = _draw_setup(rng)
    setup["scaler"]["enabled"] = False
    _run(rng, setup, seed, Side(setup, seed, backend), Side(setup, seed, None))


@pytest.mark.parametrize("seed", seeds(20))
def test_random_call_sequence_with_more_grad_changes_matches_torch(backend, seed):
    """Grads also changed in place, through ``.data`` / ``set_`` (a GradBucket view object
    over other memory) and by ops (``_random_calls.MORE_GRAD_CHANGES``); every third
    parameter float64 (in its own bucket when drawn); more optimizer kinds, fused ones too."""
    rng = random.Random(seed)
    setup = _draw_setup(rng)
    setup["more_grad_changes"] = True
    setup["params"] = [(shape, torch.float64 if i % 3 == 2 else dtype, transposed)
                       for i, (shape, dtype, transposed) in enumerate(setup["params"])]
    setup["optimizers"] = [(rng.choice(list(OPTIMIZERS)), cut) for _, cut in setup["optimizers"]]
    _run(rng, setup, seed, Side(setup, seed, backend), Side(setup, seed, None))


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
    _run(rng, setup, seed, Side(setup, seed, "triton", device=device),
         Side(setup, seed, "reference", buckets=False, device=device))


@pytest.mark.parametrize("seed", SEEDS)
def test_random_call_sequence_on_cuda_matches_torch(cuda, seed):
    """The Triton kernels compiled for the GPU against torch's CUDA scaler (a GPU run)."""
    rng = random.Random(seed)
    setup = _draw_setup(rng, bf16=False)
    _run(rng, setup, seed, Side(setup, seed, "triton", device="cuda"),
         Side(setup, seed, None, device="cuda"))


def _run(rng: random.Random, setup: dict, seed: int, ours: Side, theirs: Side) -> None:
    gen = torch.Generator().manual_seed(seed)
    for n in range(CALLS):
        call, args = draw_call(rng, setup, gen)
        if call is change_grad and theirs.params[args[0]].grad is None:
            continue  # (GradBuckets: ours may hold a zero view where torch holds None)
        where = f"call {n}: {call.__name__}{tuple(a if not isinstance(a, list) else '…' for a in args)}"
        if _assert_same_outcome(_outcome(call, ours, args), _outcome(call, theirs, args),
                                where):
            return  # torch's failed step left half-made optimizer state: not comparable
        try:
            _assert_same_sides(ours, theirs, where)
        except AssertionError as error:
            raise AssertionError(f"after {where}: {error}") from error
