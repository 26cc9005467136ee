#!/usr/bin/env bash
# The whole test suite on a CUDA machine in one command: the Triton kernels compiled for the
# GPU (no interpreter), the GPU-only tests (tests/test_gpu.py, CUDA graphs, sync debug mode),
# and the CPU reference tests. Usage: bash tests/run_gpu.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'"
TRITON_SCALER_GPU_TESTS=1 python -m pytest -q -rs tests "$@"
