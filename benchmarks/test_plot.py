"""benchmarks/plot.py on a suite JSON as ``run_cpu.sh`` / ``run_gpu.sh`` save it: kernel rows
(bytes, GB/s), the host-cost rows of test_bench_host.py (no bytes) and the watch-cost rows
of test_watch_cost.py, each kind in its own table."""

import importlib.util
import json

import pytest
from plot import host_table, load, ops_table, plots, tables, watch_table


def _bench(median: float, **info) -> dict:
    return {"stats": {"median": median}, "extra_info": info}


def _suite(path) -> None:
    kernel = {"case": "bucket", "dtype": "fp32", "n_tensors": 1, "numel": 1024, "bytes": 8192}
    many = {**kernel, "case": "many", "n_tensors": 4}
    host = {"case": "host", "n_params": 100, "kernels": 2}
    path.write_text(json.dumps({"machine_info": {}, "benchmarks": [
        _bench(2e-6, impl="torch", **kernel), _bench(1e-6, impl="ours", **kernel),
        _bench(4e-6, impl="ours", **many),
        _bench(70e-6, impl="torch, plain, grads same", host_layout="heap", **host),
        _bench(35e-6, impl="ours, plain, grads same", host_layout="heap", **host),
        _bench(20e-6, impl="ours+buckets, plain", host_layout="dense", **host),
        _bench(80e-6, impl="torch, plain, grads same", host_layout="dense", **host),
        _bench(30e-6, case="ops host", n_grads=100, grads="same_list"),
        _bench(90e-6, case="ops host", n_grads=100, grads="cycle12"),
        _bench(10e-6, impl="plain", case="bucket", dtype="fp16", numel=4096, bytes=8192),
        _bench(11e-6, impl="watched", case="bucket", dtype="fp16", numel=4096, bytes=8192)]}))


def test_kernel_and_host_rows(tmp_path):
    path = tmp_path / "suite.json"
    _suite(path)
    rows, host, ops, watch, _ = load(path)
    assert list(rows) == [("bucket", "fp32", 1, 1024, ""), ("many", "fp32", 4, 1024, "")]
    assert "| bucket | fp32 | 1 x 1024 | ours | 1.0 us | 8.2 | 2.00 |" in tables(rows)
    table = host_table(host)
    assert "| 100 | plain, grads same | heap | 35 | 70 | 0.50 | 2 |" in table
    assert "| 100 | plain, GradBuckets (torch: grads same) | dense | 20 | 80 | 0.25 | 2 |" in table
    assert len(table.splitlines()) == 4  # header, rule, the two pairs with both scalers
    calls = ops_table(ops)  # the ops' call rows (the script stopped at the first one before)
    assert "| 100 | same_list | 30 |" in calls and "| 100 | cycle12 | 90 |" in calls
    assert len(calls.splitlines()) == 4
    # test_watch_cost.py's rows (no n_tensors) get their own table
    assert "| bucket | fp16 | 10.0 us | 11.0 us | 1.10 |" in watch_table(watch)


def test_plots_beside_host_rows(tmp_path):
    if importlib.util.find_spec("matplotlib") is None:
        pytest.skip("matplotlib not installed: the plots are drawn where it is")
    path = tmp_path / "suite.json"
    _suite(path)
    rows, *_ = load(path)
    assert [p.name for p in plots(rows, tmp_path, "t")] == ["t_bucket.png", "t_many.png",
                                                            "t_ratio.png"]
