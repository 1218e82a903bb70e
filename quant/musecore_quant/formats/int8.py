"""INT8 weights, symmetric per output channel: the operand of TPU v6e's int8 MXU (the ``tpu-v6e-int8`` option).

No checkpoint that musecore reads ships INT8 and ``musecore-quant convert --to`` does not offer it: INT8 is a
load-time target only (a device profile converts BF16, FP8, NVFP4 or MXFP4 weights to it while loading), so it
has a codec here but no on-disk layout, reader or writer.

The rule, one rounding of an fp32 quotient:

- ``scale_n = amax(|W_n|) / 127`` per output row ``n`` (fp32, a correctly rounded division; 1.0 for an all-zero
  row, or where the quotient underflows to 0, so no 0/0);
- ``q = round_half_even(W / scale_n)``, clamped to ``[-127, 127]`` (symmetric: -128 is never written);
- ``W_hat = q * scale_n`` in fp32.

Canonical layout: ``data`` int8 ``[..., out, in]``, ``scale`` fp32 ``[..., out, 1]`` (compressed-tensors'
channel-wise shape), ``group_size`` 0 (:data:`INT8_PER_CHANNEL`). A leading dimension stacks experts.

Activations (W8A8, ``int8-token`` in ``musecore.ops.reference``): each token (row) through the same rule over its
K values, :func:`int8_fake_quantize_activation` with that row's ``amax / 127`` as ``input_scale``.

Example::

    qt = int8_quantize(w)                 # w: [out, in] or [E, out, in], any float dtype
    w_hat = int8_dequantize(qt)           # fp32
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from ..qtensor import QTensor
from ._common import divide, require_float_tensor, require_weight, row_chunks

INT8_MAX = 127.0
INT8_PER_CHANNEL = 0                # QTensor.group_size of an INT8 weight: one scale per output row
_LABEL = "INT8"


def int8_scale(amax: torch.Tensor) -> torch.Tensor:
    """``amax / 127`` in fp32, 1.0 where that is 0 (an all-zero row, or an amax so small the quotient underflows)."""
    scale = divide(amax.float(), INT8_MAX)
    return torch.where(scale == 0, 1.0, scale)


def int8_codes(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``round_half_even(x / scale)`` clamped to +-127, as int8 (fp32 quotient; ``scale`` broadcasts)."""
    return torch.round(x.float() / scale).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)


def int8_quantize(w: torch.Tensor) -> QTensor:
    """INT8 of ``w`` ``[..., out, in]`` with one fp32 scale per output row.

    Example::

        qt = int8_quantize(torch.randn(256, 512))
        qt.data.dtype, qt.scale.shape          # torch.int8, [256, 1]
    """
    w = require_weight(w, _LABEL)
    in_features = w.shape[-1]
    rows = w.reshape(-1, in_features)                                        # [R, K]
    data = torch.empty(rows.shape, dtype=torch.int8, device=w.device)
    scale = torch.empty(rows.shape[0], 1, dtype=torch.float32, device=w.device)
    for chunk in row_chunks(rows.shape[0], in_features):
        part = rows[chunk].float()
        scale[chunk] = int8_scale(part.abs().amax(-1, keepdim=True))
        data[chunk] = int8_codes(part, scale[chunk])
    return QTensor(format="int8", data=data.reshape(w.shape), scale=scale.reshape(*w.shape[:-1], 1),
                   shape=tuple(w.shape), group_size=INT8_PER_CHANNEL)


def int8_dequantize(qt: QTensor) -> torch.Tensor:
    """fp32 weights ``[..., out, in]`` of an INT8 QTensor (``data * scale``, one scale per output row)."""
    if qt.format != "int8" or qt.layout != "canonical":
        raise ValueError(f"int8_dequantize expects a canonical int8 QTensor; got format {qt.format!r}, "
                         f"layout {qt.layout!r}")
    if qt.scale.shape != (*qt.shape[:-1], 1):
        raise ValueError(f"an INT8 QTensor of shape {list(qt.shape)} needs one scale per output row, "
                         f"{[*qt.shape[:-1], 1]}; got {list(qt.scale.shape)}")
    return qt.data.float() * qt.scale.float()


def int8_fake_quantize_activation(x: torch.Tensor,
                                  input_scale: Optional[Union[float, torch.Tensor]] = None) -> torch.Tensor:
    """INT8 round trip of activations ``x`` in ``x.dtype``: ``round_half_even(x / s)`` clamped to +-127, times ``s``.

    ``input_scale`` ``s`` broadcasts against ``x`` (a per-row ``[..., 1]`` scale is the ``int8-token`` rule); None
    is dynamic per tensor, ``amax(|x|) / 127``. Pass fp32 ``x`` to keep ``q * s`` unrounded (what an int8 MXU
    kernel multiplies its int32 sums by).

    Example::

        x_hat = int8_fake_quantize_activation(x.float(), int8_scale(x.float().abs().amax(-1, keepdim=True)))
    """
    x = require_float_tensor(x, _LABEL, "activation")
    xf = x.float()
    if input_scale is None:
        scale = int8_scale(xf.abs().amax())
    else:
        scale = torch.as_tensor(input_scale, dtype=torch.float32, device=x.device)
        if not bool(torch.isfinite(scale).all()) or bool((scale <= 0).any()):
            raise ValueError(f"input_scale must be finite and > 0 (amax / 127); got {scale.flatten()[:8].tolist()}")
    return (int8_codes(xf, scale).float() * scale).to(x.dtype)
