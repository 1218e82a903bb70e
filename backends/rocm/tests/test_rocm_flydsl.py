"""The FlyDSL MoE kernels (``backends/rocm/lab/flydsl``: the MXFP4 expert GEMMs gate/up with SwiGLU and down, and
the finalize) compile to gfx950 with no GPU.

FlyDSL's compile-only mode (``COMPILE_ONLY=1 ARCH=gfx950``) in a subprocess; its final ISA is dumped and
checked: the GEMMs for ``v_mfma_scale_f32_16x16x128_f8f6f4`` on e2m1 x e2m1 (``cbsz:4 blgp:4``), one per
128-wide K step and weight (two for gate/up); the finalize for one load of each expert-row element, the
hardware bf16 conversion, one wave reduction (DPP) and one square root per assignment, and the cross-wave
sum through LDS. Register, scratch and LDS use are printed and bounded. No kernel has ever run (no AMD GPU, no
FlyDSL interpreter): this proves the toolchain and the instruction choice, not the numerics.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KERNEL = ROOT / "lab" / "flydsl" / "mx_expert_gemm.py"
FINALIZE = ROOT / "lab" / "flydsl" / "moe_finalize.py"
SHIM = Path(__file__).with_name("flydsl_ld_lld.py")


def _toolkit(tmp_path: Path) -> Path:
    """A ROCm toolkit root whose ``llvm/bin/ld.lld`` is Triton's embedded LLD (``flydsl_ld_lld.py``)."""
    if os.path.exists("/opt/rocm/llvm/bin/ld.lld"):
        return Path("/opt/rocm")
    if importlib.util.find_spec("triton.backends.amd") is None:
        pytest.skip("no ld.lld for FlyDSL: no /opt/rocm and this Triton has no AMD backend (its LLD)")
    root = tmp_path / "rocm"
    lld = root / "llvm" / "bin" / "ld.lld"
    lld.parent.mkdir(parents=True)
    lld.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{SHIM}" "$@"\n')
    lld.chmod(0o755)
    return root


def _compile_isa(tmp_path: Path, script: Path, *args) -> str:
    """Compile ``script args`` for gfx950 in FlyDSL's compile-only mode; the final ISA text."""
    if importlib.util.find_spec("flydsl") is None:
        pytest.skip("FlyDSL is not installed (pip install flydsl==0.5.0)")
    env = {**os.environ, "COMPILE_ONLY": "1", "ARCH": "gfx950", "ROCM_PATH": str(_toolkit(tmp_path)),
           "FLYDSL_DEBUG_DUMP_ASM": "1", "FLYDSL_DUMP_DIR": str(tmp_path / "dump"),
           "HOME": str(tmp_path)}  # FlyDSL caches under ~/.flydsl: a fresh one, so the ISA is dumped
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, str(script), *map(str, args)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    isa_files = list((tmp_path / "dump").glob("*/*final_isa.s"))
    assert isa_files, f"FlyDSL wrote no ISA dump:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    return isa_files[0].read_text()


def _resources(isa: str) -> dict[str, int]:
    keys = {"vgprs": r"\.vgpr_count", "agprs": r"\.agpr_count", "scratch": r"\.private_segment_fixed_size",
            "lds": r"\.group_segment_fixed_size", "spills": r"\.vgpr_spill_count"}
    return {k: int(re.search(rf"{pat}:\s+(\d+)", isa).group(1)) for k, pat in keys.items()}


# the 816B experts: gate/up 4096 -> 2 x 4096, down 4096 -> 4096
@pytest.mark.parametrize("kind, K, N, per_step", [("gate_up", 4096, 4096, 2), ("down", 4096, 4096, 1)])
def test_flydsl_mxfp4_expert_gemm_compiles_to_gfx950_scaled_mfma(tmp_path, kind, K, N, per_step):
    isa = _compile_isa(tmp_path, KERNEL, kind, K, N, 4, 32)
    scaled = re.findall(r"v_mfma_scale_f32_16x16x128_f8f6f4 .*cbsz:4 blgp:4", isa)
    assert len(scaled) == per_step * K // 128, f"expected {per_step * K // 128} e2m1 x e2m1 scaled MFMAs, found {len(scaled)}"
    res = _resources(isa)
    print(f"\nFlyDSL {kind} K={K} N={N} gfx950: {len(scaled)} scaled MFMAs, {res}")
    assert res["vgprs"] <= 512 and res["lds"] == 0 and res["scratch"] == 0


def test_flydsl_moe_finalize_compiles_to_gfx950(tmp_path):
    """The 816B finalize: hidden 4096, top-8, bf16 activations; 256 threads, 16 columns each."""
    L, topk, per_thread = 4096, 8, 4096 // 256
    isa = _compile_isa(tmp_path, FINALIZE, L, topk, "bf16", 4)
    count = lambda pattern: len(re.findall(pattern, isa))  # noqa: E731
    found = {"row loads": count(r"global_load_dword\b"), "stores": count(r"global_store_dword\b"),
             "bf16 cvt": count(r"v_cvt_pk_bf16_f32"), "dpp adds": count(r"v_add_f32_dpp"), "sqrt": count(r"v_sqrt_f32"),
             "lds writes": count(r"ds_write"), "lds reads": count(r"ds_read"), "barriers": count(r"s_barrier")}
    res = _resources(isa)
    print(f"\nFlyDSL finalize L={L} top-{topk} bf16 gfx950: {found}, {res}")
    assert found["row loads"] == topk * per_thread, found  # each element of the k expert rows read once
    assert found["stores"] == per_thread, found           # y written once, fp32
    assert found["bf16 cvt"] > 0 and found["sqrt"] == topk, found  # hardware bf16 rounding; one norm per row
    assert found["dpp adds"] >= 4 * topk, found              # each row's sum of squares: a DPP wave reduction
    assert found["lds writes"] >= topk and found["lds reads"] >= topk and found["barriers"] >= topk, found
    assert res["scratch"] == 0 and res["spills"] == 0 and res["agprs"] == 0 and res["vgprs"] <= 256, res
    assert 0 < res["lds"] <= 64, res  # the 4 wave sums
