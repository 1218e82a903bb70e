"""Every Triton kernel the ROCm backend launches compiles for gfx950 (MI350X/MI355X) and gfx942
(MI300X) with no GPU, and the gfx950 W4A4 GEMMs really use the scaled MFMA.

``amd_compile.py`` runs in a subprocess (Triton's interpreter, which the other tests here enable,
cannot compile) and reports each compiled specialization's MFMA instructions, VGPRs and LDS; the
table is printed (``pytest -s``) so a change in register or LDS use shows in the log. Compiling is
not running: nothing here has executed on AMD silicon.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("amd_compile.py")
ARCHES = ("gfx950", "gfx942")
SCALED_MFMA = "_f8f6f4"
EXPECTED_KERNELS = {"mx_gemm_kernel", "mxfp4_quantize_kernel", "w4a16_gemm_kernel", "moe_finalize_kernel",
                    "dense_gemv_kernel", "rms_norm_kernel", "residual_norm_kernel", "qk_norm_rope_kernel",
                    "head_norm_gate_kernel", "silu_mul_kernel", "logit_softcap_kernel", "router_topk_kernel",
                    "router_gemv_kernel",
                    "attention_kernel", "kv_write_kernel", "decode_embed_kernel", "greedy_positions_kernel",
                    "argmax_partial_kernel", "argmax_final_kernel", "align_assignments_kernel"}


def _has_amd_backend() -> bool:
    import importlib.util
    return importlib.util.find_spec("triton.backends.amd") is not None


@pytest.fixture(scope="module")
def compiled() -> dict[str, list[dict]]:
    if not _has_amd_backend():
        pytest.skip("this Triton has no AMD backend (triton.backends.amd): cannot compile for gfx9xx")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    procs = {arch: subprocess.Popen([sys.executable, str(SCRIPT), arch], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, env=env) for arch in ARCHES}
    out = {}
    for arch, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=900)
        assert proc.returncode == 0, f"compiling for {arch} failed:\n{stderr[-4000:]}"
        out[arch] = json.loads(stdout)
    for arch, rows in out.items():
        print(f"\n{arch}: kernel | variant | mfma | VGPRs | AGPRs | scratch B | LDS B | occupancy")
        for r in rows:
            print(f"  {r['kernel']} | {r['variant']} | {','.join(r['mfma']) or '-'} | {r['vgprs']} | {r['agprs']} | "
                  f"{r['scratch_bytes']} | {r['lds_bytes']} | {r['occupancy_waves']}")
    return out


@pytest.mark.parametrize("arch", ARCHES)
def test_every_kernel_the_backend_launches_compiles_for(compiled, arch):
    missing = EXPECTED_KERNELS - {r["kernel"] for r in compiled[arch]}
    assert not missing, f"not compiled for {arch}: {sorted(missing)}"


def test_gfx950_w4a4_gemms_use_the_scaled_mfma(compiled):
    w4a4 = [r for r in compiled["gfx950"] if r["kernel"] == "mx_gemm_kernel" and "w4a4" in r["variant"]]
    assert len(w4a4) >= 4  # decode, mid, prequantized prefill, MoE gate/up and down
    for r in w4a4:
        assert any(m.startswith("v_mfma_scale_f32_") and m.endswith(SCALED_MFMA) for m in r["mfma"]), r


def test_gfx950_w4a4_paths_do_not_spill(compiled):
    for r in compiled["gfx950"]:
        if r["kernel"] == "mx_gemm_kernel" and "w4a4" in r["variant"]:
            assert r["scratch_bytes"] == 0, f"{r['variant']} spills {r['scratch_bytes']} B of scratch"
            assert 0 < r["vgprs"] <= 512 and r["lds_bytes"] <= 160 * 1024  # gfx950: 160 KB LDS per CU


def test_gfx942_has_no_fp4_matrix_cores_so_dot_scaled_upcasts(compiled):
    for r in compiled["gfx942"]:
        assert not any(SCALED_MFMA in m for m in r["mfma"]), r
        if r["kernel"] == "mx_gemm_kernel":
            assert any("bf16" in m for m in r["mfma"]), r


@pytest.mark.parametrize("arch", ARCHES)
def test_router_gemv_multiplies_in_full_fp32(compiled, arch):
    """The split-K router GEMV (``tl.dot`` at ``ieee`` precision) must use fp32 MFMA, never xf32 (TF32-like)."""
    rows = [r for r in compiled[arch] if r["kernel"] == "router_gemv_kernel"]
    assert rows
    for r in rows:
        assert r["mfma"] and all(m.endswith("_f32") and "xf32" not in m for m in r["mfma"]), r
        assert r["scratch_bytes"] == 0 and r["lds_bytes"] <= 64 * 1024, r


@pytest.mark.parametrize("arch", ARCHES)
def test_shared_decode_switches_compile_without_scratch(compiled, arch):
    """The shared kernels' off-by-default decode switches (attention's prefetched key positions and eager first
    step; the greedy graph's fused position update and the Triton argmax) compile for AMD too, so routing one for
    CUDA does not leave ROCm with a kernel never compiled for it. Register pressure is printed, not bounded: with
    the prefetch the gfx9xx decode attention takes 256 VGPRs and some AGPRs (occupancy 1; 205 VGPRs without)."""
    switched = [r for r in compiled[arch] if r["variant"].startswith("attention decode prefetch")]
    assert {(r["constexprs"]["PREFETCH"], r["constexprs"]["EAGER"]) for r in switched} == \
        {("True", "False"), ("False", "True"), ("True", "True")}, switched
    sampling = {r["kernel"] for r in compiled[arch] if r["variant"] == "sampling"}
    assert sampling == {"greedy_positions_kernel", "argmax_partial_kernel", "argmax_final_kernel"}, sampling
    for r in switched + [r for r in compiled[arch] if r["variant"] == "sampling"]:
        assert r["scratch_bytes"] == 0, f"{arch} {r['kernel']} ({r['variant']}) spills {r['scratch_bytes']} B"
