"""Fused 3-D experts (transformers 5 ``experts.gate_up_proj`` / ``experts.down_proj``) through the converter,
the producers' per-expert layouts, the CLI, and back to a checkpoint transformers loads.

The source is a random tiny ``MuseSparkForConditionalGeneration`` saved by transformers itself (the ground
truth of the layout, MODEL.md section 3), with the router, its bias and the residual gates in fp32.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file

from musecore_quant import dequantize, muse_rule, quant_error, quantize
from musecore_quant.checkpoint import CheckpointError, open_checkpoint, verify_checkpoint
from musecore_quant.checkpoint.experts import PER_EXPERT, fuse, fuse_groups, unfuse
from musecore_quant.cli import inspect_checkpoint, main
from musecore_quant.convert import CLI_DEFAULT_INCLUDE, convert

LAYERS, E, I, H = 4, 4, 128, 128
P = "model.language_model.layers.{}.mlp.experts."
# SQNR floors for N(0, 0.02^2) weights (as in test_convert.py): measured NVFP4 20.4 dB, MXFP4 18.9,
# INT4 g128 19.6, FP8 31.5
SQNR_FLOOR = {"nvfp4": 19.5, "mxfp4": 18.0, "int4": 18.5, "fp8": 30.0}
QUANTIZED_LAYERS = (1, 2)  # the Muse rule for L = 4
FP32_KEYS = re.compile(r"residual_gate\.gate$|mlp\.gate\.weight$|e_score_correction_bias$")


@pytest.fixture(scope="module")
def muse_bf16(tmp_path_factory):
    """A random tiny Muse Spark checkpoint written by transformers' save_pretrained; (folder, tensors)."""
    transformers = pytest.importorskip("transformers", reason="the fused-experts ground truth is what "
                                       "transformers' save_pretrained writes for MuseSparkForConditionalGeneration")
    if not hasattr(transformers, "MuseSparkConfig"):
        pytest.skip("this transformers has no muse_spark model (needs transformers >= 5.24)")
    cfg = transformers.MuseSparkConfig(
        text_config=dict(vocab_size=512, hidden_size=H, intermediate_size=256, num_hidden_layers=LAYERS,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=64, num_local_experts=E,
                         num_experts_per_tok=2, moe_hidden_size=H, moe_intermediate_size=I, sliding_window=16),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2),
        audio_config=dict(hidden_sizes=[16, 16, 16, 16], depths=[1, 1, 1, 1], out_hidden_size=128),
        out_hidden_size=128, projector_hidden_size=128)
    torch.manual_seed(0)
    model = transformers.MuseSparkForConditionalGeneration(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not FP32_KEYS.search(name):
                p.data = p.data.to(torch.bfloat16)
    folder = tmp_path_factory.mktemp("muse") / "bf16"
    model.save_pretrained(folder)
    return folder, load_file(folder / "model.safetensors")


def _is_routed_expert(name: str) -> bool:
    return ".mlp.experts.gate_up_proj" in name or ".mlp.experts.down_proj" in name or bool(PER_EXPERT.match(name))


def _fused_from_checkpoint(ckpt, layer: int, proj: str) -> torch.Tensor:
    """The fp32 fused tensor a per-expert quantized checkpoint stands for."""
    names = fuse_groups([n for n in ckpt.weight_names() if n.startswith(P.format(layer))])[P.format(layer) + proj]
    return fuse(P.format(layer) + proj, [(n, dequantize(ckpt.read(n))) for n in names])


def test_saved_model_has_fused_experts_and_fp32_router(muse_bf16):
    folder, tensors = muse_bf16
    gate_up, down = tensors[P.format(1) + "gate_up_proj"], tensors[P.format(1) + "down_proj"]
    assert gate_up.shape == (E, 2 * I, H) and down.shape == (E, H, I) and gate_up.dtype == torch.bfloat16
    assert tensors["model.language_model.layers.1.mlp.gate.weight"].dtype == torch.float32
    assert not any(PER_EXPERT.match(n) for n in tensors)
    assert any(n.startswith("model.vision_tower.") for n in tensors) and any(n.startswith("model.audio_tower.")
                                                                             for n in tensors)


def test_muse_rule_selects_fused_and_per_expert_names_of_layers_1_to_L_minus_2():
    rule = [re.compile(p) for p in muse_rule(62)]
    hit = lambda n: any(p.search(n) for p in rule)  # noqa: E731
    for layer in (1, 30, 60):
        assert hit(P.format(layer) + "gate_up_proj") and hit(P.format(layer) + "down_proj")
        assert hit(P.format(layer) + "7.gate_proj.weight") and hit(P.format(layer) + "0.down_proj.weight")
    for layer in (0, 61, 62, 100):
        assert not hit(P.format(layer) + "gate_up_proj") and not hit(P.format(layer) + "3.up_proj.weight")
    for n in (P.format(5) + "post_expert_norm.weight", "model.language_model.layers.5.mlp.gate.weight",
              "model.language_model.layers.5.mlp.up_proj.weight", "model.language_model.layers.5.mlp.gate_up_proj",
              "model.language_model.layers.15.mlp.pre_expert_proj.weight", P.format(5) + "gate_up_proj_bias"):
        assert not hit(n), n
    assert muse_rule(2) == [] and len(muse_rule(3)) == 1
    assert re.search(CLI_DEFAULT_INCLUDE, P.format(0) + "gate_up_proj")
    assert re.search(CLI_DEFAULT_INCLUDE, P.format(0) + "3.down_proj.weight")
    with pytest.raises(CheckpointError, match="num_hidden_layers"):
        muse_rule(0)


@pytest.mark.parametrize("to", ["nvfp4", "mxfp4", "int4", "fp8"])
def test_fused_experts_convert_to_each_format_and_back_to_bf16(tmp_path, muse_bf16, to):
    src, tensors = muse_bf16
    report = convert(src, tmp_path / to, to=to, include=muse_rule(LAYERS), progress=False)
    assert verify_checkpoint(tmp_path / to).ok
    records = {t.name: t for t in report.tensors}
    ckpt = open_checkpoint(tmp_path / to)
    for layer in QUANTIZED_LAYERS:
        for proj in ("gate_up_proj", "down_proj"):
            name = P.format(layer) + proj
            r = records[name]
            assert (r.action, r.source_format, r.target_format) == ("quantize", "bf16", to)
            assert r.shape == list(tensors[name].shape)
            assert r.sqnr_db > SQNR_FLOOR[to], f"{name}: reported SQNR {r.sqnr_db:.2f} dB"
            # the producer's layout: per-expert 2-D weights, bytes equal to the fused quantization split
            fused_q = quantize(tensors[name], to)
            for e in range(E):
                for sub, rows in (((f"{e}.gate_proj", (0, I)), (f"{e}.up_proj", (I, 2 * I)))
                                  if proj == "gate_up_proj" else ((f"{e}.down_proj", (0, H)),)):
                    got = ckpt.read(P.format(layer) + sub + ".weight")
                    want = dict(unfuse(name, fused_q))[P.format(layer) + sub + ".weight"]
                    assert got.format == to and got.shape == (rows[1] - rows[0], tensors[name].shape[2])
                    assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8)), sub
                    assert torch.equal(got.scale.float(), want.scale.float().reshape(got.scale.shape)), sub
            measured = quant_error(tensors[name].float(), _fused_from_checkpoint(ckpt, layer, proj)).sqnr_db
            assert measured > SQNR_FLOOR[to], f"{name} ({to}): dequantized SQNR {measured:.2f} dB"
    # layers 0 and L-1 experts and every non-expert tensor: bit-exact copies
    for name, t in tensors.items():
        if _is_routed_expert(name) and int(name.split(".layers.")[1].split(".")[0]) in QUANTIZED_LAYERS:
            assert name not in ckpt.weight_names()
            continue
        got = ckpt.read(name)
        assert got.dtype == t.dtype and torch.equal(got.view(torch.uint8), t.view(torch.uint8)), name
        assert records[name].action == "copy"
    experts = inspect_checkpoint(ckpt, scale_stats=False)["experts"]
    assert experts[P.format(0)[:-1]]["layout"] == "fused"
    assert experts[P.format(1)[:-1]] == {"layout": "per-expert", "experts": E,
                                         "formats": {"gate_proj": [to], "up_proj": [to], "down_proj": [to]}}
    ckpt.close()

    back = convert(tmp_path / to, tmp_path / f"{to}-bf16", to="bf16", progress=False)
    out = load_file(tmp_path / f"{to}-bf16" / "model-00001-of-00001.safetensors")
    assert sorted(out) == sorted(tensors)  # re-fused: the transformers layout again
    ref = open_checkpoint(tmp_path / to)
    for name, t in tensors.items():
        if _is_routed_expert(name) and int(name.split(".layers.")[1].split(".")[0]) in QUANTIZED_LAYERS:
            layer = int(name.split(".layers.")[1].split(".")[0])
            assert out[name].dtype == torch.bfloat16
            assert torch.equal(out[name], _fused_from_checkpoint(ref, layer, name.rsplit(".", 1)[1]).bfloat16())
        else:
            assert out[name].dtype == t.dtype and torch.equal(out[name].view(torch.uint8), t.view(torch.uint8)), name
    actions = {t.name: t.action for t in back.tensors}
    assert actions[P.format(1) + "gate_up_proj"] == "dequantize" and actions[P.format(0) + "gate_up_proj"] == "copy"


def test_nvfp4_fused_experts_share_one_weight_scale_2_per_expert(tmp_path, muse_bf16):
    src, tensors = muse_bf16
    convert(src, tmp_path / "nv", to="nvfp4", include=muse_rule(LAYERS), progress=False)
    ckpt = open_checkpoint(tmp_path / "nv")
    fused = tensors[P.format(1) + "gate_up_proj"].float()
    for e in range(E):
        gate, up = (ckpt.read(P.format(1) + f"{e}.{p}_proj.weight") for p in ("gate", "up"))
        assert gate.global_scale.item() == up.global_scale.item()
        assert gate.global_scale.item() == pytest.approx(fused[e].abs().amax().item() / (6 * 448), rel=1e-6)
    hf_quant = json.loads((tmp_path / "nv" / "hf_quant_config.json").read_text())["quantization"]
    assert P.format(0)[:-1] in hf_quant["exclude_modules"] and P.format(3)[:-1] in hf_quant["exclude_modules"]
    assert not any(m.startswith(P.format(1)) for m in hf_quant["exclude_modules"])


def test_nvfp4_to_mxfp4_of_fused_experts_reports_per_tensor_error(tmp_path, muse_bf16):
    src, tensors = muse_bf16
    convert(src, tmp_path / "nv", to="nvfp4", include=muse_rule(LAYERS), progress=False)
    report = convert(tmp_path / "nv", tmp_path / "mx", to="mxfp4", include=muse_rule(LAYERS), progress=False)
    requant = [t for t in report.tensors if t.action == "requantize"]
    assert len(requant) == len(QUANTIZED_LAYERS) * E * 3
    for t in requant:
        assert (t.source_format, t.target_format) == ("nvfp4", "mxfp4") and t.rmse > 0
        assert t.sqnr_db > 18.0, f"{t.name}: NVFP4 -> MXFP4 SQNR {t.sqnr_db:.2f} dB"
    mx = open_checkpoint(tmp_path / "mx")
    assert mx.producer == "quark" and verify_checkpoint(tmp_path / "mx").ok
    for layer in QUANTIZED_LAYERS:
        name = P.format(layer) + "gate_up_proj"
        sqnr = quant_error(tensors[name].float(), _fused_from_checkpoint(mx, layer, "gate_up_proj")).sqnr_db
        # double rounding (FORMATS.md): measured 16.7 dB here, vs 18.9 dB for MXFP4 straight from BF16
        assert sqnr > 16.0, f"{name}: BF16 -> NVFP4 -> MXFP4 SQNR {sqnr:.2f} dB"


def test_bf16_converted_back_loads_in_transformers(tmp_path, muse_bf16):
    transformers = pytest.importorskip("transformers", reason="loading needs transformers' muse_spark")
    src, tensors = muse_bf16
    convert(src, tmp_path / "int4", to="int4", include=muse_rule(LAYERS), progress=False)
    convert(tmp_path / "int4", tmp_path / "back", to="bf16", progress=False)
    model, info = transformers.MuseSparkForConditionalGeneration.from_pretrained(
        tmp_path / "back", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    state = model.state_dict()
    assert torch.equal(state[P.format(0) + "gate_up_proj"].bfloat16(), tensors[P.format(0) + "gate_up_proj"])
    assert state[P.format(1) + "gate_up_proj"].shape == (E, 2 * I, H)


def test_cli_on_fused_experts(tmp_path, muse_bf16, capsys):
    src, _ = muse_bf16
    dst = tmp_path / "mx"
    assert main(["convert", str(src), str(dst), "--to", "mxfp4", "--muse-rule", "--no-progress", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["include"] == muse_rule(LAYERS) and report["summary"]["actions"]["quantize"] == 4
    assert main(["inspect", str(dst), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["experts"][P.format(2)[:-1]]["formats"]["gate_proj"] == ["mxfp4"]
    assert info["experts"][P.format(3)[:-1]] == {"layout": "fused", "experts": E,
                                                 "formats": {"gate_up_proj": ["bf16"], "down_proj": ["bf16"]}}
    assert main(["verify", str(dst)]) == 0
    capsys.readouterr()
    assert main(["convert", str(dst), str(tmp_path / "b"), "--to", "bf16", "--no-fuse-experts", "--no-progress"]) == 0
    assert P.format(1) + "0.gate_proj.weight" in open_checkpoint(tmp_path / "b").weight_names()
    assert main(["convert", str(dst), str(tmp_path / "f"), "--to", "bf16", "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["diff", str(src), str(tmp_path / "f"), "--json"]) == 0
    diff = json.loads(capsys.readouterr().out)
    assert diff["summary"]["compared"] == diff["summary"]["identical"] + 4
    assert diff["summary"]["min_sqnr_db"] > SQNR_FLOOR["mxfp4"]
    # --all-experts quantizes every layer's fused experts (the default for a Muse checkpoint is the Muse rule)
    assert main(["convert", str(src), str(tmp_path / "all"), "--to", "fp8", "--all-experts", "--no-progress"]) == 0
    assert open_checkpoint(tmp_path / "all").weight_format(P.format(0) + "2.up_proj.weight") == "fp8"
