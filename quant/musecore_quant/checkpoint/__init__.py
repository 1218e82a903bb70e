"""Checkpoint readers and writers for every producer musecore meets, over safetensors only.

- ``open_checkpoint(folder) -> CheckpointReader``: ModelOpt NVFP4/FP8/MIXED_PRECISION, Quark MXFP4,
  AutoRound/GPTQ/AWQ INT4, compressed-tensors NVFP4/FP8, GPT-OSS MXFP4, HF FP8 blocks, plain BF16;
  strict validation from headers, companions grouped under their weight, canonical ``QTensor``s.
- ``CheckpointWriter``: the target producer's keys and configs, atomic and resumable.
- ``verify_checkpoint``: sha256, headers, companions, shapes and a NaN/Inf scan.
- ``convert`` (``musecore_quant.convert``): the streaming converter built on both.

The package knows nothing of any model graph: it works on any Hugging Face-style checkpoint.
"""

from __future__ import annotations

import importlib
from typing import Any

from .errors import CheckpointError
from .layout import WeightEntry
from .reader import CheckpointReader, is_partial, open_checkpoint
from .verify import VerifyReport, verify_checkpoint
from .writer import DEFAULT_MAX_SHARD_BYTES, TARGET_PRODUCERS, CheckpointWriter

__all__ = [
    "DEFAULT_MAX_SHARD_BYTES", "TARGET_PRODUCERS", "CheckpointError", "CheckpointReader", "CheckpointWriter",
    "VerifyReport", "WeightEntry", "convert", "is_partial", "open_checkpoint", "verify_checkpoint",
]


def __getattr__(name: str) -> Any:
    # convert imports this package; importing it lazily keeps the import graph acyclic.
    if name in ("convert", "ConversionReport"):
        return getattr(importlib.import_module("musecore_quant.convert"), name)
    raise AttributeError(f"module 'musecore_quant.checkpoint' has no attribute {name!r}")
