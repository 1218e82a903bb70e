"""AMD's aiter (ROCm/aiter; PyPI ``amd-aiter``) as an optional plan candidate: never required, opt-in.

On a ROCm host with aiter installed, these are the vendor's tuned kernels beside this backend's Triton ones:
``aiter.fused_moe(..., quant_type=QuantType.per_1x32)`` (MXFP4 MoE on weights pre-shuffled with
``shuffle_weight`` / ``e8m0_shuffle``) and ``gemm_a4w4`` (MXFP4 W4A4 GEMM) on gfx950; the same
``fused_moe`` with BF16 activations (a16w4: ``shuffle_weight_a16w4`` / ``shuffle_scale_a16w4``, gate/up
interleaved) on gfx942 and gfx950; ``unified_attention`` at decode on the static KV cache mapped onto
pages. **The adapter has never called the real aiter** (no ROCm host was reachable): its calls are
written against aiter's signatures as of ROCm/aiter@e404860 (``aiter/fused_moe.py``,
``aiter/ops/gemm_op_a4w4.py``, ``aiter/ops/shuffle.py``, ``aiter/utility/fp4_utils.py``,
``aiter/ops/triton/attention/unified_attention.py``) and tested with a stand-in module that checks every
argument's shape, dtype and layout and computes the reference numerics from them. So aiter runs only when
asked for (``MUSECORE_ROCM_AITER=1``) and importable; otherwise the plan shows why not.

How the calls map this model onto aiter:

* **MoE.** aiter's ``fused_moe`` sums the weighted expert outputs itself, but Muse Spark normalises each
  expert's output (the shared post-expert RMSNorm, scale first) *before* weighting. So each token-expert
  assignment is passed as its own row with top-1 and weight 1 (``hidden_states`` repeated k times), which
  makes aiter's output the expert outputs rounded to the activation dtype; the shared Triton finalize then
  does the unpermute-free norm, routing weight and fp32 sum. ``w1`` is gate and up stacked ``[E, 2I, h/2]``
  (aiter's separated gate/up layout) with ``ActivationType.Silu`` (``silu(gate) * up``). aiter quantizes the
  activations to MXFP4 with its own rule, so the numerics are not bit-equal to ``emulate=True`` (the Triton
  path's are).
* **Linear (W4A4).** The activation is quantized by this backend's kernel (the emulated plan's rule, so the
  activation bits equal ``emulate=True``'s), its scales shuffled with ``e8m0_shuffle``, then
  ``gemm_a4w4(A, B, A_scale, B_scale, dtype=..., bpreshuffle=True)`` on the preshuffled weight.

The PyPI name ``aiter`` is an unrelated asyncio package: the import alone does not prove AMD's library is
present, so the check looks for the functions the adapter calls.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from dataclasses import dataclass
from typing import Any, Optional

import torch

ENV = "MUSECORE_ROCM_AITER"
AITER_SYMBOLS = ("fused_moe", "gemm_a4w4")
UNIFIED_ATTENTION_MODULE = "aiter.ops.triton.attention.unified_attention"


@dataclass(frozen=True)
class AiterApi:
    """The parts of aiter the adapter calls (a stand-in module provides the same names in tests).

    ``shuffle_weight_a16w4`` / ``shuffle_scale_a16w4`` (the bf16-activation MoE layouts) and
    ``unified_attention`` are None where the installed aiter lacks them: those candidates then decline."""

    fused_moe: Any
    gemm_a4w4: Any
    shuffle_weight: Any
    e8m0_shuffle: Any
    QuantType: Any
    ActivationType: Any
    fp4x2: torch.dtype
    fp8_e8m0: torch.dtype
    shuffle_weight_a16w4: Any = None
    shuffle_scale_a16w4: Any = None
    unified_attention: Any = None


def load_aiter() -> AiterApi:
    """Import what the adapter calls from aiter; ImportError/AttributeError with the cause otherwise."""
    aiter = importlib.import_module("aiter")
    missing = [name for name in AITER_SYMBOLS if not hasattr(aiter, name)]
    if missing:
        raise ImportError(f"the installed 'aiter' lacks {missing}: it is not AMD's aiter (PyPI 'aiter' is an "
                          "unrelated asyncio package)")
    fused_moe = importlib.import_module("aiter.fused_moe").fused_moe  # aiter.fused_moe is the module
    shuffle = importlib.import_module("aiter.ops.shuffle")
    fp4_utils = importlib.import_module("aiter.utility.fp4_utils")
    try:  # a Triton module: importable wherever aiter is, but optional here
        unified = importlib.import_module(UNIFIED_ATTENTION_MODULE).unified_attention
    except (ImportError, AttributeError):
        unified = None
    return AiterApi(fused_moe=fused_moe, gemm_a4w4=aiter.gemm_a4w4, shuffle_weight=shuffle.shuffle_weight,
                    e8m0_shuffle=fp4_utils.e8m0_shuffle, QuantType=aiter.QuantType,
                    ActivationType=aiter.ActivationType, fp4x2=aiter.dtypes.fp4x2, fp8_e8m0=aiter.dtypes.fp8_e8m0,
                    shuffle_weight_a16w4=getattr(shuffle, "shuffle_weight_a16w4", None),
                    shuffle_scale_a16w4=getattr(shuffle, "shuffle_scale_a16w4", None), unified_attention=unified)


def aiter_status() -> tuple[bool, str]:
    """``(importable, reason)`` for AMD's aiter in this process; never raises, imports nothing when absent."""
    if importlib.util.find_spec("aiter") is None:
        return False, "aiter is not installed (AMD's ROCm/aiter, PyPI amd-aiter; optional)"
    try:
        load_aiter()
    except Exception as exc:  # aiter imports HIP extensions: on a host without ROCm the import fails
        if "not AMD's aiter" in str(exc):
            return False, str(exc)
        return False, f"import aiter failed ({type(exc).__name__}: {exc})"
    return True, "AMD aiter is importable"


def aiter_selected(arch: str | None) -> tuple[bool, str]:
    """Whether the MXFP4 W4A4 linears and MoE go to aiter here, and why (never raises)."""
    ok, reason = aiter_status()
    if not ok:
        return False, reason
    if arch != "gfx950":
        return False, f"{reason}, but its MXFP4 per_1x32 kernels need gfx950 (this is {arch})"
    if os.environ.get(ENV) != "1":
        return False, (f"{reason}; not selected: the adapter has never called the real aiter (set {ENV}=1 to run "
                       "it; numerics then follow aiter's activation rounding, not the emulated plan's)")
    return True, f"{reason}; selected by {ENV}=1 (the adapter has never been run against the real aiter)"


def _asked(reason: str) -> tuple[bool, str]:
    if os.environ.get(ENV) != "1":
        return False, f"{reason}; not selected: the adapter has never called the real aiter (set {ENV}=1 to run it)"
    return True, f"{reason}; selected by {ENV}=1 (the adapter has never been run against the real aiter)"


def _loaded_for(arch: str | None, arches: tuple[str, ...], mismatch: str) -> tuple[AiterApi | None, str]:
    """aiter's API when it is importable and ``arch`` is one of ``arches``; else None, and why ("..., but
    <mismatch>" for another arch). :func:`aiter_status` has just imported it, so loading it again cannot fail."""
    ok, reason = aiter_status()
    if not ok:
        return None, reason
    if arch not in arches:
        return None, f"{reason}, but {mismatch}"
    return load_aiter(), reason


def aiter_a16w4_selected(arch: str | None) -> tuple[bool, str]:
    """Whether MXFP4 experts with BF16 activations (W4A16) go to aiter's a16w4 ``fused_moe``, and why."""
    api, reason = _loaded_for(arch, ("gfx942", "gfx950"), f"its a16w4 MoE targets gfx942/gfx950 (this is {arch})")
    if api is None:
        return False, reason
    if api.shuffle_weight_a16w4 is None or api.shuffle_scale_a16w4 is None:
        return False, f"{reason}, but it lacks shuffle_weight_a16w4/shuffle_scale_a16w4 (the a16w4 layouts)"
    bound = "" if arch == "gfx942" else (
        "; on gfx950 aiter keeps activations bf16 only below AITER_BF16_FP8_MOE_BOUND rows per call "
        "(default 256), so the adapter calls it in chunks of fewer rows")
    return _asked(f"{reason}: fused_moe(per_1x32, Silu, gate_mode='interleave') with bf16 activations{bound}")


def aiter_attention_selected(arch: str | None) -> tuple[bool, str]:
    """Whether decode attention on static KV caches goes to aiter's ``unified_attention``, and why."""
    api, reason = _loaded_for(arch, ("gfx942", "gfx950"), f"this is {arch}")
    if api is None:
        return False, reason
    if api.unified_attention is None:
        return False, f"{reason}, but {UNIFIED_ATTENTION_MODULE}.unified_attention is not importable"
    fp8 = ("BF16 and FP8 (e4m3fn, k/v descales) KV" if arch == "gfx950" else
           "BF16 KV only (aiter's FP8 KV dtype on gfx942 is e4m3fnuz; Muse's FP8 cache holds e4m3fn)")
    return _asked(f"{reason}: unified_attention on the static cache's pages at decode, {fp8}")


# -- the adapter: weights prepared once at load, then one call per op --------------------------------------

@dataclass
class AiterLinear:
    """An MXFP4 weight in gemm_a4w4's layout: preshuffled fp4x2 ``[N, K/2]``, shuffled E8M0 scales."""

    packed: torch.Tensor
    scales: torch.Tensor
    out_features: int
    in_features: int
    api: AiterApi


@dataclass
class AiterExperts:
    """MXFP4 experts in fused_moe's layout: ``w1`` gate and up stacked ``[E, 2I, h/2]``, ``w2`` ``[E, h, I/2]``
    (fp4x2, preshuffled (16, 16)), their E8M0 scales ``[E*2I, h/32]`` / ``[E*h, I/32]`` shuffled."""

    w1: torch.Tensor
    w2: torch.Tensor
    w1_scale: torch.Tensor
    w2_scale: torch.Tensor
    num_experts: int
    api: AiterApi
    a16w4: bool = False  # bf16 activations: a16w4 layouts (gate/up interleaved per 16-row tile)


def aiter_fits(out_features: int, in_features: int) -> bool:
    """The (16, 16) weight shuffle needs rows % 16 == 0 and packed bytes % 32 == 0 (K % 64 == 0)."""
    return out_features % WEIGHT_TILE_N == 0 and (in_features // 2) % WEIGHT_TILE_K_BYTES == 0


def prepare_aiter_linear(packed: torch.Tensor, scales: torch.Tensor, api: AiterApi) -> AiterLinear:
    """Canonical MXFP4 ``packed [N, K/2]`` uint8 and ``scales [N, K/32]`` uint8 -> :class:`AiterLinear`."""
    n, kb = packed.shape
    w = api.shuffle_weight(packed.contiguous().view(api.fp4x2), layout=(16, 16))
    s = api.e8m0_shuffle(scales.contiguous().view(api.fp8_e8m0))
    return AiterLinear(w, s, n, kb * 2, api)


def aiter_linear(x: torch.Tensor, w: AiterLinear) -> torch.Tensor:
    """W4A4 ``x @ W^T``: activations quantized by this backend's kernel, the GEMM by ``gemm_a4w4``."""
    from musecore_triton.kernels.mx_gemm import mxfp4_quantize_activation
    api, lead = w.api, x.shape[:-1]
    a, a_scales = mxfp4_quantize_activation(x.reshape(-1, w.in_features))
    a_scales = api.e8m0_shuffle(a_scales.view(api.fp8_e8m0))
    y = api.gemm_a4w4(a.view(api.fp4x2), w.packed, a_scales, w.scales, dtype=x.dtype, bpreshuffle=True)
    return y.reshape(*lead, w.out_features)


def prepare_aiter_experts(experts, api: AiterApi) -> AiterExperts:
    """:class:`musecore_triton.kernels.mx_moe.MxExperts` (canonical bytes) -> :class:`AiterExperts`."""
    E, inter, hb = experts.gate.shape
    hidden = hb * 2
    w1 = torch.cat([experts.gate, experts.up], dim=1).view(api.fp4x2)          # [E, 2I, h/2], gate rows first
    w1_scale = torch.cat([experts.gate_scales, experts.up_scales], dim=1).reshape(E * 2 * inter, hidden // 32)
    w2_scale = experts.down_scales.reshape(E * hidden, inter // 32)
    return AiterExperts(w1=api.shuffle_weight(w1, layout=(16, 16)),
                        w2=api.shuffle_weight(experts.down.contiguous().view(api.fp4x2), layout=(16, 16)),
                        w1_scale=api.e8m0_shuffle(w1_scale.contiguous().view(api.fp8_e8m0)),
                        w2_scale=api.e8m0_shuffle(w2_scale.contiguous().view(api.fp8_e8m0)), num_experts=E,
                        api=api)


def aiter_moe(z: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: AiterExperts,
              post_norm: torch.Tensor, post_eps: float) -> torch.Tensor:
    """The ``moe`` op through ``aiter.fused_moe`` (one row per assignment, top-1, weight 1: the expert outputs)
    and the shared Triton finalize (post norm, routing weight, fp32 sum); fp32 ``[T, h]``."""
    from musecore_triton.kernels.moe import finalize
    api, (T, topk) = experts.api, ids.shape
    if T == 0:
        return torch.empty(0, z.shape[-1], dtype=torch.float32, device=z.device)
    rows = z.contiguous().repeat_interleave(topk, dim=0)                     # row t*k + j: token t, slot j
    one_each = torch.ones(T * topk, 1, dtype=torch.float32, device=z.device)
    out = api.fused_moe(rows, experts.w1, experts.w2, one_each, ids.reshape(-1, 1).to(torch.int32),
                        activation=api.ActivationType.Silu, quant_type=api.QuantType.per_1x32,
                        doweight_stage1=False, w1_scale=experts.w1_scale, w2_scale=experts.w2_scale)
    return finalize(out, ids.reshape(-1), ids, weights, post_norm, post_eps, sorted_rows=False, act_dtype=z.dtype)


# -- a16w4: MXFP4 experts, BF16 activations (gfx942; gfx950 below aiter's bf16/fp8 bound) -------------
# aiter's fused_moe keeps the activations bf16 for per_1x32 fp4x2 weights when called with Silu and
# gate_mode="interleave" (aiter/fused_moe.py, fused_moe_: ``get_gfx() != "gfx950" or M <
# AITER_BF16_FP8_MOE_BOUND`` -> bf16, else fp8), on weights laid out by ``shuffle_weight_a16w4(w1, 16,
# True)`` (gate and up tiles interleaved) / ``shuffle_weight_a16w4(w2, 16, False)`` and scales by
# ``shuffle_scale_a16w4(s, E, gate_up)``. With Silu and the separated layout it would quantize the
# activations to MXFP4 instead (A4W4), so the interleaved layout is what keeps this W4A16.

A16W4_BOUND_ENV, A16W4_BOUND_DEFAULT = "AITER_BF16_FP8_MOE_BOUND", 256


def aiter_a16w4_fits(hidden: int, inter: int) -> bool:
    """The a16w4 shuffles tile K by 256 (scale groups of 8) and N by 32: hidden and inter % 256 == 0."""
    return hidden % 256 == 0 and inter % 256 == 0


def prepare_aiter_experts_a16w4(experts, api: AiterApi) -> AiterExperts:
    """Canonical MXFP4 experts -> aiter's a16w4 layout (``w1`` = gate rows then up rows, interleaved by the shuffle)."""
    E, inter, hb = experts.gate.shape
    hidden = hb * 2
    w1 = torch.cat([experts.gate, experts.up], dim=1).contiguous().view(api.fp4x2)      # [E, 2I, h/2]
    w1_scale = torch.cat([experts.gate_scales, experts.up_scales], dim=1).reshape(E * 2 * inter, hidden // 32)
    w2_scale = experts.down_scales.reshape(E * hidden, inter // 32)
    return AiterExperts(w1=api.shuffle_weight_a16w4(w1, 16, True),
                        w2=api.shuffle_weight_a16w4(experts.down.contiguous().view(api.fp4x2), 16, False),
                        w1_scale=api.shuffle_scale_a16w4(w1_scale.contiguous().view(api.fp8_e8m0), E, True),
                        w2_scale=api.shuffle_scale_a16w4(w2_scale.contiguous().view(api.fp8_e8m0), E, False),
                        num_experts=E, api=api, a16w4=True)


def a16w4_rows_per_call() -> int:
    """Rows per fused_moe call that keep aiter's activations bf16 on gfx950 (below its bf16/fp8 bound)."""
    return max(1, int(os.environ.get(A16W4_BOUND_ENV, str(A16W4_BOUND_DEFAULT))) - 1)


def aiter_moe_a16w4(z: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: AiterExperts,
                    post_norm: torch.Tensor, post_eps: float, arch: str) -> torch.Tensor:
    """The W4A16 ``moe`` op: one aiter row per assignment (top-1, weight 1), bf16 activations, then the shared
    finalize; on gfx950 in chunks below aiter's bf16/fp8 bound so the activations are never quantized."""
    from musecore_triton.kernels.moe import finalize
    api, (T, topk) = experts.api, ids.shape
    if T == 0:
        return torch.empty(0, z.shape[-1], dtype=torch.float32, device=z.device)
    rows = z.contiguous().repeat_interleave(topk, dim=0)
    flat_ids = ids.reshape(-1, 1).to(torch.int32)
    step = rows.shape[0] if arch != "gfx950" else a16w4_rows_per_call()
    outs = []
    for start in range(0, rows.shape[0], step):
        part = rows[start:start + step]
        ones = torch.ones(part.shape[0], 1, dtype=torch.float32, device=z.device)
        outs.append(api.fused_moe(part, experts.w1, experts.w2, ones, flat_ids[start:start + step],
                                  activation=api.ActivationType.Silu, quant_type=api.QuantType.per_1x32,
                                  doweight_stage1=False, w1_scale=experts.w1_scale, w2_scale=experts.w2_scale,
                                  gate_mode="interleave"))
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return finalize(out, ids.reshape(-1), ids, weights, post_norm, post_eps, sorted_rows=False, act_dtype=z.dtype)


A16W4_LINEAR_REASON = ("aiter's dense a16w4 GEMM (gemm_a16wfp4) quantizes the bf16 activations to MXFP4 inside the "
                       "kernel and asserts FP4 hardware (gfx950): it is W4A4, not W4A16, so it is no candidate here")


# -- unified attention on Muse Spark's static KV caches --------------------------------------------------
# aiter's unified_attention (aiter/ops/triton/attention/unified_attention.py, from vLLM) reads K/V pages
# ``[num_blocks, block_size, nkv, d]``; for sequence b the key at *logical* index j is
# ``k[block_table[b, j // bs], j % bs]``, read at ``block_table * stride(0) + (j % bs) * stride(1)``. The
# queries of sequence b are rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` of ``q`` and sit at the last logical
# indices: with ``seq_len = seqused_k[b]`` and ``T_b`` queries, query i is at ``seq_len - T_b + i``; key j is
# visible to it iff ``j <= seq_len - T_b + i`` and ``(seq_len - T_b + i) - j < 1 + window_size[0]``. It never
# looks at positions, so the mapping must make logical index = position - base, for any per-row base.
#
# Muse's static layer cache is ``[B, C+1, nkv, d]`` (C slots and one trash slot per row) and holds
# position p in slot ``p % C`` (a full layer: C = max_length > every position, so slot = p; a sliding layer:
# a ring of C = min(window, max_length) slots). With a page size bs dividing C, logical block n of row b
# (positions base_b + n*bs ...) sits in the slots ``(base_b + n*bs) % C ...`` of that row, contiguous and
# inside the row because base_b is a multiple of bs. The pages are then windows of the flat slot array:
# page stride = bs slots when bs divides C+1 (plain partitions, block_table = flat_slot / bs, the
# ``b*S/bs + arange`` table of a contiguous cache), else one slot (overlapping windows, block_table = the
# flat slot where the page starts; the kernel's address is the same). base_b = the largest multiple of bs
# with ``q_last - base_b < C`` keeps every logical index inside one ring turn: the C + bs - 1 logical keys
# before the query hold positions base_b .. q_last; those older than q_last - C + 1 read the slot a newer
# position took, but they are older than the window (window <= C on a ring) and masked by it. Window
# semantics match exactly: Muse sees key p from query q iff ``0 <= q - p < window``; aiter iff
# ``q - p < 1 + window_size[0]``, so ``window_size = (window - 1, 0)`` (``(-1, -1)`` for full layers).
#
# This holds at decode (the static cache is written first, then read in place) for full and sliding
# layers, and at prefill when the chunk's entries were written into the cache before the call, for full
# layers always and for sliding layers only while the ring has not wrapped (last position < C): after a
# wrap the chunk's own entries overwrite keys its earlier queries still see (that is why Muse's prefill
# attends over [cache, new] before writing), so the adapter declines it. FP8 KV: aiter takes per-tensor
# fp32 ``k_descale`` / ``v_descale`` (scores and output multiplied by them, as Muse's reference does) and
# needs the cache in its e4m3 dtype: e4m3fn on gfx950, e4m3fnuz on gfx942, where Muse's e4m3fn cache is
# declined (converting the whole cache every step would cost more than the kernel saves).

ATTENTION_PAGE_SIZES = (64, 32, 16)  # the kernel's tiles are min(64, next_pow2(bs)) keys; tl.dot needs >= 16


@dataclass(frozen=True)
class PagedKV:
    """Muse's static cache as aiter pages: the K/V page views, the block table and the sequence lengths."""

    k: torch.Tensor            # [num_blocks, bs, nkv, d], views of the cache (no copy)
    v: torch.Tensor
    block_table: torch.Tensor  # [B, C/bs + 1] int32
    seqused_k: torch.Tensor    # [B] int32: logical keys per row (q_last + 1 - base)
    block_size: int
    max_seqlen_k: int          # host bound: C + bs - 1


def page_size_for(capacity: int) -> Optional[int]:
    """The largest page size aiter can tile that divides the cache's slots per row, or None."""
    return next((bs for bs in ATTENTION_PAGE_SIZES if capacity % bs == 0), None)


def _pages(cache: torch.Tensor, bs: int, page_slots: int) -> torch.Tensor:
    B, R, nkv, d = cache.shape
    slot = cache.stride(1)
    count = (B * R - bs) // page_slots + 1  # every page that lies wholly inside the buffer
    return cache.as_strided((count, bs, nkv, d), (page_slots * slot, slot, cache.stride(2), cache.stride(3)),
                            cache.storage_offset())


def paged_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, q_last: torch.Tensor, capacity: int) -> PagedKV:
    """Map a static layer cache ``[B, capacity + 1, nkv, d]`` (slot ``p % capacity`` holds position ``p``) and each
    row's last query position ``q_last [B]`` onto aiter's paged interface; device ops only (graph-capturable)."""
    B, R, nkv, d = k_cache.shape
    bs = page_size_for(capacity)
    if bs is None or R < capacity or k_cache.stride(1) != nkv * d or k_cache.stride(0) != R * nkv * d:
        raise ValueError(f"aiter attention: the cache {list(k_cache.shape)} (capacity {capacity}) is not a contiguous "
                         f"static cache with capacity a multiple of {ATTENTION_PAGE_SIZES[-1]}; use the Triton kernel")
    page_slots = bs if R % bs == 0 else 1
    dev = q_last.device
    base = torch.clamp(q_last + 1 - capacity, min=0) // bs * bs                        # [B]
    blocks = capacity // bs + 1
    logical = base[:, None] + torch.arange(blocks, device=dev)[None, :] * bs           # [B, blocks] positions
    flat = torch.arange(B, device=dev)[:, None] * R + logical % capacity               # slot where the page starts
    table = (flat // page_slots).to(torch.int32)
    seqused = torch.clamp(q_last + 1 - base, min=0).to(torch.int32)
    return PagedKV(_pages(k_cache, bs, page_slots), _pages(v_cache, bs, page_slots), table, seqused, bs,
                   capacity + bs - 1)


def attention_declines(arch: str, k_cache: torch.Tensor, capacity: int, T: int, window: Optional[int],
                       kv_fp8: bool, last_position: Optional[int] = None) -> Optional[str]:
    """Why aiter's unified_attention cannot serve this call exactly (None when it can)."""
    if page_size_for(capacity) is None:
        return f"capacity {capacity} is not a multiple of {ATTENTION_PAGE_SIZES[-1]} (aiter's smallest page here)"
    if k_cache.shape[1] != capacity + 1:
        return "not a static cache view (decode on static caches only: other views are [cache, new] concatenations)"
    if kv_fp8 and arch != "gfx950":
        return "FP8 KV on gfx942: aiter reads e4m3fnuz there, Muse's cache holds e4m3fn"
    if window is not None and window > capacity and (last_position is None or last_position >= capacity):
        return f"window {window} wider than the ring ({capacity} slots) after it wrapped"
    if T > 1 and window is not None and (last_position is None or last_position >= capacity):
        return ("sliding prefill after the ring wrapped: the chunk's entries overwrite keys its earlier queries "
                "still see")
    return None


def aiter_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, q_pos: torch.Tensor,
                    capacity: int, window: Optional[int], scale: float, api: AiterApi,
                    k_scale: Optional[float] = None, v_scale: Optional[float] = None) -> torch.Tensor:
    """Muse's ``attention`` op through aiter's ``unified_attention`` on a static cache that already holds this
    step's entries: ``q [B, T, nq, d]``, ``q_pos [B, T]`` (contiguous per row, left padding -1); ``[B, T, nq, d]``.
    The caller checks :func:`attention_declines` first."""
    B, T, nq, d = q.shape
    paged = paged_kv(k_cache, v_cache, q_pos[:, -1], capacity)
    out = torch.empty(B * T, nq, d, dtype=q.dtype, device=q.device)
    cu = (torch.arange(B + 1, device=q.device, dtype=torch.int32) * T)
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    k_descale = v_descale = None
    if fp8:  # per-tensor fp32 scales, read by pointer; torch.full is a fill kernel, no host copy (capturable)
        k_descale = torch.full((1,), 1.0 if k_scale is None else k_scale, dtype=torch.float32, device=q.device)
        v_descale = torch.full((1,), 1.0 if v_scale is None else v_scale, dtype=torch.float32, device=q.device)
    api.unified_attention(q=q.reshape(B * T, nq, d), k=paged.k, v=paged.v, out=out, cu_seqlens_q=cu, max_seqlen_q=T,
                          seqused_k=paged.seqused_k, max_seqlen_k=paged.max_seqlen_k, softmax_scale=scale, causal=True,
                          window_size=(window - 1, 0) if window is not None else (-1, -1),
                          block_table=paged.block_table, softcap=0.0, q_descale=None, k_descale=k_descale,
                          v_descale=v_descale)
    return out.reshape(B, T, nq, d)


# -- aiter's preshuffled MXFP4 layouts (what gemm_a4w4 / fused_moe read), as permutations --------------
# Written from aiter's definitions (aiter/ops/shuffle.py: ``shuffle_weight`` with layout (16, 16) on
# uint8, ``shuffle_scale`` for E8M0) so that the adapter can prepare weights once at load; each has
# its inverse, and the tests check both are bijections that undo each other (and equal aiter's own
# functions where aiter is importable).

WEIGHT_TILE_N, WEIGHT_TILE_K_BYTES, WEIGHT_LANE_BYTES = 16, 32, 16


def _weight_view(shape: tuple[int, ...]) -> tuple[int, ...]:
    *lead, n, kb = shape
    if n % WEIGHT_TILE_N or kb % WEIGHT_TILE_K_BYTES:
        raise ValueError(f"aiter's weight shuffle needs rows % {WEIGHT_TILE_N} == 0 and packed bytes % "
                         f"{WEIGHT_TILE_K_BYTES} == 0; got {list(shape)}")
    return (-1, n // WEIGHT_TILE_N, WEIGHT_TILE_N, kb // WEIGHT_TILE_K_BYTES,
            WEIGHT_TILE_K_BYTES // WEIGHT_LANE_BYTES, WEIGHT_LANE_BYTES)


def shuffle_weight(packed):
    """Canonical MXFP4 bytes ``[..., N, K/2]`` -> aiter's (16, 16) preshuffled order (same shape)."""
    return packed.reshape(_weight_view(tuple(packed.shape))).permute(0, 1, 3, 4, 2, 5).contiguous().reshape(packed.shape)


def unshuffle_weight(shuffled):
    """Inverse of :func:`shuffle_weight`."""
    *lead, n, kb = shuffled.shape
    v = _weight_view(tuple(shuffled.shape))
    tiled = shuffled.reshape(v[0], v[1], v[3], v[4], v[2], v[5])
    return tiled.permute(0, 1, 4, 2, 3, 5).contiguous().reshape(shuffled.shape)


def shuffle_scale(scale):
    """E8M0 scales ``[M, K/32]`` -> aiter's shuffled order, padded to ``[ceil(M/256)*256, ceil(K/32 / 8)*8]``."""
    import torch
    m, n = scale.shape
    sm, sn = (m + 255) // 256 * 256, (n + 7) // 8 * 8
    padded = torch.zeros(sm, sn, dtype=scale.dtype, device=scale.device)
    padded[:m, :n] = scale
    return padded.view(sm // 32, 2, 16, sn // 8, 2, 4).permute(0, 3, 5, 2, 4, 1).contiguous().view(sm, sn)


def unshuffle_scale(shuffled, rows: int, cols: int):
    """Inverse of :func:`shuffle_scale`: the ``[rows, cols]`` scales back in row-major order."""
    sm, sn = shuffled.shape
    tiled = shuffled.view(sm // 32, sn // 8, 4, 16, 2, 2)  # the permuted axes (0, 3, 5, 2, 4, 1)
    return tiled.permute(0, 5, 3, 1, 4, 2).contiguous().view(sm, sn)[:rows, :cols]


# The a16w4 layouts (aiter/ops/shuffle.py: ``shuffle_weight(..., layout=(16, 16), is_guinterleave=True,
# gate_up=...)`` behind ``shuffle_weight_a16w4``, ``shuffle_scale(..., is_guinterleave=True, gate_up=...)``
# behind ``shuffle_scale_a16w4``): a view into tiles, one permutation of the tile axes, a view back. Each is
# written here as (tile shape, axis order) so that the inverse is the inverse axis order.

A16W4_LANES, A16W4_KPACK = 16, 16  # NLane 16 -> KLane 64 / 16 = 4; KPack 16 bytes


def _inverse(order: tuple[int, ...]) -> tuple[int, ...]:
    inv = [0] * len(order)
    for i, o in enumerate(order):
        inv[o] = i
    return tuple(inv)


def _a16w4_weight_tiles(shape: tuple[int, ...], gate_up: bool) -> tuple[tuple[int, ...], tuple[int, ...]]:
    E, n, kb = shape
    klane = 64 // A16W4_LANES
    rows = n // 2 if gate_up else n
    if rows % A16W4_LANES or kb % (klane * A16W4_KPACK):
        raise ValueError(f"aiter's a16w4 weight shuffle needs rows{' per half' if gate_up else ''} % {A16W4_LANES} == 0 "
                         f"and packed bytes % {klane * A16W4_KPACK} == 0; got {list(shape)}")
    n0, k0 = rows // A16W4_LANES, kb // (klane * A16W4_KPACK)
    if gate_up:
        return (E, 2, n0, A16W4_LANES, k0, klane, A16W4_KPACK), (0, 2, 1, 4, 5, 3, 6)
    return (E, n0, A16W4_LANES, k0, klane, A16W4_KPACK), (0, 1, 3, 4, 2, 5)


def shuffle_weight_a16w4(packed, gate_up: bool):
    """Canonical MXFP4 expert bytes ``[E, N, K/2]`` -> aiter's a16w4 order (``gate_up``: rows are gate then up,
    interleaved per 16-row tile by the shuffle)."""
    tiles, order = _a16w4_weight_tiles(tuple(packed.shape), gate_up)
    return packed.reshape(tiles).permute(order).contiguous().reshape(packed.shape)


def unshuffle_weight_a16w4(shuffled, gate_up: bool):
    """Inverse of :func:`shuffle_weight_a16w4`."""
    tiles, order = _a16w4_weight_tiles(tuple(shuffled.shape), gate_up)
    permuted = tuple(tiles[o] for o in order)
    return shuffled.reshape(permuted).permute(_inverse(order)).contiguous().reshape(shuffled.shape)


def _a16w4_scale_tiles(shape: tuple[int, ...], experts: int, gate_up: bool):
    rows, k = shape
    n = rows // experts
    if rows % experts or n % 32 or k % 8 or k * 32 < 256:
        raise ValueError(f"aiter's a16w4 scale shuffle needs rows per expert % 32 == 0 and K/32 % 8 == 0 (K >= 256; "
                         f"other K pads, which is no permutation); got {list(shape)} for {experts} experts")
    n1, k1 = n // 32, k // 8
    if gate_up:
        return (experts, 2, n1, 16, k1, 2, 4), (0, 2, 4, 6, 3, 5, 1)
    return (experts, n1, 2, 16, k1, 2, 4), (0, 1, 4, 6, 3, 5, 2)


def shuffle_scale_a16w4(scale, experts: int, gate_up: bool):
    """E8M0 expert scales ``[E*N, K/32]`` -> aiter's a16w4 order (same shape)."""
    tiles, order = _a16w4_scale_tiles(tuple(scale.shape), experts, gate_up)
    return scale.reshape(tiles).permute(order).contiguous().reshape(scale.shape)


def unshuffle_scale_a16w4(shuffled, experts: int, gate_up: bool):
    """Inverse of :func:`shuffle_scale_a16w4`."""
    tiles, order = _a16w4_scale_tiles(tuple(shuffled.shape), experts, gate_up)
    permuted = tuple(tiles[o] for o in order)
    return shuffled.reshape(permuted).permute(_inverse(order)).contiguous().reshape(shuffled.shape)
