#!/usr/bin/env bash
# Every GPU test and figure in one command on a bare GPU machine (torch, triton, pytest, pytest-benchmark; no
# network). Usage:
#   bash benchmarks/gpu_all.sh [all|PART[,PART...]] [OUT_DIR]
#     tests   the GPU tests and the reference tests (tests/run_gpu.sh's first pass; junit XML)
#     launcher the kernel tests again through Triton's kernel[grid] (run_gpu.sh's second
#             pass; the first runs with kernels.launcher.DIRECT, the default, on)
#     bench   benchmarks/gpu_figures.py: the GPU figures (figures.json / figures.md)
#     profile benchmarks/gpu_profile.py: device against wall time where a figure misses,
#             benchmarks/_host_wait.py: a step's host time by call, its host read apart, and
#             benchmarks/_step_timeline.py: one step's ops, CUDA calls and kernels
#     suite   the pytest-benchmark suites (benchmarks/test_bench_*.py) at full sizes
#             (suite.json, for benchmarks/plot.py; 67 s on an H200)
#     compiled benchmarks/compiled_step.py: a small transformer's full step, torch's scaler
#             against ours compiled and under mode="reduce-overhead" (compiled.log)
#     watch   benchmarks/test_watch_cost.py at 1e8 elements: unscale_ (fp16: the fused
#             route's check) with scaler.watch against without (watch.json, ratios in
#             summary.txt)
#     all     tests, launcher, bench, profile, suite, watch, then compiled (default): about 390 s on
#             the H200 without compiled (317 s without the suite)
# Everything goes under OUT_DIR (default: $OUT when set, else benchmarks/results/gpu; on a machine
# that hands back only a few files, give a folder under /tmp and archive it), with
# summary.txt: device, versions, date and each part's outcome (failed tests listed). Each part
# has a time limit (a part cut there keeps its failures so far, counts and junit XML) and a
# failing part does not stop the next, so a part can be re-run alone. Plots need matplotlib:
# draw them where it is installed, from the fetched JSON (python benchmarks/gpu_figures.py
# --plot OUT_DIR; python benchmarks/plot.py OUT_DIR/suite.json --label gpu).
set -uo pipefail
cd "$(dirname "$0")/.."
part=${1:-all}
[[ $part == all ]] && part=tests,launcher,bench,profile,suite,watch,compiled
wants() { [[ ,$part, == *,$1,* ]]; }
out=${2:-${OUT:-benchmarks/results/gpu}}
mkdir -p "$out"
summary="$out/summary.txt"
unset TRITON_INTERPRET

install() {
  pip install --no-deps --no-build-isolation -e . > "$out/install.log" 2>&1
  # from the repository root, ./triton_scaler shadows an editable install, and the GPU image's
  # setuptools then found no triton_scaler.kernels (2026-11-26); and with no build backend the
  # install fails: either way the source tree itself on PYTHONPATH, with kernels/ linked where
  # the installed package has it (triton_scaler/kernels, git-ignored)
  # the check runs from / : from the root, ./triton_scaler (with a kernels link left by an earlier
  # call on a warm machine) imports, but a script run from benchmarks/ does not find it
  if ! (cd / && python -c "import triton_scaler.kernels") 2> /dev/null; then
    ln -sfn ../kernels triton_scaler/kernels
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    echo "triton_scaler.kernels not importable after pip install (install.log): the source" \
      "tree on PYTHONPATH" | tee -a "$summary"
  fi
}

header() {
  python - <<'EOF' | tee -a "$summary"
import platform, time
import torch, triton
print("==", time.strftime("%Y-%m-%d %H:%M:%S %Z"))
print("device:", torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA",
      "| torch", torch.__version__, "(CUDA", str(torch.version.cuda) + ")",
      "| triton", triton.__version__, "| python", platform.python_version())
EOF
}

source benchmarks/_run_part.sh  # run_part NAME SECONDS COMMAND...

install
header
python -c "import triton_scaler.kernels" || { echo "triton_scaler does not import" | tee -a "$summary"; exit 1; }
export TRITON_SCALER_GPU_TESTS=1
# pytest-xdist where installed (the GPU image has it): 8 workers of 2 threads each, 80 s for the
# whole suite on the H200 machine; with 16 threads each they had 99.7% of it done at 230 s
workers=()
if python -c "import xdist" 2> /dev/null; then
  workers=(-n 8)
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
fi
if wants tests; then
  run_part tests 270 python -m pytest -q -rfEs -p no:cacheprovider ${workers[@]+"${workers[@]}"} \
    tests --junitxml="$out/tests.xml"
fi
if wants launcher; then
  run_part launcher 60 python -m pytest -q -rfEs -p no:cacheprovider ${workers[@]+"${workers[@]}"} \
    --triton-launch tests/test_gpu.py tests/test_ops_unscale.py tests/test_ops_update.py \
    tests/test_buckets.py tests/test_launch_count.py tests/test_plan_reuse.py \
    --junitxml="$out/launcher.xml"
fi
if wants bench; then
  run_part bench 120 python benchmarks/gpu_figures.py --out "$out"
  if [[ -f $out/figures.json ]] && python -c "import matplotlib" 2> /dev/null; then
    python benchmarks/gpu_figures.py --plot "$out" > "$out/plot.log" 2>&1  # gpu_flat.png
  fi
  [[ -f $out/figures.md ]] && cat "$out/figures.md" >> "$summary"
fi
if wants profile; then
  run_part profile 60 python benchmarks/gpu_profile.py --out "$out"
  # where a plain step's host time goes: its four calls and its one host read
  run_part host_wait 90 python benchmarks/_host_wait.py --device cuda 10 1000 10000
  grep "^|" "$out/host_wait.log" >> "$summary"
  # the same 10,000 parameters of ~16 elements: the bucket's kernel (~330 MB at ~4k) then
  # takes a few us, so what the plain GradBuckets row keeps is host work, not a wait for it
  run_part host_wait_small 60 python benchmarks/_host_wait.py --device cuda --numel 16 10000
  grep "^|" "$out/host_wait_small.log" >> "$summary"
  # and inside one step, from torch.profiler: its ops, CUDA calls and kernels (the
  # plain GradBuckets row at 10,000 parameters, against 1,000, 10 and the fused route)
  run_part timeline 120 bash -c 'for run in "10000 plain" "1000 plain" "10 plain" "10000 fused"; do
      set -- $run
      python benchmarks/_step_timeline.py --device cuda "$1" "ours, $2, GradBuckets" \
        --min-us 2 || exit 1
    done'
fi
if wants suite; then
  # the benchmarks alone: benchmarks/test_gpu_all.py and the other script tests are CI's
  run_part suite 150 env TRITON_SCALER_BENCH_SIZES=full python -m pytest -q \
    -p no:cacheprovider benchmarks/test_bench_*.py --benchmark-enable \
    --benchmark-json="$out/suite.json"
fi
if wants watch; then
  run_part watch 90 env TRITON_SCALER_BENCH_SIZES=full python -m pytest -q \
    -p no:cacheprovider benchmarks/test_watch_cost.py --benchmark-enable \
    --benchmark-json="$out/watch.json"
  python benchmarks/watch_cost.py "$out/watch.json" >> "$summary"
fi
if wants compiled; then
  run_part compiled 180 python benchmarks/compiled_step.py
  grep "^|\|^full training step" "$out/compiled.log" >> "$summary"
fi
echo "everything is under $out"
