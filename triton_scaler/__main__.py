"""Command line: ``python -m triton_scaler demo [--steps N] [--threads T]`` or
``python -m triton_scaler bench``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m triton_scaler")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="mixed-precision training beside torch.amp.GradScaler")
    demo.add_argument("--steps", type=int, default=300)
    demo.add_argument("--threads", type=int, default=1,
                      help="torch's CPU threads while timing (default 1)")
    sub.add_parser("bench", help="quick microbenchmarks against torch's scaler ops")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from .demo import main as run_demo

        return run_demo(args.steps, args.threads)
    from .bench import main as run_bench

    return run_bench()


if __name__ == "__main__":
    sys.exit(main())
