"""Every writer round-trips through the reader byte for byte, in the producer's own layout."""

import json

import pytest
import torch
from safetensors import safe_open

from musecore_quant import dequantize, quantize
from musecore_quant.checkpoint import CheckpointWriter, open_checkpoint, verify_checkpoint
from musecore_quant.checkpoint.safetensors_io import sha256_file
from test_checkpoint_helpers import (PREFIX, assert_same_qtensor, bf16_checkpoint,  # noqa: F401
                                     muse_config, muse_tensors)

EXPERT = PREFIX + "layers.1.mlp.experts.0."


def _write(tmp_path, target, quantized, *, max_shard_bytes=10**9, name="out"):
    """A Muse-like checkpoint whose weights in ``quantized`` are replaced by QTensors."""
    tensors = muse_tensors()
    with CheckpointWriter(tmp_path / name, config=muse_config(), format=target,
                          max_shard_bytes=max_shard_bytes) as w:
        for n, t in tensors.items():
            w.add(n, quantized.get(n, t))
    return tmp_path / name, tensors


def _keys(folder):
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    return index, set(index["weight_map"])


@pytest.mark.parametrize("target,opts,expect_producer", [
    ("nvfp4", {}, "modelopt"), ("mxfp4", {}, "quark"), ("int4", {"group_size": 128}, "auto-round"),
    ("int4", {"group_size": 128, "sym": False}, "auto-round"), ("fp8", {}, "modelopt"),
])
def test_writer_then_reader_gives_the_same_qtensor_bytes(tmp_path, target, opts, expect_producer):
    tensors = muse_tensors()
    names = [n for n in tensors if n.startswith(EXPERT) and n.endswith("_proj.weight")]
    qts = {n: quantize(tensors[n], target, **opts) for n in names}
    folder, _ = _write(tmp_path, target, qts, max_shard_bytes=400_000)
    ckpt = open_checkpoint(folder)
    assert (ckpt.format, ckpt.producer) == (target, expect_producer)
    assert len(ckpt.shards) > 1, "small max_shard_bytes should give several shards"
    assert sorted(ckpt.weight_names()) == sorted(tensors), "companions must be grouped under their weight"
    for n in names:
        assert ckpt.weight_format(n) == target and ckpt.weight_shape(n) == tuple(tensors[n].shape)
        assert_same_qtensor(ckpt.read(n), qts[n], n)
    plain = PREFIX + "layers.1.self_attn.q_proj.weight"
    assert ckpt.weight_format(plain) == "bf16" and torch.equal(ckpt.read(plain), tensors[plain])
    streamed = {n: v for _, weights in ckpt.iter_shards() for n, v in weights.items()}
    assert list(streamed) == ckpt.weight_names(), "iter_shards streams every weight in file order"
    report = verify_checkpoint(folder)
    assert report.ok and report.sha256_verified == len(ckpt.shards), report.problems


def test_modelopt_nvfp4_layout_and_configs_match_what_modelopt_writes(tmp_path):
    tensors = muse_tensors()
    gate, up = EXPERT + "gate_proj.weight", EXPERT + "up_proj.weight"
    qt = quantize(tensors[gate], "nvfp4")
    qt.input_scale = torch.tensor(0.01)
    folder, _ = _write(tmp_path, "nvfp4", {gate: qt, up: quantize(tensors[up], "nvfp4")})
    index, keys = _keys(folder)
    module = gate[: -len(".weight")]
    assert {module + s for s in (".weight", ".weight_scale", ".weight_scale_2", ".input_scale")} <= keys
    with safe_open(str(folder / index["weight_map"][gate]), "pt") as f:
        assert f.get_tensor(gate).dtype == torch.uint8
        assert f.get_tensor(module + ".weight_scale").dtype == torch.float8_e4m3fn
        assert f.get_tensor(module + ".weight_scale_2").shape == ()
    hf_quant = json.loads((folder / "hf_quant_config.json").read_text())
    assert hf_quant["producer"]["name"] == "modelopt"
    # one NVFP4 weight with an input scale (W4A4) and one without (W4A16): two algos -> MIXED_PRECISION
    section = hf_quant["quantization"]
    assert section["quant_algo"] == "MIXED_PRECISION"
    assert section["quantized_layers"][module] == {"quant_algo": "NVFP4", "group_size": 16}
    assert section["quantized_layers"][up[: -len(".weight")]]["quant_algo"] == "W4A16_NVFP4"
    assert PREFIX + "layers.0.mlp.experts.0.gate_proj" in section["exclude_modules"], "BF16 Linears are excluded"
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "modelopt" and qc["quant_algo"] == "MIXED_PRECISION"
    assert open_checkpoint(folder).read(gate).input_scale.item() == pytest.approx(0.01)


def test_single_algo_modelopt_checkpoint_declares_quant_algo_and_exclude_modules(tmp_path):
    tensors = muse_tensors()
    names = [n for n in tensors if ".layers.1.mlp.experts." in n and n.endswith("_proj.weight")]
    qts = {}
    for n in names:
        qts[n] = quantize(tensors[n], "nvfp4")
        qts[n].input_scale = torch.tensor(0.02)
    folder, _ = _write(tmp_path, "nvfp4", qts)
    section = json.loads((folder / "hf_quant_config.json").read_text())["quantization"]
    assert section["quant_algo"] == "NVFP4" and section["group_size"] == 16
    assert "lm_head" in section["exclude_modules"] and "quantized_layers" not in section
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert qc["config_groups"]["group_0"]["weights"] == {"dynamic": False, "num_bits": 4, "type": "float",
                                                          "group_size": 16}
    assert qc["config_groups"]["group_0"]["input_activations"]["group_size"] == 16
    assert qc["ignore"] == section["exclude_modules"]


def test_modelopt_mixed_nvfp4_and_fp8_reads_back_as_mixed(tmp_path):
    tensors = muse_tensors()
    q = PREFIX + "layers.1.self_attn.q_proj.weight"
    qts = {EXPERT + "down_proj.weight": quantize(tensors[EXPERT + "down_proj.weight"], "nvfp4"),
           q: quantize(tensors[q], "fp8")}
    folder, _ = _write(tmp_path, "nvfp4", qts)
    ckpt = open_checkpoint(folder)
    assert ckpt.format == "mixed" and ckpt.producer == "modelopt"
    assert ckpt.weight_format(q) == "fp8"
    assert_same_qtensor(ckpt.read(q), qts[q], q)
    layers = json.loads((folder / "hf_quant_config.json").read_text())["quantization"]["quantized_layers"]
    assert layers[q[: -len(".weight")]] == {"quant_algo": "FP8"}


def test_quark_mxfp4_config_matches_quark_export(tmp_path):
    tensors = muse_tensors()
    n = EXPERT + "up_proj.weight"
    folder, _ = _write(tmp_path, "mxfp4", {n: quantize(tensors[n], "mxfp4")})
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "quark"
    weight = qc["global_quant_config"]["weight"]
    assert (weight["dtype"], weight["qscheme"], weight["group_size"], weight["scale_format"],
            weight["scale_calculation_mode"], weight["round_method"]) == ("fp4", "per_group", 32, "e8m0",
                                                                          "even", "half_even")
    assert qc["global_quant_config"]["input_tensors"]["is_dynamic"] is True
    assert "lm_head" in qc["exclude"] and n[: -len(".weight")] not in qc["exclude"]
    _, keys = _keys(folder)
    assert {n, n[: -len(".weight")] + ".weight_scale"} <= keys
    assert not (folder / "hf_quant_config.json").exists()


def test_autoround_int4_config_and_gptq_v1_tensors(tmp_path):
    tensors = muse_tensors()
    n = EXPERT + "down_proj.weight"
    folder, _ = _write(tmp_path, "int4", {n: quantize(tensors[n], "int4", group_size=128, sym=True)})
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert {k: qc[k] for k in ("quant_method", "packing_format", "bits", "group_size", "sym", "data_type")} == {
        "quant_method": "auto-round", "packing_format": "auto_round:auto_gptq", "bits": 4, "group_size": 128,
        "sym": True, "data_type": "int"}
    assert qc["extra_config"]["lm_head"] == {"bits": 16, "data_type": "float"}
    index, keys = _keys(folder)
    module = n[: -len(".weight")]
    assert {module + s for s in (".qweight", ".qzeros", ".scales", ".g_idx")} <= keys and n not in keys
    with safe_open(str(folder / index["weight_map"][module + ".qzeros"]), "pt") as f:
        assert (f.get_tensor(module + ".qzeros") == 0x77777777).all(), "symmetric GPTQ v1 stores z-1 = 7"
        assert f.get_tensor(module + ".qweight").shape == (tensors[n].shape[1] // 8, tensors[n].shape[0])


def test_bf16_writer_drops_quantization_config_and_refuses_qtensors(tmp_path, bf16_checkpoint):
    tensors = muse_tensors()
    cfg = {**muse_config(), "quantization_config": {"quant_method": "modelopt"}}
    w = CheckpointWriter(tmp_path / "plain", config=cfg, format="bf16")
    with pytest.raises(ValueError, match="bf16 target"):
        w.add(EXPERT + "up_proj.weight", quantize(tensors[EXPERT + "up_proj.weight"], "nvfp4"))
    for n, t in tensors.items():
        w.add(n, t)
    w.close()
    assert "quantization_config" not in json.loads((tmp_path / "plain" / "config.json").read_text())
    ckpt = open_checkpoint(tmp_path / "plain")
    assert (ckpt.format, ckpt.producer) == ("bf16", "none")


def test_index_records_sha256_of_every_shard(tmp_path):
    folder, _ = _write(tmp_path, "bf16", {}, max_shard_bytes=300_000)
    index, _ = _keys(folder)
    shards = sorted({*index["weight_map"].values()})
    assert len(shards) > 2 and shards[0].endswith(f"-of-{len(shards):05d}.safetensors")
    assert index["metadata"]["sha256"] == {s: sha256_file(folder / s) for s in shards}
    assert not any(p.name.startswith((".partial", "journal")) for p in folder.iterdir())


def test_stacked_and_misnamed_qtensors_are_refused_with_what_to_do(tmp_path):
    w = CheckpointWriter(tmp_path / "x", config=muse_config(), format="nvfp4")
    stacked = quantize(torch.randn(2, 128, 128), "nvfp4")
    with pytest.raises(ValueError, match="add each expert separately"):
        w.add("experts.gate_proj.weight", stacked)
    with pytest.raises(ValueError, match="must be named '<module>.weight'"):
        w.add("experts.0.gate_proj", quantize(torch.randn(128, 128), "nvfp4"))
    with pytest.raises(ValueError, match="mxfp4"):
        w.add("a.weight", quantize(torch.randn(128, 128), "mxfp4"))
    with pytest.raises(ValueError, match="already exists"):
        (tmp_path / "y").mkdir()
        CheckpointWriter(tmp_path / "y", config={}, format="bf16")


def test_dequantized_values_survive_the_round_trip(tmp_path):
    tensors = muse_tensors()
    n = EXPERT + "gate_proj.weight"
    qt = quantize(tensors[n], "nvfp4")
    folder, _ = _write(tmp_path, "nvfp4", {n: qt})
    assert torch.equal(dequantize(open_checkpoint(folder).read(n)), dequantize(qt))
