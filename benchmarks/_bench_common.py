"""Shared settings of the benchmark suites (see conftest.py)."""

import os

import torch

FULL = os.environ.get("TRITON_SCALER_BENCH_SIZES", "small") == "full"
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
