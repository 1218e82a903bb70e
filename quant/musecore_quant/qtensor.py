"""The one container in which quantized weights travel between checkpoint readers, the loader
and backends.

A ``QTensor`` holds the bytes as a producer stores them (packed codes, block scales in their
on-disk dtype) plus the logical shape, so nothing is lost in transit and every backend can turn
it into its own resident layout once, at load.

Canonical in-memory layouts (the checkpoint readers convert producer layouts to these):

=========  ===========================  ==============================  ===================  =====================
format     data                         scale                           global_scale         zero
=========  ===========================  ==============================  ===================  =====================
nvfp4      uint8 ``[..., out, in/2]``   float8_e4m3fn ``[..., out, in/16]``  fp32 ``[...]`` (weight_scale_2)  None
mxfp4      uint8 ``[..., out, in/2]``   uint8 E8M0 ``[..., out, in/32]``     None                  None
int4       uint8 ``[..., out, in/2]``   fp16 ``[..., out, in/g]``            None                  uint8 ``[..., out, in/g]`` (true zero 0..15) or None (symmetric, zero 8)
fp8        float8_e4m3fn ``[..., out, in]``  fp32 ``[]``/``[...]`` per tensor, or ``[..., ceil(out/128), ceil(in/128)]`` for 128x128 blocks
int8       int8 ``[..., out, in]``      fp32 ``[..., out, 1]`` per output row (group_size 0; a load-time target, no on-disk layout)
=========  ===========================  ==============================  ===================  =====================

FP4 and INT4 codes are packed two per byte along the input (K) dimension, element ``2i`` in the
low nibble. A leading ``...`` dimension stacks experts (``[E, out, in]`` logical shape).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch

FORMATS = ("nvfp4", "mxfp4", "int4", "fp8", "int8")


@dataclass
class QTensor:
    """A quantized weight: packed data, block scales as stored on disk, logical shape.

    Example::

        qt = musecore_quant.quantize(w, "nvfp4")     # w: [out, in] bf16
        w_hat = musecore_quant.dequantize(qt)        # fp32 [out, in]
    """

    format: str
    data: torch.Tensor
    scale: torch.Tensor
    shape: tuple[int, ...]
    group_size: int
    global_scale: Optional[torch.Tensor] = None
    zero: Optional[torch.Tensor] = None
    input_scale: Optional[torch.Tensor] = None  # NVFP4 static activation global scale (W4A4)
    layout: str = "canonical"  # a backend's prepare_weight may re-tag its own resident layout

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"unknown quantized format {self.format!r}; expected one of {FORMATS}")
        self.shape = tuple(int(s) for s in self.shape)

    @property
    def out_features(self) -> int:
        return self.shape[-2]

    @property
    def in_features(self) -> int:
        return self.shape[-1]

    @property
    def nbytes(self) -> int:
        """Bytes held by every tensor of the container (what a decode step must read)."""
        parts = (self.data, self.scale, self.global_scale, self.zero, self.input_scale)
        return sum(t.numel() * t.element_size() for t in parts if t is not None)

    def to(self, device: torch.device | str) -> "QTensor":
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return replace(self, data=move(self.data), scale=move(self.scale),
                       global_scale=move(self.global_scale), zero=move(self.zero),
                       input_scale=move(self.input_scale))

    def __repr__(self) -> str:
        return (f"QTensor(format={self.format!r}, shape={list(self.shape)}, group_size={self.group_size}, "
                f"data={self.data.dtype}{list(self.data.shape)}, scale={self.scale.dtype}{list(self.scale.shape)})")


INT4_IMPLIED_ZERO = 8  # an INT4 QTensor without zero points is symmetric: every zero point is 8


def _with_zero_points(parts: list[QTensor]) -> list[QTensor]:
    """``parts``, where INT4 ones disagree on having zero points, with the implied zero point (8) of the
    symmetric ones materialised: the same values, one layout. A reader decides symmetric-or-not per tensor
    from its zeros, so an asymmetric checkpoint's expert whose zero points all happen to be 8 arrives
    without them beside experts that have them."""
    if {p.zero is None for p in parts} != {True, False} or parts[0].format != "int4":
        return parts
    return [p if p.zero is not None else
            replace(p, zero=torch.full(p.scale.shape, INT4_IMPLIED_ZERO, dtype=torch.uint8, device=p.scale.device))
            for p in parts]


def stack_qtensors(parts: list[QTensor]) -> QTensor:
    """Stack same-format, same-shape QTensors (e.g. the experts of one layer) along a new dim 0.

    INT4 parts with and without zero points stack with the implied zero point (8) made explicit."""
    first = parts[0]
    for i, p in enumerate(parts):
        if (p.format, p.shape, p.group_size) != (first.format, first.shape, first.group_size):
            raise ValueError(f"cannot stack QTensor {i} ({p!r}) with QTensor 0 ({first!r}): "
                             "format, shape and group size must match")
    parts = _with_zero_points(parts)
    for name in ("global_scale", "zero", "input_scale"):
        present = [getattr(p, name) is not None for p in parts]
        if any(present) and not all(present):
            raise ValueError(f"cannot stack {first.format} QTensor {present.index(not present[0])} with QTensor 0: "
                             f"one has a {name} and the other not; every part needs the same companions")
    stack = lambda name: (None if getattr(parts[0], name) is None  # noqa: E731
                          else torch.stack([getattr(p, name) for p in parts]))
    return QTensor(format=first.format, data=stack("data"), scale=stack("scale"),
                   shape=(len(parts), *first.shape), group_size=first.group_size,
                   global_scale=stack("global_scale"), zero=stack("zero"),
                   input_scale=stack("input_scale"), layout=first.layout)


ROW_SCALED = ("mxfp4", "int4", "int8")  # formats whose every scale belongs to one row block: rows can be concatenated


def concat_problem(parts: list[QTensor]) -> Optional[str]:
    """Why :func:`concat_qtensors` cannot join ``parts`` (``None`` when it can)."""
    parts = _with_zero_points(parts)
    first = parts[0]
    if first.format not in ROW_SCALED:
        return (f"cannot concatenate {first.format} QTensors without requantizing: only {ROW_SCALED} keep every "
                "scale per row block")
    for i, p in enumerate(parts):
        if (p.format, p.group_size, p.layout, len(p.shape), p.in_features) != \
                (first.format, first.group_size, first.layout, 2, first.in_features) \
                or (p.zero is None) != (first.zero is None) or p.input_scale is not None:
            return (f"cannot concatenate QTensor {i} ({p!r}) with QTensor 0 ({first!r}): format, group size, layout, "
                    "in_features and zero points must match (2-D, no activation scale)")
    return None


def concat_qtensors(parts: list[QTensor]) -> QTensor:
    """Concatenate 2-D QTensors of one format along the output dimension, codes and scales unchanged
    (``dequantize`` of the result is the members' dequantizations stacked row-wise).

    Only for formats whose scales are all per row block (MXFP4, INT4, INT8): NVFP4's per-tensor global
    scale and per-tensor FP8 differ between tensors, and merging them would mean requantizing.
    """
    problem = concat_problem(parts)
    if problem:
        raise ValueError(problem)
    parts = _with_zero_points(parts)
    first = parts[0]
    cat = lambda name: None if getattr(first, name) is None else torch.cat([getattr(p, name) for p in parts])  # noqa: E731
    return QTensor(format=first.format, data=cat("data"), scale=cat("scale"),
                   shape=(sum(p.out_features for p in parts), first.in_features), group_size=first.group_size,
                   zero=cat("zero"), layout=first.layout)


def slice_cols(qt: QTensor, start: int, stop: int) -> QTensor:
    """Input columns ``start:stop`` of a (possibly stacked) QTensor, codes and scales unchanged.

    Both ends must fall on an edge of the format's scale blocks (a block's scale covers columns of
    one block only), so the slice dequantizes to the same values as the whole tensor's columns:
    this is how a row-parallel linear (tensor parallelism) keeps its piece without requantizing.
    """
    cols, g = qt.in_features, qt.group_size
    if not 0 <= start < stop <= cols:
        raise ValueError(f"column slice {start}:{stop} is outside the {cols} input columns of {qt!r}")
    block = g if g else 1  # per-tensor FP8, per-row INT8: any column
    if start % block or (stop % block and stop != cols):
        raise ValueError(f"column slice {start}:{stop} of a {qt.format} weight must fall on its {block}-column "
                         "scale-block edges")
    per_byte = 1 if qt.format in ("fp8", "int8") else 2  # FP4 and INT4 pack two codes per byte along the input
    if start % per_byte or stop % per_byte:
        raise ValueError(f"column slice {start}:{stop} splits a packed byte of {qt!r}")
    data = qt.data[..., start // per_byte: stop // per_byte]
    cut = lambda t: None if t is None else t[..., start // block: -(-stop // block)]  # noqa: E731
    scale = qt.scale if (qt.format in ("fp8", "int8") and not g) else cut(qt.scale)  # per tensor / per row: kept
    return replace(qt, data=data, scale=scale, zero=cut(qt.zero), shape=(*qt.shape[:-1], stop - start))


def slice_experts(qt: QTensor, start: int, stop: int) -> QTensor:
    """Experts ``start:stop`` of a stacked ``[E, out, in]`` QTensor (every part is stacked along dim 0)."""
    if len(qt.shape) != 3 or not 0 <= start < stop <= qt.shape[0]:
        raise ValueError(f"expert slice {start}:{stop} does not fit the stacked QTensor {qt!r}")
    cut = lambda t: None if t is None or t.dim() == 0 else t[start:stop]  # noqa: E731
    return replace(qt, data=qt.data[start:stop], scale=cut(qt.scale), global_scale=cut(qt.global_scale),
                   zero=cut(qt.zero), input_scale=cut(qt.input_scale), shape=(stop - start, *qt.shape[1:]))


def slice_rows(qt: QTensor, start: int, stop: int) -> QTensor:
    """Output rows ``start:stop`` of a (possibly stacked) QTensor, codes and scales unchanged.

    This is how a fused ``gate_up_proj [E, 2I, h]`` splits into its gate and up halves without
    requantizing: every format's block scales belong to row blocks (FP8's 128x128 blocks need
    ``start`` and ``stop`` on a block edge), and the per-tensor scales (NVFP4's ``weight_scale_2``,
    FP8's per-tensor scale, the activation scale) are shared by both halves, as producers fuse them.
    """
    rows = qt.out_features
    if not 0 <= start < stop <= rows:
        raise ValueError(f"row slice {start}:{stop} is outside the {rows} output rows of {qt!r}")
    cut = lambda t: None if t is None else t[..., start:stop, :]  # noqa: E731
    scale = qt.scale
    if qt.format == "fp8" and qt.group_size:  # 128x128 blocks: [..., out/b, in/b]
        b = qt.group_size
        if start % b or (stop % b and stop != rows):
            raise ValueError(f"row slice {start}:{stop} of a {b}x{b}-block FP8 weight must fall on block edges")
        scale = scale[..., start // b:-(-stop // b), :]
    elif qt.format != "fp8":
        scale = cut(scale)
    return replace(qt, data=cut(qt.data), scale=scale, zero=cut(qt.zero),
                   shape=(*qt.shape[:-2], stop - start, qt.in_features))
