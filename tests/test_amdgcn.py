"""Every kernel compiled for AMD Instinct GPUs (``gfx942``: MI300, ``gfx90a``: MI200) without a
GPU, with assertions on the AMDGCN Triton's AMD backend makes of it (the same variants as
test_ptx.py's). On ROCm torch's tensors are ``cuda`` tensors, so ``backend="auto"`` runs these
kernels there (through ``kernel[grid]``: kernels.launcher's direct path is CUDA's only).
Compiled, not run: no AMD GPU has run them."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton.backends.amd")

_CONTROL = "control/fp32/fused_multiply_add"  # x * x + 1 compiled with fusion on, on purpose


@pytest.fixture(scope="module", params=["gfx942", "gfx90a"])
def amd_facts(request):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    probe = Path(__file__).with_name("_compile_probe.py")
    out = subprocess.run([sys.executable, str(probe), request.param], env=env,
                         capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        if "ld.lld not found" in out.stderr:  # triton 3.4: no linker shipped with the backend
            pytest.skip("this triton ships no ROCm linker (ld.lld): its AMD backend cannot "
                        "link without a ROCm install")
        raise AssertionError(out.stderr[-3000:])
    return json.loads(out.stdout)


def _variants(facts):
    return {key: ops for key, ops in facts.items() if key != _CONTROL}


def _fact(ops, name: str) -> str:
    return next(op for op in ops if op.startswith(name + ":"))[len(name) + 1:]


def _vector(ops, access: str) -> bool:
    """A 128-bit global access (``buffer_load_dwordx4``, ``global_store_dwordx4``...)."""
    return any(op.startswith("AMD:") and op.endswith(f"_{access}_dwordx4") for op in ops)


def test_every_variant_compiles(amd_facts):
    # as test_ptx.py's 68, and the fusion control
    assert len(_variants(amd_facts)) == 4 * 2 * 2 + 6 + 2 + 4 * 2 * 3 + 4 * 2 + 1 + 8 + 3
    assert _CONTROL in amd_facts


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16", "fp64"])
@pytest.mark.parametrize("path", ["flat", "table"])
@pytest.mark.parametrize("mode", ["write", "check"])
def test_full_blocks_use_128_bit_accesses(amd_facts, dtype, path, mode):
    """An aligned bucket (flat) and a chunk table's full, aligned chunks: 128-bit loads, and
    128-bit stores where the grads are written."""
    ops = amd_facts[f"unscale/{dtype}/{path}/{mode}"]
    assert _vector(ops, "load"), ops
    assert _vector(ops, "store") == (mode == "write"), ops


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("mode", ["write", "check"])
def test_unaligned_size_flat_tensor_full_blocks_use_128_bit_accesses(amd_facts, dtype, mode):
    ops = amd_facts[f"unscale/{dtype}/flat/{mode}/odd_size"]
    assert _vector(ops, "load"), ops
    assert _vector(ops, "store") == (mode == "write"), ops


@pytest.mark.parametrize("mode", ["write", "check"])
def test_chunk_table_from_the_scale_uses_128_bit_accesses(amd_facts, mode):
    ops = amd_facts[f"unscale/fp32/table/{mode}/inv_from_scale"]
    assert _vector(ops, "load"), ops
    assert _vector(ops, "store") == (mode == "write"), ops


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16", "fp64"])
@pytest.mark.parametrize("path", ["flat", "table"])
@pytest.mark.parametrize("name", ["norm2", "norminf", "clip"])
def test_clip_passes_use_128_bit_accesses(amd_facts, dtype, path, name):
    ops = amd_facts[f"clip/{dtype}/{path}/{name}"]
    assert _vector(ops, "load"), ops
    assert _vector(ops, "store") == (name == "clip"), ops


def test_no_variant_spills_or_uses_scratch(amd_facts):
    for key, ops in amd_facts.items():
        assert _fact(ops, "VGPR_SPILL") == "0" and _fact(ops, "SGPR_SPILL") == "0", (key, ops)
        assert _fact(ops, "SCRATCH") == "0", (key, ops)
        assert not [op for op in ops if op.startswith("AMD:scratch_")], (key, ops)


def test_every_variant_keeps_half_a_simd_busy(amd_facts):
    """At least 4 of a CDNA SIMD's 8 wavefronts resident, by registers: 512 vector registers
    a lane, shared by the VGPRs and AGPRs of its wavefronts, so at most 128 a wavefront."""
    for key, ops in amd_facts.items():
        agprs = _fact(ops, "AGPR")
        registers = int(_fact(ops, "VGPR")) + (0 if agprs == "missing" else int(agprs))
        assert registers <= 128, (key, registers)


def test_denormals_are_kept_as_torch_keeps_them(amd_facts):
    """Subnormal grads, products and reciprocals (a scale above 2**126 has a subnormal
    inv_scale) are kept, not flushed to zero: IEEE mode 3 (inputs and outputs) for float32
    and for float16 / float64."""
    for key, ops in amd_facts.items():
        assert _fact(ops, "DENORM32") == "3" and _fact(ops, "DENORM16_64") == "3", (key, ops)


def test_no_fused_multiply_add_outside_ieee_division(amd_facts):
    """Products are rounded as torch's are: no contraction of a multiply and an add (the
    probe compiles with ``enable_fp_fusion=False``, as a launch does). A mixed-precision fma
    with a zero addend is a multiply rounded once (LLVM's form of one whose operand or
    result is float16) and does not count (its sign of zero: the next test). The only fused
    adds allowed are an IEEE division's steps (with ``v_div_fixup``); the control, compiled
    with fusion on, shows that they are seen."""
    for key, ops in _variants(amd_facts).items():
        if not any(op.startswith("AMD:v_div_fixup") for op in ops):
            assert _fact(ops, "FUSED_ADD") == "0", (key, ops)
    assert int(_fact(amd_facts[_CONTROL], "FUSED_ADD")) > 0, amd_facts[_CONTROL]


def test_products_keep_the_sign_of_zero(amd_facts):
    """A multiply written as an fma keeps a -0 product -0 (a ``neg(0)`` addend) with triton
    3.9. Triton 3.6 to 3.8 write float16 grads' products rounded to float16 with a +0
    addend, so a -0.0 grad is stored +0.0 (torch's op keeps -0.0; equal by value, not by
    bits): pinned here, so that it is seen if it spreads or goes."""
    plus_zero = {key for key, ops in amd_facts.items() if _fact(ops, "PLUS_ZERO_ADD") != "0"}
    if _triton_version() >= (3, 9):
        assert not plus_zero, sorted(plus_zero)
    else:
        assert plus_zero and all(key.split("/")[1] == "fp16" for key in plus_zero), \
            sorted(plus_zero)


def _triton_version() -> tuple[int, int]:
    import triton

    major, minor = triton.__version__.split(".")[:2]
    return int(major), int(minor)


def test_every_division_is_ieee(amd_facts):
    """A reciprocal instruction (approximate) only inside a division's IEEE sequence
    (``v_div_scale`` / ``v_div_fmas`` / ``v_div_fixup``). The scale's reciprocal,
    ``fp32(1 / fp64(scale))``, is there: LLVM narrows it to a float32 division, which rounds
    the same (a double has 53 >= 2 * 24 + 2 bits: rounding twice is rounding once)."""
    for key, ops in amd_facts.items():
        for width in ("f32", "f64"):
            if any(op.startswith(f"AMD:v_rcp_{width}") for op in ops):
                assert f"AMD:v_div_fixup_{width}" in ops, (key, ops)
    for mode in ("write", "check"):
        ops = amd_facts[f"unscale/fp32/table/{mode}/inv_from_scale"]
        assert {"AMD:v_div_fixup_f32", "AMD:v_div_fixup_f64"} & set(ops), ops


def test_update_factor_math_is_fp64(amd_facts):
    for key in [k for k in amd_facts if k.startswith("update/")]:
        ops = amd_facts[key]
        assert "AMD:v_mul_f64" in ops, ops
        assert "AMD:v_cvt_f32_f64_e32" in ops, ops  # the fp64 product rounded once to fp32


@pytest.mark.parametrize("mode", ["write", "check"])
def test_fp64_grads_multiply_in_fp64(amd_facts, mode):
    ops = amd_facts[f"unscale/fp64/flat/{mode}"]
    assert "AMD:v_mul_f64" in ops, ops
    assert not [op for op in ops if op.startswith("AMD:v_cvt_f32_f64")], ops


def test_unscale_offsets_are_64_bit(amd_facts):
    for key, ops in amd_facts.items():
        if key.startswith(("unscale/", "clip/")):
            assert "TTIR:program_id_widened_to_i64" in ops, key


def test_no_variant_needs_an_atomic(amd_facts):
    """A watch's read pass and its per-tensor sums (``stats/finish``) need no atomic."""
    assert "stats/finish" in amd_facts
    for key, ops in _variants(amd_facts).items():
        assert not [op for op in ops if "atomic" in op], key
