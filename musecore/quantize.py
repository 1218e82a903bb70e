"""The Muse quantization rule, applied to ``musecore_quant``'s model-agnostic converter.

MODEL.md section 2: only the routed experts of the layers not listed in ``bf16_expert_layers``
(by default every layer but the first and the last) are quantized; everything else stays BF16.

Example::

    from musecore.quantize import convert_muse_checkpoint
    report = convert_muse_checkpoint("muse-bf16", "muse-nvfp4", to="nvfp4")
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Union

from musecore.config import MuseConfig


def quantized_expert_patterns(config: MuseConfig) -> list[str]:
    """Regexes selecting the expert projections MODEL.md quantizes (one per quantized layer)."""
    layers = [i for i in range(config.num_hidden_layers) if i not in set(config.bf16_expert_layers)]
    return [rf"\.layers\.{i}\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$" for i in layers]


def convert_muse_checkpoint(src: Union[str, Path], dst: Union[str, Path], to: str, method: str = "rtn",
                            **kwargs: Any) -> Any:
    """``musecore_quant.convert`` with the Muse rule for which weights are quantized."""
    from musecore_quant.convert import convert

    config = MuseConfig.from_pretrained(src)
    include = quantized_expert_patterns(config) if to != "bf16" else None
    return convert(src, dst, to=to, method=method, include=include, **kwargs)
