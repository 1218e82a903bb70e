"""musecore_quant: number formats, the QTensor container and checkpoint conversion for musecore.

Useful on any checkpoint, independent of the model graph. The codecs reproduce the producers'
bytes (ModelOpt NVFP4, Quark/torchao MXFP4, AutoRound/GPTQ/AWQ INT4, FP8), so a checkpoint read
here and written back is the same checkpoint.

Example::

    import musecore_quant
    qt = musecore_quant.quantize(w, "nvfp4")          # w: [out, in] or [E, out, in]
    mx = musecore_quant.requantize(qt, "mxfp4")       # what MI355X runs
    print(musecore_quant.quant_error(w, musecore_quant.dequantize(mx)))
"""

from __future__ import annotations

from typing import Any

from .api import dequantize, fake_quantize_activation, quantize, requantize
from .metrics import QuantError, quant_error
from .qtensor import (FORMATS, QTensor, concat_problem, concat_qtensors, slice_cols, slice_experts, slice_rows,
                      stack_qtensors)

__all__ = [
    "FORMATS", "QTensor", "QuantError", "dequantize", "fake_quantize_activation", "quant_error",
    "quantize", "requantize", "stack_qtensors", "concat_qtensors", "concat_problem", "slice_rows", "slice_cols",
    "slice_experts", "muse_rule",
]


def __getattr__(name: str) -> Any:
    # convert lives with the checkpoint readers/writers; import it on first use so that the codecs
    # stay importable (and fast to import) without the checkpoint package's dependencies.
    if name == "convert":
        from .checkpoint import convert
        return convert
    if name == "muse_rule":
        from .checkpoint.experts import muse_rule
        return muse_rule
    raise AttributeError(f"module 'musecore_quant' has no attribute {name!r}")
