"""The static KV cache write in one kernel (the backend's ``kv_write``; reference:
:func:`musecore.kv_cache.write_static`).

The reference scatter is five to seven small PyTorch kernels per layer (slot arithmetic, then one
advanced-index write each for keys, values and positions); a captured decode step of muse-small ran
about a hundred of them per token. Here one program per new entry computes its slot and copies the
key row, the value row and the position. Rows are moved as raw 1/2/4-byte words, so bf16, fp16,
fp32 and FP8 caches are one kernel (and the interpreter, which has no bf16, runs it too).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from musecore_triton import hooks

_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


@triton.jit
def static_slot(p, capacity, RING: tl.constexpr):
    """A static cache's slot for position ``p``: ``p % capacity`` in a ring, ``p`` in a full layer; padding (-1) and
    positions past a full layer's capacity go to the trash slot ``capacity``."""
    if RING:
        slot = tl.where(p >= 0, p % capacity, capacity)
    else:
        slot = tl.where((p >= 0) & (p < capacity), p, capacity)
    return slot


@triton.jit
def kv_write_kernel(k_ptr, v_ptr, pos_ptr, kn_ptr, vn_ptr, pn_ptr, T, slots, capacity,
                    kn_sb, kn_st, vn_sb, vn_st, ROW: tl.constexpr, BLOCK: tl.constexpr, RING: tl.constexpr,
                    PDL: tl.constexpr):
    hooks.pdl_wait(PDL)  # the kernel before has finished (musecore_triton.hooks)
    i = tl.program_id(0).to(tl.int64)  # entry b * T + t
    b, t = i // T, i % T
    p = tl.load(pn_ptr + i)
    slot = static_slot(p, capacity, RING)
    dst = (b * slots + slot) * ROW
    offs = tl.arange(0, BLOCK)
    mask = offs < ROW
    tl.store(k_ptr + dst + offs, tl.load(kn_ptr + b * kn_sb + t * kn_st + offs, mask=mask), mask=mask)
    tl.store(v_ptr + dst + offs, tl.load(vn_ptr + b * vn_sb + t * vn_st + offs, mask=mask), mask=mask)
    tl.store(pos_ptr + b * slots + slot, p)


def _rows_contiguous(x: torch.Tensor) -> bool:
    """Each ``[heads, d]`` row of ``x [B,T,heads,d]`` is one contiguous run (a slice of a fused projection is)."""
    return x.stride(3) == 1 and x.stride(2) == x.shape[3]


def kv_write(k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
             pos_new: torch.Tensor, capacity: int, ring: bool) -> None:
    """:func:`musecore.kv_cache.write_static` as one Triton launch, for the static cache's layout: contiguous
    ``[B, capacity + 1, heads, d]`` buffers, long positions, new entries already in the cache's dtype."""
    B, T = pos_new.shape
    words = _WORDS.get(k.element_size())
    if words is None or k.dtype != k_new.dtype or v.dtype != v_new.dtype or k.shape != v.shape \
            or k_new.shape[:2] != (B, T) or k.shape[1] != capacity + 1 or positions.dtype != torch.long \
            or not (k.is_contiguous() and v.is_contiguous() and positions.is_contiguous()):
        raise ValueError(f"kv_write needs a static cache's buffers (contiguous [B, capacity + 1, heads, d], "
                         f"long positions) and new entries in their dtype; got cache {k.dtype} {list(k.shape)}, "
                         f"new {k_new.dtype} {list(k_new.shape)}, capacity {capacity}")
    if B * T == 0:
        return
    if not _rows_contiguous(k_new):
        k_new = k_new.contiguous()
    if not _rows_contiguous(v_new):
        v_new = v_new.contiguous()
    row = k.shape[2] * k.shape[3]
    kn, vn = k_new.view(words), v_new.view(words)
    kv_write_kernel[(B * T,)](k.view(words), v.view(words), positions, kn, vn, pos_new.contiguous(), T, k.shape[1],
                              capacity, kn.stride(0), kn.stride(1), vn.stride(0), vn.stride(1), ROW=row,
                              BLOCK=triton.next_power_of_2(row), RING=ring, num_warps=4,
                              **hooks.launch_options(k.device, "kv_write"))
