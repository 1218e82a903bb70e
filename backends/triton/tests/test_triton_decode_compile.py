"""The decode kernels of the CUDA backend's fused sublayers (``dense_gemv``'s row-op epilogues and fp32 input, the
one-launch router alone and beside the pooler, the q/k norms writing the KV cache, attention with the head norm and
gate, the split keys' merge, the q/k/v/gate GEMV with the q/k norms and with attention in its tails, greedy sampling's
argmax, the unpooler GEMV with the MoE finalize) compile for SM90 with no GPU (``decode_compile.py`` in a subprocess:
the interpreter the other tests enable neither compiles nor type-checks both sides of an ``if``, which let a kernel
that Triton refuses pass every CPU test once). Numerics: the interpreter tests beside this one and, on a GPU,
``backends/cuda/tests/test_cuda_fused.py``."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("decode_compile.py")
KERNELS = {"dense_gemv_kernel": 4, "router_one_launch_kernel": 1, "router_pooler_kernel": 1, "qk_norm_rope_kernel": 4,
           "qkv_gemv_rope_kernel": 2, "qkv_attention_kernel": 2, "attention_kernel": 6, "merge_splits_kernel": 2,
           "decode_embed_kernel": 2, "argmax_partial_kernel": 1, "argmax_final_kernel": 1,
           "greedy_positions_kernel": 1, "finalize_gemv_kernel": 2}


@pytest.mark.slow
def test_fused_decode_kernels_compile_for_sm90():
    if importlib.util.find_spec("triton.backends.nvidia") is None:
        pytest.skip("this Triton has no nvidia backend (triton.backends.nvidia): cannot compile for sm90")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    proc = subprocess.run([sys.executable, str(SCRIPT), "sm90"], capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, f"compiling the fused decode kernels for sm90 failed:\n{proc.stderr[-4000:]}"
    rows = json.loads(proc.stdout)
    want = dict(KERNELS)
    if importlib.util.find_spec("musecore_cuda") is not None:  # the CUDA backend's cuts and early attention too
        for name in ("dense_gemv_kernel", "router_pooler_kernel", "attention_kernel", "decode_embed_kernel",
                     "router_one_launch_kernel"):
            want[name] += 1
        for name in ("router_pooler_kernel", "qkv_gemv_rope_kernel"):  # running a deferred norm (session 79)
            want[name] += 1
    counts = {name: sum(r["kernel"] == name for r in rows) for name in want}
    assert counts == want, f"compiled {counts}, expected {want}"
    over = [r for r in rows if r["shared_bytes"] > 227 * 1024]
    assert not over, f"shared memory over the H200's 227 KiB per block: {over}"
