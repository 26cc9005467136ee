"""The two commands of the README's quick start and the bench command, at small sizes."""

import torch

from triton_scaler import bench
from triton_scaler.__main__ import main


def test_demo_runs_and_finds_no_difference(capsys):
    """The demo's two runs agree; it names device, backend, dtype and threads, says on the CPU
    that both scalers run torch's op there, and leaves torch's thread count as it found it."""
    threads = torch.get_num_threads()
    assert main(["demo", "--steps", "25", "--threads", "2"]) == 0
    assert torch.get_num_threads() == threads
    out = capsys.readouterr().out
    assert "differences (other than speed): none" in out
    assert out.count("host syncs / step") == 2
    assert "device cpu, backend reference, autocast torch.bfloat16" in out
    assert "2 CPU thread(s)" in out and "both scalers run torch's own unscale op" in out


def test_bench_prints_a_table(monkeypatch, capsys):
    monkeypatch.setattr(bench, "CASES", [("3 x 1000 fp32", 3, 1000, torch.float32),
                                         ("1 x 4096 bf16", 1, 4096, torch.bfloat16)])
    assert main(["bench"]) == 0
    out = capsys.readouterr().out
    assert "3 x 1000 fp32" in out and "speed ratio" in out
