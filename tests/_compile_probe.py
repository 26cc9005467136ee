"""Compile every kernel variant without a GPU, for an H100 (``sm_90``, the default) or an AMD
Instinct GPU (``gfx942``: MI300, ``gfx90a``: MI200), and print facts about the generated code
as JSON: for NVIDIA the PTX's instructions and, where Triton ships ``cuobjdump``, the SASS
ptxas made of it; for AMD the AMDGCN's instructions and its register and spill counts. Run in
a subprocess by test_ptx.py and test_amdgcn.py (``python _compile_probe.py [TARGET]``): it
needs TRITON_INTERPRET unset."""

import json
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "0")

import triton  # noqa: E402
import triton.backends.nvidia  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton_scaler.kernels.guard import spike_guard_kernel  # noqa: E402
from triton_scaler.kernels.stats import finish_stats_kernel  # noqa: E402
from triton_scaler.kernels.unscale import (  # noqa: E402
    GPU_BLOCK,
    GPU_NUM_WARPS,
    GPU_NUM_WARPS_FP64,
    GPU_NUM_WARPS_STATS,
    GPU_NUM_WARPS_STATS_FP64,
    HIP_NUM_WARPS_STATS_FP64,
    unscale_kernel,
)
from triton_scaler.kernels.update import update_scale_kernel  # noqa: E402

#: what each target's facts are about; AMD's wavefronts are 64 threads
TARGETS = {"sm_90": GPUTarget("cuda", 90, 32), "gfx942": GPUTarget("hip", "gfx942", 64),
           "gfx90a": GPUTarget("hip", "gfx90a", 64)}
TARGET = TARGETS["sm_90"]  # set by main()
CUOBJDUMP = os.path.join(os.path.dirname(triton.backends.nvidia.__file__), "bin", "cuobjdump")


def _instructions(ptx):
    ops = set()
    for line in ptx.splitlines():
        line = re.sub(r"^\s*@!?%p\d+\s+", "", line.strip())
        if re.match(r"^[a-z]", line):
            ops.add(line.split()[0].rstrip(";"))
    return sorted(ops)


def _amd_instructions(amdgcn: str) -> list[str]:
    """``AMD:<mnemonic>`` of each instruction (an indented lower-case word: directives start
    with a dot, labels are not indented)."""
    return [f"AMD:{op}" for op in sorted(set(re.findall(r"^\s+([a-z][a-z0-9_]*)\b", amdgcn,
                                                          re.M)))]


_AMD_FMA = re.compile(r"^\s+(v_(?:pk_)?(?:fma|fmac|mad|mac)\w*)\s+(.*)$", re.M)


def _amd_fused_adds(amdgcn: str) -> list[str]:
    """``FUSED_ADD:<n>``: the fused multiply-adds whose addend is not a zero, and
    ``PLUS_ZERO_ADD:<n>``: those whose addend is +0. LLVM writes a multiply whose operand is
    converted from float16 (or whose product is rounded to it) as a mixed-precision fma with
    a zero addend, which rounds the product once, as a multiply does; with ``-0`` (``neg(0)``)
    it is that multiply, with ``+0`` a product of -0 comes out +0. A real addend is a
    contraction, or one of an IEEE division's steps."""
    fused = plus_zero = 0
    for op, operands in _AMD_FMA.findall(amdgcn):
        fourth = re.match(r"(?:[^,\s]+,\s*){3}([^,\s]+)", operands)  # dst, a, b, c, modifiers
        addend = fourth[1] if fourth else operands
        if op.startswith(("v_fmac", "v_mac")) or addend not in ("0", "neg(0)", "-0"):
            fused += 1  # (the accumulating forms add their destination)
        elif addend == "0":
            plus_zero += 1
    return [f"FUSED_ADD:{fused}", f"PLUS_ZERO_ADD:{plus_zero}"]


def _amd_resources(amdgcn: str) -> list[str]:
    """``VGPR:<n>``, ``AGPR:<n>``, ``SGPR:<n>``, their spills, the scratch bytes a thread and
    the float32 / float16-float64 denormal modes (3: kept on input and output), from the
    kernel's metadata and descriptor."""
    facts = []
    for fact, key in (("VGPR", r"\.vgpr_count:"), ("AGPR", r"\.agpr_count:"),
                      ("SGPR", r"\.sgpr_count:"), ("VGPR_SPILL", r"\.vgpr_spill_count:"),
                      ("SGPR_SPILL", r"\.sgpr_spill_count:"),
                      ("SCRATCH", r"\.private_segment_fixed_size:"),
                      ("DENORM32", r"\.amdhsa_float_denorm_mode_32"),
                      ("DENORM16_64", r"\.amdhsa_float_denorm_mode_16_64")):
        found = re.search(rf"^\s*{key}\s+(\d+)", amdgcn, re.M)
        facts.append(f"{fact}:{found[1] if found else 'missing'}")
    return facts


def _compile(fn, signature, constexprs, attrs, num_warps, fp_fusion=False):
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    kernel = triton.compile(src, target=TARGET, options={"num_warps": num_warps,
                                                          "enable_fp_fusion": fp_fusion})
    if TARGET.backend == "hip":
        amdgcn = kernel.asm["amdgcn"]
        ops = _amd_instructions(amdgcn) + _amd_resources(amdgcn) + _amd_fused_adds(amdgcn)
    else:
        ops = _instructions(kernel.asm["ptx"]) + _sass_facts(kernel.asm["cubin"])
    if "tt.get_program_id" in kernel.asm["ttir"]:  # offsets must be 64-bit: >2**31 elements
        pid_line = re.search(r"(%\S+) = tt.get_program_id", kernel.asm["ttir"]).group(1)
        widened = re.search(rf"arith.extsi {re.escape(pid_line)} : i32 to i64", kernel.asm["ttir"])
        ops.append("TTIR:program_id_widened_to_i64" if widened else "TTIR:program_id_i32")
    return ops + [f"WARPS:{num_warps}"]


@triton.jit
def _multiply_add(x_ptr, BLOCK: tl.constexpr):
    """Not a scaler kernel: ``x * x + 1`` in place, for the probe's control."""
    ptrs = x_ptr + tl.arange(0, BLOCK)
    x = tl.load(ptrs)
    tl.store(ptrs, x * x + 1.0)


def _sass_facts(cubin: bytes) -> list[str]:
    """``SASS:<op>`` for each global / local memory access opcode of the machine code, and
    ``REG:<n>`` / ``LOCAL:<bytes>`` from its resource usage (none without cuobjdump)."""
    if not os.path.exists(CUOBJDUMP):
        return []
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        dump = subprocess.run([CUOBJDUMP, "-res-usage", "-sass", f.name], capture_output=True,
                              text=True, check=True).stdout
    memory_ops = set(re.findall(r"\b((?:LDG|STG|LDL|STL)(?:\.[A-Z0-9]+)*)\b", dump))
    usage = re.search(r"REG:(\d+) .*LOCAL:(\d+)", dump)
    return [f"SASS:{op}" for op in sorted(memory_ops)] + [f"REG:{usage[1]}",
                                                           f"LOCAL:{usage[2]}"]


def _unscale_signature(dtype):
    return {"grad_ptr": f"*{dtype}", "table_ptr": "*i64", "starts_ptr": "*i64",
            "inv_scale_ptr": "*fp32", "found_inf_ptr": "*fp32", "coef_ptr": "*fp32",
            "partial_ptr": "*fp32" if dtype != "fp64" else "*fp64", "stats_ptr": "*fp64",
            "n_elements": "i64",
            **{name: "constexpr" for name in ("BLOCK", "USE_TABLE", "WRITE", "BF16_BITS",
                                              "VEC", "FP64", "ROUND", "NORM", "CLIP",
                                              "INV_FROM_SCALE", "STATS")}}


def main():
    global TARGET
    TARGET = TARGETS[sys.argv[1] if len(sys.argv) > 1 else "sm_90"]
    facts = {}
    names = list(unscale_kernel.arg_names)
    # what triton's launcher specialises for a 16-byte aligned pointer / a size % 16 == 0
    aligned_ptr = {(names.index("grad_ptr"),): [["tt.divisibility", 16]]}
    aligned_size = {**aligned_ptr, (names.index("n_elements"),): [["tt.divisibility", 16]]}
    for dtype in ("fp32", "fp16", "bf16", "fp64"):
        signature = _unscale_signature(dtype)
        warps = GPU_NUM_WARPS_FP64 if dtype == "fp64" else GPU_NUM_WARPS  # as launch_unscale
        for use_table in (False, True):
            for write in (True, False):
                constexprs = {"BLOCK": GPU_BLOCK, "USE_TABLE": use_table, "WRITE": write,
                              "BF16_BITS": False,
                              "VEC": 16 // {"fp32": 4, "fp16": 2, "bf16": 2, "fp64": 8}[dtype],
                              "FP64": dtype == "fp64", "ROUND": write, "NORM": 0,
                              "CLIP": False, "INV_FROM_SCALE": False, "STATS": False}
                key = f"unscale/{dtype}/{'table' if use_table else 'flat'}/" \
                      f"{'write' if write else 'check'}"
                facts[key] = _compile(unscale_kernel, signature, constexprs, aligned_size, warps)
                if not use_table and dtype != "fp64":  # n % 16 != 0: only the base aligned
                    facts[key + "/odd_size"] = _compile(unscale_kernel, signature, constexprs,
                                                        aligned_ptr, warps)
                if use_table and dtype == "fp32":  # the scaler's route: inv from the scale
                    facts[key + "/inv_from_scale"] = _compile(
                        unscale_kernel, signature, {**constexprs, "INV_FROM_SCALE": True},
                        aligned_ptr, warps)
                # clip_grad_norm_'s two passes: a table group's, or a bucket's (flat, padded)
                for name, extra in (("norm2", dict(WRITE=False, ROUND=True, NORM=2)),
                                    ("norminf", dict(WRITE=False, ROUND=True, NORM=-1)),
                                    ("clip", dict(WRITE=True, ROUND=True, CLIP=True))):
                    if write == extra["WRITE"]:
                        facts[f"clip/{dtype}/{'table' if use_table else 'flat'}/{name}"] = \
                            _compile(unscale_kernel, signature, {**constexprs, **extra},
                                     aligned_ptr if use_table else aligned_size, warps)
                if not write:  # a watch's read pass (the watch_stats op, every route)
                    facts[f"stats/{dtype}/{'table' if use_table else 'flat'}/check"] = \
                        _compile(unscale_kernel, signature, {**constexprs, "STATS": True},
                                 aligned_ptr, GPU_NUM_WARPS_STATS if dtype != "fp64" else
                                 HIP_NUM_WARPS_STATS_FP64 if TARGET.backend == "hip" else
                                 GPU_NUM_WARPS_STATS_FP64)
    facts["stats/finish"] = _compile(
        finish_stats_kernel, {"stats_ptr": "*fp64", "ranges_ptr": "*i64", "out_ptr": "*fp64"},
        {}, {}, 4)
    for hysteresis in (False, True):
        signature = {"scale_ptr": "*fp32", "growth_tracker_ptr": "*i32",
                     "found_inf_ptr": "*fp32", "hysteresis_tracker_ptr": "*i32",
                     "params_ptr": "*fp64", "skipped_ptr": "*u8", "skipped_count_ptr": "*i64",
                     "stats_ptr": "*fp64", "overflow_ptr": "*fp64", "counters_ptr": "*fp64",
                     "guard_ptr": "*fp64", "n_rows": "i32",
                     **{name: "constexpr" for name in ("N_FOUND", "HAS_HYSTERESIS",
                                                       "CONSECUTIVE_HYSTERESIS", "DYNAMIC",
                                                       "RECORD_SKIP", "RESET_FOUND", "WATCH",
                                                       "GUARD")}}
        # ops.update_scale_ / the scaler's whole update() / a watched one / a skipping guard's
        for kind in ("op", "scaler", "scaler+watch", "scaler+guard"):
            scaler = kind != "op"
            facts[f"update/hysteresis={hysteresis}/{kind}"] = _compile(
                update_scale_kernel, signature,
                {"N_FOUND": 8 if scaler else 1, "HAS_HYSTERESIS": hysteresis,
                 "CONSECUTIVE_HYSTERESIS": False, "DYNAMIC": True, "RECORD_SKIP": scaler,
                 "RESET_FOUND": scaler, "WATCH": kind == "scaler+watch",
                 "GUARD": kind == "scaler+guard"}, {}, 1)
    for mode, clip_mean, skip in ((True, False, False), (True, True, True), (False, False, True)):
        facts[f"guard/zscore={mode}/mean={clip_mean}/skip={skip}"] = _compile(
            spike_guard_kernel, {"stats_ptr": "*fp64", "settings_ptr": "*fp64",
                                 "norm_ptr": "*fp32", "ZSCORE": "constexpr",
                                 "CLIP_MEAN": "constexpr", "SKIP": "constexpr"},
            {"ZSCORE": mode, "CLIP_MEAN": clip_mean, "SKIP": skip}, {}, 1)
    if TARGET.backend == "hip":  # what FUSED_ADD sees of a contraction: x * x + 1, fused
        facts["control/fp32/fused_multiply_add"] = _compile(
            _multiply_add, {"x_ptr": "*fp32", "BLOCK": "constexpr"}, {"BLOCK": 1024}, {},
            GPU_NUM_WARPS, fp_fusion=True)
    json.dump(facts, sys.stdout)


if __name__ == "__main__":
    main()
