"""The cases of ``benchmarks/gpu_figures.py``: what is timed, over which data, and how many
bytes each implementation moves. Cases are generated one at a time, so that each frees its
tensors (a 1e9-element bucket and its copy take 8 GB) before the next allocates."""

from __future__ import annotations

import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from triton_scaler import GradBuckets, GradScaler, ops

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass
class Case:
    section: str
    name: str
    dtype: str
    elements: int
    tensors: int
    fns: dict[str, Callable[[], None]]
    nbytes: dict[str, int]
    notes: list[str] = field(default_factory=list)

    def bytes_of(self, impl: str) -> int:
        return self.nbytes[impl]


def gpt2_small_shapes() -> list[tuple[int, ...]]:
    """The parameter shapes of GPT-2 small (124M; 148 tensors, one of 50,257 rows)."""
    shapes: list[tuple[int, ...]] = [(50257, 768), (1024, 768)]
    for _ in range(12):
        shapes += [(768,), (768,), (768, 2304), (2304,), (768, 768), (768,),
                   (768,), (768,), (768, 3072), (3072,), (3072, 768), (768,)]
    return shapes + [(768,), (768,)]


def _sizes(kind: str, smoke: bool) -> list[int]:
    gen = torch.Generator().manual_seed(0)
    if kind.startswith("random"):
        n = int(kind.split()[1])
        return torch.randint(1, 65537, (n // 100 if smoke else n,), generator=gen).tolist()
    if kind == "gpt2-small shapes":
        sizes = [int(torch.Size(s).numel()) for s in gpt2_small_shapes()]
        return [max(1, s // 1000) for s in sizes] if smoke else sizes
    count, numel = (10, 64) if smoke else (1000, 4096)  # one odd tensor among aligned ones
    return [numel] * (count - 1) + [numel - 3]


def _count(n: int) -> str:
    """1e8 for 100000000, 1e8+3 for 100000003."""
    for extra in (0, 3):
        digits = str(n - extra)
        if digits.startswith("1") and set(digits[1:]) <= {"0"} and len(digits) > 3:
            return f"1e{len(digits) - 1}" + (f"+{extra}" if extra else "")
    return str(n)


def _fill(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(numel % 1000)
    return torch.randn(numel, device=device, generator=gen).to(dtype)


def kernel_cases(device: torch.device, smoke: bool) -> Iterator[Case]:
    backend = "triton" if device.type == "cuda" else "auto"
    found = torch.zeros((), device=device)
    one = torch.ones((), device=device)  # scale 1: repeated runs leave the grads unchanged

    def ours(grads):
        return lambda: ops.non_finite_check_and_unscale_(grads, found, one, backend=backend)

    def theirs(grads):
        return lambda: torch._amp_foreach_non_finite_check_and_unscale_(grads, found, one)

    flat = ([(10**3, "fp32"), (10**3 + 3, "fp32"), (10**3, "bf16")] if smoke else
            [(10**6, "fp32"), (10**7, "fp32"), (10**8, "fp32"), (10**8 + 3, "fp32"),
             (10**9, "fp32"), (10**8, "fp16"), (10**8, "bf16")])
    for numel, dtype in flat:
        g = _fill(numel, DTYPES[dtype], device)
        dst = torch.empty_like(g)
        nbytes = 2 * g.numel() * g.element_size()
        yield Case("flat", _count(numel) + (" (n % 16 != 0)" if numel % 16 else ""), dtype,
                   numel, 1, {"ours": ours([g]), "torch": theirs([g]),
                              "copy": lambda g=g, dst=dst: dst.copy_(g)},
                   {"ours": nbytes, "torch": nbytes, "copy": nbytes})
        del g, dst
    for kind in ("random 1000", "random 10000", "gpt2-small shapes", "aligned + one odd"):
        sizes = _sizes(kind, smoke)
        grads = [_fill(n, torch.float32, device) for n in sizes]
        bucket = _fill(sum(-(-n // 16) * 16 for n in sizes), torch.float32, device)
        nbytes = 2 * 4 * sum(sizes)
        yield Case("many", f"{kind} (1-64k)" if kind.startswith("random") else kind, "fp32",
                   sum(sizes), len(sizes), {"ours": ours(grads), "torch": theirs(grads),
                                            "ours_buckets": ours([bucket])},
                   {"ours": nbytes, "torch": nbytes, "ours_buckets": nbytes})
        del grads, bucket
    for kind in ("flat", "random 10000"):
        grads = ([_fill(10**3 if smoke else 10**8, torch.float32, device)] if kind == "flat"
                 else [_fill(n, torch.float32, device) for n in _sizes(kind, smoke)])
        total = 4 * sum(g.numel() for g in grads)
        yield Case("check", "1e8 bucket" if kind == "flat" else "random 10000 (1-64k)", "fp32",
                   total // 4, len(grads),
                   {"ours": lambda grads=grads: ops.non_finite_check_(grads, found, one,
                                                                      backend=backend),
                    "torch": theirs(grads)},
                   {"ours": total if device.type == "cuda" else 2 * total, "torch": 2 * total})
        del grads


class _Transformer(torch.nn.Module):
    """A GPT-like stack of torch's encoder layers: ~110M parameters at full size."""

    def __init__(self, vocab: int, width: int, layers: int, heads: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        layer = torch.nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0,
                                                 batch_first=True, norm_first=True)
        self.blocks = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(tokens)))


def train_rows(device: torch.device, smoke: bool) -> list[dict]:
    """Milliseconds and host syncs per training step, torch's scaler against ours (with and
    without GradBuckets); fused AdamW, fp16 autocast (bf16 on the CPU smoke run)."""
    rows = []
    for name in ("torch", "ours", "ours + GradBuckets"):
        rows.append(_train_row(name, device, smoke))
        print(rows[-1], flush=True)
    return rows


def _train_row(name: str, device: torch.device, smoke: bool) -> dict:
    step, params = train_step(name, device, smoke)
    for _ in range(2 if smoke else 5):
        step()
    times = []
    for _ in range(3 if smoke else 20):
        _sync(device)
        start = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - start)
    return {"section": "train", "case": name, "ms": statistics.median(times) * 1e3,
            "syncs": _syncs_in(step, device), "params": params}


def train_step(name: str, device: torch.device, smoke: bool) -> tuple[Callable[[], None], int]:
    """One training step of the ~110M-parameter transformer with scaler ``name`` (``torch``,
    ``ours``, ``ours + GradBuckets``), and its parameter count."""
    vocab, width, layers, heads, batch, seq = ((100, 32, 2, 4, 2, 16) if smoke else
                                               (16000, 768, 12, 12, 8, 512))
    half = torch.float16 if device.type == "cuda" else torch.bfloat16
    torch.manual_seed(0)
    model = _Transformer(vocab, width, layers, heads).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    buckets = GradBuckets(opt) if "Buckets" in name else None
    scaler = torch.amp.GradScaler(device.type) if name == "torch" else GradScaler(device.type)
    gen = torch.Generator(device=device).manual_seed(1)
    tokens = torch.randint(0, vocab, (batch, seq + 1), device=device, generator=gen)

    def step():
        with torch.autocast(device.type, dtype=half):
            logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1),
                                                 tokens[:, 1:].flatten())
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        if buckets is not None:
            buckets.zero_()
        else:
            opt.zero_grad()

    return step, sum(p.numel() for p in model.parameters())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _syncs_in(step: Callable[[], None], device: torch.device) -> int | None:
    """Host synchronisations in one call of ``step`` (CUDA's sync debug mode, as warnings)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)
