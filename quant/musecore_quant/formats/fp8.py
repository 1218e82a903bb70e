"""FP8 E4M3 weights, per tensor (ModelOpt FP8) or per 128x128 block (DeepSeek-V3 style).

Hopper runs FP8 natively and many checkpoints ship in it. Both producers store
``W / scale`` cast to float8_e4m3fn and dequantize with a MULTIPLY (DeepSeek's ``weight_scale_inv``
is a multiplier despite its name):

- per tensor: ``scale = amax / 448`` (per matrix; ``[E]`` for stacked experts), ``group_size = 0``;
- 128x128 blocks: ``scale`` fp32 ``[..., ceil(M/128), ceil(N/128)]`` of ``block_amax / 448``,
  ``group_size = block_size``; ragged edge blocks are allowed, as in DeepSeek-V3.

The quotient is computed in fp32 and clamped to +-448 before the cast, always: older eager casts
turn values >= 480 into NaN instead of saturating.

Per tensor, a single bf16 or fp16 matrix ``[out, in]`` is rounded twice, as ModelOpt's export
does (``to_quantized_weight``: ``(weight / weight_scale).to(float8_e4m3fn)`` with a 0-dim fp32
``weight_scale``). A 0-dim tensor does not promote a dimensioned one, so that quotient is the
weight's dtype: PyTorch divides in fp32 and rounds the quotient to bf16/fp16 (nearest even), then
the cast rounds that to E4M3. Double rounding can differ from one rounding: with amax 320 (scale
5/7), the bf16 weight 5.1875 has quotient 7.2625, just above E4M3's midpoint 7.25 between 7.0 and
7.5; bf16 rounds it to 7.25, a tie the cast sends to the even 7.0, where one rounding gives 7.5.
Here the fp32 quotient is rounded to the weight's dtype before the E4M3 cast, so the bytes
equal ModelOpt's for bf16, fp16 and fp32 weights (checked in tests/interop). Stacked experts
``[E, out, in]`` are divided by a dimensioned scale there (fp32 result), so they, fp32 weights
and the 128x128 blocks (``FP8QTensor.quantize``, fp32 scales) are one rounding of the fp32
quotient.

An all-zero tensor or block gets scale 1.0 rather than the producers' 0 (which divides 0 by 0).

Example::

    qt = fp8_quantize(w)                    # per tensor
    qb = fp8_quantize(w, block_size=128)    # DeepSeek-V3 blocks
    w_hat = fp8_dequantize(qb)
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from ..qtensor import QTensor
from ._common import divide, require_float_tensor, require_weight, row_chunks

E4M3_MAX = 448.0
FP8_PER_TENSOR = 0                  # QTensor.group_size of a per-tensor FP8 weight
_LABEL = "FP8"


def _to_e4m3(scaled: torch.Tensor, via: torch.dtype = torch.float32) -> torch.Tensor:
    """E4M3 of the fp32 quotient ``scaled``, first rounded to ``via`` (ModelOpt's bf16/fp16 quotient).

    448 is exact in bf16 and fp16, so clamping after that rounding saturates as before.
    """
    if via != torch.float32:
        scaled = scaled.to(via)
    return scaled.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def _scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    # amax 0, or so small that amax/448 underflows fp32, would give scale 0 and 0/0; use 1.0 there.
    scale = divide(amax.float(), E4M3_MAX)
    return torch.where(scale == 0, 1.0, scale)


def _expand_blocks(scale: torch.Tensor, block_size: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Block scales ``[..., Mb, Nb]`` repeated to the element grid ``[..., M, N]`` (edges cropped)."""
    rows, cols = shape[-2], shape[-1]
    expanded = scale.repeat_interleave(block_size, dim=-2).repeat_interleave(block_size, dim=-1)
    return expanded[..., :rows, :cols]


def fp8_quantize(w: torch.Tensor, block_size: Optional[int] = None) -> QTensor:
    """FP8 E4M3 of ``w`` ``[..., out, in]``: per tensor (``block_size=None``) or per square block.

    Example::

        qt = fp8_quantize(torch.randn(300, 200), block_size=128)
        qt.data.dtype, qt.scale.shape          # torch.float8_e4m3fn, [3, 2]
    """
    w = require_weight(w, _LABEL)
    if block_size is None:
        data, scale = _quantize_per_tensor(w)
        return QTensor(format="fp8", data=data, scale=scale, shape=tuple(w.shape), group_size=FP8_PER_TENSOR)
    if not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"FP8 block_size must be None (per tensor) or a positive int such as 128; got {block_size!r}")
    data, scale = _quantize_blocks(w, block_size)
    return QTensor(format="fp8", data=data, scale=scale, shape=tuple(w.shape), group_size=block_size)


def _quantize_per_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out_features, in_features = w.shape[-2:]
    low, high = w.flatten(-2).aminmax(dim=-1)
    scale = _scale_from_amax(torch.maximum(-low, high))                     # [...]
    rows = w.reshape(-1, in_features)                                        # [R, N]
    row_scale = scale.unsqueeze(-1).expand(*scale.shape, out_features).reshape(-1, 1)
    # ModelOpt's quotient is in the weight's dtype for one bf16/fp16 matrix (0-dim scale), fp32 otherwise.
    via = w.dtype if w.dim() == 2 and w.dtype in (torch.bfloat16, torch.float16) else torch.float32
    data = torch.empty(rows.shape, dtype=torch.float8_e4m3fn, device=w.device)
    for chunk in row_chunks(rows.shape[0], in_features):
        data[chunk] = _to_e4m3(rows[chunk].float() / row_scale[chunk], via)
    return data.reshape(w.shape), scale


def _quantize_blocks(w: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    out_features, in_features = w.shape[-2:]
    matrices = w.reshape(-1, out_features, in_features)                     # [L, M, N]
    data = torch.empty(matrices.shape, dtype=torch.float8_e4m3fn, device=w.device)
    scale = torch.empty(matrices.shape[0], -(-out_features // block_size), -(-in_features // block_size),
                        dtype=torch.float32, device=w.device)                # [L, Mb, Nb]
    for m in range(matrices.shape[0]):
        for chunk in row_chunks(out_features, in_features, multiple=block_size):
            rows = matrices[m, chunk].float()
            pad = (0, -in_features % block_size, 0, -rows.shape[0] % block_size)  # zeros keep every amax
            blocks = torch.nn.functional.pad(rows, pad).unflatten(-1, (-1, block_size)).unflatten(0, (-1, block_size))
            block_rows = slice(chunk.start // block_size, chunk.start // block_size + blocks.shape[0])
            scale[m, block_rows] = _scale_from_amax(blocks.abs().amax(dim=(1, 3)))
            data[m, chunk] = _to_e4m3(rows / _expand_blocks(scale[m, block_rows], block_size, tuple(rows.shape)))
    return data.reshape(w.shape), scale.reshape((*w.shape[:-2], *scale.shape[1:]))


def fp8_dequantize(qt: QTensor) -> torch.Tensor:
    """fp32 weights ``[..., out, in]`` of an FP8 QTensor (``data * scale``, per tensor or per block)."""
    if qt.format != "fp8" or qt.layout != "canonical":
        raise ValueError(f"fp8_dequantize expects a canonical fp8 QTensor; got format {qt.format!r}, "
                         f"layout {qt.layout!r}")
    values = qt.data.float()
    scale = qt.scale.float()
    if qt.group_size == FP8_PER_TENSOR:
        return values * scale[..., None, None]
    return values * _expand_blocks(scale, qt.group_size, qt.shape)


def fp8_fake_quantize_activation(x: torch.Tensor,
                                 input_scale: Optional[Union[float, torch.Tensor]] = None) -> torch.Tensor:
    """FP8 E4M3 round trip of activations ``x`` in ``x.dtype``.

    With ``input_scale`` (ModelOpt's static ``amax / 448``) the scale is that; with None it is
    dynamic per tensor (``amax(|x|) / 448``), as FP8 runtimes do without calibration. Values
    beyond the static range saturate at 448 * input_scale.

    Example::

        x_hat = fp8_fake_quantize_activation(x, input_scale=torch.tensor(0.02))
    """
    x = require_float_tensor(x, _LABEL, "activation")
    xf = x.float()
    if input_scale is None:
        scale = _scale_from_amax(xf.abs().amax())
    else:
        scale = torch.as_tensor(input_scale, dtype=torch.float32, device=x.device)
        if not bool(torch.isfinite(scale).all()) or bool((scale <= 0).any()):
            raise ValueError(f"input_scale must be finite and > 0 (amax / 448); got {scale.tolist()}")
    return (_to_e4m3(xf / scale).float() * scale).to(x.dtype)
