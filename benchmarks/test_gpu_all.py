"""gpu_all.sh's part runner on CPU: GPU time is short, so a part that runs past its limit
must still leave which tests failed, the counts so far and its junit XML; and every pytest run
of the GPU scripts must list failed tests in its summary (an ``-r`` option keeps ``f`` and ``E``)."""

import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("python") is None,
                                reason="needs bash, and python on PATH (as gpu_all.sh)")

LIMIT_S = 600  # never reached: the suite's last test interrupts itself, as the limit would
# (in file order: the inner run blocks pytest-randomly, which would run the interrupter first)
_INTERRUPTED_SUITE = """
import os, signal, time
def test_passes(): pass
def test_fails(): assert 1 == 2
def test_is_cut():  # the SIGINT that _run_limited.py sends its command's group at the limit
    os.killpg(os.getpgrp(), signal.SIGINT)
    time.sleep(60)
"""


def test_a_part_cut_by_sigint_keeps_its_failures_counts_and_junit_xml(tmp_path):
    """A part whose pytest gets the limit's SIGINT mid-run still leaves, in the summary, its
    exit status, the counts so far and the failed tests, and its junit XML."""
    suite = tmp_path / "test_cut_suite.py"
    suite.write_text(_INTERRUPTED_SUITE)
    out = tmp_path / "out"
    out.mkdir()
    script = (f'out={out}; summary=$out/summary.txt; source benchmarks/_run_part.sh; '
              f'run_part demo {LIMIT_S} {sys.executable} -m pytest -q -rfEs -p no:cacheprovider '
              f'-p no:randomly {suite} '
              f'--junitxml=$out/demo.xml')
    done = subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr  # a failing part does not stop the next
    summary = (out / "summary.txt").read_text()
    assert re.search(rf"^\[demo\] exit 2 after \d+ s \(limit {LIMIT_S} s\): 1 failed, 1 passed",
                     summary, re.M), summary
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
import pathlib, signal, sys, time
seen = []
signal.signal(signal.SIGINT, lambda *_: seen.append(1))
pathlib.Path(sys.argv[1]).touch()  # ready: the handler is set
while not seen:
    time.sleep(0.001)
time.sleep(1.5)  # a second SIGINT would come within this
print(len(seen))
"""

_IGNORES_SIGINT = """
import pathlib, signal, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)
pathlib.Path(sys.argv[1]).touch()
while True:
    time.sleep(1)
"""


def _started(tmp_path, source: str, shell: bool = False):
    """A process running ``source`` in a group of its own (as ``run_limited`` starts its
    command), once it has set its signal handling."""
    script, ready = tmp_path / "child.py", tmp_path / "ready"
    script.write_text(source)
    command = [sys.executable, str(script), str(ready)]
    if shell:  # a shell and its python: two processes of the group
        command = ["bash", "-c", " ".join(command) + "; true"]
    proc = subprocess.Popen(command, start_new_session=True, stdout=subprocess.PIPE, text=True)
    while not ready.exists():
        assert proc.poll() is None, "the child exited before it was ready"
        time.sleep(0.01)
    return proc


def test_the_stop_sends_one_sigint_to_the_whole_group(tmp_path):
    """Each process of the command's group (here a shell and its python) gets exactly one
    SIGINT when the limit stops it; coreutils' timeout sends the command two."""
    proc = _started(tmp_path, _COUNT_SIGINTS, shell=True)
    _run_limited()._stop(proc)
    assert proc.stdout.read().split() == ["1"]


def test_a_command_past_its_limit_exits_124():
    assert _run_limited().run_limited(0.5, [sys.executable, "-c",
                                            "import time; time.sleep(600)"]) == 124


def test_a_command_that_ignores_sigint_is_killed_after_the_grace(tmp_path, monkeypatch):
    module = _run_limited()
    monkeypatch.setattr(module, "GRACE_S", 1)
    proc = _started(tmp_path, _IGNORES_SIGINT)
    module._stop(proc)
    assert proc.returncode == -signal.SIGKILL


def test_a_command_within_its_limit_keeps_its_status():
    assert _run_limited().run_limited(60, [sys.executable, "-c", "raise SystemExit(3)"]) == 3
    assert _run_limited().run_limited(60, ["bash", "-c", "kill -TERM $$"]) == 128 + 15
