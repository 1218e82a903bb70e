"""The MoE op beyond the decode GEMVs through the grouped Gluon W4A16 GEMM (issue 26 item 1's grouped variant): the
dense Gluon GEMM's mainloop (:mod:`musecore_cuda.kernels.fp4_gemm_gluon`) over the assignments sorted by expert. It
takes prefills, and (:func:`takes_decode`) decode batches from :data:`DECODE_FROM_TOKENS` tokens on experts of at least
:data:`DECODE_MIN_WEIGHTS` elements.

Steps, for NVFP4 experts and bf16 activations:

1. ``align_assignments`` (the portable Triton path's, :mod:`musecore_triton.kernels.moe`) sorts the ``T * k``
   assignments by expert and pads each expert's segment to the GEMM's ``block_m``;
2. ``gather_token_rows`` copies each sorted row's token activations into one tensor (the TMA loads need the rows
   contiguous: Hopper's TMA has no row gather), only in the token tiles that hold an expert (~0.3-0.5 GB at an 8K
   prefill of the 816B layer; padding rows read the last token and are never read back);
3. gate and up in one grouped launch (each program holds 32 rows of each, SwiGLU in fp32 in its epilogue) -> ``h``;
4. down in a second grouped launch over ``h`` (already in sorted order) -> the expert outputs in the activation
   dtype (the rounding the finalize would apply first);
5. the portable finalize (post-expert norm, routing weight, fp32 sum per token).

The default for NVFP4 experts with bf16 activations on SM90 with Triton 3.6 (``MUSECORE_CUDA_GLUON_MOE=0`` keeps
the grouped Triton GEMM): on the H200 (session 59, run 80, the 816B layer) it took 15.2 ms against the Triton
GEMM's 28.5 at 8192 tokens (1.54x the BF16 experts, where Triton's was 0.83x) and 4.6 ms against 9.8 at 1024.
:func:`unavailable_reason` says why a layer keeps the Triton path.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from musecore_cuda.kernels import fp4_gluon_plan
from musecore_triton.kernels.moe import ExpertStack, align_assignments, finalize, gather_token_rows
from musecore_triton.layouts import Fp4Resident

GLUON_MOE_ENV = "MUSECORE_CUDA_GLUON_MOE"


def enabled() -> bool:
    """False when ``MUSECORE_CUDA_GLUON_MOE=0`` (the grouped Triton GEMM); unset or 1: the grouped Gluon GEMM where it
    can run."""
    setting = os.environ.get(GLUON_MOE_ENV, "1")
    if setting not in ("0", "1"):
        raise ValueError(f"{GLUON_MOE_ENV} must be 0 (off) or 1 (on, the default); got {setting!r}")
    return setting == "1"


# The grouped Gluon GEMM against the decode GEMVs (one program per assignment, or runs of one expert) on the 816B layer
# (E 256, top-8, h = I = 4096), in one process, CUDA graphs, tile 128 x 16 (backends/cuda/lab/scripts/
# cuda_gluon_moe_probe.py; session 65, H100s). With the PyTorch alignment (runs 110-112): 0.58 / 0.77 / 0.92x at
# 1 / 2 / 4 tokens, then 1.06x at 6, 1.04 / 1.09x at 8, 1.13x at 12, 1.06 / 1.13x at 16, 1.13x at 24, 1.11x at 32,
# 1.15x at 64, 1.34x at 128. The one-program alignment saved 50-60 us per call (run 114, another H100, where the
# GEMVs ran 10-25% faster than on the others): 0.94x at 2 tokens, 1.09x at 4 and 5, 1.00-1.01x at 6-16. Its fixed
# cost (alignment, gathers, finalize) is what the GEMVs avoid, so on muse-small's experts (E 64, h = I = 768) it lost
# at every batch measured (0.24-0.41x at 1-32 tokens, run 112): it takes decode batches only for experts of the
# measured size and larger. Session 66 made the GEMVs faster at 2-7 tokens (the hand-off from 2 tokens, the down GEMV
# with three chunks in flight): on run 122's H100 the Gluon GEMM ran 0.84 / 0.89 / 0.86 / 0.89 / 0.96x them at 2 / 3 / 4
# / 5 / 6 tokens (run 119's, with the hand-off alone: 1.01-1.05x at 3-6). From 8 tokens the GEMVs take runs of one
# expert (no three-chunk cut there), where the Gluon GEMM led by 1.04-1.15x on every machine; so it started at 8.
# Session 68 launched it at two CTAs per SM on these experts (fp4_gluon_plan.MOE_TWO_CTA; run 129, H100): against the
# GEMVs 0.980 / 1.073 / 1.060x at 4 / 6 / 7 tokens (422.5 vs 413.9, 572.2 vs 613.7, 669.2 vs 709.5 us); so it starts
# at 6 (5 unmeasured).
DECODE_FROM_TOKENS = 6
DECODE_MIN_WEIGHTS = 4096 * 4096  # elements of one expert's gate (h x I)


def takes_decode(tokens: int, width: int, inter: int) -> bool:
    """Whether the grouped Gluon GEMM, where it can run, takes a batch of ``tokens`` tokens from the decode GEMVs for
    experts ``gate/up [I, h]`` (``width`` h, ``inter`` I)."""
    return tokens >= DECODE_FROM_TOKENS and width * inter >= DECODE_MIN_WEIGHTS


def shape_problem(fmt: str, width: int, inter: int, folds: tuple[int, ...]) -> Optional[str]:
    """Why experts of ``fmt`` with these dimensions and folds cannot take the grouped Gluon GEMM (no device needed)."""
    if fmt != "nvfp4":
        return f"the grouped Gluon GEMM takes NVFP4 experts (e4m3 group-16 scales); these are {fmt}"
    if width % 128 or inter % 128:
        return f"the grouped Gluon GEMM needs h and I divisible by 128; got h={width}, I={inter}"
    if len(set(folds[:2])) != 1 or not all(7 <= f <= 116 for f in folds):
        return f"the grouped Gluon GEMM needs gate and up to share one fold in 7-116; got folds {folds}"
    return None


def unavailable_reason(z: torch.Tensor, gate: ExpertStack, up: ExpertStack, down: ExpertStack) -> Optional[str]:
    """Why this MoE call keeps the grouped Triton GEMM, or None when it takes the grouped Gluon GEMM."""
    if not enabled():
        return f"the grouped Gluon GEMM is switched off ({GLUON_MOE_ENV}=0)"
    return cannot_run(z, gate, up, down)


def cannot_run(z: torch.Tensor, gate: ExpertStack, up: ExpertStack, down: ExpertStack) -> Optional[str]:
    """Why the grouped Gluon GEMM cannot run these experts on ``z``'s device, switched on or not (None: it can)."""
    if not all(isinstance(s, Fp4Resident) for s in (gate, up, down)):
        return "the grouped Gluon GEMM takes FP4 expert stacks; these are 16-bit"
    if z.dtype != torch.bfloat16:
        return f"the grouped Gluon GEMM takes bf16 activations; got {z.dtype}"
    if not all(t.is_contiguous() for s in (gate, up, down) for t in (s.packed, s.scales)):
        return "the grouped Gluon GEMM reads each expert stack as one 2-D tensor; these are not contiguous"
    problem = shape_problem(gate.format, gate.in_features, gate.out_features,
                            (gate.fold_log2, up.fold_log2, down.fold_log2))
    return problem or fp4_gluon_plan.unavailable_reason(z.device)


def moe_forward_gluon(z: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate: Fp4Resident, up: Fp4Resident,
                      down: Fp4Resident, num_experts: int, post_norm: torch.Tensor, post_eps: float,
                      cfg: Optional[fp4_gluon_plan.GluonConfig] = None) -> torch.Tensor:
    """The ``moe`` op through the grouped Gluon GEMM (see the module docstring); returns fp32 ``[T, h]``.
    ``cfg`` overrides :func:`fp4_gluon_plan.pick_moe_config`'s launch (lab sweeps, tests); both GEMMs use it."""
    from musecore_cuda.kernels import fp4_gemm_gluon  # needs Gluon: imported once unavailable_reason said None

    T, topk = ids.shape
    width, inter = gate.in_features, gate.out_features
    n_assign = T * topk
    if cfg is None:
        cfg = fp4_gluon_plan.pick_moe_config(n_assign, num_experts, 2 * inter, width,
                                             fp4_gluon_plan.device_sms(z.device))
    sorted_ids, blk_expert, position = align_assignments(ids, num_experts, cfg.block_m)
    rows = sorted_ids.numel()
    xs = gather_token_rows(z, sorted_ids, blk_expert, topk, cfg.block_m)
    h = torch.empty(rows, inter, dtype=z.dtype, device=z.device)
    fp4_gemm_gluon.launch_grouped(xs, blk_expert, (gate.packed, gate.scales, gate.out_scale), h,
                                  fold_log2=gate.fold_log2, cfg=cfg, stack2=(up.packed, up.scales, up.out_scale))
    o = torch.empty(rows, width, dtype=z.dtype, device=z.device)
    fp4_gemm_gluon.launch_grouped(h, blk_expert, (down.packed, down.scales, down.out_scale), o,
                                  fold_log2=down.fold_log2, cfg=cfg)
    return finalize(o, position, ids, weights, post_norm, post_eps, sorted_rows=True, act_dtype=z.dtype)
