#!/usr/bin/env bash
# All CPU benchmarks in one command (reference backend against torch's CPU ops).
set -euo pipefail
cd "$(dirname "$0")/.."
TRITON_SCALER_BENCH_SIZES=full python -m pytest benchmarks -q -p no:cacheprovider \
    --benchmark-enable --benchmark-json=benchmarks/results/cpu.json
python benchmarks/plot.py benchmarks/results/cpu.json --label cpu
python -m triton_scaler bench | tee benchmarks/results/cpu_bench.txt
