"""FP8 E4M3 (W8A8) on Hopper: cuBLASLt's scaled GEMM for linears, a Triton grouped GEMM for experts.

Two activation schemes, named by the activation format the plan gives a weight:

* ``"fp8"`` (ModelOpt FP8 checkpoints): per-tensor activations, with the checkpoint's static
  ``input_scale`` when it has one, else dynamically (``amax / 448`` over the whole tensor), exactly
  as the reference's emulation does; ``torch._scaled_mm`` with two scalar scales.
* ``"fp8-token"`` (the ``h200-fp8`` / ``h100-fp8`` profiles, :data:`TOKEN_ACT`): dynamic per-token
  scales, ``amax(|x_t|) / 448`` for each row (an all-zero row gets 1.0), so a token's numerics never
  depend on the rest of its batch; the weight's scales are applied per output channel. Linears run
  ``torch._scaled_mm`` with row-wise scales (cuBLASLt's fastest FP8 path on SM90); routed experts run
  :mod:`musecore_cuda.kernels.fp8_moe`.

Weights stay as the loader hands them over: E4M3 ``[N, K]`` (or ``[E, N, K]`` for experts) with a
per-tensor (per-expert) fp32 scale, which the row-wise path repeats per output channel. 128x128
block-scaled FP8 weights are not implemented here.

:func:`quantize_rows` is the per-token quantization in plain PyTorch (any device): it is the
definition the GPU kernel must match bit for bit, and what the reference's emulation computes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

E4M3_MAX = 448.0
TOKEN_ACT = "fp8-token"  # the activation format of the per-token scheme


@dataclass
class Fp8Resident:
    data: torch.Tensor        # float8_e4m3fn [N, K] (or [E, N, K]), row-major: its transpose is column-major
    scale: torch.Tensor       # fp32 per-tensor scale: [] (or [E])
    out_features: int
    in_features: int
    col_scale: Optional[torch.Tensor] = None  # fp32 [1, N] (or [E, N]): the scale per output channel
    experts: int = 0

    @property
    def nbytes(self) -> int:
        extra = self.col_scale.numel() * 4 if self.col_scale is not None else 0
        return self.data.numel() + self.scale.numel() * 4 + extra


def row_scales(amax: torch.Tensor) -> torch.Tensor:
    """``amax / 448`` in fp32, correctly rounded; 1.0 where that is 0 (all-zero row, or underflow)."""
    scale = amax.float() / torch.tensor(E4M3_MAX, dtype=torch.float32, device=amax.device)
    return torch.where(scale == 0, torch.ones_like(scale), scale)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token E4M3 of ``x [..., K]``: ``(codes float8_e4m3fn [..., K], scales fp32 [..., 1])``.

    ``codes = e4m3(clamp(x / scale, +-448))`` with ``scale = amax(|x_row|) / 448`` (fp32, RNE); the
    clamp comes before the cast because older eager casts turn values >= 480 into NaN. This is the
    definition: the CUDA kernel (:func:`musecore_cuda.kernels.fp8_moe.quantize_rows_gpu`) and the
    reference's emulation of ``fp8-token`` activations give these bits exactly.
    """
    xf = x.float()
    scale = row_scales(xf.abs().amax(dim=-1, keepdim=True))
    return (xf / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


def fake_quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """The per-token FP8 round trip of ``x`` in ``x.dtype`` (what the reference's emulation computes)."""
    q, scale = quantize_rows(x)
    return (q.float() * scale).to(x.dtype)


def prepare_fp8(qt, device: torch.device, per_token: bool = False) -> Fp8Resident:
    """The loader's FP8 QTensor on ``device``; ``per_token`` also keeps its scale per output channel
    (the row-wise path), and allows stacked experts ``[E, N, K]``."""
    if qt.scale.numel() != (qt.shape[0] if len(qt.shape) == 3 else 1) or qt.group_size:
        raise NotImplementedError(f"FP8 weight {list(qt.shape)} has block scales {list(qt.scale.shape)}: the CUDA "
                                  "backend runs per-tensor FP8 (ModelOpt layout) only; dequantize it to BF16 instead")
    if len(qt.shape) == 3 and not per_token:
        raise NotImplementedError(f"FP8 experts {list(qt.shape)} run with per-token activations only (the h200-fp8 "
                                  "profile); per-tensor activation scales are for linears")
    n, k = qt.shape[-2], qt.shape[-1]
    if k % 16:
        raise ValueError(f"FP8 GEMM needs in_features divisible by 16; got {k}")
    data = qt.data.to(device)
    scale = qt.scale.float().to(device)
    experts = qt.shape[0] if len(qt.shape) == 3 else 0
    if experts:
        col = scale.reshape(experts, 1).expand(experts, n).contiguous()
        return Fp8Resident(data.contiguous(), scale, n, k, col, experts)
    if n % 16:  # cuBLASLt wants N % 16 == 0: zero rows, sliced off the output
        data = torch.cat([data, data.new_zeros((-n) % 16, k)])
    scale = scale.reshape(())
    col = scale.expand(1, data.shape[0]).contiguous() if per_token else None
    return Fp8Resident(data.contiguous(), scale, n, k, col)


def _pad_rows(t: torch.Tensor, rows: int, value: float = 0.0) -> torch.Tensor:
    pad = (-t.shape[0]) % rows
    return torch.cat([t, t.new_full((pad, t.shape[1]), value)]) if pad else t


def fp8_linear(x: torch.Tensor, w: Fp8Resident, input_scale: Optional[torch.Tensor]) -> torch.Tensor:
    """Per-tensor W8A8: ``x`` quantized with ``input_scale`` (or dynamically over the whole tensor)."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, w.in_features)
    if input_scale is None:  # dynamic per tensor; a zero tensor gets scale 1 (as the reference does)
        scale_a = row_scales(x2.abs().amax())
    else:
        scale_a = input_scale.reshape(()).float().to(x.device)
    xq = (x2.float() / scale_a).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    m = xq.shape[0]
    xq = _pad_rows(xq, 16)  # cuBLASLt FP8 wants M, N, K multiples of 16
    out = torch._scaled_mm(xq, w.data.t(), scale_a=scale_a, scale_b=w.scale, out_dtype=x.dtype)
    return out[:m, :w.out_features].reshape(*lead, w.out_features)


def fp8_linear_rows(x: torch.Tensor, w: Fp8Resident) -> torch.Tensor:
    """Per-token W8A8: rows of ``x`` quantized with their own scales (the GPU kernel), the weight's
    scale per output channel; ``torch._scaled_mm`` with row-wise scales, bf16 out (cuBLASLt's row-wise
    FP8 GEMM writes bf16 only: fp16 callers get a cast)."""
    from musecore_cuda.kernels.fp8_moe import quantize_rows_gpu
    lead = x.shape[:-1]
    x2 = x.reshape(-1, w.in_features)
    m = x2.shape[0]
    if m == 0:
        return x.new_empty(*lead, w.out_features)
    xq, scale_a = quantize_rows_gpu(x2) if x2.is_cuda else quantize_rows(x2)
    xq, scale_a = _pad_rows(xq, 16), _pad_rows(scale_a, 16, 1.0)
    out = torch._scaled_mm(xq, w.data.t(), scale_a=scale_a, scale_b=w.col_scale, out_dtype=torch.bfloat16)
    return out[:m, :w.out_features].to(x.dtype).reshape(*lead, w.out_features)


def emulate_linear_rows(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What :func:`fp8_linear_rows` computes, in fp32 on any device (for tests): exact products of the
    E4M3 codes summed in fp32, then the row scale and the weight scale, rounded once to ``x.dtype``."""
    xq, sa = quantize_rows(x.reshape(-1, x.shape[-1]))
    acc = xq.float() @ codes.float().T
    return (acc * sa * scale.float().reshape(-1)).to(x.dtype).reshape(*x.shape[:-1], codes.shape[0])
