"""A decode step's prologue in one kernel: ``MuseModel.embed`` for one token per row.

``embed`` at decode is ~18 launches of a few microseconds each in a captured step (the cache's next position, the
rotary rows: clamp, float, multiply, cat, cos, sin; the placeholder mask; the embedding gather; the weightless norm;
the first layer's input norm). Here one program per row does all of it, in the ops' roundings: the gathered row in
the activation dtype, its weightless RMSNorm rounded, then ``rms(x) * w`` rounded; ``cos, sin`` of
``max(position, 0) * inv_freq`` over both halves, times the attention factor when it is not 1; the cache's next
position ``max(next, position + 1)``. Placeholder ids (image, video, audio) embed as token 0, as in ``embed``.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import triton
import triton.language as tl

from musecore_triton import hooks
from musecore_triton.kernels import norms

MAX_PLACEHOLDERS = 4  # the model's image, video and audio ids (padded to a power of two)


@triton.jit
def decode_embed_kernel(ids_ptr, pos_ptr, next_ptr, table_ptr, mm_ptr, n_mm, w_ptr, inv_freq_ptr, x_ptr, a_ptr,
                        cos_ptr, sin_ptr, V, H, eps, attention_factor, BLOCK_H: tl.constexpr, D: tl.constexpr,
                        N_MM: tl.constexpr, SCALED: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr = False):
    # Weights first, before the wait (nothing writes them), then every input at once: the program's chain of memory
    # round trips is the inputs, then the embedding row (its address needs the id), nothing after its reductions.
    offs = tl.arange(0, BLOCK_H)
    m = offs < H
    d = tl.arange(0, D)
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    inv_freq = tl.load(inv_freq_ptr + d % (D // 2))
    hooks.pdl_wait(PDL)  # the kernel before has finished (musecore_triton.hooks)
    hooks.pdl_launch_dependents(EARLY)  # the first q/k/v/gate GEMV may start loading its weights (as attention's)
    b = tl.program_id(0).to(tl.int64)
    tok = tl.load(ids_ptr + b)
    p = tl.load(pos_ptr + b)
    next_p = tl.load(next_ptr + b)
    mm = tl.load(mm_ptr + tl.arange(0, N_MM), mask=tl.arange(0, N_MM) < n_mm, other=-1)
    tok = tl.where(tl.sum((mm == tok).to(tl.int32), axis=0) > 0, 0, tok)
    row = offs * 0 + tok  # (an id outside the table reads nothing: the caller checked the ids)
    e = tl.load(table_ptr + row * H + offs, mask=m & (row >= 0) & (row < V), other=0.0)
    e = e.to(x_ptr.dtype.element_ty).to(tl.float32)
    x = norms._norm(e, e, m, H, eps, False, False, x_ptr.dtype.element_ty).to(x_ptr.dtype.element_ty)
    tl.store(x_ptr + b * H + offs, x, mask=m)
    a = norms._norm(x.to(tl.float32), w, m, H, eps, True, False, a_ptr.dtype.element_ty)
    tl.store(a_ptr + b * H + offs, a.to(a_ptr.dtype.element_ty), mask=m)

    angle = tl.maximum(p, 0).to(tl.float32) * inv_freq
    c, s = tl.cos(angle), tl.sin(angle)
    if SCALED:
        c, s = c * attention_factor, s * attention_factor
    tl.store(cos_ptr + b * D + d, c)
    tl.store(sin_ptr + b * D + d, s)
    tl.store(next_ptr + b, tl.maximum(next_p, p + 1))


def decode_embed(ids: torch.Tensor, positions: torch.Tensor, next_position: torch.Tensor, table: torch.Tensor,
                 placeholders: torch.Tensor, norm_weight: torch.Tensor, eps: float, inv_freq: torch.Tensor,
                 attention_factor: float, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """``(x, a, (cos, sin))`` of ``MuseModel.embed`` for ``ids [B,1]`` at ``positions [B,1]`` (``-1``: padding),
    and ``next_position [B]`` advanced in place: ``x`` the weightless-normed embedding in ``dtype``, ``a`` =
    ``rms_norm(x, norm_weight)``, ``cos, sin [B,1,d]`` fp32 from ``inv_freq [d/2]``."""
    B, T = ids.shape
    H, D = table.shape[1], 2 * inv_freq.numel()
    if T != 1 or positions.shape != (B, 1) or next_position.shape != (B,) or norm_weight.shape != (H,) \
            or not table.is_contiguous() or D & (D - 1) or placeholders.numel() > MAX_PLACEHOLDERS:
        raise ValueError(f"decode_embed takes ids and positions [B,1], next_position [B], a contiguous table [V,H], "
                         f"a norm weight [H], a power-of-two rotary width and <= {MAX_PLACEHOLDERS} placeholder ids; "
                         f"got ids {list(ids.shape)}, positions {list(positions.shape)}, next_position "
                         f"{list(next_position.shape)}, table {list(table.shape)}, weight {list(norm_weight.shape)}, "
                         f"rotary width {D}, {placeholders.numel()} placeholders")
    x = torch.empty(B, 1, H, dtype=dtype, device=ids.device)
    a = torch.empty_like(x)
    cos = torch.empty(B, 1, D, dtype=torch.float32, device=ids.device)
    sin = torch.empty_like(cos)
    if B:
        decode_embed_kernel[(B,)](ids.contiguous(), positions.contiguous(), next_position, table, placeholders,
                                  placeholders.numel(), norm_weight.contiguous(), inv_freq.contiguous(), x, a, cos, sin,
                                  table.shape[0], H, eps, attention_factor, BLOCK_H=triton.next_power_of_2(H), D=D,
                                  N_MM=MAX_PLACEHOLDERS, SCALED=attention_factor != 1.0,
                                  EARLY=hooks.early_trigger(ids.device, "decode_embed"),
                                  **hooks.launch_options(ids.device, "decode_embed"))
    return x, a, (cos, sin)


def model_decode_embed(model: Any) -> tuple[Optional[Callable[..., Optional[tuple]]], str]:
    """``(embed, "")``: ``model.embed`` for one token per row through a static cache in one launch
    (:func:`decode_embed`), as ``embed(input_ids, positions, cache) -> (x, a, positions, rope)`` or None for other
    inputs (a prefill, no positions or cache, tensors off the table's device, the embedding or the first norm
    replaced since); or ``(None, why)`` when the model's weights do not fit it. What a GPU backend's
    ``Backend.fuse_embed`` returns (CUDA and ROCm)."""
    table = getattr(model.embed_tokens, "data", None)
    norm = model.layers[0].input_layernorm if model.layers else None
    if not isinstance(table, torch.Tensor) or table.device.type != "cuda" or table.dim() != 2 \
            or not table.is_contiguous() or table.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return None, "the embedding is not a contiguous [V, H] GPU tensor"
    if not isinstance(norm, torch.Tensor) or norm.shape != (table.shape[1],) or norm.device != table.device:
        return None, "the first layer's input norm is not a weight [H] beside the embedding"
    if model.rope.inv_freq.device != table.device or model.multimodal_ids.numel() > MAX_PLACEHOLDERS:
        return None, "the rotary frequencies or the placeholder ids are not on the embedding's device"
    weight, eps = model.embed_tokens, model.config.rms_norm_eps

    def embed(input_ids: torch.Tensor, positions: Optional[torch.Tensor], cache: Any) -> Optional[tuple]:
        if positions is None or cache is None or input_ids.dim() != 2 or input_ids.shape[1] != 1 \
                or input_ids.device != table.device or positions.device != table.device \
                or not cache.next_position.is_contiguous() or model.embed_tokens is not weight \
                or weight.data is not table or model.layers[0].input_layernorm is not norm:
            return None
        x, a, rope = decode_embed(input_ids, positions, cache.next_position, table, model.multimodal_ids, norm, eps,
                                  model.rope.inv_freq, model.rope.attention_factor, model.dtype)
        return x, a, positions, rope

    return embed, ""
