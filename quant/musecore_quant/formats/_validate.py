"""Input checks shared by the format codecs, so every format rejects bad weights with the same words.

A quantizer that silently accepts NaN, a ragged last block or a 1-D tensor writes a checkpoint that
fails far away (a kernel, a perplexity run). These checks fail at the tensor, saying what was
expected and what to do (STYLE.md rule 6).
"""

from __future__ import annotations

import torch

FORMAT_LABELS = {"nvfp4": "NVFP4", "mxfp4": "MXFP4", "int4": "INT4", "fp8": "FP8"}


def require_float_tensor(x: object, label: str, what: str = "weight") -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{label} quantization expects a torch.Tensor {what}; got {type(x).__name__}")
    if not x.dtype.is_floating_point or x.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise TypeError(f"{label} quantization expects a floating-point {what} (bf16, fp16 or fp32); "
                        f"got dtype {x.dtype}. Dequantize it first (musecore_quant.dequantize).")
    return x


def require_weight(w: object, label: str) -> torch.Tensor:
    """A floating, finite tensor of at least 2 dims ``[..., out, in]``."""
    w = require_float_tensor(w, label)
    if w.dim() < 2:
        raise ValueError(f"{label} quantization expects a weight of shape [..., out_features, in_features]; "
                         f"got shape {list(w.shape)}")
    require_finite(w, label)
    return w


def require_finite(x: torch.Tensor, label: str, what: str = "weight") -> None:
    finite = torch.isfinite(x)
    if not bool(finite.all()):
        bad = (~finite).nonzero()
        first = bad[0].tolist()
        raise ValueError(f"cannot quantize to {label}: the {what} of shape {list(x.shape)} holds {bad.shape[0]} "
                         f"NaN/Inf value(s), the first at index {first} ({x[tuple(first)].item()}). "
                         "Fix the source tensor or exclude this layer (--exclude).")


def require_divisible(shape: torch.Size | tuple[int, ...], multiple: int, label: str,
                      what: str = "in_features", dim: int = -1, why: str = "") -> None:
    size = shape[dim]
    if size % multiple:
        because = f" ({why})" if why else ""
        raise ValueError(f"{label} needs {what} divisible by {multiple}{because}; got {size} "
                         f"(shape {list(shape)}). Exclude this layer (--exclude).")


def leading_shape(w: torch.Tensor) -> tuple[int, ...]:
    """The stacking dims before ``[out, in]`` (``(E,)`` for stacked experts, ``()`` for one matrix)."""
    return tuple(w.shape[:-2])
