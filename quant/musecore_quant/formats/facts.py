"""What each number format costs and needs, as data: the one place other code looks these up.

The codecs (``nvfp4.py``, ``mxfp4.py``, ``int4.py``, ``fp8.py``, ``int8.py``) know how to encode; callers that
only need to *reason* about a format (the plan's memory estimate, which widths a device can take,
what options a device's own producer uses) read :data:`FACTS` instead of restating a block size or
a bytes-per-value figure.

Example::

    from musecore_quant.formats.facts import FACTS, bytes_per_value, block_size
    bytes_per_value("nvfp4")          # 0.5625: 4-bit codes + one E4M3 scale per 16 values
    block_size("int4")                # 128: the group every producer here writes by default
    FACTS["mxfp4"].producer_options   # {"scale_mode": "even", "rounding": "rne"} (Quark)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from .int4 import DEFAULT_GROUP_SIZE as INT4_DEFAULT_GROUP
from .mxfp4 import MXFP4_BLOCK_SIZE
from .nvfp4 import NVFP4_BLOCK_SIZE


@dataclass(frozen=True)
class FormatFacts:
    """One format's storage: value bits, the block that shares a scale, the scale's bytes."""

    name: str
    value_bits: int                  # bits of one stored value
    block_size: Optional[int] = None  # values along in_features that share one scale; None: no block scales
    scale_bytes: int = 0             # bytes of one block scale (E4M3 1, E8M0 1, fp16 2)
    # The quantizer options the format's own producer uses (FORMATS.md): what a device that converts
    # at load applies, so its weights match what that producer would have shipped.
    producer_options: dict[str, Any] = field(default_factory=dict)
    quantized: bool = True

    @property
    def bytes_per_value(self) -> float:
        """Bytes per weight value, block scales included (per-tensor scales are negligible)."""
        scales = self.scale_bytes / self.block_size if self.block_size else 0.0
        return self.value_bits / 8 + scales


FACTS: dict[str, FormatFacts] = {f.name: f for f in (
    FormatFacts("nvfp4", 4, NVFP4_BLOCK_SIZE, 1),                       # E4M3 scale per 16 (+ fp32 per tensor)
    FormatFacts("mxfp4", 4, MXFP4_BLOCK_SIZE, 1, {"scale_mode": "even", "rounding": "rne"}),  # E8M0 per 32
    FormatFacts("int4", 4, INT4_DEFAULT_GROUP, 2, {"group_size": INT4_DEFAULT_GROUP, "sym": True}),  # fp16 scale
    FormatFacts("fp8", 8),                                              # per-tensor fp32 scale
    FormatFacts("int8", 8),            # fp32 scale per output row: 4/in_features bytes per value, not counted
    FormatFacts("bf16", 16, quantized=False),
    FormatFacts("fp16", 16, quantized=False),
    FormatFacts("fp32", 32, quantized=False),
)}


def facts(fmt: str) -> FormatFacts:
    if fmt not in FACTS:
        raise ValueError(f"unknown format {fmt!r}; known formats: {', '.join(FACTS)}")
    return FACTS[fmt]


def bytes_per_value(fmt: str) -> float:
    """Bytes per weight value of ``fmt`` in its canonical layout (block scales included)."""
    return facts(fmt).bytes_per_value


def block_size(fmt: str) -> Optional[int]:
    """The in_features multiple a weight needs to be stored in ``fmt`` (None: any width)."""
    return facts(fmt).block_size


def producer_options(fmt: str) -> dict[str, Any]:
    """The quantizer options of ``fmt``'s own producer (a copy, safe to extend)."""
    return dict(facts(fmt).producer_options)


def weight_bytes(fmt: str, numel: int) -> int:
    """Bytes of ``numel`` weight values stored in ``fmt`` (:func:`bytes_per_value` times ``numel``)."""
    return int(numel * bytes_per_value(fmt))
