"""The CUDA C++ kernels compiled for SM90 (the H200's ISA) on a host with no GPU, through NVRTC (``nvrtc_sass.py``):
every decode-GEMV instantiation the plans pick for the 816B shapes (linear M = 1..16, the MoE decode's SwiGLU and
down launches with and without runs, NVFP4 and MXFP4), the dequantize and the tiled GEMM's plans. Each must compile
without spills, and the q_proj M = 1 decode GEMV's K loop must stay within its instruction budget: that kernel is
issue-bound (lab NOTES, session 56), so instructions per chunk are its speed at M = 1."""

from __future__ import annotations

import functools
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # (the helper beside this file; pytest runs from the repository root)
import nvrtc_sass  # noqa: E402
from musecore_cuda.bench import LINEAR_SHAPES  # noqa: E402
from musecore_cuda.kernels import fp4_gemm_cuda, fp4_gemv_cuda, moe_decode  # noqa: E402
from musecore_triton.kernels.fp4_gemm import WFMT_MXFP4, WFMT_NVFP4  # noqa: E402

pytestmark = pytest.mark.skipif(nvrtc_sass.missing() is not None, reason=str(nvrtc_sass.missing()))

CUDA = torch.device("cuda")  # (the MMA plans read no device property)
# Warp instructions per 128-element chunk of the q_proj M = 1 K loop (that kernel is issue-bound): 246 in session 55's
# kernel, 206 in the lean path that the M = 1 cuts (KW > 1) take since session 56 (csrc/fp4_gemv.cu, gemv_mma_body).
Q_PROJ_M1_BUDGET = 210


def decode_kernel_names() -> list[str]:
    names = set()
    for wfmt in (WFMT_NVFP4, WFMT_MXFP4):
        for n, k in LINEAR_SHAPES.values():
            for m in (1, 2, 4, 8, 16):
                plan = fp4_gemv_cuda.make_plan(m, n, k, torch.bfloat16, CUDA)
                names |= {fp4_gemv_cuda.plan_kernel_name(plan, wfmt, early=e) for e in (False, True)}
        for programs in (8, 64):  # the 816B MoE decode (4096 x 4096 experts) at batch 1 and 8
            up = fp4_gemv_cuda.make_plan(1, 4096, 4096, torch.bfloat16, CUDA, programs=programs, swiglu=True)
            down = fp4_gemv_cuda.make_plan(1, 4096, 4096, torch.bfloat16, CUDA, programs=programs)
            for width in (4096, 768):  # what moe_decode runs (per assignment, on runs): 816B and muse-small
                for ask_runs in (False, True):
                    per_up, per_down, runs = moe_decode._plans(width, width, torch.bfloat16, CUDA, programs, ask_runs)
                    names |= {fp4_gemv_cuda.plan_kernel_name(p, wfmt, True, sw, early=e, runs=runs)
                              for p, sw in ((per_up, True), (per_down, False)) for e in (False, True)}
            for plan, swiglu in ((up, True), (down, False)):
                runs = fp4_gemv_cuda.run_plan(plan, 4096, swiglu=swiglu)
                for p, on_runs in ((plan, False), (runs, True)) if runs else ((plan, False),):
                    names |= {fp4_gemv_cuda.plan_kernel_name(p, wfmt, True, swiglu, early=e, runs=on_runs)
                              for e in (False, True)}
    return sorted(names)


@functools.lru_cache(maxsize=None)
def compiled(source: str, name: str) -> nvrtc_sass.Compiled:
    return nvrtc_sass.inspect(nvrtc_sass.compile_cubin(source, name))


@pytest.mark.parametrize("name", decode_kernel_names())
def test_decode_gemv_compiles_for_sm90_without_spills(name):
    c = compiled(fp4_gemv_cuda.SOURCE, name)
    assert c.stack == 0 and c.registers <= 255, f"{name}: {c.registers} registers, {c.stack}-byte stack (spills)"


def test_q_proj_m1_decode_loop_stays_within_its_instruction_budget():
    n, k = LINEAR_SHAPES["q_proj"]
    plan = fp4_gemv_cuda.make_plan(1, n, k, torch.bfloat16, CUDA)
    loop = compiled(fp4_gemv_cuda.SOURCE, fp4_gemv_cuda.plan_kernel_name(plan, WFMT_NVFP4)).main_loop()
    per_chunk = len(loop) / (plan.prefetch + 1)  # the loop body is unrolled over the ring's prefetch + 1 slots
    ops = nvrtc_sass.opcode_counts(loop)
    assert ops["HMMA"] == 8 * (plan.prefetch + 1), f"expected 8 mma per chunk: {dict(ops)}"
    assert per_chunk <= Q_PROJ_M1_BUDGET, (
        f"{per_chunk:.0f} warp instructions per chunk > budget {Q_PROJ_M1_BUDGET}: {ops.most_common(12)}")


@pytest.mark.parametrize("min_blocks,cap", [(4, 128), (8, 64)])
def test_a_plans_min_blocks_caps_the_decode_gemvs_registers(min_blocks, cap):
    """``GemvPlan.min_blocks`` reaches the kernel's ``__launch_bounds__``: the MoE's SwiGLU GEMV (159 registers
    uncapped) at one chunk in flight fits ``min_blocks`` blocks of 128 threads per SM."""
    plan = fp4_gemv_cuda.make_plan(1, 4096, 4096, torch.bfloat16, CUDA, programs=8, swiglu=True)
    free = compiled(fp4_gemv_cuda.SOURCE, fp4_gemv_cuda.plan_kernel_name(plan, WFMT_NVFP4, True, True))
    capped = replace(plan, prefetch=1, min_blocks=min_blocks)
    c = compiled(fp4_gemv_cuda.SOURCE, fp4_gemv_cuda.plan_kernel_name(capped, WFMT_NVFP4, True, True))
    assert free.registers > 128 and c.registers <= cap, (free.registers, c.registers)


@pytest.mark.parametrize("wfmt", [WFMT_NVFP4, WFMT_MXFP4])
def test_dequantize_compiles_for_sm90(wfmt):
    c = compiled(fp4_gemv_cuda.SOURCE, f"fp4_dequant<{wfmt}>")
    assert c.stack == 0, f"fp4_dequant<{wfmt}>: {c.stack}-byte stack"


@pytest.mark.parametrize("plan", [fp4_gemm_cuda.GemmPlan(groups=2, tile=1, split=4),
                                  fp4_gemm_cuda.GemmPlan(groups=8, tile=2),
                                  fp4_gemm_cuda.GemmPlan(groups=8, tile=1, split=2)], ids=str)
def test_tiled_gemm_plans_compile_for_sm90_without_spills(plan):
    """Cuts make_plan picks at M = 16 / 64 / 256 (its choice needs the driver's occupancy, so they are named here)."""
    name = fp4_gemm_cuda.kernel_name(plan, WFMT_NVFP4)
    c = compiled(fp4_gemm_cuda.SOURCE, name)
    assert c.stack == 0 and c.registers <= 255, f"{name}: {c.registers} registers, {c.stack}-byte stack"
