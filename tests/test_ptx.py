"""Every kernel compiled for an H100 (sm_90) without a GPU, with assertions on the PTX and on
the machine code ptxas makes of it (SASS, read with the cuobjdump Triton ships)."""

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
    probe = Path(__file__).with_name("_compile_probe.py")
    out = subprocess.run([sys.executable, str(probe)], env=env, capture_output=True, text=True,
                         timeout=600)
    if out.returncode != 0:
        raise AssertionError(out.stderr[-3000:])
    return json.loads(out.stdout)


def test_every_variant_compiles(ptx_facts):
    # 16 dtype x path x mode, 6 unaligned-size flat, 2 inv-from-scale, 24 clip (dtype x path
    # x pass), 8 a watch's read pass (dtype x path) and its per-tensor sums, 8 update (op,
    # scaler, watched scaler, skipping guard; with and without hysteresis), 3 spike guard
    assert len(ptx_facts) == 4 * 2 * 2 + 6 + 2 + 4 * 2 * 3 + 4 * 2 + 1 + 8 + 3


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("path", ["flat", "table"])
@pytest.mark.parametrize("mode", ["write", "check"])
def test_aligned_buckets_use_16_byte_vector_loads(ptx_facts, dtype, path, mode):
    ops = ptx_facts[f"unscale/{dtype}/{path}/{mode}"]
    assert "ld.global.v4.b32" in ops, ops
    if mode == "write":
        assert "st.global.v4.b32" in ops, ops


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("mode", ["write", "check"])
def test_unaligned_size_flat_tensor_full_blocks_use_vector_loads(ptx_facts, dtype, mode):
    """n % 16 != 0 (only the base pointer specialised aligned): full blocks run mask-free
    with 16-byte accesses; only the tail block is masked."""
    ops = ptx_facts[f"unscale/{dtype}/flat/{mode}/odd_size"]
    assert "ld.global.v4.b32" in ops, ops
    if mode == "write":
        assert "st.global.v4.b32" in ops, ops


@pytest.mark.parametrize("mode", ["write", "check"])
def test_chunk_table_vector_loads_do_not_depend_on_sizes(ptx_facts, mode):
    """The table kernel is compiled once for any sizes (no all-or-nothing alignment constexpr):
    a table with one odd-sized tensor among aligned ones runs the same vectorised code, each
    chunk deciding at run time (full and 16-byte aligned: vector path)."""
    ops = ptx_facts[f"unscale/fp32/table/{mode}/inv_from_scale"]
    assert "ld.global.v4.b32" in ops, ops
    assert ("st.global.v4.b32" in ops) == (mode == "write"), ops


@pytest.mark.parametrize("mode", ["write", "check"])
def test_inv_scale_from_scale_is_an_exact_fp64_reciprocal(ptx_facts, mode):
    ops = ptx_facts[f"unscale/fp32/table/{mode}/inv_from_scale"]
    assert "div.rn.f64" in ops, ops  # IEEE round-to-nearest, as torch's reciprocal
    assert "cvt.rn.f32.f64" in ops, ops


def test_no_approximate_division_anywhere(ptx_facts):
    for key, ops in ptx_facts.items():
        bad = [op for op in ops if (op.startswith("div.") and not op.startswith("div.rn."))
               or op.startswith("rcp.approx")]
        assert not bad, (key, bad)


def test_update_factor_math_is_fp64(ptx_facts):
    for key in [k for k in ptx_facts if k.startswith("update/")]:
        ops = ptx_facts[key]
        assert any(op.startswith("mul") and op.endswith(".f64") for op in ops), ops
        assert "cvt.rn.f32.f64" in ops, ops  # the fp64 product rounded once to fp32


def test_guard_is_ieee_fp64_without_contraction(ptx_facts):
    """The spike guard's kernel divides and takes square roots IEEE-rounded in fp64 and
    fuses no multiply-add, as the reference path's torch ops compute."""
    keys = [key for key in ptx_facts if key.startswith("guard/")]
    assert len(keys) == 3, keys
    for key in keys:
        ops = ptx_facts[key]
        assert "div.rn.f64" in ops and "sqrt.rn.f64" in ops, (key, ops)
        assert not [op for op in ops if op.startswith(("fma", "mad"))], (key, ops)


def test_unscale_keeps_fp32_multiply(ptx_facts):
    ops = ptx_facts["unscale/fp16/flat/write"]
    assert any(op.startswith("mul") and op.endswith(".f32") for op in ops), ops
    assert not any(op.startswith("fma") for op in ops), ops


@pytest.mark.parametrize("mode", ["write", "check"])
def test_fp64_grads_multiply_in_fp64(ptx_facts, mode):
    ops = ptx_facts[f"unscale/fp64/flat/{mode}"]
    assert any(op.startswith("mul") and op.endswith(".f64") for op in ops), ops
    assert "cvt.rn.f32.f64" not in ops, ops  # never narrowed to fp32


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16", "fp64"])
@pytest.mark.parametrize("path", ["flat", "table"])
@pytest.mark.parametrize("name", ["norm2", "norminf", "clip"])
def test_clip_passes_use_vector_loads(ptx_facts, dtype, path, name):
    """Both passes of clip_grad_norm_, for a bucket (flat) and a table group, in every grad
    dtype (float64: GradBuckets hold it too): 16-byte loads, 16-byte stores in the clip."""
    ops = ptx_facts[f"clip/{dtype}/{path}/{name}"]
    vector = "v2.b64" if dtype == "fp64" else "v4.b32"
    assert f"ld.global.{vector}" in ops, ops
    assert (f"st.global.{vector}" in ops) == (name == "clip"), ops


def test_unscale_offsets_are_64_bit(ptx_facts):
    for key, ops in ptx_facts.items():
        if key.startswith(("unscale/", "clip/")):
            assert "TTIR:program_id_widened_to_i64" in ops, key


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_bucket_from_odd_sized_parameters_launches_the_aligned_vector_kernel(ptx_facts, dtype):
    """A bucket of odd-sized parameters (a 10-class bias, a 50,257-row vocabulary slice) is
    padded: its base is 16-byte aligned and its size a multiple of 16, which is what triton's
    launcher specialises the flat launch on; that specialisation has 16-byte vector accesses."""
    import torch

    from triton_scaler import GradBuckets

    torch_dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    params = [torch.nn.Parameter(torch.zeros(n, dtype=torch_dtype)) for n in (10, 50257, 3, 7)]
    (bucket,) = GradBuckets(params)
    assert bucket.buffer.data_ptr() % 16 == 0 and bucket.buffer.numel() % 16 == 0
    ops = ptx_facts[f"unscale/{dtype}/flat/write"]  # grad_ptr and n_elements divisible by 16
    assert "ld.global.v4.b32" in ops and "st.global.v4.b32" in ops, ops


def _sass(ptx_facts):
    """The variants' facts, once it is known that they include the SASS ones."""
    if not any(op.startswith("SASS:") for ops in ptx_facts.values() for op in ops):
        pytest.skip("this triton ships no cuobjdump: no facts about the machine code")
    return ptx_facts


def test_ptxas_keeps_every_16_byte_access(ptx_facts):
    """What the PTX does in 16-byte vectors (v4.b32, v2.b64), the machine code does in 128-bit
    LDG / STG: ptxas splits none of them."""
    for key, ops in _sass(ptx_facts).items():
        for ptx, sass in (("ld.global", "LDG"), ("st.global", "STG")):
            if f"{ptx}.v4.b32" in ops or f"{ptx}.v2.b64" in ops:
                assert f"SASS:{sass}.E.128" in ops, (key, ops)


def test_no_variant_spills_to_local_memory(ptx_facts):
    """No register spills (LDL / STL in the machine code: what ``maxnreg=24`` makes of the
    table kernel) and no local arrays, with triton 3.6's ptxas and 3.9's."""
    for key, ops in _sass(ptx_facts).items():
        assert "LOCAL:0" in ops, (key, ops)
        assert not [op for op in ops if op.startswith(("SASS:LDL", "SASS:STL"))], (key, ops)


def _fact(ops, name: str) -> int:
    return int(next(op for op in ops if op.startswith(name + ":"))[len(name) + 1:])


def test_every_variant_keeps_half_an_sm_busy(ptx_facts):
    """At least 32 of an sm_90 SM's 64 warps resident, by registers (65,536 an SM, handed out
    in multiples of 8 a thread): at most 64 registers a thread for 8-warp blocks (4 blocks).
    The masked path's 64-bit element compares took 80 or more (3 blocks or fewer) with triton
    3.6's ptxas, the GPU machine's, in every table write pass and every odd-size flat launch;
    float64 in 8-warp blocks took up to 66 with triton 3.8's (it runs 16-warp blocks)."""
    for key, ops in _sass(ptx_facts).items():
        registers, warps = _fact(ops, "REG"), _fact(ops, "WARPS")
        blocks = min(65536 // (-(-registers // 8) * 8 * 32 * warps), 32)  # 32 blocks at most
        assert min(blocks * warps, 64) >= 32, (key, registers, warps)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
def test_gpu_launches_pass_what_the_probe_compiles(monkeypatch, dtype):
    """What a GPU launch passes is what these tests compiled: 8 warps, float64 16 (its 8-warp
    variants took up to 66 registers and spilled with triton 3.8's ptxas), a watch's read
    pass 16, float64 32 (see ``GPU_NUM_WARPS_STATS``), no FMA fusion, the GPU block
    (the plan cut in it too) and 16-byte vectors."""
    import torch
    from triton_scaler.kernels import unscale

    from triton_scaler._plans import plan_unscale

    seen = []
    monkeypatch.setattr(unscale, "_INTERPRETED", False)
    monkeypatch.setattr(unscale, "BLOCK", unscale.GPU_BLOCK)  # as decided at import on a GPU
    monkeypatch.setattr(unscale, "launch", lambda *args: seen.append(args[1:2] + args[-2:]))
    sizes = (5, unscale.GPU_BLOCK + 3)  # 1 + 2 programs of the GPU block
    grads = [torch.ones(n, dtype=getattr(torch, dtype)) for n in sizes]
    stats = torch.zeros((3, 4), dtype=torch.float64)
    cases = ((0, None, None), (2, None, None), (0, torch.ones(()), None), (0, None, stats))
    for norm, coef, with_stats in cases:
        unscale.launch_unscale(plan_unscale(grads), torch.zeros(()), torch.ones(()), norm=norm,
                               clip_coef=coef, stats=with_stats, write=with_stats is None)
    warps = unscale.GPU_NUM_WARPS_FP64 if dtype == "float64" else unscale.GPU_NUM_WARPS
    # a watch's read pass: one number per dtype (as the probe compiles it)
    stats_warps = unscale.GPU_NUM_WARPS_STATS_FP64 if dtype == "float64" else \
        unscale.GPU_NUM_WARPS_STATS
    expected = [warps] * 3 + [stats_warps]
    assert [options for *_, options in seen] == [{"num_warps": w, "enable_fp_fusion": False}
                                                 for w in expected]
    vec = 16 // grads[0].element_size()
    assert [(grid, c["BLOCK"], c["VEC"], c["BF16_BITS"]) for grid, c, _ in seen] == \
        [(3, unscale.GPU_BLOCK, vec, False)] * 4


def test_no_variant_needs_an_atomic(ptx_facts):
    """A watch's read pass stores each program's statistics and a launch of its own sums them
    per tensor (``stats/finish``): no variant orders programs with an atomic."""
    assert "stats/finish" in ptx_facts
    for key, ops in ptx_facts.items():
        assert not [op for op in ops if op.startswith("atom.")], key
