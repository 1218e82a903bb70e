"""FP8 E4M3 W8A8 linear on Hopper through cuBLASLt (``torch._scaled_mm``).

Weights stay as the checkpoint stores them (E4M3 ``[N, K]`` with one fp32 per-tensor scale, the
ModelOpt FP8 layout); activations are quantized per tensor, with the checkpoint's static
``input_scale`` when it has one, else dynamically (``amax / 448``), exactly as the reference's
emulation does. 128x128 block-scaled FP8 weights are not implemented here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

E4M3_MAX = 448.0


@dataclass
class Fp8Resident:
    data: torch.Tensor     # float8_e4m3fn [N, K], row-major (its transpose is column-major for cuBLASLt)
    scale: torch.Tensor    # fp32 scalar
    out_features: int
    in_features: int


def prepare_fp8(qt, device: torch.device) -> Fp8Resident:
    if qt.scale.numel() != 1:
        raise NotImplementedError(f"FP8 weight {list(qt.shape)} has block scales {list(qt.scale.shape)}: the CUDA "
                                  "backend runs per-tensor FP8 (ModelOpt layout) only; dequantize it to BF16 instead")
    n, k = qt.shape[-2], qt.shape[-1]
    if k % 16:
        raise ValueError(f"FP8 GEMM needs in_features divisible by 16; got {k}")
    data = qt.data.to(device)
    if n % 16:  # cuBLASLt wants N % 16 == 0: zero rows, sliced off the output
        data = torch.cat([data, data.new_zeros((-n) % 16, k)])
    return Fp8Resident(data.contiguous(), qt.scale.reshape(()).float().to(device), n, k)


def fp8_linear(x: torch.Tensor, w: Fp8Resident, input_scale: Optional[torch.Tensor]) -> torch.Tensor:
    lead = x.shape[:-1]
    x2 = x.reshape(-1, w.in_features)
    if input_scale is None:  # dynamic per tensor; a zero tensor gets scale 1 (as the reference does)
        scale_a = x2.abs().amax().float() / E4M3_MAX
        scale_a = torch.where(scale_a == 0, torch.ones_like(scale_a), scale_a)
    else:
        scale_a = input_scale.reshape(()).float().to(x.device)
    xq = (x2.float() / scale_a).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    m = xq.shape[0]
    pad = (-m) % 16  # cuBLASLt FP8 wants M, N, K multiples of 16
    if pad:
        xq = torch.cat([xq, xq.new_zeros(pad, w.in_features)])
    out = torch._scaled_mm(xq, w.data.t(), scale_a=scale_a, scale_b=w.scale, out_dtype=x.dtype)
    return out[:m, :w.out_features].reshape(*lead, w.out_features)
