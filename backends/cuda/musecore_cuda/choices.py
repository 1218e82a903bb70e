"""Every kernel choice of the CUDA backend as data: the rules ``CudaBackend`` runs, and what
``CudaBackend.kernel_choices`` tells the plan about them without a GPU.

The crossovers were measured on the H200 (backends/cuda/lab/NOTES.md): for bf16 activations the
CUDA C++ tensor-core GEMV up to 15 rows, the CUDA C++ tiled GEMM from ``GEMM_MIN_M`` rows, and from
``DEQUANT_MIN_M`` rows a transient bf16 copy of the weight and cuBLAS (compute-bound there, where
cuBLAS's BF16 kernel beats W4A16 by more than the dequantization costs). NVFP4 weights at
``GLUON_MIN_M``-``GLUON_MAX_M`` rows (from ``GLUON_WIDE_M`` = 2 for weights of ``GLUON_WIDE_WEIGHTS`` elements and
more, from one row for weights of ``GLUON_ONE_ROW_WEIGHTS`` and more over ``GLUON_ONE_ROW_MIN_K`` inputs or more)
take the Gluon GEMM instead where it can run (SM 9.x, Triton 3.6's Gluon Hopper API; ``MUSECORE_CUDA_GLUON=0``
turns it off). What depends on the GPU itself (SM count, occupancy, whether NVRTC compiles, whether Gluon runs) is
decided at load and says so.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Sequence

import torch

from musecore.backends.base import EnvSetting, KernelChoice, LinearShape
from musecore_cuda.kernels import fp4_gemv_cuda, fp4_gluon_plan, moe_decode, moe_prefill, pdl, triton_hooks
from musecore_cuda import fused
from musecore_triton.kernels import router
from musecore_triton.kernels.dense_gemv import DENSE_GEMV_MAX_BYTES
from musecore_triton.kernels.fp4_gemm import tile_regime
from musecore_triton.kernels.moe import uses_dense_decode
from musecore_triton.layouts import FP4_GROUP

FP4_FORMATS = ("nvfp4", "mxfp4")
GEMM_MIN_M, DEQUANT_MIN_M = 16, 128
INTERPRET_ENV = "TRITON_INTERPRET"
# The Gluon GEMM's rows (H200, session 40 sweep, backends/cuda/lab/results/cuda_gluon_sweep_s40_packed.json, us,
# gluon's best cut vs today's path): at M=64 and 256 it beat today's path on all four 816B shapes (q_proj 8192->8192:
# 28.7 vs 60.5 gemm, 49.1 vs 99.4 dequant; expert_up 4096->8192: 15.9 vs 36.8, 26.5 vs 53.1; expert_down 4096->4096:
# 14.3 vs 24.0, 18.5 vs 28.2; k_proj 8192->1024: 11.1 vs 15.6, 18.8 vs 20.3); at M=4096 dequant + cuBLAS won
# everywhere (215.9 vs 261.6 on expert_down). The crossover between 256 and 4096 is unmeasured.
# From M=9 (session 42, targets run 6, benchmarks/results/h200_issue26/run6_s42_call1_fixup_targets/): at M=16 the
# Gluon GEMM (block_m 16, the launch it takes at every M of 9-16) beat the CUDA C++ GEMM on all seven 816B shapes
# (q_proj 25.5 vs 31.7 us, unpooler 14.3 vs 21.1, k_proj 8.7 vs 9.8; expert_down tied, 11.7 vs 11.8), and beat the
# M=8 tensor-core GEMV (one mma n8 token group; M 9-15 take two) on five of seven (q_proj 25.5 vs 28.9 us); on
# k_proj and expert_down the M=8 GEMV was 5-12% faster, so M <= 8 keeps the decode GEMV there. The small-M sweep of
# session 42 (run 7, run7_s42_call2_runs_targets/cuda_gluon_sweep_small_m.json.gz) repeated it: at M=8 the Gluon GEMM
# took 25.1 / 17.0 / 14.2 us against the GEMV's 29.3 / 20.8 / 17.8 on q_proj, pooler and expert_up (weights of
# 32M elements and more), 8.8 vs 9.1 on k_proj (8M) and 11.5 vs 10.4 on expert_down (16M); so weights of at least
# 8M elements took it from M=8. Session 62 (an H100, run 93, benchmarks/results/h200_issue26/
# run93_s62_call4_small_m_h100/): with split-K finish's kept workspace (no memset node per launch) the Gluon GEMM beat
# the tensor-core GEMV at every M of 2-8 on all seven 816B shapes, 1.05-1.61x (k_proj M = 2 / 8 7.16 / 7.17 vs 8.00 /
# 9.60 us, expert_down 9.17 / 9.24 vs 9.77 / 10.90, q_proj 22.75 / 22.97 vs 28.98 / 30.22 at M = 4, unpooler and
# expert_up M = 2 1.05x); at M = 1 it lost on unpooler and expert_up (0.88 / 0.90x) and won by 1-5% elsewhere, so one
# row keeps the GEMV (the decode graph's PDL chain at batch 1 overlaps it with its neighbours). Session 63 (an H100,
# run 96, run96_s63_call2_cuts_small_moe_h100/) measured muse-small's six linears (192 x 1536 to 1536 x 3072, 0.3-4.7M
# elements) the same way: the Gluon GEMM beat the GEMV at every M of 2-8 on all six, 1.01-1.29x (1536 x 1536 M = 8
# 6.31 vs 7.72 us, 192 x 1536 M = 2 6.04 vs 6.20), and lost at M = 1 (0.58-0.86x); so weights of 192 x 1536 elements
# and more (the smallest measured) take it from M = 2; smaller ones (muse-tiny's) are unmeasured and keep the GEMV
# below M = 9.
GLUON_MIN_M, GLUON_MAX_M = 9, 256
GLUON_WIDE_M, GLUON_WIDE_WEIGHTS = 2, 192 * 1536
# One row on the 816B shapes (k_proj's 1024 x 8192 the smallest): since the two-CTA launches (session 69, run 137,
# H100, same process) the Gluon GEMM beat the tensor-core GEMV at M = 1 on q_proj / k_proj / o_proj / pooler /
# expert_down 1.05-1.11x (k_proj 6.88 vs 7.55 us, pooler 12.72 vs 14.08) and tied on unpooler / expert_up (0.99 /
# 1.00x); session 62 (run 93), before them, had it 0.88-0.90x there and even elsewhere. Smaller weights, and weights
# of fewer than 4096 input features (a quantized lm_head of muse-small's, 65536 x 1536): unmeasured, on the GEMV.
GLUON_ONE_ROW_WEIGHTS, GLUON_ONE_ROW_MIN_K = 1024 * 8192, 4096
# GLUON_MAX_M < M <= GLUON_LARGE_MAX_M: the Gluon GEMM with two consumer warpgroups over 256 tokens
# (fp4_gluon_plan.LARGE_M_CONFIG) where its grid fills the GPU (>= GLUON_LARGE_MIN_TILES output tiles of 128 x 256),
# else dequantize + cuBLAS. Session 59 (benchmarks/results/h200_issue26/NOTES.md, runs 80-83), us, Gluon vs
# dequantize + cuBLAS, same process: H200 M = 1024 q_proj 188 vs 235, expert_up 95 vs 122, expert_down 48 vs 60 (128
# tiles), k_proj (32 tiles) 81 vs 34 (the reason for the tile floor); H100 M = 512 q_proj 89 vs ~147, M = 2048 q_proj
# 359-387 vs 444, expert_down 104-106 vs 113. At M = 4096 the two were even and the sign moved with the machine (H200
# 1.00-1.05x, one H100 1.03-1.13x, another 0.87-0.96x). Session 63 (runs 88-101) had the Gluon launch ahead at
# M = 4096 on the K = 8192 shapes in 15 of 16 comparisons, and weights of K >= 8192 took it up to 4096 until session
# 82; the targets case has timed both paths there in every run since, and from session 66 on (runs 122-167, thirteen
# runs, sessions 66-81's kernels) dequantize + cuBLAS led in 36 of 52 comparisons: 4 of 4 on the only H200 among
# them (run 139: q_proj 0.937 vs 0.887 of BF16, k_proj 0.910 vs 0.876, o_proj 0.935 vs 0.890, pooler 0.944 vs
# 0.898), 3 of 4 on run 167's H100. With it on every M = 4096 shape each run's worst row is as good or better in
# 12 of 13 (run 139 0.876 -> 0.910, run 137 0.882 -> 0.918; run 124 0.920 -> 0.907 the exception). So every K
# stops at GLUON_LARGE_MAX_M.
# M = 2049-4095 in the same interleaved rounds (session 83, runs 169-170, twice on one H100,
# lab/scripts/cuda_large_m_crossover.py): the Gluon launch led on o_proj at every point, on q_proj at all but one,
# and trailed on pooler at 2560 both times (320 tiles: three waves of 132 SMs). That H100, and run 171's at 4096
# (4 of 4, by 0.6-6%: 36 of 56 for the copy since session 66), favour the launch where run 167's H100 and run 139's
# H200 favoured the copy; no H200 has timed 2049-4095, so the bound stays.
GLUON_LARGE_MIN_TILES, GLUON_LARGE_MAX_M = 128, 2048
GLUON_ENV = "MUSECORE_CUDA_GLUON"
GLUON_FORMATS = ("nvfp4",)  # the kernel reads NVFP4's e4m3 group-16 scales; MXFP4 (e8m0, group 32) keeps its paths


def gluon_enabled() -> bool:
    """False when ``MUSECORE_CUDA_GLUON=0``; unset or 1: the Gluon GEMM is used where it can run."""
    setting = os.environ.get(GLUON_ENV, "1")
    if setting not in ("0", "1"):
        raise ValueError(f"{GLUON_ENV} must be 0 (off) or 1 (on, the default); got {setting!r}")
    return setting == "1"


def gluon_min_m(weights: int, in_features: int = 0) -> int:
    """The fewest rows that take the Gluon GEMM for a weight of ``weights`` elements over ``in_features`` (K; 0:
    unknown)."""
    if weights >= GLUON_ONE_ROW_WEIGHTS and in_features >= GLUON_ONE_ROW_MIN_K:
        return 1
    return GLUON_WIDE_M if weights >= GLUON_WIDE_WEIGHTS else GLUON_MIN_M


def gluon_large(m: int, out_features: int) -> bool:
    """Whether ``m`` rows past ``GLUON_MAX_M`` (up to ``GLUON_LARGE_MAX_M``) take the Gluon GEMM's large-M launch
    against ``out_features`` weight rows: when its 128 x 256 output tiles number at least ``GLUON_LARGE_MIN_TILES``."""
    tiles = -(-out_features // fp4_gluon_plan.LARGE_M_CONFIG.block_n) * -(-m // fp4_gluon_plan.LARGE_M_CONFIG.block_m)
    return GLUON_MAX_M < m <= GLUON_LARGE_MAX_M and tiles >= GLUON_LARGE_MIN_TILES


def gluon_large_first_m(out_features: int) -> int:
    """The fewest rows past ``GLUON_MAX_M`` that :func:`gluon_large` takes for ``out_features`` weight rows."""
    n_tiles = -(-out_features // fp4_gluon_plan.LARGE_M_CONFIG.block_n)
    return max(GLUON_MAX_M + 1, fp4_gluon_plan.LARGE_M_CONFIG.block_m * (-(-GLUON_LARGE_MIN_TILES // n_tiles) - 1) + 1)


def fp4_path_for(m: int, dtype: torch.dtype, *, weight_format: str = "nvfp4", gluon: bool = False,
                 weights: int = 0, out_features: int = 0) -> str:
    """The FP4 linear kernel for ``m`` rows of ``dtype`` activations against a weight of ``weights`` elements
    (``out_features`` rows) when NVRTC is available: "gluon" (the Gluon W4A16 GEMM, only when ``gluon``: it can run
    here and is not switched off), "mma" / "fma" (CUDA C++ decode GEMVs), "gemm" (CUDA C++ tiled GEMM), "dequant"
    (bf16 copy + cuBLAS) or "tiled" (Triton W4A16 GEMM)."""
    in_features = weights // out_features if out_features else 0  # (0: unknown)
    if (gluon and dtype == torch.bfloat16 and weight_format in GLUON_FORMATS
            and (gluon_min_m(weights, in_features) <= m <= GLUON_MAX_M or gluon_large(m, out_features))):
        return "gluon"
    if dtype == torch.bfloat16 and m >= GEMM_MIN_M:
        return "dequant" if m >= DEQUANT_MIN_M else "gemm"
    return fp4_gemv_cuda.kind_for(m, dtype) or "tiled"


def moe_uses_gemv(n_assign: int, num_experts: int, tokens: int, width: int, inter: int, gluon: bool = False) -> bool:
    """Whether bf16 FP4 experts take the CUDA C++ decode GEMVs (``musecore_cuda.kernels.moe_decode.use_gemv``,
    without the device): one per assignment up to ``E`` assignments, on runs of one expert from
    ``RUNS_MIN_TOKENS`` tokens up to ``RUNS_MAX_ASSIGNMENTS``; a grouped GEMM beyond, and with ``gluon`` (the grouped
    Gluon GEMM can run) from ``moe_prefill.DECODE_FROM_TOKENS`` tokens on experts as large as the 816B layer's."""
    return moe_decode.gemv_rule(n_assign, num_experts, tokens, width, inter, torch.bfloat16, torch.device("cpu"),
                                gluon)


PATH_NAMES = {
    "mma": "CUDA C++ tensor-core GEMV (NVRTC, fp4_gemv_mma)",
    "fma": "CUDA C++ FMA GEMV (NVRTC, fp4_gemv)",
    "gemm": "CUDA C++ tiled tensor-core GEMM (NVRTC, fp4_gemm_mma)",
    "dequant": "dequantize to a transient bf16 copy + cuBLAS",
    "tiled": "Triton W4A16 GEMM (musecore_triton)",
    "gluon": "Gluon W4A16 GEMM (swap-AB, register-A wgmma, TMA ring, packed upcast; fp4_gemm_gluon)",
}


def _m_ranges(dtype: torch.dtype, *, weight_format: str = "nvfp4", weights: int = 0, out_features: int = 0,
              gluon: bool = False) -> list[tuple[int, Optional[int], str]]:
    """Consecutive M ranges ``(first, last or None, path)`` over which :func:`fp4_path_for` is constant (the Gluon
    GEMM's launches below and past ``GLUON_MAX_M`` differ, so they are separate ranges)."""
    ranges: list[tuple[int, Optional[int], str]] = []
    edges = sorted({1, 2, 3, fp4_gemv_cuda.FMA_MAX_M + 1, fp4_gemv_cuda.MAX_M + 1, GEMM_MIN_M, DEQUANT_MIN_M,
                    GLUON_WIDE_M, GLUON_MIN_M, GLUON_MAX_M + 1, gluon_large_first_m(out_features or 1),
                    GLUON_LARGE_MAX_M + 1})
    for m in edges:
        path = fp4_path_for(m, dtype, weight_format=weight_format, gluon=gluon, weights=weights,
                            out_features=out_features)
        if ranges and ranges[-1][2] == path and (path != "gluon" or m != GLUON_MAX_M + 1):
            continue
        if ranges:
            ranges[-1] = (ranges[-1][0], m - 1, ranges[-1][2])
        ranges.append((m, None, path))
    return ranges


def _span(first: int, last: Optional[int]) -> str:
    if last is None:
        return f"M >= {first}"
    return f"M = {first}" if first == last else f"M {first}-{last}"


def gluon_fallback_reason(weight_format: str, arch: str) -> Optional[str]:
    """Why FP4 linears of ``weight_format`` on ``arch`` keep today's rule at ``GLUON_MIN_M``-``GLUON_MAX_M`` rows
    instead of the Gluon GEMM,
    or None when the plan routes them to it (checked again at load on the real GPU)."""
    if weight_format not in GLUON_FORMATS:
        return f"the Gluon GEMM takes NVFP4 only (e4m3 group-16 scales); {weight_format} keeps the CUDA C++ paths"
    if not gluon_enabled():
        return f"the Gluon GEMM is switched off ({GLUON_ENV}=0)"
    if arch and arch != "sm90":
        return f"the Gluon GEMM is written for SM90 (wgmma, TMA); the profile is {arch}"
    return fp4_gluon_plan.import_problem()


GLUON_PLAN_SMS = 132  # the H200's SM count, for the config the plan shows; at load the GPU's own count is used


def _gluon_reason(n: int, k: int, first: int) -> str:
    cfg = fp4_gluon_plan.pick_config(first, n, k, GLUON_PLAN_SMS)
    if first > GLUON_MAX_M:
        return (f"NVFP4 past M={GLUON_MAX_M} where {GLUON_LARGE_MIN_TILES}+ output tiles of {cfg.block_n} x "
                f"{cfg.block_m} fill the GPU, up to M={GLUON_LARGE_MAX_M}: two consumer warpgroups over 256 "
                f"tokens ({cfg.label()}); 816B shapes: 1.20-1.25x dequantize + cuBLAS at M=1024 (H200), 1.07-1.65x "
                "at 512 and 2048 (H100); at 4096 behind it (36 of 56 comparisons in fourteen runs, 4 of 4 on the "
                "H200), so dequantize + cuBLAS takes M > 2048; today's rule applies if the GPU at load is not SM 9.x "
                "or Triton is not 3.6")
    return (f"NVFP4, M {first}-{GLUON_MAX_M} (from M=1 for weights of {GLUON_ONE_ROW_WEIGHTS} elements and more "
            f"over K >= {GLUON_ONE_ROW_MIN_K}, "
            f"from M={GLUON_WIDE_M} for {GLUON_WIDE_WEIGHTS} and more): beat today's path 1.0-2.3x on the 816B "
            f"shapes (H200, M=8-16, 64 and 256; H100, M=2-8 1.05-1.61x, M=1 0.99-1.11x), 1.01-1.29x on "
            f"muse-small's at M=2-8 (H100); launch "
            f"from M, N, K and the SM "
            f"count (at M={first} on {GLUON_PLAN_SMS} SMs: {cfg.label()}"
            + (": two consumer warpgroups (128 weight rows)" if cfg.block_n == 128 else "")
            + (": two CTAs per SM (128 registers)" if cfg.ctas_per_sm == 2 else "")
            + (f": split-K {cfg.split_k}, the tile's last split storing the bf16 sum, no cast kernel"
               + (", and zeroing its sums again (no memset per launch)" if cfg.rezero else "") if cfg.finish else "")
            + (f": {cfg.stages} ring stages paired per mbarrier, released late, scale words 2 chunks ahead" if cfg.pair
               else ": ring stages released late" if cfg.late else "")
            + "); today's rule applies if the GPU at load is not SM 9.x or its Triton is not 3.6 (Gluon's API)")


def _fp4_linear_choices(shape: LinearShape, arch: str = "") -> list[KernelChoice]:
    n, k = shape.out_features, shape.in_features
    label = f"{shape.name} {shape.weight_format} {k}->{n}"
    fallback = gluon_fallback_reason(shape.weight_format, arch)
    out = []
    for first, last, path in _m_ranges(torch.bfloat16, weight_format=shape.weight_format, weights=n * k,
                                       out_features=n, gluon=fallback is None):
        if path == "gluon":
            reason = _gluon_reason(n, k, first)
        elif path == "mma":
            plan = fp4_gemv_cuda.make_plan(first, n, k, torch.bfloat16, torch.device("cpu"), kind="mma")
            reason = (f"decode: weights stream once, upcast in registers into mma.m16n8k16; at M={first} "
                      f"split_k={plan.split_k}, k_warps={plan.k_warps}, tile={plan.tile}, "
                      f"{'lean' if fp4_gemv_cuda.lean_path(plan, experts=False) else 'plain'} path")
        elif path == "gemm":
            reason = (f"from M={GEMM_MIN_M} the tiled GEMM beats the decode GEMV (H200 sweep); token tile, "
                      "rows per warp and cluster split-K decided at load from the GPU's SM count and occupancy")
        elif path == "dequant":
            reason = (f"from M={first} compute-bound: cuBLAS BF16 on a per-call copy beats W4A16 "
                      f"(transient {n * k * 2 / 2**20:.0f} MiB per call)")
        else:
            reason = "no CUDA C++ kernel for this M"
        if fallback and path in ("gemm", "dequant") and first <= GLUON_MAX_M:
            reason += f"; not the Gluon GEMM: {fallback}"
        env = GLUON_ENV if path == "gluon" or (fallback and GLUON_ENV in fallback) else ""
        out.append(KernelChoice(f"linear {label}, bf16, {_span(first, last)}", PATH_NAMES[path], reason, env=env))
    return out


def _triton_gemm_note(m_rows: int) -> str:
    bm, bn, warps, stages, _, max_split = tile_regime(m_rows)
    return f"tiles {bm}x{bn}, {warps} warps, {stages} stages, split-K <= {max_split} (from the SM count, at load)"


def _dense_linear_choice(shape: LinearShape) -> list[KernelChoice]:
    n, k = shape.out_features, shape.in_features
    label = f"{shape.name} {shape.weight_format} {k}->{n}"
    nbytes = n * k * 2
    if nbytes <= DENSE_GEMV_MAX_BYTES:
        return [KernelChoice(f"linear {label}, M = 1", "Triton dense GEMV (musecore_triton)",
                             "one token on a small 16-bit weight: cuBLAS's M=1 tiles are launch-bound there"),
                KernelChoice(f"linear {label}, M >= 2", "cuBLAS (torch.nn.functional.linear)")]
    return [KernelChoice(f"linear {label}, any M", "cuBLAS (torch.nn.functional.linear)",
                         f"{nbytes / 2**20:.0f} MiB > {DENSE_GEMV_MAX_BYTES >> 20} MiB: the dense GEMV did not win there")]


TOKEN_ACT = "fp8-token"  # musecore_cuda.fp8.TOKEN_ACT (not imported: this module stays free of kernel imports)


def _fp8_token_choices(shape: LinearShape) -> list[KernelChoice]:
    """The h200-fp8 profile's W8A8 per-token paths (musecore_cuda.fp8, kernels.fp8_moe)."""
    n, k = shape.out_features, shape.in_features
    why = ("FP8 tensor cores run at ~2x the BF16 rate; per-token scales keep each token's numerics independent of "
           "its batch; at decode the weights are 8 bits per value (the NVFP4 plan reads 4.5)")
    if shape.experts:
        from musecore_cuda.kernels.fp8_moe import pick_config
        label = f"moe {shape.name} fp8 E={shape.experts} top-{max(1, shape.top_k)} {k}->{n}"
        small, large = pick_config(1), pick_config(1 << 10)
        return [KernelChoice(f"{label}, any T", "per-token E4M3 quantize (Triton) + Triton FP8 grouped GEMM (wgmma): "
                             "gate+up+SwiGLU (fp32), per-token requantize, down, finalize",
                             f"{why}; tiles {small.block_m}x{small.block_n} up to 64 rows per expert, "
                             f"{large.block_m}x{large.block_n}x{large.block_k} beyond, partial sums promoted to fp32 "
                             "every 128 K. H200, 816B layer vs BF16 experts: 1.05x at T=1 (NVFP4 2.19x), 2.14x at "
                             "T=16, 1.61x at T=256, 1.97x at T=8192 (NVFP4 0.81x)")]
    return [KernelChoice(f"linear {shape.name} fp8 {k}->{n}, any M",
                         "per-token E4M3 quantize (Triton) + cuBLASLt row-wise scaled FP8 GEMM (torch._scaled_mm)",
                         f"{why}; M padded to 16 rows. H200 vs BF16 cuBLAS at M=4096: 1.0-1.6x (the per-token "
                         "quantization is up to a third of it on an 8192->1024 weight); at M=256 0.53-1.46x")]


def _expert_choices(shape: LinearShape) -> list[KernelChoice]:
    e, top_k = shape.experts, max(1, shape.top_k)
    label = f"moe {shape.name} {shape.weight_format} E={e} top-{top_k} {shape.in_features}->{shape.out_features}"
    if shape.weight_format in FP4_FORMATS:
        # (width h, intermediate I): gate/up is [2I, h] (gate and up stacked), down [h, I]
        down = "down" in shape.name
        width, inter = (shape.out_features, shape.in_features) if down else (shape.in_features, shape.out_features // 2)
        gluon_problem = _gluon_moe_problem(shape.weight_format, width, inter)
        limit = next(t for t in range(1, 1 << 20)
                     if not moe_uses_gemv(t * top_k, e, t, width, inter, gluon_problem is None)) - 1
        runs = next((t for t in range(1, limit + 1) if moe_decode.on_runs_by_default(t, t * top_k, e)), limit + 1)
        choices = [KernelChoice(f"{label}, T <= {runs - 1} tokens",
                                "CUDA C++ expert GEMVs (NVRTC): gate+up+SwiGLU, down, Triton finalize",
                                f"one program per assignment: up to E = {e} assignments experts rarely repeat, and "
                                "the GEMV streams at about twice the grouped Triton GEMM's bandwidth; no sort or "
                                "gathers; the kernel's lean path (H200, 816B layer: 1.06-1.08x the plain one at 1-4 "
                                "tokens)")]
        if runs <= limit:
            choices.append(KernelChoice(
                f"{label}, T {runs}-{limit} tokens",
                "CUDA C++ expert GEMVs on runs of one expert (a one-program Triton sort, then the same GEMVs), Triton "
                "finalize",
                "each program computes up to 5-8 of one expert's assignments (as many as its staged activations fit "
                "in shared memory), so an expert several tokens chose streams once per run, with the same bits as one "
                "program per assignment (H200, 816B layer: 1285 -> 1137 us at 16 tokens, 972 -> 862 at 12, even at "
                "6-8; at 4, where few experts repeat, one program per assignment is ahead, 358 vs 414); 1.7-2.0x the "
                "grouped Triton GEMM at 64-128 tokens; the kernel's plain path (the lean one ran 0.96-0.97x at 8-16 "
                "tokens)"))
        return choices + [_expert_grouped_choice(shape, label, width, inter, limit, gluon_problem)]
    if shape.weight_format in ("bf16", "fp16"):
        limit = next(t for t in range(1, 1 << 20) if not uses_dense_decode(t * top_k, e)) - 1
        return [KernelChoice(f"{label}, T <= {limit} tokens", "Triton expert GEMV (16-bit) + finalize",
                             "three launches instead of the grouped path's ~20"),
                KernelChoice(f"{label}, T > {limit} tokens", "Triton grouped GEMM (16-bit weights)")]
    return [KernelChoice(label, "none", f"{shape.weight_format} experts are not implemented in the CUDA backend")]


def _gluon_moe_problem(weight_format: str, width: int, inter: int) -> Optional[str]:
    """Why FP4 experts of this shape would not take the grouped Gluon GEMM (no device: the SM count and the GPU are
    checked at load), or None."""
    if not moe_prefill.enabled():
        return f"the grouped Gluon GEMM is switched off ({moe_prefill.GLUON_MOE_ENV}=0)"
    return moe_prefill.shape_problem(weight_format, width, inter, (9, 9, 9)) or fp4_gluon_plan.import_problem()


def _expert_grouped_choice(shape: LinearShape, label: str, width: int, inter: int, limit: int,
                           problem: Optional[str]) -> KernelChoice:
    """FP4 experts beyond the decode GEMVs: the grouped Gluon GEMM where it can run (``problem`` None), else the
    grouped Triton GEMM."""
    e, top_k = shape.experts, max(1, shape.top_k)
    if problem is None:
        cfg = fp4_gluon_plan.pick_moe_config((limit + 1) * top_k, e, 2 * inter, width, GLUON_PLAN_SMS)
        decode = (f"; from {moe_prefill.DECODE_FROM_TOKENS} tokens ahead of the decode GEMVs on experts this large "
                  "(H100, 816B layer: 1.06-1.07x at 6-7 tokens, 1.14-1.46x at 8-128; 0.98x at 4)"
                  if moe_prefill.takes_decode(limit + 1, width, inter) else "")
        variant = (f" at two CTAs per SM up to {fp4_gluon_plan.MOE_TWO_CTA_MAX_ASSIGNMENTS // top_k} tokens (H100, "
                   "816B layer: 1.03-1.08x the one-CTA tiles at 4-256 tokens)" if cfg.ctas_per_sm == 2 else "")
        return KernelChoice(f"{label}, T > {limit} tokens",
                            "Gluon grouped W4A16 GEMM (align, gather, gate+up+SwiGLU, down; fp4_gemm_gluon), Triton "
                            "finalize", "the dense Gluon GEMM's mainloop over the assignments sorted by expert (H200, "
                            "816B layer: 15.2 ms at 8192 tokens, 1.54x the BF16 experts, against the Triton grouped "
                            f"GEMM's 28.5; 4.6 vs 9.8 ms at 1024){decode}; tile {cfg.block_n} x {cfg.block_m} at T = "
                            f"{limit + 1}{variant} on {GLUON_PLAN_SMS} SMs (SM count and Gluon checked at load)",
                            env=moe_prefill.GLUON_MOE_ENV)
    return KernelChoice(f"{label}, T > {limit} tokens", "Triton grouped W4A16 GEMM (align, gate+up+SwiGLU, down, "
                        "finalize)", f"each routed expert streamed once per block of its tokens; "
                        f"{_triton_gemm_note(max(1, (limit + 1) * top_k // e))} at T = {limit + 1}; not the grouped "
                        f"Gluon GEMM: {problem}",
                        env=moe_prefill.GLUON_MOE_ENV if moe_prefill.GLUON_MOE_ENV in problem else "")


def _pdl_choice() -> KernelChoice:
    setting = pdl.env_setting()  # (a value that is neither on, off nor kernel names: a one-line error here)
    if setting is None:
        return KernelChoice("programmatic dependent launch (PDL)",
                            f"on in decode CUDA graphs of batch <= {pdl.MAX_BATCH}, off elsewhere",
                            "won at batch 1 (H200; muse-small 1.07x on an H100), lost 2% at 2-16 (H100) and a little "
                            "at 8-32 (H200); SM90+ with a Triton that has griddepcontrol, checked at load", env=pdl.ENV)
    choice = {"1": "on for every kernel", "0": "off"}.get(setting, f"on for kernels {setting}")
    return KernelChoice("programmatic dependent launch (PDL)", choice,
                        f"overridden by {pdl.ENV}={setting} (SM90+ only, checked at load)", env=pdl.ENV)


def _pdl_early_choice() -> KernelChoice:
    what = "early launch_dependents (decode kernels letting the next one start before they finish)"
    setting = os.environ.get(pdl.EARLY_ENV)
    if setting not in (None, "1"):
        return KernelChoice(what, "none" if setting == "0" else f"kernels {setting}",
                            f"overridden by {pdl.EARLY_ENV}={setting}", env=pdl.EARLY_ENV)
    experts = fp4_gemv_cuda.EXPERTS_EARLY_BLOCKS_PER_SM
    return KernelChoice(what, f"the decode GEMVs at their top (the FP4 expert GEMVs on grids of <= {experts} blocks "
                        "per SM), the router + pooler launch, one-token attention after its own wait",
                        "the next kernel streams its weights meanwhile: muse-small's decode graph on an H100 708 -> "
                        "672 us per replay with attention (session 76), 671 -> 663 with the expert GEMVs (session 77); "
                        "the 816B MoE layer's full-wave expert grids lost 3% early and stay late; not timed on the "
                        "H200", env=pdl.EARLY_ENV)


def kernel_choices(linears: Sequence[LinearShape], profile: Any) -> list[KernelChoice]:
    """What :class:`~musecore_cuda.CudaBackend` runs for these linears on ``profile`` (see the module docstring)."""
    arch = getattr(profile, "arch", "") or ""
    out: list[KernelChoice] = []
    if arch and arch != "sm90":
        out.append(KernelChoice(f"kernels on {arch}", "the SM90 kernels", "run and checked on SM90 only; reported as "
                                "emulated on other architectures (no native FP4 tensor-core kernel here)"))
    for shape in linears:
        if shape.weight_format == "fp8" and shape.act_format == TOKEN_ACT:
            out += _fp8_token_choices(shape)
        elif shape.act_format is not None and not (shape.weight_format == "fp8" and shape.act_format == "fp8"):
            out.append(KernelChoice(f"{shape.name} {shape.weight_format} with {shape.act_format} activations", "none",
                                    "W4A4 needs FP4 tensor cores; not implemented in the CUDA backend"))
        elif shape.experts:
            out += _expert_choices(shape)
        elif shape.weight_format in FP4_FORMATS:
            out += _fp4_linear_choices(shape, arch)
        elif shape.weight_format == "fp8":
            out.append(KernelChoice(f"linear {shape.name} fp8 {shape.in_features}->{shape.out_features}",
                                    "cuBLASLt W8A8 (torch._scaled_mm)", "per-tensor FP8 weights and activations"))
        elif shape.weight_format in ("bf16", "fp16", "fp32"):
            out += _dense_linear_choice(shape)
        else:
            out.append(KernelChoice(f"linear {shape.name} {shape.weight_format}", "none",
                                    f"{shape.weight_format} weights are not implemented in the CUDA backend"))
    if any(s.weight_format in FP4_FORMATS for s in linears):
        out.append(KernelChoice("FP4 linears, fp16 activations",
                                f"{PATH_NAMES['fma']} for M <= {fp4_gemv_cuda.FMA_MAX_M}, else {PATH_NAMES['tiled']}",
                                "the tensor-core CUDA kernels take bf16 only"))
        out.append(KernelChoice("FP4 kernels if NVRTC cannot compile", PATH_NAMES["tiled"],
                                "checked once at load (torch.cuda._compile_kernel); announced as a RuntimeWarning"))
    out += [
        _pdl_choice(),
        _pdl_early_choice(),
        KernelChoice("decode step", "replayed from a captured CUDA graph (static KV cache)",
                     "a decode step is a few hundred small kernels; launching them costs more than running them"),
        KernelChoice("attention", "Triton flash attention (musecore_triton), GQA heads packed into tile rows",
                     "decode splits long contexts along S when the heads fill < 2 waves (SM count, at load)"),
        KernelChoice("router_topk", "Triton split-K fp32 GEMV + top-k kernel up to 16 tokens, cuBLAS fp32 GEMM + "
                     "top-k kernel beyond", "the fp32 router weight spread over every SM at decode"),
        *_fused_choice(),
        _row_op_cut_choice(),
        _deferred_norm_choice(),
        _router_block_k_choice(),
        _handoff_choice(),
        KernelChoice("norms, silu_mul, logit_softcap, kv_write", "Triton row kernels (musecore_triton), fp32 math"),
    ]
    return out


def _row_op_cut_choice() -> KernelChoice:
    cuts = ", ".join(f"{name} {rows} x {warps}" for name, (rows, warps) in triton_hooks.ROW_OP_CUTS.items())
    return KernelChoice("decode launches with a row op in their last program (rows x warps per program)",
                        f"{cuts}; the other 16-bit GEMVs 2 x 2",
                        "the row op's warps are the program's: muse-small's decode graph on an H100 715.8 -> 707.7 us "
                        "per replay (session 76); not timed on the H200")


def _deferred_norm_choice() -> KernelChoice:
    moved = []
    if fused.DEFER_RESIDUAL_NORM:
        moved.append("after attention: in every program of the router + pooler launch (DEFER_RESIDUAL_NORM)")
    if fused.DEFER_MOE_NORM:
        moved.append("after the MoE block: in every program of the next layer's q/k/v/gate launch (DEFER_MOE_NORM)")
    rest = "the others in" if moved else "both in"
    return KernelChoice("residual norms between fused sublayers at one-token decode",
                        "; ".join(moved + [f"{rest} the last program of the sublayer's final GEMV (o_proj, unpooler)"]),
                        "deferred: each consumer program redoes the norm's two sums over the whole row and the "
                        "producer's serial tail goes; after the MoE block muse-small's decode graph on an H200 "
                        "613.6 -> 611.0 us per replay (session 80), after attention no gain (musecore_cuda.fused)")


def _router_block_k_choice() -> KernelChoice:
    return KernelChoice("one-token router launch (hidden columns per one-warp program)",
                        f"{triton_hooks.ROUTER_BLOCK_K}; the portable kernel's {router.DEFAULT_ONE_LAUNCH_BLOCK_K} "
                        "elsewhere",
                        "half the programs and partials: muse-small's decode graph on an H100 660.3 -> 652.0 us per "
                        "replay (session 78); not timed on the H200")


def _handoff_choice() -> KernelChoice:
    what = "decode MoE, down GEMV after gate/up"
    forced = moe_decode.handoff_forced()  # (a mistyped switch is an error in the plan too)
    if forced is False:
        return KernelChoice(what, "launched after the gate/up GEMV has completed, at every batch",
                            f"{moe_decode.HANDOFF_ENV}=0", moe_decode.HANDOFF_ENV)
    how = ("hand-off: started in the gate/up GEMV's last wave (PDL attribute, SM90), each block waiting for its own "
           "assignment's gate/up warps (acquire/release counters)")
    if forced:
        return KernelChoice(what, how + ", at every batch", f"{moe_decode.HANDOFF_ENV}=1", moe_decode.HANDOFF_ENV)
    return KernelChoice(what, f"{how}, from {moe_decode.HANDOFF_FROM_TOKENS} tokens on experts of 4096 x 4096 and "
                        "more; after the gate/up GEMV has completed otherwise",
                        "816B layer on H100s: 1.04-1.06x at 2-4 tokens, 0.96x at 1; muse-small's 768 x 768 experts "
                        f"0.89-1.02x; {moe_decode.HANDOFF_ENV}=1 / 0 forces it on / off", moe_decode.HANDOFF_ENV)


def _fused_choice() -> list[KernelChoice]:
    blocks = (("MoE sublayer at one-token decode", "10", "4 launches (one launch for the router and the pooler GEMV + "
               "pre-expert norm, the expert GEMVs, the unpooler GEMV with the finalize in every program + the "
               "residual norm; 5 where the experts take a grouped GEMM: the finalize its own launch)",
               "with 16-bit pooler/unpooler and an fp32 router"),
              ("attention sublayer at one-token decode", "7", "3 launches (q/k/v/gate GEMV with each head's q/k "
               "norms + RoPE + KV write in its last program, attention + head norm and gate, o_proj + the residual "
               "norm)",
               "with a fused 16-bit q/k/v/gate weight and a static cache"),
              ("embedding stage at decode (one token per row)", "~18", "1 launch (the cache's next position, the "
               "rotary rows, the placeholder mask, the embedding and its two norms: musecore_triton decode_embed)",
               "at any batch"))
    if fused.disabled():
        return [KernelChoice(what, f"the separate ops ({n} launches)",
                             f"{fused.FUSED_ENV}={os.environ.get(fused.FUSED_ENV)}", fused.FUSED_ENV)
                for what, n, _, _ in blocks]
    return [KernelChoice(what, f"fused: {how}", f"{when}; other blocks, batches and prefills take the separate ops "
                         "(H200, muse-small batch 1: each launch removed saved ~1.2 us)", fused.FUSED_ENV)
            for what, _, how, when in blocks]


def env_settings() -> list[EnvSetting]:
    return [
        EnvSetting(pdl.ENV, os.environ.get(pdl.ENV), f"unset: on in decode graphs of batch <= {pdl.MAX_BATCH}",
                   "programmatic dependent launch: 1 every kernel, 0 none, or a comma list of kernel names"),
        EnvSetting(pdl.EARLY_ENV, os.environ.get(pdl.EARLY_ENV), "1: " + ",".join(pdl.EARLY_DEFAULT),
                   "kernels (launched with PDL) that let the next one start from their top: 1, 0 or names"),
        EnvSetting(GLUON_ENV, os.environ.get(GLUON_ENV), f"1: NVFP4 linears at M {GLUON_MIN_M}-{GLUON_MAX_M} (bf16; "
                   "from M = 1-2 on large weights) take the Gluon GEMM on SM 9.x with Triton 3.6's Gluon",
                   "0 keeps the CUDA C++ GEMM / dequant + cuBLAS there"),
        EnvSetting(moe_prefill.GLUON_MOE_ENV, os.environ.get(moe_prefill.GLUON_MOE_ENV), "1: NVFP4 experts beyond "
                   f"the decode GEMVs, and 816B-sized experts from {moe_prefill.DECODE_FROM_TOKENS} tokens, take the "
                   "grouped Gluon GEMM on SM 9.x with Triton 3.6's Gluon",
                   "0 keeps the grouped Triton GEMM there and the decode GEMVs up to 128 tokens"),
        EnvSetting(fused.FUSED_ENV, os.environ.get(fused.FUSED_ENV), "on: MoE sublayers in 4 launches, "
                   "attention sublayers in 3, at one-token decode; the decode embed in 1",
                   "0 runs the separate ops (10, 7 and ~18 launches)"),
        EnvSetting(moe_decode.HANDOFF_ENV, os.environ.get(moe_decode.HANDOFF_ENV), "unset: the decode MoE's down "
                   "GEMV starts in the gate/up GEMV's last wave from 2 tokens on experts of 4096 x 4096 and more",
                   "1 at every batch (slower at batch 1), 0 never"),
        EnvSetting(INTERPRET_ENV, os.environ.get(INTERPRET_ENV), "unset",
                   "1 runs the Triton kernels in Triton's CPU interpreter on a 'cpu' backend (tests only)"),
    ]


def resident_bytes(weight_format: str, out_features: int, in_features: int, *, experts: int = 0) -> Optional[int]:
    """Bytes ``prepare_weight`` / ``prepare_experts`` keep: FP4 as packed nibbles, the block-scale bytes
    and one fp32 ``out_scale`` per expert (no second copy); FP8 with N padded to 16 rows (linears) and the
    scale repeated per output channel; None for
    16-bit weights (kept as the checkpoint's tensor in the activation dtype) and unsupported formats."""
    e = max(1, experts)
    if weight_format in FP4_FORMATS:
        return e * (out_features * in_features // 2 + out_features * (in_features // FP4_GROUP[weight_format]) + 4)
    if weight_format == "fp8" and not experts:  # + the per-channel copy of the scale on the per-token path
        n = out_features + (-out_features) % 16
        return n * in_features + 4 + 4 * n
    if weight_format == "fp8":  # stacked experts (per-token path): codes, one scale each, its per-channel copy
        return experts * (out_features * in_features + 4 + 4 * out_features)
    return None
