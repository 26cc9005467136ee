"""The gradients :class:`triton_scaler.GradScaler` works on, grouped as torch groups them."""

from __future__ import annotations

from collections import defaultdict

import torch

from . import ops
from ._backend import resolve_backend
from ._distributed import local_grad
from .buckets import buckets_of


def grad_groups(optimizer: torch.optim.Optimizer, allow_fp16: bool, backend: str):
    """``([(device, grads of one dtype)], mesh groups by device)``: each gradient bucket's
    buffer as its own group, then the other grads grouped by (device, dtype) as torch.
    DTensor grads (FSDP2) are their local shards; their mesh is returned for agreement."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    float_dtypes = ops.FLOAT_DTYPES
    fp16, plain = torch.float16, torch.Tensor
    mesh_groups: dict[torch.device, tuple] = {}
    flat = []
    covered: frozenset[int] = frozenset()
    for bucket in buckets_of(optimizer):
        if bucket.dtype == fp16 and not allow_fp16:
            raise ValueError("Attempting to unscale FP16 gradients.")
        attached = bucket.attach_grads()
        covered = attached if not covered else covered | attached
        flat.append((bucket.device, [bucket.buffer]))
    for group in optimizer.param_groups:
        for param in group["params"]:
            grad = param.grad
            if grad is None or (covered and id(param) in covered):
                continue
            if type(grad) is not plain:  # DTensor (FSDP2): its local shard
                grad, on_mesh = local_grad(grad, resolve_backend(backend, grad.device))
                if on_mesh:
                    mesh_groups.setdefault(grad.device, on_mesh)
            dtype = grad.dtype
            if dtype == fp16 and not allow_fp16:
                raise ValueError("Attempting to unscale FP16 gradients.")
            if grad.is_sparse:
                if dtype is fp16:
                    param.grad = grad = grad.coalesce()
                grad = grad._values()
            groups[grad.device, dtype].append(grad)
    for (device, dtype), grads in groups.items():
        if dtype not in float_dtypes:
            ops.check_grad_dtype(f"a gradient on {device}", dtype)
        flat.append((device, grads))
    return flat, mesh_groups
