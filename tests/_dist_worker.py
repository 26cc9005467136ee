"""Worker of test_distributed.py: one rank of a 2-process gloo group on loopback."""

import math
import os

import torch
import torch.distributed as dist
from _spawn import init_group


def run(rank, world_size, store_file, optimizer_name, backend, overflow_steps, out_dir,
        unscale_first=False, own_group=False):
    """``own_group``: each rank's scaler agrees over a group of its own rank only."""
    init_group(rank, world_size, store_file)
    groups = [dist.new_group([r]) for r in range(world_size)] if own_group else None
    all_reduce, all_reduces = dist.all_reduce, []

    def counted_all_reduce(*args, **kwargs):
        all_reduces.append(1)
        return all_reduce(*args, **kwargs)

    dist.all_reduce = counted_all_reduce
    try:
        from triton_scaler import GradScaler

        torch.manual_seed(0)
        model = torch.nn.Linear(6, 3)
        if optimizer_name == "adamw_fused":
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        else:
            opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
        scaler = GradScaler("cpu", init_scale=2.0**8, growth_interval=3, backend=backend,
                            process_group=groups[rank] if own_group else dist.group.WORLD)
        gen = torch.Generator().manual_seed(rank + 1)  # each rank its own shard of data
        skipped, scales, found = [], [], []
        for step in range(12):
            before = [p.detach().clone() for p in model.parameters()]
            state_before = {k: v.clone() if torch.is_tensor(v) else v
                            for s in opt.state.values() for k, v in s.items()}
            loss = model(torch.randn(4, 6, generator=gen)).square().mean()
            # rank 1 overflows; at the last overflow step both do (agreed by MAX: a SUM of
            # 2.0 is a found_inf that torch's fused optimizers do not skip on)
            if step in overflow_steps and (rank == 1 or step == overflow_steps[-1]):
                loss = loss * math.inf
            scaler.scale(loss).backward()
            if unscale_first:  # what an integrator's skip check reads right after unscale_
                scaler.unscale_(opt)
                found.append(sum(v.item() for v in scaler._found_inf_per_device(opt).values()))
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            unchanged = all(torch.equal(a, p.detach()) for a, p in zip(before, model.parameters()))
            if scaler.last_step_skipped.item():
                skipped.append(step)
                assert unchanged, "a skipped step changed the parameters"
                state_after = {k: v for s in opt.state.values() for k, v in s.items()}
                for k, v in state_before.items():
                    assert torch.equal(torch.as_tensor(v), torch.as_tensor(state_after[k])), k
            else:
                assert not unchanged or step == 0
            scales.append(scaler.get_scale())
        torch.save({"skipped": skipped, "scales": scales, "all_reduces": len(all_reduces),
                    "found_after_unscale": found},
                   os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()  # gloo's teardown can abort a rank that destroys the group early
    finally:
        dist.all_reduce = all_reduce
        dist.destroy_process_group()
