"""Every kernel compiled for an H100 (sm_90) without a GPU, with assertions on the PTX."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton.backends.nvidia")


@pytest.fixture(scope="module")
def ptx_facts():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    probe = Path(__file__).with_name("_ptx_probe.py")
    out = subprocess.run([sys.executable, str(probe)], env=env, capture_output=True, text=True,
                         timeout=600)
    if out.returncode != 0:
        raise AssertionError(out.stderr[-3000:])
    return json.loads(out.stdout)


def test_every_variant_compiles(ptx_facts):
    assert len(ptx_facts) == 4 * 2 * 2 + 2 + 2 * 3


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("path", ["flat", "table"])
@pytest.mark.parametrize("mode", ["write", "check"])
def test_aligned_buckets_use_16_byte_vector_loads(ptx_facts, dtype, path, mode):
    ops = ptx_facts[f"unscale/{dtype}/{path}/{mode}"]
    assert "ld.global.v4.b32" in ops, ops
    if mode == "write":
        assert "st.global.v4.b32" in ops, ops


def test_no_approximate_division_anywhere(ptx_facts):
    for key, ops in ptx_facts.items():
        assert not [op for op in ops if op.startswith("div.") or op.startswith("rcp.approx")], key


def test_update_factor_math_is_fp64(ptx_facts):
    for key in ("update/hysteresis=False", "update/hysteresis=True"):
        ops = ptx_facts[key]
        assert any(op.startswith("mul") and op.endswith(".f64") for op in ops), ops
        assert "cvt.rn.f32.f64" in ops, ops  # the fp64 product rounded once to fp32


def test_unscale_keeps_fp32_multiply(ptx_facts):
    ops = ptx_facts["unscale/fp16/flat/write"]
    assert any(op.startswith("mul") and op.endswith(".f32") for op in ops), ops
    assert not any(op.startswith("fma") for op in ops), ops


@pytest.mark.parametrize("mode", ["write", "check"])
def test_fp64_grads_multiply_in_fp64(ptx_facts, mode):
    ops = ptx_facts[f"unscale/fp64/flat/{mode}"]
    assert any(op.startswith("mul") and op.endswith(".f64") for op in ops), ops
    assert "cvt.rn.f32.f64" not in ops, ops  # never narrowed to fp32


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("name", ["norm2", "norminf", "clip"])
def test_clip_passes_use_vector_loads(ptx_facts, dtype, name):
    ops = ptx_facts[f"clip/{dtype}/table/{name}"]
    assert "ld.global.v4.b32" in ops, ops
    assert ("st.global.v4.b32" in ops) == (name == "clip"), ops


def test_unscale_offsets_are_64_bit(ptx_facts):
    for key, ops in ptx_facts.items():
        if key.startswith(("unscale/", "clip/")):
            assert "TTIR:program_id_widened_to_i64" in ops, key
