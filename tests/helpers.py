"""Small configs and checkpoints for the core tests."""

from pathlib import Path

import torch
from safetensors.torch import save_file

from musecore.config import MuseConfig
from musecore.model import init_weights

SMALL = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, num_local_experts=6, num_experts_per_tok=2, moe_hidden_size=32,
             moe_intermediate_size=48, sliding_window=5, max_position_embeddings=512, output_multiplier=0.7,
             # The released scale (5.47) sharpens attention so much that a random model's logits swing on
             # one rounding; tests that compare two numerics paths on random weights need a calmer model.
             qk_scale_factor=1.0,
             bos_token_id=0, eos_token_id=1, pad_token_id=2, image_token_id=94, video_token_id=95, audio_token_id=96)


def small_config(**overrides) -> MuseConfig:
    return MuseConfig(**{**SMALL, **overrides})


def random_tensors(config: MuseConfig, seed: int = 0, dtype=torch.float32) -> dict:
    """Random weights with non-trivial norms, residual gates and correction bias (their zero or
    one initialisation would hide mix-ups)."""
    tensors = init_weights(config, seed=seed, std=0.15, dtype=dtype)
    gen = torch.Generator().manual_seed(seed + 1)
    for name, t in tensors.items():
        if t.dim() == 1:
            offset = 1.0 if name == "model.language_model.norm.weight" else 0.0  # the final norm is not centred
            tensors[name] = (offset + 0.3 * torch.randn(t.shape, generator=gen)).to(t.dtype)
    return tensors


def write_checkpoint(folder: Path, config: MuseConfig, tensors: dict, shards: int = 1) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    if shards == 1:
        save_file(tensors, str(folder / "model.safetensors"))
        return folder
    names = list(tensors)  # model order, cut into contiguous runs as HF writers shard
    weight_map = {}
    for s in range(shards):
        part = names[s * len(names) // shards:(s + 1) * len(names) // shards]
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n] for n in part}, str(folder / file))
        weight_map.update({n: file for n in part})
    import json
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def transformers_function(path: Path, name: str, cls: str | None = None, **namespace):
    """A function (or a method, called with a stub self) from a transformers source file, its annotations and
    decorators dropped, so it runs without that file's imports (e.g. torchvision); ``namespace`` adds the globals
    it uses beyond torch, math and itertools."""
    import ast
    import itertools
    import math
    tree = ast.parse(path.read_text())
    scope = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls).body if cls else tree.body
    node = next(n for n in scope if isinstance(n, ast.FunctionDef) and n.name == name)
    node.decorator_list, node.returns = [], None
    for arg in node.args.args + node.args.kwonlyargs:
        arg.annotation = None
    scope_globals = {"torch": torch, "math": math, "itertools": itertools, **namespace}
    exec(compile(ast.Module([node], []), str(path), "exec"), scope_globals)
    return scope_globals[name]
