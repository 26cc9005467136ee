"""gpu_all.sh's part runner on CPU: a GPU session is short, so a part that runs past its limit
must still leave which tests failed, the counts so far and its junit XML; and every pytest run
of the GPU scripts must list failed tests in its summary (an ``-r`` option keeps ``f`` and ``E``)."""

import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                                reason="needs bash and coreutils' timeout")

LIMIT_S = 10  # pytest's start and the two quick tests fit well inside it, also under load
# (in file order: the inner run blocks pytest-randomly, which would run the sleeper first)
_SLOW_SUITE = """
import time
def test_passes(): pass
def test_fails(): assert 1 == 2
def test_runs_past_the_limit(): time.sleep(120)
"""


def test_a_part_cut_at_its_limit_keeps_its_failures_counts_and_junit_xml(tmp_path):
    suite = tmp_path / "test_slow_suite.py"
    suite.write_text(_SLOW_SUITE)
    out = tmp_path / "out"
    out.mkdir()
    script = (f'out={out}; summary=$out/summary.txt; source benchmarks/_run_part.sh; '
              f'run_part demo {LIMIT_S} {sys.executable} -m pytest -q -rfEs -p no:cacheprovider '
              f'-p no:randomly {suite} '
              f'--junitxml=$out/demo.xml')
    start = time.monotonic()
    done = subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr  # a failing part does not stop the next
    assert time.monotonic() - start < LIMIT_S + 25  # cut at its limit, not after 120 s
    summary = (out / "summary.txt").read_text()
    assert re.search(rf"^\[demo\] exit 124 after \d+ s \(limit {LIMIT_S} s\): 1 failed, 1 passed", summary,
                     re.M), summary
    assert "FAILED" in summary and "test_fails" in summary, summary
    assert 'tests="' in (out / "demo.xml").read_text()


@pytest.mark.parametrize("script", ["benchmarks/gpu_all.sh", "tests/run_gpu.sh"])
def test_every_pytest_run_of_the_gpu_scripts_lists_failures(script):
    runs = [line for line in (ROOT / script).read_text().splitlines()
            if "python -m pytest" in line]
    assert runs
    for line in runs:
        report = re.search(r" -r(\w+)", line)  # none: pytest's default, "fE"
        assert report is None or {"f", "E"} <= set(report.group(1)), line
