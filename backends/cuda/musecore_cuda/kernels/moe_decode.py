"""The MoE op at decode through the CUDA C++ expert GEMVs (NVRTC): one FP4 GEMV per token-expert
assignment for gate+up+SwiGLU and one for down, then the portable Triton finalize.

From :data:`RUNS_MIN_TOKENS` tokens the assignments are sorted by expert first (``torch.sort``), and each GEMV
program computes a run of one expert's assignments together (``fp4_gemv_cuda.launch(perm=...)``): an expert that
several tokens chose streams once per run chunk instead of once per assignment. At batch 1 top-k never repeats an
expert, and at 2 a repeat is rare (~0.25 of 16 assignments over 256 experts), not worth the sort's launches.

:func:`use_gemv` is the choice between this path and the grouped Triton GEMM of
:func:`musecore_triton.kernels.moe.moe_forward`; ``CudaBackend.moe`` makes it, and
``CudaBackend.kernel_choices`` shows it.
"""

from __future__ import annotations

from typing import Optional

import torch

from musecore_cuda.kernels import fp4_gemv_cuda
from musecore_triton.kernels.moe import ExpertStack, finalize
from musecore_triton.layouts import Fp4Resident


RUNS_MIN_TOKENS = 4  # batch from which the GEMVs take runs of one expert (sorted assignments)


def use_gemv(stack: ExpertStack, n_assign: int, num_experts: int) -> bool:
    """Per-assignment GEMV (decode) when assignments are few enough that experts rarely repeat.

    Each assignment streams its expert's weights once, so an expert chosen by two tokens is read
    twice: ``n`` assignments spread over ``E`` experts read ``n / (E (1 - (1 - 1/E)^n))`` times the
    routed bytes, 1.58x at ``n = E`` and 2.3x at ``2E``. The GEMV streams at about twice the grouped
    GEMM's bandwidth (measured on the H200), so it wins up to ``n = E``; the routing also needs no sort, no alignment and no gathers (~15 fewer kernels).
    """
    return (isinstance(stack, Fp4Resident) and n_assign <= max(1, num_experts)
            and fp4_gemv_cuda.available(stack.packed.device))  # (both decode kernels take M = 1)


def moe_decode_gemv(z: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate: Fp4Resident,
                    up: Fp4Resident, down: Fp4Resident, post_norm: torch.Tensor, post_eps: float,
                    plans: Optional[tuple[fp4_gemv_cuda.GemvPlan, fp4_gemv_cuda.GemvPlan]] = None,
                    runs: Optional[bool] = None) -> torch.Tensor:
    """The ``moe`` op at decode: gate+up+SwiGLU and down as one FP4 GEMV per token-expert assignment
    (``plans`` overrides ``make_plan``'s cuts for the two launches, for sweeps; ``runs`` forces runs of one
    expert on or off, default from :data:`RUNS_MIN_TOKENS`; the output bits are the same either way)."""
    T, topk = ids.shape
    width, inter = z.shape[-1], gate.out_features
    flat = ids.reshape(-1).contiguous()
    z = z.contiguous()
    h = torch.empty(flat.numel(), inter, dtype=z.dtype, device=z.device)
    # The tensor-core kernel reduces its K splits before SwiGLU; the FMA kernel's fp32 atomics cannot.
    split = fp4_gemv_cuda.kind_for(1, z.dtype) == "mma"
    plan_up, plan_down = plans or (
        fp4_gemv_cuda.make_plan(1, inter, width, z.dtype, z.device, allow_split=split, programs=flat.numel(),
                                swiglu=True),
        fp4_gemv_cuda.make_plan(1, width, inter, z.dtype, z.device, allow_split=split, programs=flat.numel()))
    order, perm = flat, None  # the GEMVs' programs: assignments in their own order, or sorted by expert (runs)
    if (T >= RUNS_MIN_TOKENS if runs is None else runs) and split:  # (runs are an MMA-kernel mode)
        run_up, run_down = fp4_gemv_cuda.run_plan(plan_up, width, swiglu=True), fp4_gemv_cuda.run_plan(plan_down, inter)
        if run_up and run_down:  # (both fit at least 2 staged rows: at the 816B and muse-small widths, 5 and 8)
            plan_up, plan_down = run_up, run_down
            order, perm = torch.sort(flat)  # sorted expert ids, and the assignment at each sorted position
    fp4_gemv_cuda.launch(z, gate.packed, gate.scales, gate.out_scale, wfmt=gate.wfmt, fold_log2=gate.fold_log2,
                         n=inter, k=width, out=h, plan=plan_up, ids=order, a_div=topk, packed2=up.packed,
                         scales2=up.scales, out_scale2=up.out_scale, perm=perm)
    o = torch.empty(flat.numel(), width, dtype=torch.float32, device=z.device)
    fp4_gemv_cuda.launch(h, down.packed, down.scales, down.out_scale, wfmt=down.wfmt, fold_log2=down.fold_log2,
                         n=width, k=inter, out=o, plan=plan_down, ids=order, a_div=1, perm=perm)
    return finalize(o, flat, ids, weights, post_norm, post_eps, sorted_rows=False, act_dtype=z.dtype)


