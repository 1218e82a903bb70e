"""Merge the sharded checkpoint that ``train_muse_tiny.py`` writes into the single file that ships.

The device tool returns files of at most 16 MiB, so training writes two shards plus an index;
the bundled model is one ``model.safetensors`` (21.6 MB of BF16). Tensors are copied unchanged
(the script checks names, shapes and BF16 dtype against ``checkpoint_shapes``), in sorted order.

Usage::

    python training/merge_shards.py /path/to/run/muse-tiny musecore/data/muse-tiny
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from musecore.config import MuseConfig
from musecore.model import checkpoint_shapes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path, help="folder with config.json, model.safetensors.index.json and shards")
    parser.add_argument("dest", type=Path, help="folder to write config.json and model.safetensors into")
    args = parser.parse_args()

    config = MuseConfig.from_pretrained(args.source)
    weight_map = json.loads((args.source / "model.safetensors.index.json").read_text())["weight_map"]
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(set(weight_map.values())):
        tensors.update(load_file(str(args.source / file)))
    expected = checkpoint_shapes(config)
    got = {name: tuple(t.shape) for name, t in tensors.items()}
    if got != expected:
        raise SystemExit(f"shards hold {len(got)} tensors that differ from checkpoint_shapes ({len(expected)} expected)")
    dtypes = {t.dtype for t in tensors.values()}
    if dtypes != {torch.bfloat16}:
        raise SystemExit(f"expected only BF16 tensors, found {dtypes}")
    args.dest.mkdir(parents=True, exist_ok=True)
    save_file({name: tensors[name] for name in sorted(tensors)}, str(args.dest / "model.safetensors"),
              metadata={"format": "pt"})
    shutil.copyfile(args.source / "config.json", args.dest / "config.json")
    size = (args.dest / "model.safetensors").stat().st_size
    print(f"{len(tensors)} tensors, {sum(t.numel() for t in tensors.values()):,} parameters -> "
          f"{args.dest / 'model.safetensors'} ({size / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
