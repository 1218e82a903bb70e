"""What every format codec shares: input checks, device-independent division, row chunking.

- Checks: a quantizer that silently accepts NaN, a ragged last block or a 1-D tensor writes a
  checkpoint that fails far away (a kernel, a perplexity run). These fail at the tensor, saying
  what was expected and what to do (STYLE.md rule 6), in the same words for every format.
- Division: PyTorch's CUDA kernel divides by a Python scalar as a multiply by its reciprocal,
  which can differ from the CPU's correctly rounded quotient in the last bit (seen on
  ``amax / 2688``: one ulp of weight_scale_2). ``divide`` always divides by a tensor, so CPU and
  CUDA write the same bytes, equal to ModelOpt's on CPU (the FORMATS.md vector).
- Chunking: encoding makes several full-size fp32/int32 temporaries; quantizing a stacked expert
  tensor row block by row block keeps the peak near the input plus the output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

CHUNK_ELEMENTS = 1 << 24   # elements per encoding pass: a few hundred MB of temporaries at most


@dataclass(frozen=True)
class SearchError:
    """Squared error (summed over the tensor, float64) of a least-error quantization (the
    ``*_quantize_min_error`` functions) and of the producer rule it starts from and never does
    worse than, so a caller can report both without quantizing twice."""

    squared_error: float
    producer_squared_error: float


def divide(x: torch.Tensor, divisor: float) -> torch.Tensor:
    """``x / divisor`` correctly rounded on every device (never a multiply by the reciprocal)."""
    return x / torch.tensor(divisor, dtype=x.dtype, device=x.device)


def row_chunks(rows: int, row_length: int, multiple: int = 1) -> Iterator[slice]:
    """Slices over ``rows`` rows of ``row_length`` elements, each about CHUNK_ELEMENTS in size.

    Every slice but the last spans a multiple of ``multiple`` rows (whole 128-row FP8 blocks).
    """
    step = multiple * max(1, CHUNK_ELEMENTS // max(1, row_length * multiple))
    for start in range(0, rows, step):
        yield slice(start, min(rows, start + step))


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
    if w.numel() == 0:
        raise ValueError(f"{label} quantization got an empty weight (shape {list(w.shape)}); a checkpoint's weights "
                         "are never empty: fix the source tensor or exclude this layer (--exclude)")
    require_finite(w, label)
    return w


def require_finite(x: torch.Tensor, label: str, what: str = "weight") -> None:
    if x.numel() == 0:
        return
    # min and max propagate NaN and show an Inf, without isfinite's full-size temporaries.
    low, high = x.aminmax()
    if bool(torch.isfinite(low) & torch.isfinite(high)):
        return
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
