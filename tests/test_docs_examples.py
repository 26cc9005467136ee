"""The README's complete example runs as it is, as a user would run it: a fresh Python process
in an empty temporary directory, on the CPU, with no test environment (no Triton interpreter).
The examples in docs/ marked ``<!-- runs -->`` run too. Each must also show what it claims."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_BLOCK = re.compile(r"```python\n(.*?)```", re.S)


def _blocks_after(text: str, marker: str) -> list[str]:
    return [_BLOCK.match(text, i + len(marker) + 1).group(1)
            for i in (m.start() for m in re.finditer(re.escape(marker), text))]


def _run(code: str, tmp_path: Path) -> str:
    script = tmp_path / "example.py"
    script.write_text(code)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU route, as on a machine without a GPU
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout


def test_the_readme_example_runs_on_a_cpu_and_skips_its_planted_overflow(tmp_path):
    """The README's example trains, skips exactly the step with the planted overflow and
    prints a finite loss."""
    (code,) = _blocks_after((ROOT / "README.md").read_text(), "<!-- example -->")
    out = _run(code, tmp_path)
    match = re.search(r"loss (\S+), scale (\S+), skipped steps (\d+)", out)
    assert match, out
    loss, scale, skipped = float(match[1]), float(match[2]), int(match[3])
    assert skipped == 1
    assert loss == loss and abs(loss) < float("inf")
    assert scale == 2.0**15  # one backoff from 2**16, no growth within 50 steps


_DOC_EXAMPLES = [(page.name, i, code) for page in sorted((ROOT / "docs").glob("*.md"))
                 for i, code in enumerate(_blocks_after(page.read_text(), "<!-- runs -->"))]


def test_every_docs_page_has_a_runnable_example():
    """Each page of docs/ opens with an example that runs, but the distributed one (which needs
    several processes) and the integrations one (which needs the frameworks: its recipes run
    in tests/test_integrations.py where they are installed)."""
    pages = {page.name for page in (ROOT / "docs").glob("*.md")}
    assert pages - {name for name, _, _ in _DOC_EXAMPLES} <= {"distributed.md", "testing.md",
                                                               "integrations.md"}


@pytest.mark.parametrize("name,index,code", _DOC_EXAMPLES,
                         ids=[f"{n}-{i}" for n, i, _ in _DOC_EXAMPLES])
def test_the_docs_examples_run(name, index, code, tmp_path):
    """A marked example in docs/ runs as it is, in a fresh process."""
    _run(code, tmp_path)
