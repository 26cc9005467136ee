"""Worker of test_engines_features.py: one rank of a 2-process gloo group that trains under
each engine with triton_scaler's extension settings, torch's scaler (the parameters' oracle
while the same steps are skipped) and a disabled scaler (the oracle of a run that never
skips). Also the worker of test_engines.py's GradBuckets test (:func:`run_buckets`)."""

import math
import os

import torch
import torch.distributed as dist
from _engines import STEPS, _model, _scaler, _wrap, train
from _spawn import attempt, init_group

FEATURE_ENGINES = ("fsdp2", "fsdp2_fused", "ddp", "ddp_zero", "fsdp1")

#: name -> (our extension settings, step after which the scaler is checkpointed, or None)
FEATURES = {
    "hysteresis": (dict(hysteresis=2, min_scale=1.0), None),  # Megatron-core
    "consecutive_hysteresis": (dict(hysteresis=2, consecutive_hysteresis=True), None),
    "min_max_scale": (dict(min_scale=128.0, max_scale=512.0), None),  # apex
    "static": (dict(dynamic=False), None),
    "no_skip": (dict(skip_on_overflow=False), None),
    "raise_at_min_scale": (dict(min_scale=2.0**8, max_scale=2.0**8, raise_at_min_scale=True),
                           None),
    "checkpoint": ({}, 3),  # state_dict into a fresh scaler mid-run
    # the tracker at 1 when saved: the next overflow (step 5, before any growth) backs off
    "checkpoint_hysteresis": (dict(hysteresis=2, growth_interval=4), 2),
}


def run_features(rank, world_size, store_file, backend, out_dir):
    init_group(rank, world_size, store_file)
    try:
        results = {}
        for engine in FEATURE_ENGINES:
            feature_runs(results, engine, backend, rank)
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()  # gloo's teardown can abort a rank that destroys the group early
    finally:
        dist.destroy_process_group()


def feature_runs(results, engine, backend, rank):
    """``results[engine, name]``: torch's scaler, a disabled one, and ours with each feature."""
    runs = [("torch", "torch", {}, None), ("disabled", "disabled", {}, None)]
    runs += [(name, "ours", settings, at) for name, (settings, at) in FEATURES.items()]
    for name, kind, settings, checkpoint_at in runs:
        # overflows in a rank's own grad (only agreement skips the step); a run that steps
        # on overflows (no_skip, its oracle) overflows in the loss, which every engine spreads
        # over every parameter (a grad's inf may land in FSDP1's padding)
        injection = "loss" if name in ("no_skip", "disabled") else "grad"
        attempt(results, (engine, name), train, engine, kind, backend, injection, rank,
                settings, checkpoint_at)


def run_buckets(rank, world_size, store_file, backend, out_dir):
    """GradBuckets against the engines: refused for FSDP2's DTensor parameters and for DDP's
    own bucket views (with advice), exact with DDP(gradient_as_bucket_view=False), also with
    ZeRO-1 (ZeroRedundancyOptimizer)."""
    from triton_scaler import GradBuckets, GradScaler

    init_group(rank, world_size, store_file)
    results = {}
    try:
        fsdp2, (opt,) = _wrap("fsdp2", _model())
        try:
            GradBuckets(opt)
        except TypeError as error:
            results["fsdp2"] = str(error)
        ddp, (opt,) = _wrap("ddp_bucket_view", _model())
        GradBuckets(opt)
        scaler = GradScaler("cpu", backend=backend, process_group=dist.group.WORLD)
        scaler.scale(ddp(torch.ones(2, 8)).sum()).backward()
        try:
            scaler.step(opt)
        except RuntimeError as error:
            results["ddp_bucket_view"] = str(error)
        dist.barrier()
        for engine in ("ddp", "ddp_zero"):
            results[f"{engine}_buckets_equal"] = _buckets_match_torch(engine, backend, rank)
        results["ddp_unused"] = [_ddp_unused_branches(kind, backend, rank)
                                 for kind in ("torch", "ours")]
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _buckets_match_torch(engine, backend, rank):
    """Ours with GradBuckets against torch's scaler under DDP (``ddp_zero``: with ZeRO-1),
    rank 1 overflowing at step 3: equal final parameters and scale."""
    from triton_scaler import GradBuckets

    finals = []
    for kind in ("torch", "ours"):
        ddp, (opt,) = _wrap(engine, _model())
        buckets = GradBuckets(opt) if kind == "ours" else None
        scaler = _scaler(engine, kind, backend)
        gen = torch.Generator().manual_seed(rank + 1)
        for step in range(STEPS):
            loss = ddp(torch.randn(4, 8, generator=gen)).square().mean()
            scaler.scale(loss * (math.inf if rank == 1 and step == 3 else 1.0)).backward()
            scaler.step(opt)
            scaler.update()
            buckets.zero_() if buckets else opt.zero_grad()
        finals.append(([p.detach().clone() for p in ddp.parameters()], scaler.get_scale()))
    return finals[0][1] == finals[1][1] and all(
        torch.equal(a, b) for a, b in zip(finals[0][0], finals[1][0]))


class _Branches(torch.nn.Module):
    """A trunk and two branches: ``use`` picks the branches this forward runs. The trunk's
    ReLU gives the branches' weight gradients zero columns, so a reduced gradient written into
    a locally unused branch's view is found by any element, not all (it has some zeros)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.trunk, self.left, self.right = (torch.nn.Linear(4, 4) for _ in range(3))

    def forward(self, x, use):
        x = torch.relu(self.trunk(x))
        return sum((getattr(self, name)(x) for name in use), x)


def _ddp_unused_branches(kind, backend, rank):
    """DDP(find_unused_parameters=True) where the ranks use different branches: a parameter
    unused on this rank but used on the other gets DDP's reduced gradient in its grad (written,
    not accumulated) and is stepped; one unused on both keeps grad None. Per step: the scale,
    which grads are None, and the parameters; an inf on rank 1 at step 3."""
    from triton_scaler import GradBuckets

    model = torch.nn.parallel.DistributedDataParallel(_Branches(),
                                                      find_unused_parameters=True)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    buckets = GradBuckets(opt) if kind == "ours" else None
    scaler = _scaler("ddp", kind, backend)
    uses = ([("left",), ("left",), (), ("left", "right"), ()],  # rank 0
            [("right",), ("left",), ("left",), (), ()])  # rank 1: step 4 unused everywhere
    gen, records = torch.Generator().manual_seed(rank), []
    for step, use in enumerate(uses[rank]):
        buckets.zero_() if buckets else opt.zero_grad()
        loss = model(torch.randn(2, 4, generator=gen), use).sum()
        scaler.scale(loss * (math.inf if rank == 1 and step == 3 else 1.0)).backward()
        scaler.unscale_(opt)  # (and the step: two checks of the buckets per iteration)
        scaler.step(opt)
        scaler.update()
        records.append((scaler.get_scale(), [p.grad is None for p in model.parameters()],
                        [p.detach().clone() for p in model.parameters()]))
    return records
