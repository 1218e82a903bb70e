"""The towers' Triton kernels compile for the GPUs they target (SM90 for the CUDA backend, gfx950 and gfx942 for ROCm)
with no GPU: ``towers_compile.py`` runs in a subprocess (the interpreter the other tests enable cannot
compile) and reports each specialization's shared memory, which must fit the target (H200: 227 KiB per
block, MI355X: 160 KiB LDS, MI300X: 64 KiB). Compiling is not running: numerics are checked by the interpreter tests and, on
a GPU, by the ``gpu`` tests."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("towers_compile.py")
TARGETS = {"sm90": ("nvidia", 227 * 1024), "gfx950": ("amd", 160 * 1024), "gfx942": ("amd", 64 * 1024)}
KERNELS = {"varlen_attention_kernel", "causal_conv1d_kernel", "rope_kernel"}


@pytest.fixture(scope="module")
def compiled() -> dict[str, list[dict]]:
    """Every target compiled at once (one subprocess each), each target's rows; a target whose Triton backend is
    missing maps to None."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    procs = {arch: subprocess.Popen([sys.executable, str(SCRIPT), arch], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True, env=env)
             for arch, (vendor, _) in TARGETS.items() if importlib.util.find_spec(f"triton.backends.{vendor}")}
    out: dict[str, list[dict]] = {}
    for arch, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=900)
        assert proc.returncode == 0, f"compiling the tower kernels for {arch} failed:\n{stderr[-4000:]}"
        out[arch] = json.loads(stdout)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("arch", list(TARGETS))
def test_tower_kernels_compile_for(compiled, arch):
    vendor, shared_limit = TARGETS[arch]
    if arch not in compiled:
        pytest.skip(f"this Triton has no {vendor} backend (triton.backends.{vendor}): cannot compile for {arch}")
    rows = compiled[arch]
    for r in rows:
        print(f"{arch} {r['kernel']} {r['constexprs']} {r['options']}: {r['shared_bytes']} B shared")
    assert {r["kernel"] for r in rows} == KERNELS
    over = [r for r in rows if r["shared_bytes"] > shared_limit]
    assert not over, f"{arch}: shared memory over {shared_limit} B: {over}"
