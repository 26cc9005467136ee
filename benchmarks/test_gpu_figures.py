"""The GPU figures script's plumbing, run on CPU at tiny sizes (``--smoke``): every section
produces its rows, the JSON and the markdown summary; the plot is drawn from the JSON."""

import importlib.util
import json

import pytest
from gpu_figures import main


@pytest.mark.exhaustive  # a script's whole run: the long tier
def test_smoke_run_writes_every_section(tmp_path):
    assert main(["--smoke", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "figures.json").read_text())
    sections = {r["section"] for r in result["kernels"]}
    assert sections == {"flat", "many", "check"}
    assert all(r["ms"]["ours"] is not None for r in result["kernels"])
    assert {r["case"] for r in result["train"]} == {"torch", "ours", "ours + GradBuckets"}
    host = [r for r in result["host"] if r["section"] == "host"]
    assert host and all(r["ratio_ours_over_torch"] > 0 for r in host)
    assert [r["section"] for r in result["host"]].count("launch") == 1
    assert "| flat |" in (tmp_path / "figures.md").read_text()
    if importlib.util.find_spec("matplotlib") is None:
        pytest.skip("matplotlib not installed: the plot is drawn where it is")
    assert main(["--plot", str(tmp_path)]) == 0
    assert (tmp_path / "gpu_flat.png").stat().st_size > 0


def test_profile_smoke_run_writes_both_sections(tmp_path):
    from gpu_profile import main as profile_main

    assert profile_main(["--smoke", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "profile.txt").read_text()
    assert "| many: random 1000 (1-64k) | 10 | ours |" in text
    assert "| check: random 10000 (1-64k) | 100 | torch |" in text
    for name in ("torch", "ours", "ours + GradBuckets"):
        assert f"### {name} (" in text
