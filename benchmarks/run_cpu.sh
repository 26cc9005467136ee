#!/usr/bin/env bash
# All CPU benchmarks in one command (reference backend against torch's CPU ops), at full sizes.
# Usage:
#   bash benchmarks/run_cpu.sh [OUT_DIR]     figures under OUT_DIR (default: a new folder in /tmp)
#   bash benchmarks/run_cpu.sh --update      figures into benchmarks/results (tracked files)
# Writes cpu.json (pytest-benchmark), cpu_tables.md, the plots (with matplotlib) and
# cpu_bench.txt (python -m triton_scaler bench). Takes about 3 minutes on a 2-core VM.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ ${1:-} == --update ]]; then out=benchmarks/results; else out=${1:-$(mktemp -d /tmp/cpu_bench.XXXX)}; fi
mkdir -p "$out"
start=$SECONDS
TRITON_SCALER_BENCH_SIZES=full python -m pytest benchmarks -q -p no:cacheprovider \
    --benchmark-enable --benchmark-json="$out/cpu.json"
python benchmarks/plot.py "$out/cpu.json" --label cpu
python -m triton_scaler bench | tee "$out/cpu_bench.txt"
echo "run_cpu.sh: figures in $out ($((SECONDS - start)) s)"
