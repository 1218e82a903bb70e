"""Producers' layouts for a transformers-5 MoE with fused experts, hand-built (never through the writer), and
the one-line errors for bad fused tensors.

ModelOpt 0.47 (``moe_utils._export_fused_experts``), Quark 0.13 (``QuarkExperts._build_expert_module``) and
AutoRound 0.16.1 (``_unfuse_experts_weights_inplace``) all unfuse ``experts.gate_up_proj [E, 2I, h]`` into
per-expert ``experts.{e}.{gate,up}_proj`` Linears with the usual companion tensors (see
``musecore_quant/checkpoint/experts.py``); the reader maps them to per-expert logical weights with 2-D shapes,
while BF16 fused tensors keep their fused 3-D logical names.
"""

import pytest
import torch

from musecore_quant import dequantize, quantize, slice_rows
from musecore_quant.checkpoint import CheckpointError, CheckpointWriter, open_checkpoint, verify_checkpoint
from musecore_quant.checkpoint.experts import unfuse
from musecore_quant.cli import main
from musecore_quant.formats.int4 import int4_to_gptq
from musecore_quant.qtensor import QTensor
from test_checkpoint_helpers import muse_config, write_hf_checkpoint

E, I, H = 2, 128, 128
X = "model.language_model.layers.{}.mlp.experts"
NORM = {"model.language_model.norm.weight": torch.ones(H, dtype=torch.bfloat16)}


def _fused(seed=0):
    g = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(E, 2 * I, H, generator=g) * 0.02).bfloat16()
    return gate_up, (torch.randn(E, H, I, generator=g) * 0.02).bfloat16()


def _per_expert(layer, gate_up, down):
    """{module: bf16 [out, in]} as the producers slice it: gate rows :I, up rows I:."""
    out = {}
    for e in range(E):
        out[f"{X.format(layer)}.{e}.gate_proj"] = gate_up[e, :I]
        out[f"{X.format(layer)}.{e}.up_proj"] = gate_up[e, I:]
        out[f"{X.format(layer)}.{e}.down_proj"] = down[e]
    return out


def _check_per_expert(ckpt, layer, fmt, gate_up, down, floor):
    for e in range(E):
        for proj, ref in (("gate_proj", gate_up[e, :I]), ("up_proj", gate_up[e, I:]), ("down_proj", down[e])):
            name = f"{X.format(layer)}.{e}.{proj}.weight"
            assert ckpt.weight_format(name) == fmt and ckpt.weight_shape(name) == tuple(ref.shape), name
            err = (dequantize(ckpt.read(name)) - ref.float()).norm() / ref.float().norm()
            assert err < floor, f"{name}: relative error {err:.4f}"
    # the BF16 layer keeps its fused 3-D logical names
    assert ckpt.weight_shape(f"{X.format(0)}.gate_up_proj") == (E, 2 * I, H)
    assert ckpt.weight_shape(f"{X.format(0)}.down_proj") == (E, H, I)


def test_modelopt_per_expert_nvfp4_with_shared_gate_up_weight_scale_2(tmp_path):
    gate_up, down = _fused()
    tensors = {**NORM, f"{X.format(0)}.gate_up_proj": gate_up, f"{X.format(0)}.down_proj": down}
    quantized = []
    for e in range(E):  # ModelOpt: one weight quantizer per expert over the fused gate_up slice
        fused_q = quantize(gate_up[e].float(), "nvfp4")
        for proj, (a, b) in (("gate_proj", (0, I)), ("up_proj", (I, 2 * I))):
            q = slice_rows(fused_q, a, b)
            m = f"{X.format(1)}.{e}.{proj}"
            tensors.update({f"{m}.weight": q.data, f"{m}.weight_scale": q.scale,
                            f"{m}.weight_scale_2": q.global_scale.reshape(()).clone(),
                            f"{m}.input_scale": torch.tensor(0.01)})
            quantized.append(m)
        q = quantize(down[e].float(), "nvfp4")
        m = f"{X.format(1)}.{e}.down_proj"
        tensors.update({f"{m}.weight": q.data, f"{m}.weight_scale": q.scale,
                        f"{m}.weight_scale_2": q.global_scale.reshape(()), f"{m}.input_scale": torch.tensor(0.01)})
        quantized.append(m)
    hf_quant = {"producer": {"name": "modelopt", "version": "0.47.0"},
                "quantization": {"quant_algo": "NVFP4", "group_size": 16, "kv_cache_quant_algo": None,
                                 "exclude_modules": [X.format(0), "lm_head"]}}
    folder = write_hf_checkpoint(tmp_path / "mo", tensors, {**muse_config(), "quantization_config": {
        "quant_method": "modelopt", "quant_algo": "NVFP4"}}, hf_quant_config=hf_quant)
    ckpt = open_checkpoint(folder)
    assert (ckpt.producer, ckpt.format) == ("modelopt", "nvfp4")
    _check_per_expert(ckpt, 1, "nvfp4", gate_up, down, 0.15)
    for e in range(E):
        gate, up = (ckpt.read(f"{X.format(1)}.{e}.{p}.weight") for p in ("gate_proj", "up_proj"))
        assert gate.global_scale.item() == up.global_scale.item() and gate.input_scale.item() == pytest.approx(0.01)
    assert verify_checkpoint(folder).ok


def test_quark_per_expert_mxfp4(tmp_path):
    from musecore_quant.checkpoint.quark import quantization_config
    gate_up, down = _fused(1)
    tensors = {**NORM, f"{X.format(0)}.gate_up_proj": gate_up, f"{X.format(0)}.down_proj": down}
    for m, w in _per_expert(1, gate_up, down).items():
        q = quantize(w.float(), "mxfp4")
        tensors.update({f"{m}.weight": q.data, f"{m}.weight_scale": q.scale})
    folder = write_hf_checkpoint(tmp_path / "qk", tensors, {**muse_config(), "quantization_config":
                                                           quantization_config([X.format(0), "lm_head"])})
    ckpt = open_checkpoint(folder)
    assert (ckpt.producer, ckpt.format) == ("quark", "mxfp4")
    _check_per_expert(ckpt, 1, "mxfp4", gate_up, down, 0.15)


def test_autoround_per_expert_gptq(tmp_path):
    gate_up, down = _fused(2)
    tensors = {**NORM, f"{X.format(0)}.gate_up_proj": gate_up, f"{X.format(0)}.down_proj": down}
    for m, w in _per_expert(1, gate_up, down).items():
        tensors.update({f"{m}.{k}": v for k, v in int4_to_gptq(quantize(w.float(), "int4")).items()})
    folder = write_hf_checkpoint(tmp_path / "ar", tensors, {**muse_config(), "quantization_config": {
        "quant_method": "auto-round", "packing_format": "auto_round:auto_gptq", "bits": 4, "group_size": 128,
        "sym": True, "data_type": "int", "extra_config": {X.format(0): {"bits": 16, "data_type": "float"}}}})
    ckpt = open_checkpoint(folder)
    assert (ckpt.producer, ckpt.format) == ("auto-round", "int4")
    _check_per_expert(ckpt, 1, "int4", gate_up, down, 0.15)


@pytest.mark.parametrize("to,keys", [
    ("nvfp4", ("weight", "weight_scale", "weight_scale_2")),
    ("mxfp4", ("weight", "weight_scale")),
    ("int4", ("qweight", "qzeros", "scales", "g_idx")),
    ("fp8", ("weight", "weight_scale")),
])
def test_writer_writes_each_producers_per_expert_keys_for_a_fused_qtensor(tmp_path, to, keys):
    gate_up, _ = _fused(3)
    qt = quantize(gate_up.float(), to)
    with CheckpointWriter(tmp_path / to, config=muse_config(), format=to) as w:
        w.add(f"{X.format(1)}.gate_up_proj", qt)
        w.add("model.language_model.norm.weight", NORM["model.language_model.norm.weight"])
    ckpt = open_checkpoint(tmp_path / to)
    expected = {f"{X.format(1)}.{e}.{p}.weight" for e in range(E) for p in ("gate_proj", "up_proj")}
    assert set(ckpt.weight_names()) - {"model.language_model.norm.weight"} == expected
    for name, part in unfuse(f"{X.format(1)}.gate_up_proj", qt):
        assert sorted(ckpt.read_parts(name)) == sorted(keys)
        assert torch.equal(dequantize(ckpt.read(name)), dequantize(part)), name


# ------------------------------------------------------------------------------ bad fused tensors
@pytest.mark.parametrize("tensor,shape,match", [
    ("gate_up_proj", (2 * I, H), r"rank 2\); gate_up_proj must be 3-D \[E, 2I, h\]"),
    ("gate_up_proj", (E, 2 * I + 1, H), r"257 rows are odd"),
    ("down_proj", (E, H), r"rank 2\); down_proj must be 3-D \[E, h, I\]"),
    ("down_proj", (E, H, I + 32), r"down_proj must be \[E, h, I\] = \[2, 128, 128\]"),
])
def test_bad_fused_tensor_is_a_one_line_error_naming_tensor_and_file(tmp_path, capsys, tensor, shape, match):
    gate_up, down = _fused()
    tensors = {**NORM, f"{X.format(1)}.gate_up_proj": gate_up, f"{X.format(1)}.down_proj": down}
    tensors[f"{X.format(1)}.{tensor}"] = torch.zeros(shape, dtype=torch.bfloat16)
    folder = write_hf_checkpoint(tmp_path / "bad", tensors, muse_config(), shards=1)
    with pytest.raises(CheckpointError, match=match) as err:
        open_checkpoint(folder)
    assert "model.safetensors" in str(err.value) and f"{X.format(1)}." in str(err.value)
    assert main(["inspect", str(folder)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "model.safetensors" in lines[0] and f"{X.format(1)}." in lines[0], lines


def test_stacked_qtensor_with_mismatched_scales_is_refused_by_name(tmp_path):
    gate_up, _ = _fused()
    qt = quantize(gate_up.float(), "nvfp4")
    bad_scale = QTensor("nvfp4", qt.data, qt.scale[:1], qt.shape, 16, global_scale=qt.global_scale)
    bad_global = QTensor("nvfp4", qt.data, qt.scale, qt.shape, 16, global_scale=torch.ones(E + 1))
    for bad, what in ((bad_scale, "scale of shape"), (bad_global, "global_scale of shape")):
        with CheckpointWriter(tmp_path / what.split()[0], config=muse_config(), format="nvfp4") as w:
            with pytest.raises(CheckpointError, match=rf"{X.format(1)}\.gate_up_proj.*{what}"):
                w.add(f"{X.format(1)}.gate_up_proj", bad)
            w.add("model.language_model.norm.weight", NORM["model.language_model.norm.weight"])
