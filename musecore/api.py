"""``musecore.load``: checkpoint folder or preset name -> a ready :class:`MuseModel`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Union

import torch

from musecore.backends.reference import ReferenceBackend
from musecore.config import MuseConfig
from musecore.loader import fill_model, iter_safetensors
from musecore.model import MuseModel
from musecore.ops import Ops


def weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return [folder / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(f"{folder} has neither model.safetensors nor model.safetensors.index.json")


def load(model: Union[str, Path], device: str = "cpu", *, dtype: Optional[torch.dtype] = None) -> MuseModel:
    folder = Path(model)
    config = MuseConfig.from_pretrained(folder)
    dtype = dtype or torch.bfloat16
    backend = ReferenceBackend(device)
    muse = MuseModel(config, Ops.from_backend(backend), dtype=dtype, device=backend.device)
    fill_model(muse, iter_safetensors(weight_files(folder)), backend, source=str(folder))
    return muse
