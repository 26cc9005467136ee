"""Worker of test_pipeline.py's recipe tests: one gloo rank runs a recipe of
docs/distributed.md as it is written (its ``train(rank, world_size)``) and saves its log."""

import os

import torch
import torch.distributed as dist
from _spawn import init_group


def run_recipe(rank, world_size, store_file, code, out_dir):
    init_group(rank, world_size, store_file)
    try:
        namespace: dict = {}
        exec(compile(code, "docs/distributed.md", "exec"), namespace)  # noqa: S102
        torch.save(namespace["train"](rank, world_size), os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()
