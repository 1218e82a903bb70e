"""Tiny Muse-like Hugging Face checkpoints for the checkpoint, converter and CLI tests.

The tensor names follow MODEL.md section 3 (prefix ``model.language_model.``, per-expert keys),
with every quantizable dimension a multiple of 128 so that NVFP4 (16), MXFP4 (32) and INT4
(group 128) all apply. The checkpoints are written with ``safetensors`` directly, the way a
Hugging Face export would be, never through the writer under test.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
from safetensors.torch import save_file

from musecore_quant.qtensor import QTensor

H, LAYERS, EXPERTS, INTER, LATENT, NQ, NKV, HEAD_DIM, VOCAB = 256, 4, 2, 256, 128, 2, 1, 128, 256
PREFIX = "model.language_model."
# The Muse rule (MODEL.md section 2): routed experts of layers 1..L-2 are quantized.
MUSE_EXPERT_RULE = rf"layers\.[1-{LAYERS - 2}]\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$"


def muse_config(layers: int = LAYERS, experts: int = EXPERTS) -> dict[str, Any]:
    return {"model_type": "muse_spark", "vocab_size": VOCAB, "hidden_size": H, "num_hidden_layers": layers,
            "num_attention_heads": NQ, "num_key_value_heads": NKV, "head_dim": HEAD_DIM,
            "num_experts": experts, "num_experts_per_tok": 1, "moe_latent_size": LATENT,
            "moe_intermediate_size": INTER, "bf16_expert_layers": [0, layers - 1], "tie_word_embeddings": False}


def muse_tensors(seed: int = 0, layers: int = LAYERS, experts: int = EXPERTS) -> dict[str, torch.Tensor]:
    """BF16 weights with Muse tensor names and shapes (small random values, norms at one)."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)  # noqa: E731
    ones = lambda n: torch.ones(n, dtype=torch.bfloat16)  # noqa: E731
    t = {PREFIX + "embed_tokens.weight": rand(VOCAB, H)}
    for i in range(layers):
        p = f"{PREFIX}layers.{i}."
        t[p + "input_layernorm.weight"] = ones(H)
        t[p + "self_attn.q_proj.weight"] = rand(NQ * HEAD_DIM, H)
        t[p + "self_attn.k_proj.weight"] = rand(NKV * HEAD_DIM, H)
        t[p + "self_attn.v_proj.weight"] = rand(NKV * HEAD_DIM, H)
        t[p + "self_attn.o_proj.weight"] = rand(H, NQ * HEAD_DIM)
        for n in ("q_norm", "k_norm", "o_norm"):
            t[p + f"self_attn.{n}.weight"] = ones(HEAD_DIM)
        t[p + "self_attn.gate_proj.weight"] = rand(NQ, H)
        t[p + "post_attention_layernorm.weight"] = ones(H)
        t[p + "attn_residual_gate"] = ones(H)
        t[p + "pre_feedforward_layernorm.weight"] = ones(H)
        t[p + "mlp.router.weight"] = rand(experts, H)
        t[p + "mlp.fc1_latent_proj.weight"] = rand(LATENT, H)
        t[p + "mlp.latent_norm.weight"] = ones(LATENT)
        for e in range(experts):
            q = f"{p}mlp.experts.{e}."
            t[q + "gate_proj.weight"] = rand(INTER, LATENT)
            t[q + "up_proj.weight"] = rand(INTER, LATENT)
            t[q + "down_proj.weight"] = rand(LATENT, INTER)
            t[q + "output_norm.weight"] = ones(LATENT)
        t[p + "mlp.fc2_latent_proj.weight"] = rand(H, LATENT)
        t[p + "post_feedforward_layernorm.weight"] = ones(H)
        t[p + "ffn_residual_gate"] = ones(H)
    t[PREFIX + "norm.weight"] = ones(H)
    t["lm_head.weight"] = rand(VOCAB, H)
    return t


def write_hf_checkpoint(folder: Path, tensors: dict[str, torch.Tensor], config: dict[str, Any], *,
                        shards: int = 2, hf_quant_config: Optional[dict] = None,
                        shard_of: Optional[dict[str, int]] = None) -> Path:
    """A Hugging Face checkpoint: config.json, tokenizer.json, ``shards`` safetensors and an index.

    ``shard_of`` pins chosen keys to a shard (0-based); the others fill shards in order.
    """
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "tokenizer.json").write_text('{"version": "1.0"}')
    if hf_quant_config is not None:
        (folder / "hf_quant_config.json").write_text(json.dumps(hf_quant_config))
    keys = list(tensors)
    if shards == 1 and not shard_of:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
        return folder
    per = -(-len(keys) // shards)
    assign = {k: min(i // per, shards - 1) for i, k in enumerate(keys)}
    assign.update(shard_of or {})
    weight_map = {}
    for s in range(shards):
        name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: tensors[k].contiguous() for k in keys if assign[k] == s}
        save_file(part, str(folder / name))
        weight_map.update((k, name) for k in part)
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
             "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


def write_raw_safetensors(path: Path, header: dict[str, Any], data: bytes, *,
                          declared_length: Optional[int] = None) -> Path:
    """A hand-made safetensors file (for corruption tests): 8-byte length, JSON header, data."""
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if declared_length is None else declared_length) + raw + data)
    return path


def assert_same_qtensor(a: QTensor, b: QTensor, name: str = "") -> None:
    """Byte equality of two QTensors (data, scales, zeros, global and input scales, shape)."""
    assert (a.format, tuple(a.shape), a.group_size) == (b.format, tuple(b.shape), b.group_size), \
        f"{name}: {a!r} vs {b!r}"
    for field in ("data", "scale", "global_scale", "zero", "input_scale"):
        x, y = getattr(a, field), getattr(b, field)
        assert (x is None) == (y is None), f"{name}.{field}: one side is None ({x is None}, {y is None})"
        if x is not None:
            assert x.dtype == y.dtype and tuple(x.shape) == tuple(y.shape), \
                f"{name}.{field}: {x.dtype}{list(x.shape)} vs {y.dtype}{list(y.shape)}"
            assert torch.equal(x.view(torch.uint8) if x.element_size() == 1 else x,
                               y.view(torch.uint8) if y.element_size() == 1 else y), f"{name}.{field} bytes differ"


@pytest.fixture
def bf16_checkpoint(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    tensors = muse_tensors()
    return write_hf_checkpoint(tmp_path / "bf16", tensors, muse_config()), tensors


def test_fixture_checkpoint_has_muse_names_and_dims_multiple_of_128():
    tensors = muse_tensors()
    experts = [n for n in tensors if ".mlp.experts." in n and n.endswith("_proj.weight")]
    assert len(experts) == LAYERS * EXPERTS * 3
    assert all(d % 128 == 0 for n in experts for d in tensors[n].shape)
    assert "lm_head.weight" in tensors and PREFIX + "layers.0.mlp.experts.1.output_norm.weight" in tensors
