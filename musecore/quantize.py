"""The Muse quantization rule, applied to ``musecore_quant``'s model-agnostic converter.

MODEL.md section 3: only the routed experts of the sparse layers other than the first and the last
are quantized (fused ``experts.gate_up_proj`` / ``down_proj`` or per-expert keys); everything else
stays as it is. The rule itself lives once, in ``musecore_quant.muse_rule``, reached through
:func:`musecore.names.quantized_expert_patterns`.

Example::

    from musecore.quantize import convert_muse_checkpoint
    report = convert_muse_checkpoint("muse-bf16", "muse-nvfp4", to="nvfp4")
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Union

from musecore.config import MuseConfig
from musecore.names import quantized_expert_patterns


def convert_muse_checkpoint(src: Union[str, Path], dst: Union[str, Path], to: str, method: str = "rtn",
                            **kwargs: Any) -> Any:
    """``musecore_quant.convert`` with the Muse rule for which weights are quantized."""
    from musecore_quant.convert import convert

    config = MuseConfig.from_pretrained(src)
    include = quantized_expert_patterns(config) if to != "bf16" else None
    return convert(src, dst, to=to, method=method, include=include, **kwargs)
