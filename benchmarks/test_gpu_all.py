"""gpu_all.sh's part runner on CPU: GPU time is short, so a part that runs past its limit
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

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("python") is None,
                                reason="needs bash, and python on PATH (as gpu_all.sh)")

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


def _run_limited():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import _run_limited
    finally:
        sys.path.pop(0)
    return _run_limited


_COUNT_SIGINTS = """
import signal, time
seen = []
signal.signal(signal.SIGINT, lambda *_: seen.append(time.monotonic()))
while not seen or time.monotonic() - seen[0] < 1.5:  # 1.5 s more after the first
    time.sleep(0.001)
print(len(seen))
"""


def test_the_limit_sends_one_sigint_to_the_whole_group_and_exits_124(tmp_path, capfd):
    """Each process of the command's group (here a shell and its python) gets exactly one
    SIGINT at the limit; coreutils' timeout sends the command two."""
    script = tmp_path / "count.py"
    script.write_text(_COUNT_SIGINTS)
    status = _run_limited().run_limited(3, ["bash", "-c", f"{sys.executable} {script}; true"])
    assert status == 124
    assert capfd.readouterr().out.split() == ["1"]


def test_a_command_that_ignores_sigint_is_killed_after_the_grace(monkeypatch):
    module = _run_limited()
    monkeypatch.setattr(module, "GRACE_S", 1)
    start = time.monotonic()
    status = module.run_limited(1, [sys.executable, "-c", "import signal, time; "
                                    "signal.signal(signal.SIGINT, signal.SIG_IGN); "
                                    "time.sleep(60)"])
    assert status == 124 and time.monotonic() - start < 30


def test_a_command_within_its_limit_keeps_its_status():
    assert _run_limited().run_limited(60, [sys.executable, "-c", "raise SystemExit(3)"]) == 3
    assert _run_limited().run_limited(60, ["bash", "-c", "kill -TERM $$"]) == 128 + 15
