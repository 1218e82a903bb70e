"""Checkpoint weights -> the resident layouts the Pallas kernels read, once, at load (torch side).

- 16-bit weights: ``W^T [K, N]`` (K-major: the output dimension is the lane dimension, so output tiles and
  the MXU's result columns are lane-dense).
- 4-bit weights (INT4, MXFP4, NVFP4): the checkpoint's codes, repacked K-major and half-split per K tile
  (``codes[k', n]`` holds rows ``k'`` and ``k' + tk/2`` of its tile in its low and high nibble; see
  :mod:`musecore_tpu.kernels.decode`), and the block scales transposed to ``[K/g, N]`` in their stored bytes
  (E4M3 and E8M0 as u8; INT4's fp16 scales, and its zero points when asymmetric, as f32: fp16 is not a TPU
  vector type, and a u8 block would need 32 groups = 4096 rows of K per step). No value changes:
  this is a permutation of the checkpoint's nibbles, so W4A16 keeps a quarter of BF16's bytes.
- 8-bit weights (per-tensor FP8, per-channel INT8): the codes K-major ``[K, N]`` and their f32 scales.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from musecore_quant.formats.fp4 import unpack_nibbles
from musecore_quant.qtensor import QTensor

from musecore_tpu.kernels import tiling

PACKED_FORMATS = ("int4", "mxfp4", "nvfp4")
LAYOUT = "tpu-kmajor-halfsplit"


def half_split(codes_kn: torch.Tensor, tk: int) -> torch.Tensor:
    """4-bit codes ``[..., K, N]`` (uint8 0..15) -> bytes ``[..., K/2, N]``, half-split per K tile of ``tk``."""
    *lead, K, N = codes_kn.shape
    tiles = codes_kn.reshape(*lead, K // tk, 2, tk // 2, N)
    packed = tiles[..., 0, :, :] | (tiles[..., 1, :, :] << 4)
    return packed.reshape(*lead, K // 2, N).contiguous()


def prepare_packed(qt: QTensor) -> dict[str, Any]:
    """A 4-bit QTensor ``[..., N, K]`` -> ``{"codes", "scales", "zeros", "global_scale"}`` (torch, K-major)."""
    if qt.format not in PACKED_FORMATS:
        raise ValueError(f"the TPU's packed layout takes {PACKED_FORMATS}; got {qt.format}")
    if qt.layout != "canonical":
        raise ValueError(f"expected a canonical {qt.format} QTensor from musecore_quant; got layout {qt.layout!r}")
    K = qt.shape[-1]
    g = qt.group_size
    if K % g:
        raise ValueError(f"{qt.format} weight with in_features {K} not a multiple of its group {g}")
    tk = tiling.k_tile(qt.format, K, g)
    codes = unpack_nibbles(qt.data).transpose(-1, -2)                       # [..., K, N]
    scales = qt.scale.transpose(-1, -2)                                     # [..., K/g, N]
    if qt.format == "nvfp4":
        scales = scales.contiguous().view(torch.uint8)                      # the E4M3 bytes
    elif qt.format == "int4":
        scales = scales.float()                                             # fp16 -> f32, exact
    zeros = None if qt.zero is None else qt.zero.transpose(-1, -2).float().contiguous()  # f32: 8-row blocks
    global_scale = None if qt.global_scale is None else qt.global_scale.float().contiguous()
    return {"codes": half_split(codes.contiguous(), tk), "scales": scales.contiguous(), "zeros": zeros,
            "global_scale": global_scale}


def prepare_dense(w: torch.Tensor, dtype: torch.dtype) -> dict[str, Any]:
    """A 16-bit or fp32 weight ``[..., N, K]`` -> ``{"wt": [..., K, N]}`` in ``dtype``."""
    return {"wt": w.to(dtype).transpose(-1, -2).contiguous()}


def resident_bytes(fmt: str, out_features: int, in_features: int, experts: int = 0,
                   group: Optional[int] = None) -> int:
    """Bytes this layout keeps for one weight (INT4 scales widen from fp16 to f32; INT8: 1 byte per weight and an
    f32 scale per output channel)."""
    n = max(experts, 1) * out_features * in_features
    if fmt == "int8":
        return n + max(experts, 1) * out_features * 4
    if fmt not in PACKED_FORMATS:
        return n * 2
    g = group or tiling.GROUP[fmt]
    scale = 4 if fmt == "int4" else 1
    return n // 2 + (n // g) * scale


Q8_FORMATS = ("fp8", "int8")


def prepare_q8(weight: QTensor) -> dict[str, Any]:
    """An 8-bit QTensor ``[..., N, K]`` -> ``{"q8": [..., K, N], "wscale": f32}`` (K-major, values unchanged): FP8 with
    a per-tensor scale (``wscale [..., 1, 1]``) or INT8 with one scale per output channel (``wscale [..., 1, N]``),
    both from musecore_quant's codecs."""
    if not isinstance(weight, QTensor) or weight.format not in Q8_FORMATS:
        got = weight.format if isinstance(weight, QTensor) else type(weight).__name__
        raise ValueError(f"the TPU's 8-bit path takes per-tensor FP8 or per-channel INT8 QTensors; got {got}")
    if weight.layout != "canonical":
        raise ValueError(f"expected a canonical {weight.format} QTensor from musecore_quant; got layout "
                         f"{weight.layout!r}")
    q8 = weight.data.transpose(-1, -2).contiguous()
    if weight.format == "int8":                                             # scale [..., N, 1] -> [..., 1, N]
        return {"q8": q8, "wscale": weight.scale.float().transpose(-1, -2).contiguous()}
    if weight.group_size != 0:
        raise ValueError(f"the TPU's 8-bit path takes per-tensor FP8 QTensors; got group_size {weight.group_size} "
                         "(128x128-block FP8 is dequantized by the plan)")
    wscale = weight.scale.float().reshape(*weight.scale.shape, 1, 1)
    return {"q8": q8, "wscale": wscale.contiguous()}
