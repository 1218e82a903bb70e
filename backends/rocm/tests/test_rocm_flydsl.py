"""The FlyDSL MXFP4 expert GEMMs (``backends/rocm/lab/flydsl``: gate/up with SwiGLU, down) compile to gfx950
scaled MFMA with no GPU.

FlyDSL's compile-only mode (``COMPILE_ONLY=1 ARCH=gfx950``) in a subprocess; its final ISA is dumped
and checked for ``v_mfma_scale_f32_16x16x128_f8f6f4`` on e2m1 x e2m1 (``cbsz:4 blgp:4``), one per
128-wide K step and weight (two for gate/up), and its register and LDS use are printed. The kernel has never run (no AMD GPU, no
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


# the 816B experts: gate/up 4096 -> 2 x 4096, down 4096 -> 4096
@pytest.mark.parametrize("kind, K, N, per_step", [("gate_up", 4096, 4096, 2), ("down", 4096, 4096, 1)])
def test_flydsl_mxfp4_expert_gemm_compiles_to_gfx950_scaled_mfma(tmp_path, kind, K, N, per_step):
    if importlib.util.find_spec("flydsl") is None:
        pytest.skip("FlyDSL is not installed (pip install flydsl==0.5.0)")
    env = {**os.environ, "COMPILE_ONLY": "1", "ARCH": "gfx950", "ROCM_PATH": str(_toolkit(tmp_path)),
           "FLYDSL_DEBUG_DUMP_ASM": "1", "FLYDSL_DUMP_DIR": str(tmp_path / "dump"),
           "HOME": str(tmp_path)}  # FlyDSL caches under ~/.flydsl: a fresh one, so the ISA is dumped
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, str(KERNEL), kind, str(K), str(N), "4", "32"], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    isa_files = list((tmp_path / "dump").glob("*/*final_isa.s"))
    assert isa_files, f"FlyDSL wrote no ISA dump:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    isa = isa_files[0].read_text()
    scaled = re.findall(r"v_mfma_scale_f32_16x16x128_f8f6f4 .*cbsz:4 blgp:4", isa)
    assert len(scaled) == per_step * K // 128, f"expected {per_step * K // 128} e2m1 x e2m1 scaled MFMAs, found {len(scaled)}"
    vgprs = int(re.search(r"\.vgpr_count:\s+(\d+)", isa).group(1))
    lds = int(re.search(r"\.group_segment_fixed_size:\s+(\d+)", isa).group(1))
    print(f"\nFlyDSL {kind} K={K} N={N} gfx950: {len(scaled)} scaled MFMAs, {vgprs} VGPRs, {lds} B LDS")
    assert vgprs <= 512 and lds == 0
