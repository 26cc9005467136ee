"""Run by test_compat_deepspeed.py in its own process (DeepSpeed sets up a process group and
its accelerator for the whole process): a few ZeRO steps of DeepSpeed's own engine on the CPU,
with DeepSpeed's loss scaler or, in its place, triton_scaler.compat.deepspeed's.

Usage: python _deepspeed_engine.py OUT_DIR ZERO_STAGE deepspeed|reference|triton
Overflows at fixed steps, ``optimizer.loss_scale = 64`` at step 7 (ZeRO's setter) and a
checkpoint saved and loaded into a new engine at step 12; saves the scales, the host reads
per step (``count_host_syncs``) and the parameters to OUT_DIR/result.pt."""

import math
import os
import sys
import warnings

import torch
import torch.distributed as dist

OVERFLOW_STEPS = (2, 3, 4, 10, 15)


def main(out: str, stage: int, scaler: str) -> None:
    warnings.filterwarnings("ignore")
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.zero import stage3, stage_1_and_2

    accelerator = get_accelerator()  # DeepSpeed's CPU accelerator refuses fp16 on its own
    accelerator.is_fp16_supported = lambda: True
    accelerator.supported_dtypes = lambda: [torch.float, torch.half, torch.bfloat16]
    if scaler != "deepspeed":
        from triton_scaler.compat import deepspeed as compat

        def create(**kwargs):
            return compat.CreateLossScaler(**kwargs, device="cpu", backend=scaler)
        for module in (stage_1_and_2, stage3):
            module.CreateLossScaler = create
    os.environ.update(LOCAL_RANK="0", RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=0, world_size=1)
    config = {"train_batch_size": 4, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
              "fp16": {"enabled": True, "initial_scale_power": 10, "loss_scale_window": 3,
                       "hysteresis": 2, "min_loss_scale": 1},
              "zero_optimization": {"stage": stage}}

    def new_engine():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(9, 13), torch.nn.Tanh(),
                                    torch.nn.Linear(13, 3))
        engine, optimizer, _, _ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=config)
        return engine, optimizer

    engine, optimizer = new_engine()
    scaler_types = {type(optimizer.loss_scaler).__module__}
    from triton_scaler.diagnostics import count_host_syncs

    gen = torch.Generator().manual_seed(1)
    scales, syncs = [], []
    for step in range(20):
        if step == 12:
            engine.save_checkpoint(f"{out}/checkpoint")
            engine, optimizer = new_engine()
            engine.load_checkpoint(f"{out}/checkpoint")
            scaler_types.add(type(optimizer.loss_scaler).__module__)
        if step == 7:
            optimizer.loss_scale = 64.0
        with count_host_syncs() as counter:  # DeepSpeed's own reads included
            loss = engine(torch.randn(4, 9, generator=gen).half()).float().square().mean()
            engine.backward(loss * (math.inf if step in OVERFLOW_STEPS else 1.0))
            engine.step()
        syncs.append(counter.count)
        scales.append(float(optimizer.cur_scale))
    torch.save({"scales": scales, "syncs": syncs, "scaler_types": sorted(scaler_types),
                "params": [p.detach().clone() for p in engine.module.parameters()]},
               f"{out}/result.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
