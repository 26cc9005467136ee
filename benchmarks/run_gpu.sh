#!/usr/bin/env bash
# All GPU benchmarks in one command: full sizes, Triton kernels against torch's CUDA ops,
# saved as JSON and turned into tables and plots. Usage: bash benchmarks/run_gpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'"
label=${1:-gpu}
unset TRITON_INTERPRET
TRITON_SCALER_BENCH_SIZES=full python -m pytest benchmarks -q -p no:cacheprovider \
    --benchmark-enable --benchmark-json="benchmarks/results/${label}.json"
python benchmarks/plot.py "benchmarks/results/${label}.json" --label "$label"
python -m triton_scaler bench | tee "benchmarks/results/${label}_bench.txt"
python -c "import torch, triton; print('device', torch.cuda.get_device_name(), 'torch', torch.__version__, 'triton', triton.__version__)" \
    | tee -a "benchmarks/results/${label}_bench.txt"
