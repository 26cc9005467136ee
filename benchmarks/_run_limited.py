"""Run a command with a time limit, for ``_run_part.sh``: ``python _run_limited.py SECONDS
COMMAND...``. The command runs in a process group of its own; at the limit that group gets
one SIGINT (pytest then stops as on Ctrl-C, printing its failures and counts and writing its
junit XML), and SIGKILL ``GRACE_S`` seconds later if it still runs. Exits with the command's
status, or 124 when it was cut (as coreutils' ``timeout``).

Not coreutils' ``timeout -s INT``: it signals the command and then its process group, so the
command gets SIGINT twice, and the second can interrupt pytest while it reports the first:
the log then ends in a bare ``KeyboardInterrupt``, with no counts (seen in CI, 2026-12-03,
``benchmarks/test_gpu_all.py``; about one run in three on an idle VM).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

GRACE_S = 20


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # the group's id is the command's pid (start_new_session)
    except ProcessLookupError:  # every process of the group has exited
        pass


def _stop(proc: subprocess.Popen) -> None:
    """One SIGINT to the command's group; SIGKILL after ``GRACE_S`` seconds."""
    _signal_group(proc, signal.SIGINT)
    try:
        proc.wait(timeout=GRACE_S)
    except subprocess.TimeoutExpired:
        _signal_group(proc, signal.SIGKILL)
        proc.wait()


def _default_sigint() -> None:
    """In the command's process, before it starts: SIGINT's default handling back. A shell
    starts a background job with SIGINT ignored, which the command would inherit (Python
    then installs no handler for it), and the limit's SIGINT would do nothing."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_limited(seconds: float, command: list[str]) -> int:
    proc = subprocess.Popen(command, start_new_session=True, preexec_fn=_default_sigint)
    try:
        status = proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        _stop(proc)
        return 124
    except KeyboardInterrupt:  # Ctrl-C here: the command's own group does not see it
        _stop(proc)
        raise
    return status if status >= 0 else 128 - status  # killed by a signal: as a shell says


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit("usage: python _run_limited.py SECONDS COMMAND...")
    sys.exit(run_limited(float(sys.argv[1]), sys.argv[2:]))
