"""Element-wise ops as single kernels: ``silu_mul`` (the dense MLP's SwiGLU) and ``logit_softcap``.

In PyTorch each is three or four kernels (casts to fp32, the activation, the products) with an fp32
intermediate written and read back; here each is one pass in fp32 with one rounding at the end, the
reference's numerics. Both read their inputs as rows with a row stride, so ``silu_mul`` takes the gate
and up halves of a fused projection as the views they are, without copies.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from musecore_triton import hooks

BLOCK = 1024  # elements per program: a 16384-wide MLP row is 16 programs, a 202048-wide logit row 198


@triton.jit
def silu_mul_kernel(g_ptr, u_ptr, y_ptr, n, g_stride, u_stride, BLOCK: tl.constexpr, PDL: tl.constexpr):
    hooks.pdl_wait(PDL)  # the kernel before has finished (musecore_triton.hooks)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + row * g_stride + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * u_stride + offs, mask=mask, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(y_ptr + row * n + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def logit_softcap_kernel(x_ptr, y_ptr, n, x_stride, multiplier, cap, BLOCK: tl.constexpr, PDL: tl.constexpr):
    hooks.pdl_wait(PDL)  # the kernel before has finished (musecore_triton.hooks)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=0.0).to(tl.float32)
    t = x * multiplier / cap
    # tanh(t) = sign(t) (1 - e^{-2|t|}) / (1 + e^{-2|t|}): no overflow at any |t|; libdevice's tanh is not
    # reachable from Triton's CPU interpreter, which runs the tests.
    e = tl.exp(-2.0 * tl.abs(t))
    th = (1.0 - e) / (1.0 + e)
    tl.store(y_ptr + row * n + offs, tl.where(t < 0, -th, th) * cap, mask=mask)


def rows2d(x: torch.Tensor) -> torch.Tensor:
    """``x [...,n]`` as ``[rows, n]`` with unit column stride: a view when the layout allows, else a copy."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The ``silu_mul`` op: ``silu(gate) * up`` in fp32, returned in gate's dtype (contiguous)."""
    if gate.shape != up.shape:
        raise ValueError(f"silu_mul: gate {list(gate.shape)} and up {list(up.shape)} must have one shape")
    y = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if gate.numel():
        g2, u2 = rows2d(gate), rows2d(up)
        n = g2.shape[1]
        silu_mul_kernel[(g2.shape[0], triton.cdiv(n, BLOCK))](g2, u2, y, n, g2.stride(0), u2.stride(0), BLOCK=BLOCK,
                                                            **hooks.launch_options(gate.device, "silu_mul"))
    return y


def logit_softcap(logits: torch.Tensor, multiplier: float, cap: float) -> torch.Tensor:
    """The ``logit_softcap`` op: fp32 ``cap * tanh(logits * multiplier / cap)``."""
    if cap is None or not cap > 0:
        raise ValueError(f"logit_softcap: cap must be positive; got {cap}")
    y = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    if logits.numel():
        x2 = rows2d(logits)
        n = x2.shape[1]
        grid = (x2.shape[0], triton.cdiv(n, BLOCK))
        logit_softcap_kernel[grid](x2, y, n, x2.stride(0), float(multiplier), float(cap), BLOCK=BLOCK,
                                   **hooks.launch_options(logits.device, "logit_softcap"))
    return y
