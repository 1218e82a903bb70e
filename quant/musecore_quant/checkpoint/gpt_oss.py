"""GPT-OSS MXFP4 checkpoints (transformers' ``quant_method: mxfp4``).

GPT-OSS stores each layer's experts stacked, as ``X_blocks`` uint8 ``[E, rows, in/32, 16]`` (16
bytes = 32 E2M1 codes per block) and ``X_scales`` uint8 E8M0 ``[E, rows, in/32]``, where ``X`` is
e.g. ``model.layers.0.mlp.experts.gate_up_proj`` (no ``.weight`` suffix). The reader exposes one
logical weight ``X`` of shape ``[E, rows, in]``; the bytes are reshaped into the canonical
stacked MXFP4 ``QTensor`` by ``musecore_quant.formats.mxfp4.mxfp4_from_gpt_oss``.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from ..qtensor import QTensor
from .dense import MXFP4_GROUP
from .layout import GroupingRule, WeightEntry, expect_dtype, expect_shape, fail, require
from .safetensors_io import TensorHeader

GPT_OSS = GroupingRule("gpt-oss", "_blocks", ("_scales",), "")


def classify_blocks(name: str, parts: dict[str, TensorHeader], options: Mapping[str, Any]) -> WeightEntry:
    blocks = parts["blocks"]
    scales = require(name, parts, "scales", "_scales", "MXFP4 blocks need their E8M0 scales")
    expect_dtype(name, blocks, ("U8",), "32 packed E2M1 codes per block")
    expect_dtype(name, scales, ("U8",), "E8M0 scales")
    if len(blocks.shape) < 3 or blocks.shape[-1] != 16:
        raise fail(name, blocks, f"has shape {list(blocks.shape)}; GPT-OSS blocks are [..., rows, in/32, 16]")
    *lead, rows, nblocks, _ = blocks.shape
    expect_shape(name, scales, (*lead, rows, nblocks), "one E8M0 scale per 32-input block")
    return WeightEntry(name, "gpt-oss-mxfp4", "mxfp4", (*lead, rows, nblocks * MXFP4_GROUP), parts,
                       MXFP4_GROUP, {"e8m0_roles": ("scales",)})


def decode_blocks(entry: WeightEntry, t: dict[str, torch.Tensor]) -> QTensor:
    from ..formats.mxfp4 import mxfp4_from_gpt_oss
    return mxfp4_from_gpt_oss(t["blocks"], t["scales"])


DECODERS = {"gpt-oss-mxfp4": decode_blocks}
