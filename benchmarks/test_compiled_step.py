"""``compiled_step.py`` at tiny sizes on CPU: it times its arrangements, prints one row each
with graphs and breaks for the compiled ones, and finds the same final scale in each."""

import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.exhaustive  # a script's whole run: the long tier
def test_the_compiled_step_script_prints_its_table():
    script = Path(__file__).with_name("compiled_step.py")
    done = subprocess.run([sys.executable, str(script), "--smoke", "--steps", "2"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ")]
    names = [row.split("|")[1].strip() for row in rows[1:]]
    assert names == ["torch eager", "torch best", "ours compiled"]
    ours = rows[-1].split("|")
    assert int(ours[4]) > int(rows[-2].split("|")[4])  # more graphs: the scaler's calls
