"""A small GPT-2-style transformer's full training step with dynamic loss scaling, in four
arrangements timed in one run:

* ``torch eager``: eager model, ``torch.amp.GradScaler``, fused AdamW;
* ``torch best``: the model compiled, torch's scaler eager (dynamo skips torch.amp);
* ``ours compiled``: the model compiled and triton_scaler's calls compiled (``scale`` with
  ``fullgraph=True``; clip, step and update in one compiled function);
* ``ours reduce-overhead``: the same with ``mode="reduce-overhead"`` (CUDA graph trees; CUDA
  only).

Each step is ``forward -> loss -> scale -> backward -> clip -> step -> update -> zero_grad``,
fp16 autocast on CUDA, bf16 on the CPU, a fused AdamW. Reported per arrangement: the median
step time, its ratio to ``torch best``, the graphs and graph breaks that
``torch._dynamo.explain`` finds when the whole step is compiled with that scaler, and the
host reads per step (``Tensor.item`` and the like; the optimizer's own excluded)::

    python benchmarks/compiled_step.py                 # CPU (inductor) or CUDA, default sizes
    python benchmarks/compiled_step.py --layers 2 --steps 3 --smoke   # plumbing check
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

from triton_scaler import GradScaler
from triton_scaler.diagnostics import count_host_syncs, optimizer_step_uncounted


class Block(torch.nn.Module):
    """A GPT-2 block: pre-norm causal self-attention and a 4x GELU MLP."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(),
                                       torch.nn.Linear(4 * d, d))
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        y = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class GPT(torch.nn.Module):
    def __init__(self, vocab: int, seq: int, d: int, layers: int, heads: int) -> None:
        super().__init__()
        self.tok, self.pos = torch.nn.Embedding(vocab, d), torch.nn.Embedding(seq, d)
        self.blocks = torch.nn.Sequential(*(Block(d, heads) for _ in range(layers)))
        self.ln = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        return self.head(self.ln(self.blocks(self.tok(idx) + self.pos(positions))))


ARRANGEMENTS = ("torch eager", "torch best", "ours compiled", "ours reduce-overhead")


def make_step(arrangement: str, args: argparse.Namespace, device: torch.device):
    """The model, and one training step of ``arrangement`` as a function of a batch."""
    torch.manual_seed(0)
    model = GPT(args.vocab, args.seq, args.d, args.layers, args.heads).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
    mode = "reduce-overhead" if arrangement == "ours reduce-overhead" else None
    forward = model if arrangement == "torch eager" else torch.compile(model, mode=mode)
    ours = arrangement.startswith("ours")
    scaler = (GradScaler if ours else torch.amp.GradScaler)(device.type)

    def post_torch() -> None:
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()

    def post_ours() -> None:
        scaler.clip_grad_norm_(opt, 1.0)
        scaler.step(opt)
        scaler.update()

    scale = scaler.scale
    post = post_torch
    if ours:
        scale = torch.compile(scaler.scale, fullgraph=True, mode=mode)
        post = torch.compile(post_ours, mode=mode)

    def arranged(forward, scale, post):
        def step(idx: torch.Tensor, target: torch.Tensor, overflow: bool = False) -> None:
            with torch.autocast(device.type, dtype=dtype):
                logits = forward(idx)
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1),
                                                     target.flatten())
            scale(loss * (math.inf if overflow else 1.0)).backward()
            post()
            opt.zero_grad(set_to_none=True)
        return step

    # the step as timed, and the same step with nothing compiled in it (what
    # torch._dynamo.explain is given: the graphs and breaks of compiling it whole)
    plain = arranged(model, scaler.scale, post_ours if ours else post_torch)
    return model, opt, scaler, arranged(forward, scale, post), plain


def measure(arrangement: str, args: argparse.Namespace, device: torch.device) -> dict:
    """Step time, host syncs per step and (for the compiled arrangements) what
    ``torch._dynamo.explain`` finds in the whole step."""
    torch._dynamo.reset()
    model, opt, scaler, step, plain = make_step(arrangement, args, device)
    gen = torch.Generator(device=device).manual_seed(1)
    batch = [torch.randint(args.vocab, (args.batch, args.seq), device=device, generator=gen)
             for _ in range(2)]
    times = []
    # counted from the start, so that the compiled code is specialised with the counters in
    # place (patching them later would recompile it inside the timed steps)
    with count_host_syncs() as counter, optimizer_step_uncounted(opt, counter):
        for i in range(args.warm_up):  # compilation, and one skipped step (an overflow)
            step(*batch, overflow=i == 1)
        counter.count = 0
        for _ in range(args.steps):
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            step(*batch)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        syncs = counter.count
    explanation = None
    if arrangement in ("torch best", "ours compiled"):
        torch._dynamo.reset()
        explanation = torch._dynamo.explain(plain)(*batch)
    return {"ms": 1e3 * statistics.median(times), "syncs": syncs / args.steps,
            "graphs": explanation.graph_count if explanation else None,
            "breaks": explanation.graph_break_count if explanation else None,
            "params": sum(p.numel() for p in model.parameters()), "scale": scaler.get_scale()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--d", type=int, default=384)
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--warm-up", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (a plumbing check)")
    args = parser.parse_args()
    if args.smoke:
        args.layers, args.d, args.heads, args.vocab, args.seq, args.batch = 1, 32, 2, 64, 8, 2
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    arrangements = [a for a in ARRANGEMENTS
                    if device.type == "cuda" or a != "ours reduce-overhead"]
    rows = {a: measure(a, args, device) for a in arrangements}
    params = next(iter(rows.values()))["params"]
    print(f"full training step, {params / 1e6:.1f}M parameters ({args.layers} layers, d "
          f"{args.d}, seq {args.seq}, batch {args.batch}), {device}, torch {torch.__version__}, "
          f"median of {args.steps} steps; {torch.get_num_threads()} CPU threads")
    print("| arrangement | step ms | torch best / this | graphs | graph breaks | host syncs "
          "/ step |\n|---|---|---|---|---|---|")
    best = rows["torch best"]["ms"]
    for name, row in rows.items():
        graphs = "" if row["graphs"] is None else row["graphs"]
        breaks = "" if row["breaks"] is None else row["breaks"]
        print(f"| {name} | {row['ms']:.2f} | {best / row['ms']:.2f} | {graphs} | {breaks} | "
              f"{row['syncs']:.0f} |")
    scales = {row["scale"] for row in rows.values()}
    if len(scales) != 1:
        raise SystemExit(f"the arrangements' scales differ: {scales}")


if __name__ == "__main__":
    main()
