"""RoPE with one cos/sin row per token shared by every head (the vision tower's axial 2-D RoPE).

``x * cos + rotate_half(x) * sin`` (``musecore.ops.rope``) is six PyTorch kernels with fp32
intermediates written and read back; here one program rotates every head of one token in fp32 and
rounds once. The head dim may be any even number (the 816B tower's 96: the halves of 48 are padded
to 64 inside the kernel); x may be a strided view (q or k of a fused projection).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from musecore_triton import hooks


@triton.jit
def rope_kernel(x_ptr, cos_ptr, sin_ptr, y_ptr, nh, half, sx_n, sx_h, sc_n, ss_n,
                BLOCK_H: tl.constexpr, HALF: tl.constexpr, PDL: tl.constexpr):
    hooks.pdl_wait(PDL)  # the kernel before has finished (musecore_triton.hooks)
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    j = tl.arange(0, HALF)
    ok = (h < nh)[:, None] & (j < half)[None, :]
    cos1 = tl.load(cos_ptr + n * sc_n + j, mask=j < half, other=0.0).to(tl.float32)[None, :]
    cos2 = tl.load(cos_ptr + n * sc_n + half + j, mask=j < half, other=0.0).to(tl.float32)[None, :]
    sin1 = tl.load(sin_ptr + n * ss_n + j, mask=j < half, other=0.0).to(tl.float32)[None, :]
    sin2 = tl.load(sin_ptr + n * ss_n + half + j, mask=j < half, other=0.0).to(tl.float32)[None, :]
    base = x_ptr + n * sx_n + h[:, None] * sx_h + j[None, :]
    x1 = tl.load(base, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(base + half, mask=ok, other=0.0).to(tl.float32)
    out = y_ptr + n * nh * 2 * half + h[:, None] * 2 * half + j[None, :]
    tl.store(out, (x1 * cos1 - x2 * sin1).to(y_ptr.dtype.element_ty), mask=ok)  # rotate_half = cat(-x2, x1)
    tl.store(out + half, (x2 * cos2 + x1 * sin2).to(y_ptr.dtype.element_ty), mask=ok)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The ``rope`` op (``musecore.ops``): ``x [N,nh,d]`` rotated by ``cos/sin [N,d]``, fp32 math, x's dtype."""
    if x.dim() != 3 or x.shape[-1] % 2:
        raise ValueError(f"rope: x must be [N, heads, head_dim] with an even head_dim; got {list(x.shape)}")
    N, nh, d = x.shape
    if tuple(cos.shape) != (N, d) or tuple(sin.shape) != (N, d):
        raise ValueError(f"rope: cos and sin must be [N={N}, head_dim={d}]; got {list(cos.shape)} and {list(sin.shape)}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    y = torch.empty(N, nh, d, dtype=x.dtype, device=x.device)
    if y.numel():
        block_h = min(16, triton.next_power_of_2(nh))
        rope_kernel[(N, triton.cdiv(nh, block_h))](
            x, cos, sin, y, nh, d // 2, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0),
            BLOCK_H=block_h, HALF=triton.next_power_of_2(d // 2), num_warps=4,
            **hooks.launch_options(x.device, "rope"))
    return y
