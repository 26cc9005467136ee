"""Host cost of a scaler step (scale -> unscale_ -> step -> update) with every device launch
a counting no-op: triton_scaler against torch.amp.GradScaler at 100 / 1,000 / 10,000
parameters, with and without GradBuckets, in both CPU host layouts of the tensors' data
(``HOST_LAYOUTS``); launches per step recorded (see _host_cost.py).

Runs on CPU (no GPU needed): the host path is the same Python either way. The table in
RESULTS.md comes from ``python benchmarks/_host_cost.py``, which times both scalers
alternately in one process (here each case is its own test)."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _bench_common import FULL
from _host_cost import CASES, HOST_LAYOUTS, label, make_step
from _host_stubs import noop_launches
from _ops_host_cost import CASES as OPS_CASES
from _ops_host_cost import make_call

SIZES = [100, 1000, 10000] if FULL else [100, 1000]
#: every case in each layout (HOST_LAYOUTS)
LAID_OUT = [(impl, flags, layout) for impl, flags in CASES for layout in HOST_LAYOUTS]


@pytest.mark.parametrize("n_params", SIZES)
@pytest.mark.parametrize("impl, flags, host_layout", LAID_OUT,
                         ids=[f"{label(i, f)}, {h}" for i, f, h in LAID_OUT])
def test_host_cost(benchmark, n_params, impl, flags, host_layout):
    with noop_launches() as counts:
        prepare, step = make_step(impl, n_params, host_layout=host_layout, **flags)
        step()
        prepare()
        counts.clear()
        step()
        launches = sum(counts.values())
        benchmark.extra_info.update(case="host", n_params=n_params, impl=label(impl, flags),
                                    host_layout=host_layout, kernels=launches)

        benchmark.pedantic(step, setup=prepare, rounds=1 if not benchmark.enabled else 21,
                           warmup_rounds=0)
    # the scaler's own kernels per step: one unscale (or check) per group, one update
    assert launches == 2, counts


def test_dense_new_memory_misses_every_step(monkeypatch):
    """``dense`` new memory is new to triton_scaler's caches every step, its chunk table too
    (its shared-memory check made by ``_shares_memory`` on a miss only), also once the
    shifts come round."""
    from _host_cost import _SHIFTS

    from triton_scaler import _plans as plan

    built = []
    check = plan._shares_memory
    monkeypatch.setattr(plan, "_shares_memory", lambda *args: built.append(1) or check(*args))
    with noop_launches():
        prepare, step = make_step("ours", 10, grads="new_memory", host_layout="dense")
        for _ in range(_SHIFTS + 5):
            prepare()
            step()
    assert len(built) == _SHIFTS + 5


@pytest.mark.parametrize("n_grads", SIZES)
@pytest.mark.parametrize("case", OPS_CASES)
def test_ops_call_host_cost(benchmark, n_grads, case):
    """One ``ops.non_finite_check_and_unscale_`` call, launches no-ops
    (``_ops_host_cost.py``); one launch per call."""
    with noop_launches() as counts:
        prepare, call = make_call(n_grads, case)
        for _ in range(3):  # the first calls make the rows
            prepare()
            call()
        counts.clear()
        prepare()
        call()
        assert sum(counts.values()) == 1, counts
        benchmark.extra_info.update(case="ops host", n_grads=n_grads, grads=case)
        benchmark.pedantic(call, setup=prepare, rounds=1 if not benchmark.enabled else 21,
                           warmup_rounds=0)


@pytest.mark.exhaustive  # a script's whole run: the long tier
def test_the_dtensor_host_cost_script_prints_its_table():
    """``_dtensor_host_cost.py`` (a one-rank gloo mesh, in its own process: RESULTS.md's
    DTensor table) runs and prints a row per size."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = Path(__file__).with_name("_dtensor_host_cost.py")
    done = subprocess.run([sys.executable, str(script), "3"], capture_output=True, text=True,
                          timeout=180, env={**os.environ, "MASTER_PORT": str(port)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert any(line.startswith("| 3 | ") for line in done.stdout.splitlines()), done.stdout


@pytest.mark.exhaustive  # a script's whole run: the long tier
def test_the_host_wait_script_prints_its_table(capsys, monkeypatch):
    """``_host_wait.py`` (a plain step's time in its parts and its one host read; RESULTS.md's
    host-time table) runs with no-op launches on CPU and prints a row per case; its timers count a
    nested call of the same phase once and put every method back."""
    import _host_wait
    from _host_wait import BESIDE_CASE, CASES, EARLY_COPY_CASE, READS, _phases, main, timed_calls

    from triton_scaler import GradScaler

    methods = dict(vars(GradScaler))
    built = []  # make_step's parameter counts, in order
    monkeypatch.setattr(_host_wait, "make_step",
                        lambda impl, n, **kw: built.append(n) or make_step(impl, n, **kw))
    main([12], "cpu", repeats=2)
    monkeypatch.undo()
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 12 | ")]
    assert [row.split(" | ")[1] for row in rows] == [name for name, _, _ in CASES] + [
        EARLY_COPY_CASE[0], BESIDE_CASE[0]]
    # the control row: the row's 12 parameters built (and held) first, then 10 timed
    assert built == [12] * (len(CASES) + 1) + [12, 10]
    assert dict(vars(GradScaler)) == methods  # the early-copy row's patches undone
    # params, case, whole step, the 4 calls, 2 parts of ours, the read; then the row's end
    assert len(_phases()) == 7 and all(len(row.split(" | ")) == 10 for row in rows)

    class Nested:
        def call(self, depth: int) -> None:
            if depth:
                self.call(depth - 1)

    before = [vars(owner).get(name) for owner, name in READS] + [vars(GradScaler)["unscale_"]]
    clock = iter(range(1000))
    with timed_calls([("read", READS), ("nested", [(Nested, "call")])]) as spent:
        torch.zeros(3).tolist()
        torch.ones(()).item()
        monkeypatch.setattr(_host_wait.time, "perf_counter", lambda: next(clock))
        Nested().call(3)  # one clock pair for the outer call: 1 tick; each inner would add
        monkeypatch.undo()
    assert spent["read"] > 0 and spent["nested"] == 1
    assert [vars(owner).get(name) for owner, name in READS] + [vars(GradScaler)["unscale_"]] \
        == before  # inherited ones (Tensor.tolist) inherited again


@pytest.mark.exhaustive  # a script's whole run: the long tier
def test_the_host_wait_script_takes_the_parameters_size(capsys):
    """``--numel`` (gpu_all.sh's small-grads row: a bucket whose kernel takes a few µs) reaches
    the parameters: sizes drawn around it, named in the table's title; a size that would give
    empty parameters is refused."""
    from _host_cost import param_sizes
    from _host_wait import main

    main([10], "cpu", repeats=2, numel=16)
    out = capsys.readouterr().out
    assert "parameters of ~16 elements" in out.splitlines()[0], out
    assert sum(line.startswith("| 10 | ") for line in out.splitlines()) == 6, out
    sizes = param_sizes(500, 16)
    assert min(sizes) == 8 and max(sizes) == 23 and sizes == param_sizes(500, 16), sizes
    assert sizes != param_sizes(500) and all(n % 36 == 0 for n in param_sizes(50, 16, True))
    for bad in (1, 0, 16.0):
        with pytest.raises(ValueError, match="numel must be an int >= 2"):
            make_step("ours", 10, numel=bad)


def test_the_step_timeline_script_prints_a_step(capsys):
    """``_step_timeline.py`` (one step's host ops, runtime calls and kernels from
    ``torch.profiler``, on a GPU: the plain GradBuckets row at 10,000 parameters) runs with
    no-op launches on CPU: the scale's multiply is in the step, and the stretches between
    ops cover the rest of it."""
    from _step_timeline import main

    main(10, "ours, plain, GradBuckets", "cpu", steps=3, min_us=0.0)
    out = capsys.readouterr().out
    rows = [line.strip("| ").split(" | ") for line in out.splitlines()
            if line.startswith("| ") and line[2].isdigit()]
    assert any(row[3] == "aten::mul" for row in rows), out
    assert any(row[3].startswith("(between ops") for row in rows), out
    starts = [float(row[0]) for row in rows]
    assert starts == sorted(starts) and starts[0] == 0.0
