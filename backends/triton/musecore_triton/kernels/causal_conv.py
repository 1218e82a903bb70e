"""Depthwise causal 1-D convolution with a streaming state (the audio tower's token mixer).

``y[b,c,t] = bias[c] + sum_j w[c,j] * xp[b,c,t+j]`` where ``xp`` is the input left-padded with the
``K-1`` columns of ``state`` (zeros without one), and ``state'`` is ``xp``'s last ``K-1`` columns, so
a waveform fed in chunks gives exactly the one-pass result (``musecore.ops.causal_conv1d``).

One program computes a ``BLOCK_C x BLOCK_T`` tile in fp32 with the ``K`` taps unrolled, reading the
state's columns where the taps reach left of the chunk, so the padded input is never materialised
(PyTorch's path is ``cat`` then ``conv1d(groups=C)``: one extra copy of the chunk). Every stride is a
parameter: the audio tower's ``[B, T, C]`` activations, transposed to ``[B, C, T]``, are read as the
view they are, with coalesced loads along the channels.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from musecore_triton import hooks


@triton.jit
def causal_conv1d_kernel(x_ptr, w_ptr, b_ptr, s_ptr, y_ptr, C, T, c_blocks,
                         sx_b, sx_c, sx_t, ss_b, ss_c, ss_t, sy_b, sy_c, sy_t,
                         K: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_STATE: tl.constexpr,
                         BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr, PDL: tl.constexpr):
    hooks.pdl_wait(PDL)  # the kernel before has finished (musecore_triton.hooks)
    pid = tl.program_id(0)
    b = (pid // c_blocks).to(tl.int64)
    c = (pid % c_blocks) * BLOCK_C + tl.arange(0, BLOCK_C)
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    c_ok = c < C
    t_ok = t < T
    acc = tl.zeros((BLOCK_C, BLOCK_T), dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(b_ptr + c, mask=c_ok, other=0.0).to(tl.float32)[:, None]
    for j in tl.static_range(K):
        w = tl.load(w_ptr + c * K + j, mask=c_ok, other=0.0).to(tl.float32)
        src = t + (j - (K - 1))  # the input column tap j reads; < 0: a column of the state
        from_x = c_ok[:, None] & (t_ok & (src >= 0))[None, :]
        xv = tl.load(x_ptr + b * sx_b + c[:, None].to(tl.int64) * sx_c + src[None, :].to(tl.int64) * sx_t,
                     mask=from_x, other=0.0).to(tl.float32)
        if HAS_STATE:
            from_s = c_ok[:, None] & (t_ok & (src < 0))[None, :]
            sv = tl.load(s_ptr + b * ss_b + c[:, None].to(tl.int64) * ss_c + (src + (K - 1))[None, :] * ss_t,
                         mask=from_s, other=0.0).to(tl.float32)
            xv += sv
        acc += w[:, None] * xv
    tl.store(y_ptr + b * sy_b + c[:, None].to(tl.int64) * sy_c + t[None, :].to(tl.int64) * sy_t,
             acc.to(y_ptr.dtype.element_ty), mask=c_ok[:, None] & t_ok[None, :])


def check_conv_inputs(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                      state: Optional[torch.Tensor]) -> int:
    """The kernel size ``K``, after one-line errors for shapes that do not fit the contract."""
    if x.dim() != 3:
        raise ValueError(f"causal_conv1d: x must be [batch, channels, time]; got {list(x.shape)}")
    B, C, _ = x.shape
    if weight.dim() != 3 or weight.shape[0] != C or weight.shape[1] != 1 or weight.shape[2] < 1:
        raise ValueError(f"causal_conv1d: weight must be [channels={C}, 1, kernel] (depthwise); got "
                         f"{list(weight.shape)}")
    K = weight.shape[2]
    if bias is not None and tuple(bias.shape) != (C,):
        raise ValueError(f"causal_conv1d: bias must be [{C}]; got {list(bias.shape)}")
    if state is not None and tuple(state.shape) != (B, C, K - 1):
        raise ValueError(f"causal_conv1d: state must be [batch={B}, channels={C}, kernel-1={K - 1}] (the previous "
                         f"chunk's last input columns); got {list(state.shape)}")
    return K


def next_state(x: torch.Tensor, state: Optional[torch.Tensor], K: int) -> torch.Tensor:
    """The last ``K-1`` columns of ``[state, x]`` (zeros for a missing state), in x's dtype, contiguous."""
    B, C, T = x.shape
    if T >= K - 1:
        return x[:, :, T - (K - 1):].contiguous()
    prev = state.to(x.dtype) if state is not None else x.new_zeros(B, C, K - 1)
    return torch.cat([prev[:, :, T:], x], dim=-1)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                  state: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``causal_conv1d`` op (``musecore.ops``): ``(y [B,C,T] in x's dtype, state' [B,C,K-1])``, fp32 math.

    ``x`` and ``state`` may be any strided views; ``weight [C,1,K]`` and ``bias [C]`` are read contiguous."""
    K = check_conv_inputs(x, weight, bias, state)
    B, C, T = x.shape
    y = torch.empty_like(x)  # x's layout: a transposed [B,T,C] view gives y that transposes back contiguous
    if y.numel():
        w = weight.reshape(C, K).contiguous()
        b = bias.contiguous() if bias is not None else w
        s = state if state is not None else x
        block_c = min(64, triton.next_power_of_2(C))
        block_t = min(64, triton.next_power_of_2(T))
        c_blocks = triton.cdiv(C, block_c)
        causal_conv1d_kernel[(B * c_blocks, triton.cdiv(T, block_t))](
            x, w, b, s, y, C, T, c_blocks, x.stride(0), x.stride(1), x.stride(2), s.stride(0), s.stride(1),
            s.stride(2), y.stride(0), y.stride(1), y.stride(2), K=K, HAS_BIAS=bias is not None,
            HAS_STATE=state is not None, BLOCK_C=block_c, BLOCK_T=block_t, num_warps=4,
            **hooks.launch_options(x.device, "causal_conv1d"))
    return y, next_state(x, state, K)
