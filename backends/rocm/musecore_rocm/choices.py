"""Every kernel decision of the ROCm backend, as data the plan shows (no hardware needed).

Per linear: which Triton kernel runs for its (weight, activation) format on the profile's arch and
with which tiles per M regime; for the routed experts, the MoE candidates and why one runs (the
Triton ``dot_scaled`` MoE; the FlyDSL MoE and aiter's ``fused_moe`` with their reasons); the router
product (split-K GEMV at decode); the decode step (HIP graph). None of these choices has been measured on
AMD hardware; the reasons say so.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Sequence

from musecore.backends.base import EnvSetting, KernelChoice, LinearShape
from musecore_rocm.aiter_adapter import ENV as AITER_ENV
from musecore_rocm.aiter_adapter import (A16W4_LINEAR_REASON, aiter_a16w4_fits, aiter_a16w4_selected,
                                         aiter_attention_selected, aiter_fits, aiter_selected)
from musecore_rocm.arch import ARCHES, DEVICE_ARCH
from musecore_rocm.flydsl_moe import flydsl_status

UNMEASURED = "tiles are a first guess from the scaled-MFMA shapes, never timed on AMD hardware"


def _arch_of(profile: Any) -> Optional[str]:
    arch = getattr(profile, "arch", None)
    if arch in ARCHES:
        return arch
    return DEVICE_ARCH.get(getattr(profile, "name", ""))


def _linear_choice(arch: str, shape: LinearShape) -> KernelChoice:
    what = f"{shape.name} {shape.weight_format}" + (f"/a{shape.act_format}" if shape.act_format else "") + \
        f" {shape.out_features}x{shape.in_features}"
    caps = ARCHES[arch]
    fmt, act = shape.weight_format, shape.act_format
    if shape.experts:
        return _moe_choice(arch, shape, what)
    if fmt == "mxfp4" and act == "mxfp4":
        how = ("scaled MFMA v_mfma_scale_f32_*_f8f6f4" if caps.mxfp4_w4a4
               else "upcast to bf16 MFMA (no FP4 matrix cores: W4A4 numerics emulated)")
        choice = "Triton dot_scaled(e2m1, e2m1), activation quantized to MXFP4 in the GEMM"
        reason = f"{arch}: {how}; M <= 16: 16x64 tiles, M <= 64: 32x128, else 128x128; {UNMEASURED}"
        use_aiter, aiter_reason = aiter_selected(arch)
        if use_aiter and aiter_fits(shape.out_features, shape.in_features):
            return KernelChoice(what=f"linear {what}", env=AITER_ENV, reason=aiter_reason,
                                choice="aiter gemm_a4w4 (preshuffled weight), activation quantized by the Triton kernel")
        reason += f"; other candidate: aiter gemm_a4w4: {aiter_reason}"
    elif fmt == "mxfp4":
        choice = "Triton dot_scaled(bf16, e2m1) (W4A16)"
        reason = f"{arch}: e2m1 upcast in the kernel, bf16 MFMA; {UNMEASURED}; other candidate: {A16W4_LINEAR_REASON}"
    elif fmt == "nvfp4":
        choice = "shared Triton W4A16 FP4 upcast GEMM (musecore_triton.fp4_gemm)"
        reason = "NVFP4 kept as NVFP4 (the catalog's rule requantizes it to MXFP4 on these devices)"
    elif fmt == "fp8":
        choice = f"torch._scaled_mm (hipBLASLt), {caps.fp8_dtype}"
        reason = ("e4m3fn bytes kept, scales doubled at load (gfx942 reads e4m3fnuz)" if caps.fp8_dtype == "e4m3fnuz"
                  else "OCP e4m3fn as stored")
    else:
        choice = "torch.nn.functional.linear (hipBLASLt)"
        reason = "16-bit weights: the vendor BLAS"
    return KernelChoice(what=f"linear {what}", choice=choice, reason=reason)


def _moe_choice(arch: str, shape: LinearShape, what: str) -> KernelChoice:
    _, fly_reason = flydsl_status()
    use_aiter, aiter_reason = aiter_selected(arch)
    fmt = shape.weight_format
    if fmt == "mxfp4" and shape.act_format == "mxfp4" and use_aiter:
        return KernelChoice(what=f"moe {what}", env=AITER_ENV,
                            choice="aiter fused_moe(per_1x32, one row per assignment) + shared Triton finalize",
                            reason=f"{shape.experts} experts top-{shape.top_k} on {arch}; {aiter_reason}")
    use_a16w4, a16w4_reason = aiter_a16w4_selected(arch)
    a16w4_fits = aiter_a16w4_fits(shape.in_features, shape.out_features)
    if not a16w4_fits:
        a16w4_reason = f"{a16w4_reason}; these experts do not fit its shuffles (hidden and inter % 256 == 0)"
    if fmt == "mxfp4" and shape.act_format is None and use_a16w4 and a16w4_fits:
        return KernelChoice(what=f"moe {what}", env=AITER_ENV,
                            choice="aiter fused_moe a16w4 (bf16 activations, gate/up interleaved, one row per "
                                   "assignment) + shared Triton finalize",
                            reason=f"{shape.experts} experts top-{shape.top_k} on {arch}; {a16w4_reason}")
    if fmt == "mxfp4":
        choice = ("Triton dot_scaled grouped MoE (gate+up+SwiGLU, MXFP4-quantized epilogue, down) + shared finalize"
                  if shape.act_format == "mxfp4" else "Triton dot_scaled(bf16, e2m1) grouped MoE + shared finalize")
    elif fmt == "nvfp4":
        choice = "shared Triton W4A16 grouped MoE + finalize"
    else:
        choice = "shared Triton grouped GEMM MoE + finalize"
    reason = f"{shape.experts} experts top-{shape.top_k} on {arch}"
    if fmt == "mxfp4":  # the MXFP4 MoE candidates beside the Triton one
        reason += (f"; the Triton kernels run (checked against the reference in the interpreter); other candidates: "
                   f"FlyDSL (gate/up, down, finalize): {fly_reason}; "
                   + (f"aiter fused_moe: {aiter_reason}" if shape.act_format == "mxfp4"
                      else f"aiter a16w4 fused_moe: {a16w4_reason}"))

    return KernelChoice(what=f"moe {what}", choice=choice, reason=reason)


def kernel_choices(linears: Sequence[LinearShape], profile: Any) -> list[KernelChoice]:
    """What ``musecore plan`` shows for this backend on ``profile`` (never raises, needs no GPU)."""
    arch = _arch_of(profile)
    if arch is None:
        return [KernelChoice(what="device", choice="none",
                             reason=f"profile {getattr(profile, 'name', profile)!r} is not an AMD target "
                                    f"({', '.join(sorted(DEVICE_ARCH))})")]
    out = [_linear_choice(arch, s) for s in linears]
    out.append(KernelChoice(what="router product, T <= 16", choice="shared Triton split-K GEMV (fp32, tl.dot ieee) "
                            "feeding the top-k kernel", reason="the 8 MiB fp32 router weight spread over every CU at "
                            f"decode; beyond 16 tokens hipBLASLt fp32 GEMM; {UNMEASURED}"))
    use_attn, attn_reason = aiter_attention_selected(arch)
    paging = ("static caches mapped onto pages (slot p % capacity holds position p; capacity a multiple of 16; "
              "window_size = (window - 1, 0))")
    if use_attn:
        out.append(KernelChoice(what="attention", env=AITER_ENV,
                                choice=f"aiter unified_attention at decode on the static cache ({paging}); prefill and "
                                       "what it declines: shared Triton flash attention",
                                reason=f"{attn_reason}; declined per call: capacity not a multiple of 16, "
                                       "non-static views" + (", FP8 KV (e4m3fn vs aiter's e4m3fnuz)"
                                                             if arch == "gfx942" else "")))
    else:
        out.append(KernelChoice(what="attention",
                                choice="shared Triton flash attention (GQA, sliding/global, BF16/FP8 KV)",
                                reason=f"other candidate: aiter unified_attention on {paging}: {attn_reason}; "
                                       f"{UNMEASURED}"))
    out.append(KernelChoice(what="decode step", choice="HIP graph (torch.cuda.CUDAGraph, shared musecore_triton.graphs)",
                            reason="one static-cache decode step captured and replayed per generate(); never run on "
                                   "AMD hardware; eager launches where graphs are unavailable"))
    out.append(KernelChoice(what="embedding stage at decode (one token per row)",
                            choice="1 launch (the cache's next position, the rotary rows, the placeholder mask, the "
                                   "embedding and its two norms: shared musecore_triton decode_embed)",
                            reason="the separate ops take ~18 launches; compiled for gfx950/gfx942 here, never run on "
                                   "AMD hardware; prefills and the CPU interpreter take the ops"))
    return out


def env_settings() -> list[EnvSetting]:
    """The one variable the ROCm backend reads (Triton's and HIP's apply as usual)."""
    return [EnvSetting(AITER_ENV, os.environ.get(AITER_ENV), "unset: the Triton kernels",
                       "1: through AMD aiter where it is importable: the MXFP4 W4A4 linears and MoE on gfx950 "
                       "(gemm_a4w4, fused_moe per_1x32), the MXFP4 W4A16 MoE on gfx942/gfx950 (fused_moe a16w4), "
                       "decode attention on static caches (unified_attention); the adapter has never called the "
                       "real aiter")]


def resident_bytes(weight_format: str, out_features: int, in_features: int, *, experts: int = 0) -> Optional[int]:
    """None for every format: MXFP4 and FP8 stay in the checkpoint's bytes (no repack, ``dot_scaled`` reads the
    canonical layout), NVFP4's resident layout is a nibble permutation of the same bytes plus the per-expert
    global scale the checkpoint already has, 16-bit weights are as stored."""
    return None
