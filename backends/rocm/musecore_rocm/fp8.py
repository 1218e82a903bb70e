"""FP8 E4M3 weights on AMD: OCP e4m3fn on gfx950, e4m3fnuz on gfx942, W8A8 through hipBLASLt.

Checkpoints store OCP ``float8_e4m3fn``. gfx942's matrix cores read ``float8_e4m3fnuz`` (exponent
bias 8, no negative zero: 0x80 is NaN). The same byte means exactly half the value in fnuz, so a
weight converts by keeping its bytes and doubling its scale; the one byte that changes meaning,
0x80 (-0.0 in e4m3fn), becomes 0x00. Activations quantized for the same matmul use a doubled
scale too and saturate at 224 (e4m3fn's 448, halved), so both sides carry e4m3fn's numerics
exactly. This is the conversion vLLM and aiter apply on MI300X
(``normalize_e4m3fn_to_e4m3fnuz``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

E4M3FN_MAX = 448.0
FNUZ_NAN_BYTE = 0x80


@dataclass
class Fp8Resident:
    """A per-tensor-scaled FP8 weight in the arch's flavour: ``weight [N, K]``, ``weight_scale`` fp32."""

    weight: torch.Tensor
    weight_scale: torch.Tensor
    fnuz: bool
    out_features: int
    in_features: int


def e4m3fn_to_fnuz(weight: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight e4m3fn, scale)`` -> ``(weight e4m3fnuz, 2 * scale)`` with the same dequantized values."""
    if weight.dtype != torch.float8_e4m3fn:
        raise TypeError(f"expected float8_e4m3fn weights (the checkpoint format); got {weight.dtype}")
    as_bytes = weight.view(torch.uint8).clone()
    as_bytes[as_bytes == FNUZ_NAN_BYTE] = 0  # -0.0 in e4m3fn is NaN in e4m3fnuz
    return as_bytes.view(torch.float8_e4m3fnuz), scale.float() * 2.0


def quantize_activation_fnuz(x: torch.Tensor, input_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations -> e4m3fnuz with the doubled scale, saturating where e4m3fn saturates (448 -> 224):
    the fnuz bytes equal the e4m3fn bytes the reference computes with ``input_scale``."""
    scale = input_scale.float() * 2.0
    q = (x.float() / scale).clamp(-E4M3FN_MAX / 2, E4M3FN_MAX / 2).to(torch.float8_e4m3fnuz)
    return q, scale


def prepare_fp8(qt, device: torch.device, fnuz: bool) -> Fp8Resident:
    """A per-tensor FP8 ``QTensor`` (``data`` e4m3fn ``[N, K]``, ``scale`` fp32) -> :class:`Fp8Resident`."""
    if qt.data.dim() != 2 or qt.scale is None or qt.scale.numel() != 1:
        raise NotImplementedError(f"FP8 weights here are per-tensor scaled [N, K] (ModelOpt layout); got data "
                                  f"{list(qt.data.shape)} with scale {None if qt.scale is None else list(qt.scale.shape)}")
    weight, scale = qt.data.to(device), qt.scale.to(device).float().reshape(())
    if fnuz:
        weight, scale = e4m3fn_to_fnuz(weight, scale)
    return Fp8Resident(weight.contiguous(), scale, fnuz, weight.shape[0], weight.shape[1])


def fp8_linear(x: torch.Tensor, w: Fp8Resident, input_scale: Optional[torch.Tensor]) -> torch.Tensor:
    """W8A8: activations quantized per tensor (static ``input_scale``, or dynamic ``amax/448``), then
    ``torch._scaled_mm`` (hipBLASLt on ROCm). Never run on AMD hardware."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, w.in_features)
    if input_scale is None:  # dynamic per tensor, musecore_quant's rule: amax / 448, and 1.0 where that is 0
        scale = x2.float().abs().amax() / E4M3FN_MAX
        input_scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    if w.fnuz:
        xq, xs = quantize_activation_fnuz(x2, input_scale.to(x.device))
    else:
        xs = input_scale.to(x.device).float().reshape(())
        xq = (x2.float() / xs).clamp(-E4M3FN_MAX, E4M3FN_MAX).to(torch.float8_e4m3fn)
    y = torch._scaled_mm(xq, w.weight.t(), scale_a=xs.reshape(()), scale_b=w.weight_scale, out_dtype=x.dtype)
    return y.reshape(*lead, w.out_features)
