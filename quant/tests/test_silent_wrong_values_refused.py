"""Quantized checkpoints that would decode to wrong weights without any error are refused, naming the tensor
(issue 29, item 5): scales outside their domain, a group size the config and the tensors disagree on,
an emptied ModelOpt ignore list."""

import json

import pytest
import torch

from musecore_quant import quantize
from musecore_quant.checkpoint import CheckpointError, open_checkpoint, verify_checkpoint
from musecore_quant.checkpoint.errors import InvalidScaleError
from musecore_quant.convert import convert
from musecore_quant.formats.int4 import int4_to_gptq
from test_checkpoint_helpers import muse_config, write_hf_checkpoint

MOD = "model.layers.1.mlp.experts.0.up_proj"
PLAIN = {"model.norm.weight": torch.ones(256, dtype=torch.bfloat16)}
MODELOPT_NVFP4 = {"quant_method": "modelopt", "quant_algo": "NVFP4"}
MODELOPT_FP8 = {"quant_method": "modelopt", "quant_algo": "FP8"}
QUARK = {"quant_method": "quark", "global_quant_config": {"weight": {"dtype": "fp4", "group_size": 32}}}


def _w(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 0.02


def _write(tmp_path, tensors, qc, hf_quant=None, extra=None):
    config = {**muse_config(), "quantization_config": qc}
    return write_hf_checkpoint(tmp_path / "ckpt", {**PLAIN, **(extra or {}), **tensors}, config, shards=1,
                               hf_quant_config=hf_quant)


def _nvfp4(**changes):
    qt = quantize(_w(256, 128), "nvfp4")
    t = {f"{MOD}.weight": qt.data, f"{MOD}.weight_scale": qt.scale.clone(),
         f"{MOD}.weight_scale_2": qt.global_scale.clone(), f"{MOD}.input_scale": torch.tensor(0.01)}
    for role, edit in changes.items():
        t[f"{MOD}.{role}"] = edit(t[f"{MOD}.{role}"])
    return t


def _refused(folder, tensor, *fragments, error=InvalidScaleError):
    ckpt = open_checkpoint(folder)
    with pytest.raises(error) as info:
        ckpt.read(f"{MOD}.weight", check_finite=False)  # refused even with the NaN scan off
    message = str(info.value)
    assert tensor in message, message
    for fragment in fragments:
        assert fragment in message, message
    assert not verify_checkpoint(folder).ok
    return message


@pytest.mark.parametrize("value", [0.0, -1.8e-4])
def test_nvfp4_weight_scale_2_zero_or_negative(tmp_path, value):
    folder = _write(tmp_path, _nvfp4(weight_scale_2=lambda g: torch.full_like(g, value)), MODELOPT_NVFP4)
    _refused(folder, f"{MOD}.weight_scale_2", "expected > 0")


def test_nvfp4_input_scale_zero(tmp_path):
    folder = _write(tmp_path, _nvfp4(input_scale=lambda s: torch.zeros_like(s)), MODELOPT_NVFP4)
    _refused(folder, f"{MOD}.input_scale", "expected > 0")


def test_negative_e4m3_block_scale(tmp_path):
    def negate_one(s):
        s = s.float()
        s[3, 2] = -s[3, 2].abs() - 1
        return s.to(torch.float8_e4m3fn)
    folder = _write(tmp_path, _nvfp4(weight_scale=negate_one), MODELOPT_NVFP4)
    _refused(folder, f"{MOD}.weight_scale", "[3, 2]", "negative")


def test_zero_e4m3_block_scale_over_nonzero_codes(tmp_path):
    def zero_one(s):
        s = s.clone()
        s.view(torch.uint8)[5, 1] = 0
        return s
    folder = _write(tmp_path, _nvfp4(weight_scale=zero_one), MODELOPT_NVFP4)
    _refused(folder, f"{MOD}.weight_scale", "[5, 1]", "is 0 over nonzero codes")


def test_compressed_tensors_inverse_global_scale_negative(tmp_path):
    qt = quantize(_w(256, 128), "nvfp4")
    folder = _write(tmp_path, {f"{MOD}.weight_packed": qt.data, f"{MOD}.weight_scale": qt.scale,
                               f"{MOD}.weight_global_scale": torch.tensor([-5.0])},
                    {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"})
    _refused(folder, f"{MOD}.weight_global_scale", "expected > 0")


def _mxfp4(byte, codes=None):
    qt = quantize(_w(256, 128), "mxfp4")
    scale, data = qt.scale.clone(), qt.data.clone()
    scale[7, 2] = byte
    if codes is not None:
        data[7, 32:48] = codes  # the 16 bytes of block (7, 2)
    return {f"{MOD}.weight": data, f"{MOD}.weight_scale": scale}


def test_mxfp4_e8m0_0xff_is_nan(tmp_path):
    folder = _write(tmp_path, _mxfp4(0xFF), QUARK)
    _refused(folder, f"{MOD}.weight_scale", "0xFF", "NaN")
    with pytest.raises(CheckpointError, match="NaN"):  # and with the NaN scan on, as before
        open_checkpoint(folder).read(f"{MOD}.weight")


def test_mxfp4_e8m0_0xfe_over_codes_that_overflow_fp32(tmp_path):
    folder = _write(tmp_path, _mxfp4(0xFE, codes=0x77), QUARK)  # 6 * 2^127 is beyond fp32
    _refused(folder, f"{MOD}.weight_scale", "0xFE", "[7, 2]")


def test_mxfp4_e8m0_0xfe_is_a_valid_exponent_when_nothing_overflows(tmp_path):
    """FORMATS.md: 0xFE is 2^127; over codes below 2 (0.5, 1, 1.5) every value is finite."""
    folder = _write(tmp_path, _mxfp4(0xFE, codes=0x32), QUARK)  # codes 2 (1.0) and 3 (1.5)
    w = open_checkpoint(folder).read(f"{MOD}.weight")
    from musecore_quant import dequantize
    assert torch.isfinite(dequantize(w)).all()


@pytest.mark.parametrize("value", [0.0, -0.5])
def test_fp8_per_tensor_weight_scale_zero_or_negative(tmp_path, value):
    qt = quantize(_w(256, 128), "fp8")
    folder = _write(tmp_path, {f"{MOD}.weight": qt.data, f"{MOD}.weight_scale": torch.tensor(value)}, MODELOPT_FP8)
    _refused(folder, f"{MOD}.weight_scale", "expected > 0")


def test_fp8_block_scale_zero_over_nonzero_codes(tmp_path):
    qt = quantize(_w(256, 256), "fp8", block_size=128)
    scale = qt.scale.clone()
    scale[1, 0] = 0
    folder = _write(tmp_path, {f"{MOD}.weight": qt.data, f"{MOD}.weight_scale_inv": scale}, {"quant_method": "fp8"})
    _refused(folder, f"{MOD}.weight_scale_inv", "is 0 while its codes are nonzero")


def test_convert_from_a_bad_scale_fails_naming_the_tensor(tmp_path):
    folder = _write(tmp_path, _nvfp4(weight_scale_2=lambda g: torch.zeros_like(g)), MODELOPT_NVFP4)
    with pytest.raises(InvalidScaleError, match="weight_scale_2"):
        convert(folder, tmp_path / "mx", to="mxfp4", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def _autoround(group, qc_extra):
    qt = quantize(_w(256, 256), "int4", group_size=group)
    packed = int4_to_gptq(qt)
    tensors = {f"{MOD}.{k}": packed[k] for k in ("qweight", "qzeros", "scales", "g_idx")}
    qc = {"quant_method": "auto-round", "packing_format": "auto_round:auto_gptq", "bits": 4, "sym": True,
          "data_type": "int", **qc_extra}
    return tensors, qc


def test_autoround_group_size_contradicting_the_tensors(tmp_path):
    tensors, qc = _autoround(64, {"group_size": 128})
    with pytest.raises(CheckpointError, match=r"group size 64 .* declares group_size 128"):
        open_checkpoint(_write(tmp_path, tensors, qc))


def test_autoround_extra_config_group_size_is_honoured(tmp_path):
    tensors, qc = _autoround(64, {"group_size": 128, "extra_config": {MOD: {"bits": 4, "group_size": 64}}})
    assert open_checkpoint(_write(tmp_path, tensors, qc)).entry(f"{MOD}.weight").group_size == 64


def test_gptq_per_channel_group_size_minus_one(tmp_path):
    tensors, qc = _autoround(-1, {})
    qc = {"quant_method": "gptq", "bits": 4, "group_size": -1}
    assert open_checkpoint(_write(tmp_path, tensors, qc)).entry(f"{MOD}.weight").group_size == 256
    qc["group_size"] = 128
    with pytest.raises(CheckpointError, match="declares group_size 128"):
        open_checkpoint(_write(tmp_path / "b", tensors, qc))


def test_modelopt_nvfp4_group_size_other_than_16(tmp_path):
    hf = {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "NVFP4", "group_size": 32}}
    with pytest.raises(CheckpointError, match="group_size is 32 but NVFP4 has one scale per 16"):
        open_checkpoint(_write(tmp_path, _nvfp4(), {"quant_method": "modelopt"}, hf_quant=hf))


def test_compressed_tensors_nvfp4_group_size_other_than_16(tmp_path):
    qt = quantize(_w(256, 128), "nvfp4")
    qc = {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
          "config_groups": {"g": {"weights": {"num_bits": 4, "type": "float", "group_size": 32}}}}
    with pytest.raises(CheckpointError, match="group_size is 32"):
        open_checkpoint(_write(tmp_path, {f"{MOD}.weight_packed": qt.data, f"{MOD}.weight_scale": qt.scale,
                                          f"{MOD}.weight_global_scale": torch.tensor([2.0])}, qc))


LINEAR = "model.layers.1.self_attn.q_proj"


def test_emptied_modelopt_ignore_list_is_refused(tmp_path):
    bf16_linear = {f"{LINEAR}.weight": torch.full((256, 256), 0.01, dtype=torch.bfloat16)}
    hf = {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "NVFP4", "exclude_modules": [LINEAR]}}
    qc = {**MODELOPT_NVFP4, "ignore": [LINEAR]}
    assert open_checkpoint(_write(tmp_path, _nvfp4(), qc, hf_quant=hf, extra=bf16_linear)).format == "nvfp4"
    emptied = {**qc, "ignore": []}
    with pytest.raises(CheckpointError, match="quantization_config.ignore is empty but hf_quant_config.json excludes"):
        open_checkpoint(_write(tmp_path / "b", _nvfp4(), emptied, hf_quant=hf, extra=bf16_linear))
    both_emptied = {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "NVFP4", "exclude_modules": []}}
    with pytest.raises(CheckpointError, match=rf"{LINEAR}.weight.* exclude list does not name"):
        open_checkpoint(_write(tmp_path / "c", _nvfp4(), emptied, hf_quant=both_emptied, extra=bf16_linear))


def test_written_checkpoints_pass_these_checks(tmp_path):
    """What the writer emits (exclude lists, group sizes, scales) is accepted: no false alarms."""
    tensors = {f"model.layers.{i}.mlp.experts.0.{p}_proj.weight": _w(256, 256, seed=i).to(torch.bfloat16)
               for i in range(2) for p in ("gate", "up", "down")}
    tensors[f"{LINEAR}.weight"] = _w(256, 256).to(torch.bfloat16)
    src = write_hf_checkpoint(tmp_path / "src", {**PLAIN, **tensors}, muse_config(), shards=1)
    for to in ("nvfp4", "mxfp4", "int4", "fp8"):
        convert(src, tmp_path / to, to=to, include=[r"experts"], progress=False)
        assert verify_checkpoint(tmp_path / to).ok, to
        json.loads((tmp_path / to / "config.json").read_text())
