#!/usr/bin/env bash
# The whole test suite on a CUDA machine in one command: the Triton kernels compiled for the
# GPU (no interpreter), the GPU-only tests (tests/test_gpu.py, CUDA graphs, sync debug mode),
# and the CPU reference tests; then the tests that launch kernels again through Triton's
# kernel[grid] (kernels/launcher.py's DIRECT off). Usage: bash tests/run_gpu.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'"
export TRITON_SCALER_GPU_TESTS=1
status=0
python -m pytest -q -rfEs tests "$@" || status=$?
again=()  # the same pytest args but the junit report (the first run's)
for arg in "$@"; do [[ $arg == --junitxml=* ]] || again+=("$arg"); done
python -m pytest -q -rfEs tests/test_gpu.py tests/test_ops_unscale.py tests/test_ops_update.py \
  tests/test_buckets.py tests/test_launch_count.py tests/test_plan_reuse.py --triton-launch ${again[@]+"${again[@]}"} \
  || status=$?
exit $status
