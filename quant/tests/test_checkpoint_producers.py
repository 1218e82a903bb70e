"""Read paths of producers musecore does not write, on hand-built files in each producer's layout.

compressed-tensors NVFP4 (inverse global scales) and FP8, HF/DeepSeek FP8 blocks, GPTQ v1/v2,
AutoRound's true-zero packing, AWQ GEMM, GPT-OSS stacked MXFP4 and the legacy ModelOpt export
that only has hf_quant_config.json: each is detected from its files and decoded to the same
canonical QTensor the codecs produce.
"""

import dataclasses
import json

import pytest
import torch

from musecore_quant import dequantize, quantize
from musecore_quant.checkpoint import CheckpointWriter, open_checkpoint, verify_checkpoint
from musecore_quant.formats.int4 import int4_to_awq, int4_to_gptq
from musecore_quant.formats.mxfp4 import mxfp4_to_gpt_oss
from test_checkpoint_helpers import assert_same_qtensor, muse_config, write_hf_checkpoint

MOD = "model.layers.1.mlp.experts.0.up_proj"
PLAIN = {"model.norm.weight": torch.ones(256, dtype=torch.bfloat16),
         "model.layers.1.self_attn.q_proj.weight": torch.full((256, 256), 0.01, dtype=torch.bfloat16)}


def _w(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 0.02


def _write(tmp_path, tensors, quantization_config, **kw):
    config = {**muse_config(), "quantization_config": quantization_config}
    return write_hf_checkpoint(tmp_path / "ckpt", {**PLAIN, **tensors}, config, **kw)


def test_compressed_tensors_nvfp4_reads_inverse_global_scales(tmp_path):
    qt = quantize(_w(256, 128), "nvfp4")
    folder = _write(tmp_path, {
        f"{MOD}.weight_packed": qt.data, f"{MOD}.weight_scale": qt.scale,
        f"{MOD}.weight_global_scale": (1.0 / qt.global_scale).reshape(1),
        f"{MOD}.input_global_scale": torch.tensor([1.0 / 0.02])},
        {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
         "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "float",
                                                                            "strategy": "tensor_group",
                                                                            "group_size": 16}}},
         "ignore": ["lm_head"]})
    ckpt = open_checkpoint(folder)
    assert (ckpt.format, ckpt.producer) == ("nvfp4", "compressed-tensors")
    assert f"{MOD}.weight" in ckpt.weight_names() and f"{MOD}.weight_packed" not in ckpt.weight_names()
    got = ckpt.read(f"{MOD}.weight")
    assert torch.equal(got.data, qt.data) and torch.equal(got.scale.view(torch.uint8), qt.scale.view(torch.uint8))
    rel = abs(got.global_scale.item() / qt.global_scale.item() - 1)
    assert rel < 1e-6, f"1/(1/weight_scale_2) off by {rel:.2e}"
    assert got.input_scale.item() == pytest.approx(0.02, rel=1e-6)
    err = (dequantize(got) - dequantize(qt)).abs().max().item()
    assert err < 1e-8, f"dequantized values differ by {err}"


@pytest.mark.parametrize("block_size", [None, 128])
def test_compressed_tensors_fp8_per_tensor_and_block(tmp_path, block_size):
    qt = quantize(_w(256, 384), "fp8", block_size=block_size)
    scale = qt.scale.reshape(1) if block_size is None else qt.scale
    folder = _write(tmp_path, {f"{MOD}.weight": qt.data, f"{MOD}.weight_scale": scale},
                    {"quant_method": "compressed-tensors", "format": "float-quantized"})
    ckpt = open_checkpoint(folder)
    assert (ckpt.format, ckpt.producer) == ("fp8", "compressed-tensors")
    assert_same_qtensor(ckpt.read(f"{MOD}.weight"), qt, MOD)


def test_deepseek_fp8_weight_scale_inv_is_a_multiplier(tmp_path):
    qt = quantize(_w(300, 256), "fp8", block_size=128)   # ragged edge block, as in DeepSeek-V3
    folder = _write(tmp_path, {f"{MOD}.weight": qt.data, f"{MOD}.weight_scale_inv": qt.scale},
                    {"quant_method": "fp8", "weight_block_size": [128, 128]})
    ckpt = open_checkpoint(folder)
    assert (ckpt.format, ckpt.producer, ckpt.weight_shape(f"{MOD}.weight")) == ("fp8", "fp8", (300, 256))
    assert_same_qtensor(ckpt.read(f"{MOD}.weight"), qt, MOD)


def _gptq_tensors(packed):
    return {f"{MOD}.{k}": v for k, v in packed.items()}


@pytest.mark.parametrize("quantization_config,sym,v1", [
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}, True, True),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "gptq_v2", "sym": False},
     False, False),
    ({"quant_method": "auto-round", "packing_format": "auto_round", "bits": 4, "group_size": 128, "sym": False},
     False, False),
    ({"quant_method": "auto-round", "packing_format": "auto_round:auto_gptq", "bits": 4, "group_size": 128,
      "sym": False}, False, True),
])
def test_gptq_layouts_read_their_zero_convention(tmp_path, quantization_config, sym, v1):
    qt = quantize(_w(256, 256), "int4", group_size=128, sym=sym)
    if v1:
        packed = int4_to_gptq(qt)
    else:  # true zeros on disk: pack z+1 with the v1 packer, which stores (z+1)-1 = z
        shifted = dataclasses.replace(qt, zero=(qt.zero.to(torch.int32) + 1).remainder(16).to(torch.uint8))
        packed = int4_to_gptq(shifted)
    folder = _write(tmp_path, _gptq_tensors(packed), quantization_config)
    ckpt = open_checkpoint(folder)
    assert ckpt.format == "int4" and ckpt.weight_shape(f"{MOD}.weight") == (256, 256)
    assert_same_qtensor(ckpt.read(f"{MOD}.weight"), qt, MOD)


def test_awq_gemm_layout(tmp_path):
    qt = quantize(_w(256, 256), "int4", group_size=128, sym=False)
    folder = _write(tmp_path, _gptq_tensors(int4_to_awq(qt)),
                    {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"})
    ckpt = open_checkpoint(folder)
    assert (ckpt.format, ckpt.producer) == ("int4", "awq")
    assert_same_qtensor(ckpt.read(f"{MOD}.weight"), qt, MOD)


def test_gpt_oss_stacked_blocks_and_scales(tmp_path):
    qt = quantize(_w(2, 128, 256), "mxfp4")
    blocks, scales = mxfp4_to_gpt_oss(qt)
    base = "model.layers.0.mlp.experts.gate_up_proj"
    folder = _write(tmp_path, {base + "_blocks": blocks, base + "_scales": scales,
                               base + "_bias": torch.zeros(2, 128, dtype=torch.bfloat16)},
                    {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]})
    ckpt = open_checkpoint(folder)
    assert (ckpt.format, ckpt.producer) == ("mxfp4", "gpt-oss")
    assert ckpt.weight_shape(base) == (2, 128, 256) and base + "_bias" in ckpt.weight_names()
    assert_same_qtensor(ckpt.read(base), qt, base)
    assert verify_checkpoint(folder).ok


def test_legacy_modelopt_export_with_only_hf_quant_config(tmp_path):
    qt = quantize(_w(256, 128), "nvfp4")
    with CheckpointWriter(tmp_path / "w", config=muse_config(), format="nvfp4") as w:
        w.add(f"{MOD}.weight", qt)
        w.add("model.norm.weight", PLAIN["model.norm.weight"])
    config = json.loads((tmp_path / "w" / "config.json").read_text())
    del config["quantization_config"]
    (tmp_path / "w" / "config.json").write_text(json.dumps(config))
    ckpt = open_checkpoint(tmp_path / "w")
    assert (ckpt.format, ckpt.producer) == ("nvfp4", "modelopt")
    assert_same_qtensor(ckpt.read(f"{MOD}.weight"), qt)


def test_companions_in_a_later_shard_are_held_until_complete(tmp_path):
    qt = quantize(_w(256, 128), "nvfp4")
    tensors = {f"{MOD}.weight": qt.data, f"{MOD}.weight_scale": qt.scale,
               f"{MOD}.weight_scale_2": qt.global_scale}
    config = {**muse_config(), "quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4"}}
    folder = write_hf_checkpoint(tmp_path / "split", {**PLAIN, **tensors}, config, shards=2,
                                 shard_of={f"{MOD}.weight": 0, f"{MOD}.weight_scale": 1,
                                           f"{MOD}.weight_scale_2": 1, "model.norm.weight": 0,
                                           "model.layers.1.self_attn.q_proj.weight": 0})
    ckpt = open_checkpoint(folder)
    streamed = [(shard.name, sorted(w)) for shard, w in ckpt.iter_shards()]
    assert streamed[0][1] == sorted(PLAIN)
    assert streamed[1] == ("model-00002-of-00002.safetensors", [f"{MOD}.weight"])
    assert_same_qtensor(dict(ckpt.iter_shards([f"{MOD}.weight"]))[folder / streamed[1][0]][f"{MOD}.weight"], qt)
