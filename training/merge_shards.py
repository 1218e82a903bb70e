"""Merge the sharded checkpoint that ``train_muse_tiny.py`` writes into the single file that ships.

The device tool returns files of at most 16 MiB, so training saves with ``save_pretrained(...,
max_shard_size="15MB")``: two shards and an index. The bundled model is one ``model.safetensors``.
Tensors are copied unchanged (names, dtypes, bytes; ``{"format": "pt"}`` metadata, as
``save_pretrained`` writes it). The script checks the names against transformers'
``MuseSparkForConditionalGeneration`` state dict for the saved ``config.json`` and the dtypes
against its rule: BF16 everywhere except ``_keep_in_fp32_modules_strict`` (fp32). ``config.json``
and ``generation_config.json`` are copied as ``save_pretrained`` wrote them.

Usage::

    python training/merge_shards.py /path/to/run/muse-tiny musecore/data/muse-tiny
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path, help="folder with config.json, model.safetensors.index.json and shards")
    parser.add_argument("dest", type=Path, help="folder to write config.json, generation_config.json, model.safetensors")
    args = parser.parse_args()

    from transformers import MuseSparkConfig, MuseSparkForConditionalGeneration

    weight_map = json.loads((args.source / "model.safetensors.index.json").read_text())["weight_map"]
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(set(weight_map.values())):
        with safe_open(str(args.source / file), framework="pt") as f:
            assert (f.metadata() or {}).get("format") == "pt", f.metadata()
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    if set(tensors) != set(weight_map):
        raise SystemExit("the shards do not hold exactly the tensors that the index names")

    config = MuseSparkConfig.from_pretrained(args.source)
    with torch.device("meta"):
        reference = MuseSparkForConditionalGeneration(config)
    expected = {name: tuple(t.shape) for name, t in reference.state_dict().items()}
    got = {name: tuple(t.shape) for name, t in tensors.items()}
    if got != expected:
        raise SystemExit(f"shards hold {len(got)} tensors that differ from transformers' state dict "
                         f"({len(expected)}): {sorted(set(got) ^ set(expected))[:5]}")
    keep_fp32 = reference._keep_in_fp32_modules_strict
    for name, t in tensors.items():
        want = torch.float32 if any(k in name for k in keep_fp32) else torch.bfloat16
        if t.dtype != want:
            raise SystemExit(f"{name}: {t.dtype}, expected {want}")

    args.dest.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(args.dest / "model.safetensors"), metadata={"format": "pt"})
    for name in ("config.json", "generation_config.json"):
        shutil.copyfile(args.source / name, args.dest / name)
    size = (args.dest / "model.safetensors").stat().st_size
    n_fp32 = sum(t.dtype == torch.float32 for t in tensors.values())
    print(f"{len(tensors)} tensors ({n_fp32} fp32, the rest bf16), {sum(t.numel() for t in tensors.values()):,} "
          f"parameters -> {args.dest / 'model.safetensors'} ({size / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
