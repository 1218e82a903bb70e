"""INT8 weights for v6e's int8 MXU: the conversion at load (musecore has no INT8 checkpoint format or codec).

Symmetric per output channel: ``scale_n = amax(|W_n|) / 127`` (1.0 for an all-zero row), ``q = round(W / scale)``
clamped to +-127 (round half to even, as ``torch.round``). Memory: 1 byte per weight + one f32 per output row,
about half of BF16 and 1.8x the 4.5 bits of NVFP4. Activations for the W8A8 path (``int8-token``) are quantized
per row the same way at run time (:func:`musecore_tpu.kernels.quantized.quantize_tokens`);
:func:`fake_quantize_tokens` is that rule in torch, for the reference side of the tests.
"""

from __future__ import annotations

import torch

INT8_MAX = 127.0


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [..., N, K]`` (any float dtype) -> (int8 codes ``[..., N, K]``, f32 scales ``[..., N]``)."""
    if not w.is_floating_point():
        raise ValueError(f"INT8 conversion takes a float weight; got {w.dtype}")
    wf = w.float()
    scale = wf.abs().amax(-1) / INT8_MAX
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = torch.round(wf / scale[..., None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale[..., None]


def fake_quantize_tokens(x: torch.Tensor) -> torch.Tensor:
    """Each row of ``x`` through per-row symmetric INT8 and back (f32): what ``int8-token`` activations see."""
    xf = x.float()
    scale = xf.abs().amax(-1, keepdim=True) / INT8_MAX
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    return torch.round(xf / scale).clamp(-INT8_MAX, INT8_MAX) * scale
