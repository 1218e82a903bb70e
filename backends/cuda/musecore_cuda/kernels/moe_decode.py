"""The MoE op at decode through the CUDA C++ expert GEMVs (NVRTC): one FP4 GEMV per token-expert
assignment for gate+up+SwiGLU and one for down, then the portable Triton finalize.

From :data:`HANDOFF_FROM_TOKENS` tokens on large experts the down GEMV is launched with the PDL attribute and a
hand-off (``fp4_gemv_cuda.Handoff``): its blocks start in the gate/up GEMV's last wave, each waiting only for the
gate/up warps of its own assignment (or run chunk). It loses at batch 1 and on small experts
(:func:`handoff_by_default`); ``MUSECORE_CUDA_MOE_HANDOFF`` forces it on (``1``) or off (``0``) at every batch.

From :data:`RUNS_MIN_TOKENS` tokens the assignments are sorted by expert first (one Triton program,
``musecore_triton.kernels.sort``), and each GEMV
program computes a run of one expert's assignments together (``fp4_gemv_cuda.launch(perm=...)``): an expert that
several tokens chose streams once per run chunk instead of once per assignment. At batch 1 top-k never repeats an
expert, and at 2 a repeat is rare (~0.25 of 16 assignments over 256 experts), not worth the sort's launches.

:func:`use_gemv` is the choice between this path and a grouped GEMM (the Gluon one of
:mod:`musecore_cuda.kernels.moe_prefill` from a few tokens on large experts, where it can run, else the Triton one of
:func:`musecore_triton.kernels.moe.moe_forward`); ``CudaBackend.moe`` makes it, and
``CudaBackend.kernel_choices`` shows it.
"""

from __future__ import annotations

import functools
import os
from dataclasses import replace
from typing import Optional

import torch

from musecore_cuda.kernels import fp4_gemv_cuda, moe_prefill
from musecore_triton.kernels.moe import ExpertStack, finalize
from musecore_triton.kernels.sort import MAX_ASSIGNMENTS, MAX_EXPERTS, sort_assignments
from musecore_triton.layouts import Fp4Resident


RUNS_MIN_TOKENS = 4  # batch from which the GEMVs may take runs of one expert (sorted assignments): past E assignments
# Batch from which they take runs up to E assignments too. One program per assignment against runs on the 816B layer
# (H200, session 44, cuda_moe_runs_probe.py): 358 vs 414 us at batch 4, even at 6 and 8 (513/515, 665/666), 972 vs 862
# at 12 and 1285 vs 1137 at 16.
RUNS_FROM_TOKENS = 8


def on_runs_by_default(tokens: int, n_assign: int, num_experts: int) -> bool:
    """Whether the decode GEMVs run on runs of one expert for ``tokens`` tokens' ``n_assign`` assignments: from
    :data:`RUNS_FROM_TOKENS` tokens, or from :data:`RUNS_MIN_TOKENS` when the assignments outnumber the experts."""
    return tokens >= RUNS_FROM_TOKENS or (tokens >= RUNS_MIN_TOKENS and n_assign > num_experts)


# Most assignments the GEMVs take when they run on runs of one expert: measured to batch 128 (1024 assignments) on the
# 816B layer, where runs took 3.5 ms against the grouped GEMM's 6.0 (batch 64: 2.5 against 5.1;
# backends/cuda/lab/scripts/cuda_moe_runs_probe.py, session 43); beyond, unmeasured, the grouped GEMM.
RUNS_MAX_ASSIGNMENTS = 1024


def use_gemv(stack: ExpertStack, n_assign: int, num_experts: int, *, tokens: int = 1,
             dtype: torch.dtype = torch.bfloat16, gluon: bool = False) -> bool:
    """The decode GEMVs (this module) rather than a grouped GEMM, for ``n_assign`` assignments of ``tokens``
    tokens with ``dtype`` activations; ``gluon``: the grouped Gluon GEMM can take these experts
    (``moe_prefill.unavailable_reason`` is None), and then it takes the batches of ``moe_prefill.takes_decode``.

    One program per assignment streams its expert's weights once per assignment, so an expert chosen by two
    tokens is read twice: ``n`` assignments spread over ``E`` experts read ``n / (E (1 - (1 - 1/E)^n))`` times the
    routed bytes, 1.58x at ``n = E`` and 2.3x at ``2E``. The GEMV streams at about twice the grouped Triton GEMM's
    bandwidth (measured on the H200), so it wins up to ``n = E``; the routing also needs no sort, no alignment and
    no gathers. On runs of one expert (from :data:`RUNS_MIN_TOKENS` tokens, bf16) an expert streams once per run
    chunk instead, and the GEMVs beat the grouped Triton GEMM up to :data:`RUNS_MAX_ASSIGNMENTS`. The grouped Gluon
    GEMM streams as fast as the GEMVs on large experts, so it takes over from a few tokens there (``gluon``).
    """
    return (isinstance(stack, Fp4Resident) and fp4_gemv_cuda.available(stack.packed.device)  # (M = 1 kernels)
            and gemv_rule(n_assign, num_experts, tokens, stack.in_features, stack.out_features, dtype,
                          stack.packed.device, gluon))


def gemv_rule(n_assign: int, num_experts: int, tokens: int, width: int, inter: int, dtype: torch.dtype,
              device: torch.device, gluon: bool = False) -> bool:
    """:func:`use_gemv`'s rule for experts ``gate/up [2I, h]``, ``down [h, I]`` (``width`` h, ``inter`` I), without
    the weights (the plan shows it with no GPU: the runs plans need no device for bf16)."""
    if gluon and moe_prefill.takes_decode(tokens, width, inter):
        return False
    if n_assign <= max(1, num_experts):
        return True
    return (n_assign <= RUNS_MAX_ASSIGNMENTS and tokens >= RUNS_MIN_TOKENS
            and _plans(width, inter, dtype, device, n_assign, True)[2])


@functools.lru_cache(maxsize=256)
def _plans(width: int, inter: int, dtype: torch.dtype, device: torch.device, programs: int, runs: bool
           ) -> tuple[fp4_gemv_cuda.GemvPlan, fp4_gemv_cuda.GemvPlan, bool]:
    """(gate/up plan, down plan, on runs) for ``programs`` assignments: runs plans when ``runs`` is asked, the
    activations are bf16 (runs are an MMA-kernel mode) and both fit at least 2 staged rows (at the 816B and
    muse-small widths, 5 and 8)."""
    # The tensor-core kernel reduces its K splits before SwiGLU; the FMA kernel's fp32 atomics cannot.
    split = fp4_gemv_cuda.kind_for(1, dtype) == "mma"
    up = fp4_gemv_cuda.make_plan(1, inter, width, dtype, device, allow_split=split, programs=programs, swiglu=True)
    down = fp4_gemv_cuda.make_plan(1, width, inter, dtype, device, allow_split=split, programs=programs)
    if runs and split:
        run_up, run_down = fp4_gemv_cuda.run_plan(up, width, swiglu=True), fp4_gemv_cuda.run_plan(down, inter)
        if run_up and run_down:
            if run_down.k_warps == 1 and width * inter >= DOWN_ON_RUNS_MIN_WEIGHTS:  # as DOWN_PER_ASSIGNMENT
                run_down = replace(run_down, **DOWN_PER_ASSIGNMENT)
            return run_up, run_down, True
    if split and up.k_warps == 1:  # one program per assignment: the gate/up GEMV in one wave (UP_PER_ASSIGNMENT)
        up = replace(up, **UP_PER_ASSIGNMENT)
    if split and down.k_warps == 1:  # and the down GEMV with more chunks in flight (DOWN_PER_ASSIGNMENT)
        down = replace(down, **DOWN_PER_ASSIGNMENT)
    return up, down, False


# The gate/up GEMV with one program per assignment keeps one chunk in flight and fits 4 blocks per SM (128 registers,
# no spill; 159 and 3 blocks per SM at two chunks): at batch 1 on the 816B layer its 512 blocks fit one wave instead
# of 1.29. Same process, bit-equal (session 59, run 82, an H100 with the H200's 132 SMs): the MoE decode at batch 1
# 122.9 -> 106.6 us, at batch 4 472.5 -> 451.1 us. Only for one warp per K range (the cut measured): where warps
# split K (muse-small's 768-wide experts) the cap spills. Runs of one expert keep their own plan (unmeasured there).
UP_PER_ASSIGNMENT = {"prefetch": 1, "min_blocks": 4}
# The down GEMV with one program per assignment keeps three chunks in flight (two by make_plan). Same process,
# bit-equal, the 816B layer, with the hand-off from 2 tokens (session 66, runs 120-121 on one H100,
# cuda_gemv_ab.py --cut dpf3:on=down,prefetch=3): 104.3 vs 106.6 us at batch 1, 219.0-219.7 vs 235.7 at 2, 314.8-323.1
# vs 335.7-345.7 at 3 (1.02 / 1.07 / 1.07x); four in flight 1.00-1.05x, three at 4 or 5 blocks per SM 1.00-1.05x.
# Only for one warp per K range, as UP_PER_ASSIGNMENT (muse-small's 768-wide experts split K: unmeasured there).
DOWN_PER_ASSIGNMENT = {"prefetch": 3}
# The runs' down GEMV (5 staged rows on the 816B layer) takes the same cut: 127 registers, 4 blocks per SM, no spill;
# 809.3 vs 879.9 us at batch 8, 1334.1 vs 1439.6 at 16 (1.09 / 1.08x, bit-equal; session 67, run 125, one H100,
# MUSECORE_CUDA_GLUON_MOE=0 cuda_gemv_ab.py --batches 8,16 --cut dpf3:on=down,prefetch=3). Measured only there:
# muse-small's runs (768 x 768, 8 staged rows, one warp per K range too) keep make_plan's two chunks.
DOWN_ON_RUNS_MIN_WEIGHTS = 4096 * 4096


HANDOFF_ENV = "MUSECORE_CUDA_MOE_HANDOFF"
# Where the hand-off is on without the switch: from 2 tokens on experts of at least 4096 x 4096. 816B layer, the
# GEMVs at every batch, same process, bit-equal (cuda_handoff_ab.py, session 66, two H100s): 0.96x at batch 1
# (111.1 vs 106.7 us), 1.04-1.06x at 2-4 (221.6 vs 231.1 us at 2, 325.7 vs 344.2 at 3, 423.9 vs 444.0 at 4), 1.01-1.03x
# at 6-16. muse-small's experts (768 x 768): 0.89x at batch 1, 0.96-1.02x at 2-4, 0.97x at 8, so they keep it off.
HANDOFF_FROM_TOKENS = 2
HANDOFF_MIN_WEIGHTS = 4096 * 4096


def handoff_forced() -> Optional[bool]:
    """``MUSECORE_CUDA_MOE_HANDOFF``: True (``1``: at every batch), False (``0``: never) or None (unset: the rule of
    :func:`handoff_by_default`); any other value is a ValueError."""
    forced = os.environ.get(HANDOFF_ENV, "").strip()
    if forced not in ("", "0", "1"):
        raise ValueError(f"{HANDOFF_ENV} must be 0 (never), 1 (at every batch) or unset (from "
                         f"{HANDOFF_FROM_TOKENS} tokens on large experts); got {forced!r}")
    return None if not forced else forced == "1"


def handoff_by_default(tokens: int, width: int, inter: int) -> bool:
    """Whether the down GEMV starts in the gate/up GEMV's last wave (``fp4_gemv_cuda.Handoff``) for ``tokens`` tokens
    on experts ``gate/up [I, h]`` (``width`` h, ``inter`` I): as :func:`handoff_forced` says if the switch is set,
    else from :data:`HANDOFF_FROM_TOKENS` tokens on experts of :data:`HANDOFF_MIN_WEIGHTS` or more. At batch 1 the
    gate/up GEMV fits one wave, so the down blocks that start early only take its SMs (816B layer: 111 vs 107 us on
    an H100, 111-116 vs 97-99 on the H200 in session 45)."""
    forced = handoff_forced()
    if forced is not None:
        return forced
    return tokens >= HANDOFF_FROM_TOKENS and width * inter >= HANDOFF_MIN_WEIGHTS


def sort_by_expert(flat: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(order, perm)``: the assignments' experts ascending and the assignment at each sorted position; one Triton
    program where it can key them, ``torch.sort`` past that (the runs kernel takes any order within an expert)."""
    if flat.numel() <= MAX_ASSIGNMENTS and num_experts <= MAX_EXPERTS:
        return sort_assignments(flat)
    return torch.sort(flat)


def moe_decode_gemv(z: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate: Fp4Resident,
                    up: Fp4Resident, down: Fp4Resident, post_norm: torch.Tensor, post_eps: float,
                    plans: Optional[tuple[fp4_gemv_cuda.GemvPlan, fp4_gemv_cuda.GemvPlan]] = None,
                    runs: Optional[bool] = None, handoff: Optional[bool] = None) -> torch.Tensor:
    """The ``moe`` op at decode: gate+up+SwiGLU and down as one FP4 GEMV per token-expert assignment
    (:func:`moe_decode_rows`), then the finalize (post-expert norm, routing weight, fp32 sum per token)."""
    o, flat = moe_decode_rows(z, ids, gate, up, down, plans, runs, handoff)
    return finalize(o, flat, ids, weights, post_norm, post_eps, sorted_rows=False, act_dtype=z.dtype)


def moe_decode_rows(z: torch.Tensor, ids: torch.Tensor, gate: Fp4Resident, up: Fp4Resident, down: Fp4Resident,
                    plans: Optional[tuple[fp4_gemv_cuda.GemvPlan, fp4_gemv_cuda.GemvPlan]] = None,
                    runs: Optional[bool] = None, handoff: Optional[bool] = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode GEMVs without the finalize: ``(o [T * k, h] fp32, flat ids [T * k])``, row ``a`` the down
    product of assignment ``a`` in ``ids``' order (``plans`` overrides ``make_plan``'s cuts for the two launches,
    for sweeps; ``runs`` forces runs of one expert on or off, default :func:`on_runs_by_default`; ``handoff`` the
    down GEMV's early start, default :func:`handoff_by_default`; the output bits are the same either way)."""
    T, topk = ids.shape
    width, inter = z.shape[-1], gate.out_features
    flat = ids.reshape(-1).contiguous()
    z = z.contiguous()
    h = torch.empty(flat.numel(), inter, dtype=z.dtype, device=z.device)
    on_runs = on_runs_by_default(T, flat.numel(), gate.packed.shape[0]) if runs is None else runs
    if plans is None:
        plan_up, plan_down, on_runs = _plans(width, inter, z.dtype, z.device, flat.numel(), on_runs)
    else:
        plan_up, plan_down = plans
        if on_runs and plan_up.kind == plan_down.kind == "mma":
            run_up, run_down = fp4_gemv_cuda.run_plan(plan_up, width, swiglu=True), fp4_gemv_cuda.run_plan(plan_down,
                                                                                                           inter)
            on_runs = bool(run_up and run_down)
            plan_up, plan_down = (run_up, run_down) if on_runs else plans
        else:
            on_runs = False
    # the GEMVs' programs: assignments in their own order, or sorted by expert (runs: the assignment at each position)
    order, perm = sort_by_expert(flat, gate.packed.shape[0]) if on_runs else (flat, None)
    o = torch.empty(flat.numel(), width, dtype=torch.float32, device=z.device)
    hand = None
    on_handoff = handoff_by_default(T, width, inter) if handoff is None else handoff
    if on_handoff and plan_up.kind == plan_down.kind == "mma" \
            and fp4_gemv_cuda.Handoff.possible(flat.numel(), z.device):
        hand = fp4_gemv_cuda.Handoff(plan_up, inter, flat.numel(), z.device)
    fp4_gemv_cuda.launch(z, gate.packed, gate.scales, gate.out_scale, wfmt=gate.wfmt, fold_log2=gate.fold_log2,
                         n=inter, k=width, out=h, plan=plan_up, ids=order, a_div=topk, packed2=up.packed,
                         scales2=up.scales, out_scale2=up.out_scale, perm=perm, handoff=hand and hand.produce)
    try:
        fp4_gemv_cuda.launch(h, down.packed, down.scales, down.out_scale, wfmt=down.wfmt, fold_log2=down.fold_log2,
                             n=width, k=inter, out=o, plan=plan_down, ids=order, a_div=1, perm=perm,
                             handoff=hand and hand.consume)
    except BaseException:
        if hand is not None:  # the producer has counted: left as it is, the next consumer would not wait
            hand.counters.zero_()
        raise
    return o, flat


