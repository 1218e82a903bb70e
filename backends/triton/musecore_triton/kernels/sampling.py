"""Greedy sampling: ``argmax`` over each row of the logits, as ``torch.argmax(-1)`` gives it, in two short launches.

At muse-small's 65536-entry vocabulary PyTorch's argmax is one reduction kernel of ~16 us on the H200 per decode step
(session 51, run 51's profile of the greedy graph: the longest kernel after the lm_head), a fifth of a MoE layer.
Here ``argmax_partial_kernel`` has ``ceil(V / BLOCK)`` programs per row, each reducing ``BLOCK`` logits to the
largest and the first index holding it, and ``argmax_final_kernel`` reduces those partials per row.

:func:`greedy_positions` is greedy decoding's position update in one launch (``GreedyGraphStep``'s
``where(live, next_position, -1)`` and ``next_position += live``: five PyTorch kernels otherwise).

Ties and special values follow ``torch.argmax``: the first index of the largest value; NaN counts as larger than
everything (the first NaN wins), ``+0`` and ``-0`` are equal. Values compare through an order-preserving int32 key
of their fp32 bits (:func:`_key`), so ties are exact.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from musecore_triton import hooks
from musecore_triton.kernels.elementwise import rows2d

BLOCK = 2048  # logits per partial program: 32 programs per 65536-entry row, 99 per 202048
MAX_V = 1 << 22  # the final program holds a row's partials: up to 2048


@triton.jit
def _key(x):
    """An int32 whose order is fp32 ``x``'s: positive floats keep their bits, negative ones flip their magnitude
    bits; both zeros map to 0 and every NaN to the largest int32."""
    b = x.to(tl.int32, bitcast=True)
    k = tl.where(b >= 0, b, b ^ 0x7FFFFFFF)
    k = tl.where(x == 0.0, 0, k)
    return tl.where(x != x, 0x7FFFFFFF, k)


@triton.jit
def argmax_partial_kernel(x_ptr, key_ptr, idx_ptr, n, x_stride, parts, BLOCK: tl.constexpr, PDL: tl.constexpr):
    hooks.pdl_wait(PDL)  # the kernel before has finished (musecore_triton.hooks)
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    offs = part * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=0.0).to(tl.float32)
    k = tl.where(mask, _key(x), -2147483648)
    best = tl.max(k, axis=0)
    first = tl.min(tl.where(k == best, offs, 2147483647), axis=0)
    tl.store(key_ptr + row * parts + part, best)
    tl.store(idx_ptr + row * parts + part, first)


@triton.jit
def argmax_final_kernel(key_ptr, idx_ptr, out_ptr, parts, BLOCK_P: tl.constexpr, PDL: tl.constexpr):
    hooks.pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_P)
    mask = offs < parts
    k = tl.load(key_ptr + row * parts + offs, mask=mask, other=-2147483648)
    i = tl.load(idx_ptr + row * parts + offs, mask=mask, other=2147483647)
    best = tl.max(k, axis=0)
    tl.store(out_ptr + row, tl.min(tl.where(k == best, i, 2147483647), axis=0).to(tl.int64))


@triton.jit
def greedy_positions_kernel(next_ptr, live_ptr, pos_ptr, B, BLOCK: tl.constexpr, PDL: tl.constexpr):
    hooks.pdl_wait(PDL)
    offs = tl.arange(0, BLOCK)
    mask = offs < B
    nxt = tl.load(next_ptr + offs, mask=mask, other=0)
    live = tl.load(live_ptr + offs, mask=mask, other=0) != 0
    tl.store(pos_ptr + offs, tl.where(live, nxt, -1), mask=mask)
    tl.store(next_ptr + offs, nxt + live.to(tl.int64), mask=mask)


def greedy_positions(next_position: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """``where(live, next_position, -1)[:, None]`` (int64 ``[B, 1]``), then ``next_position += live`` in place: a
    greedy step's positions (a row that ended runs at -1) and the loop's advance, in one launch.
    ``next_position``: int64 ``[B]``, contiguous; ``live``: bool ``[B]``."""
    if next_position.dtype != torch.long or live.dtype != torch.bool or next_position.dim() != 1 \
            or live.shape != next_position.shape or not next_position.is_contiguous():
        raise ValueError(f"greedy_positions takes a contiguous int64 [B] next_position and a bool [B] live; got "
                         f"{next_position.dtype} {list(next_position.shape)} and {live.dtype} {list(live.shape)}")
    B = next_position.shape[0]
    positions = torch.empty(B, 1, dtype=torch.long, device=next_position.device)
    if B:
        greedy_positions_kernel[(1,)](next_position, live.contiguous(), positions, B,
                                      BLOCK=triton.next_power_of_2(B), num_warps=1,
                                      **hooks.launch_options(next_position.device, "greedy_positions"))
    return positions


def takes(logits: torch.Tensor) -> bool:
    """Whether :func:`argmax` takes ``logits``: 16- or 32-bit floats, 1 .. ``MAX_V`` entries per row."""
    return logits.dtype in (torch.float32, torch.bfloat16, torch.float16) and logits.dim() > 0 \
        and 0 < logits.shape[-1] <= MAX_V


def argmax(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``logits.argmax(-1)`` (int64, ``logits.shape[:-1]``) for the logits :func:`takes`; written into ``out`` (a
    contiguous int64 tensor of that many elements, e.g. a graph's static token buffer) when given, and returned."""
    if not takes(logits):
        raise ValueError(f"argmax takes float logits [..., V] with 0 < V <= {MAX_V}; got {logits.dtype} "
                         f"{list(logits.shape)}")
    x = rows2d(logits)
    rows, n = x.shape
    if out is None:
        out = torch.empty(rows, dtype=torch.long, device=logits.device)
    elif out.dtype != torch.long or out.numel() != rows or not out.is_contiguous() or out.device != logits.device:
        raise ValueError(f"argmax out= must be a contiguous int64 tensor of {rows} elements on {logits.device}; got "
                         f"{out.dtype} {list(out.shape)} on {out.device}")
    if rows:
        parts = triton.cdiv(n, BLOCK)
        key = torch.empty(rows, parts, dtype=torch.int32, device=logits.device)
        idx = torch.empty(rows, parts, dtype=torch.int32, device=logits.device)
        argmax_partial_kernel[(rows, parts)](x, key, idx, n, x.stride(0), parts, BLOCK=BLOCK, num_warps=4,
                                             **hooks.launch_options(logits.device, "argmax"))
        argmax_final_kernel[(rows,)](key, idx, out, parts, BLOCK_P=triton.next_power_of_2(parts), num_warps=4,
                                     **hooks.launch_options(logits.device, "argmax_final"))
    return out.view(logits.shape[:-1])  # (out= given: the same storage)
