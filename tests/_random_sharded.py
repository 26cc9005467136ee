"""Worker of test_random_sharded.py: one rank of a 2-process gloo group that runs the random
call sequences of test_random_sequences.py with ``triton_scaler.ShardedGradScaler`` on one
side and torch's ``ShardedGradScaler`` on the other. Both ranks draw the same calls; rank 1's
backward has an inf weight in every third call, so the ranks' own checks disagree and only the
group's agreement makes them skip together, as torch's do. With the Triton kernels (under the
interpreter) also both sides ours, with triton_scaler's own settings drawn: the kernels
against the reference path."""

import functools
import os

import torch
import torch.distributed as dist
from _spawn import init_group


def run_random_sharded(rank, world_size, store_file, seeds, out_dir):
    init_group(rank, world_size, store_file)
    try:
        planted, failures = _patch_for_sharded(rank), []
        import test_random_sequences as sequences

        backends = ["reference"] + (["triton"] if os.environ.get("TRITON_INTERPRET") == "1"
                                    else [])
        cases = [(f"{backend} against torch",
                  functools.partial(sequences.test_random_call_sequence_matches_torch, backend))
                 for backend in backends]
        if "triton" in backends:  # the extensions drawn too: the kernels against the reference
            extensions = sequences.test_random_call_sequence_with_extensions_triton_matches_reference
            cases.append(("extensions, triton against reference",
                          lambda seed: extensions(seed, "cpu")))
        for seed in seeds:
            for name, case in cases:
                try:
                    case(seed)
                except Exception as error:  # noqa: BLE001 (reported per seed by the test)
                    failures.append(f"seed {seed}, {name}: {error!r}"[:600])
                dist.barrier()
        torch.save({"failures": failures, "planted": planted[0]},
                   os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()  # gloo's teardown can abort a rank that destroys the group early
    finally:
        dist.destroy_process_group()


def _patch_for_sharded(rank: int) -> list[int]:
    """Point the random sequences at the sharded scalers (this process only) where torch's
    is exact: its CPU scale follows a Python rule, exact for power-of-two factors and scales
    below 2**128; its (1,)-shaped found_inf fails in a CPU fused AdamW's step (a foreach one
    instead); ours needs ``sharded=`` to clip with a group (torch's clip instead)."""
    import _random_calls as calls
    import test_random_sequences as sequences
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as TorchSharded

    import triton_scaler

    def new_scaler(side):
        if side.ours:
            return triton_scaler.ShardedGradScaler(side.device, **side.settings,
                                                   backend=side.backend)
        return TorchSharded(side.device, **side.settings)

    calls.Side.new_scaler = new_scaler
    calls.OPTIMIZERS["adamw_fused"] = lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True)
    draw_setup, draw_call, planted = sequences._draw_setup, sequences.draw_call, [0]

    def exact_setup(rng, bf16=True):
        setup = draw_setup(rng, bf16)
        scaler = setup["scaler"]
        scaler["growth_factor"] = {1.5: 4.0, 3.0: 2.0}.get(scaler["growth_factor"],
                                                          scaler["growth_factor"])
        scaler["backoff_factor"] = {0.7: 0.5}.get(scaler["backoff_factor"],
                                                  scaler["backoff_factor"])
        scaler["init_scale"] = min(scaler["init_scale"], 2.0**16)
        return setup

    backwards = [0]

    def sharded_call(rng, setup, gen):
        call, args = draw_call(rng, setup, gen)  # (no draw of its own: the ranks stay in step)
        if call is calls._set_factor and args == ("growth_factor", 1.5):
            args = ("growth_factor", 2.0)
        elif call is calls._unscale_and_clip:
            args = (args[0], False)
        elif call is calls._backward and rank == 1:
            backwards[0] += 1
            if backwards[0] % 3 == 0:  # both sides of rank 1 get the same loss
                (i, weight), *rest = args[0]
                args = ([(i, torch.full_like(weight, float("inf"))), *rest], args[1])
                planted[0] += weight.numel() > 0
        return call, args

    sequences._draw_setup, sequences.draw_call = exact_setup, sharded_call
    return planted
