"""The two commands of the README's quick start and the bench command, at small sizes."""

import torch

from triton_scaler import bench
from triton_scaler.__main__ import main


def test_demo_runs_and_finds_no_difference(capsys):
    assert main(["demo", "--steps", "25"]) == 0
    out = capsys.readouterr().out
    assert "differences (other than speed): none" in out
    assert out.count("host syncs / step") == 2


def test_bench_prints_a_table(monkeypatch, capsys):
    monkeypatch.setattr(bench, "CASES", [("3 x 1000 fp32", 3, 1000, torch.float32),
                                         ("1 x 4096 bf16", 1, 4096, torch.bfloat16)])
    assert main(["bench"]) == 0
    out = capsys.readouterr().out
    assert "3 x 1000 fp32" in out and "speed ratio" in out
