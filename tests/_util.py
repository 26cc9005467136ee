"""Exact comparison helpers shared by the tests, a counter of host-data uploads, CUDA's sync
debug mode as a context and torch's fake process group (meshes in one process)."""

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_INT_OF = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16,
           torch.float64: torch.int64}


#: torch's error for the inf norm of an empty grad ("infinity norm" from 2.11 on, "inf norm" before)
TORCHS_EMPTY_INF_NORM_ERROR = r"inf(inity)? norm on an empty tensor"


def unscaled_stats(grad: torch.Tensor, inv: torch.Tensor) -> tuple[float, float, int, int]:
    """torch's numbers of ``grad * inv``, what a watch reports of a gradient: its largest
    magnitude (0.0 when empty), its L2 norm (in float64), its inf and NaN counts."""
    unscaled = grad * inv
    return (unscaled.abs().max().item() if unscaled.numel() else 0.0,
            torch.linalg.vector_norm(unscaled.double()).item(),
            int(torch.isinf(unscaled).sum()), int(torch.isnan(unscaled).sum()))


def assert_same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Bit-for-bit equality, except that any NaN equals any NaN (payloads may differ)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if not actual.is_floating_point():
        assert torch.equal(actual, expected), f"{actual} != {expected}"
        return
    nan_a, nan_e = actual.isnan(), expected.isnan()
    assert torch.equal(nan_a, nan_e), "NaN positions differ"
    bits_a = actual.contiguous().view(_INT_OF[actual.dtype])[~nan_a]
    bits_e = expected.contiguous().view(_INT_OF[expected.dtype])[~nan_e]
    if not torch.equal(bits_a, bits_e):
        diff = (bits_a != bits_e).nonzero()[:5].flatten().tolist()
        raise AssertionError(f"values differ at (non-NaN) positions {diff}: "
                             f"{actual[~nan_a][diff].tolist()} vs {expected[~nan_e][diff].tolist()}")


def assert_all_same(actual, expected) -> None:
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        assert_same(a, e)


def step_by_route(scaler, optimizer, route: str) -> None:
    """``scaler.step(optimizer)`` and ``update()``, with ``unscale_`` or ``clip_grad_norm_``
    (max_norm 1.0) first when ``route`` names it (any other route: step alone)."""
    if route == "unscale_":
        scaler.unscale_(optimizer)
    elif route == "clip_grad_norm_":
        scaler.clip_grad_norm_(optimizer, 1.0)
    scaler.step(optimizer)
    scaler.update()


def view_in(memory: torch.Tensor, shape: tuple[int, ...], layout: str) -> torch.Tensor:
    """A tensor of ``shape`` at the start of 1-D ``memory``: ``contiguous``, ``channels_last``
    (4-D; 2-D: transposed; else contiguous), or ``gapped`` / ``gapped_channels_last`` (the
    same over every other element of ``memory``)."""
    numel = torch.Size(shape).numel()
    if layout == "contiguous":
        return memory[:numel].view(shape)
    step = 2 if layout.startswith("gapped") else 1
    flat = memory[:numel * step:step]
    if layout.endswith("channels_last") and len(shape) == 4:
        n, c, h, w = shape
        return flat.view(n * h * w, c).view(n, h, w, c).permute(0, 3, 1, 2)
    if layout.endswith("channels_last") and len(shape) == 2:
        return flat.view(shape[::-1]).t()
    return flat.view(shape)


class _Uploads(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten.lift_fresh.default
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def count_uploads():
    """Counts tensors made from Python data (``torch.tensor(x)``, ``torch.as_tensor(x)``:
    ``aten.lift_fresh``) while open: on CUDA each is a host-to-device copy, which
    synchronises. ``.count`` on the yielded object."""
    with _Uploads() as counter:
        yield counter


@contextlib.contextmanager
def sync_errors(device: torch.device):
    """On a CUDA ``device``: work queued so far finished, then CUDA's sync debug mode "error"
    while open (any host synchronisation raises), "default" after. Elsewhere: nothing."""
    if device.type != "cuda":
        yield
        return
    torch.cuda.synchronize(device)
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


@contextlib.contextmanager
def fake_process_group(world_size: int):
    """torch's fake process group of ``world_size`` ranks (rank 0; every collective a no-op),
    destroyed after: DTensors on CPU meshes in one process. Skips when the fake group is
    missing or a group is already initialised."""
    import pytest

    dist = pytest.importorskip("torch.distributed")
    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def graphs_compiled() -> int:
    """How many graphs dynamo has compiled in this process: unchanged between two points,
    nothing was compiled or recompiled in between (torch 2.8 to 2.13 alike)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]
