"""An asymmetric INT4 checkpoint whose experts disagree on having zero points stacks and dequantizes exactly.

The reader decides symmetric-or-not per tensor from its zeros, so in a real ``sym=False`` checkpoint an
expert whose zero points all happen to be 8 arrives without them (zero None) beside experts that have
them; stacking the layer's experts crashed with ``TypeError: expected Tensor as element 1 ... got
NoneType``. ``stack_qtensors`` (and ``concat_qtensors``) now materialise the implied zero point 8."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from musecore_quant import concat_qtensors, dequantize, muse_rule, stack_qtensors
from musecore_quant.checkpoint import open_checkpoint
from musecore_quant.convert import convert
from musecore_quant.formats.int4 import int4_quantize
from test_checkpoint_helpers import EXPERTS, LAYERS, PREFIX, muse_config, muse_tensors, write_hf_checkpoint


def test_stacking_int4_with_and_without_zero_points_keeps_every_value():
    a = int4_quantize(torch.randn(64, 256), sym=False)
    b = int4_quantize(torch.randn(64, 256), sym=True)
    assert a.zero is not None and b.zero is None
    for parts in ([a, b], [b, a]):
        stacked = stack_qtensors(parts)
        assert stacked.zero is not None and stacked.zero.shape == stacked.scale.shape, stacked
        for i, part in enumerate(parts):
            assert torch.equal(dequantize(stacked)[i], dequantize(part)), f"expert {i} changed when stacked (exact)"
        joined = concat_qtensors(parts)
        assert torch.equal(dequantize(joined), torch.cat([dequantize(p) for p in parts])), "concat changed values"


def test_stacking_refuses_parts_that_disagree_on_other_companions():
    a, b = int4_quantize(torch.randn(16, 128)), int4_quantize(torch.randn(16, 128))
    b.input_scale = torch.tensor(1.0)
    with pytest.raises(ValueError, match="input_scale"):
        stack_qtensors([a, b])


def test_a_sym_false_checkpoint_with_an_expert_whose_zeros_are_all_8_reads_and_stacks(tmp_path):
    src = write_hf_checkpoint(tmp_path / "src", muse_tensors(), muse_config(), shards=1)
    convert(src, tmp_path / "int4", to="int4", include=muse_rule(LAYERS), quantize_options={"sym": False},
            progress=False)
    assert json.loads((tmp_path / "int4" / "config.json").read_text())["quantization_config"]["sym"] is False
    shard = next((tmp_path / "int4").glob("model-*.safetensors"))
    tensors = load_file(shard)
    module = PREFIX + "layers.1.mlp.experts.0.gate_proj"
    tensors[module + ".qzeros"] = torch.full_like(tensors[module + ".qzeros"], 0x77777777)  # GPTQ v1: z - 1 = 7
    save_file(tensors, str(shard), metadata={"format": "pt"})
    with open_checkpoint(tmp_path / "int4") as reader:
        experts = [reader.read(PREFIX + f"layers.1.mlp.experts.{e}.gate_proj.weight") for e in range(EXPERTS)]
    assert experts[0].zero is None and all(e.zero is not None for e in experts[1:]), [e.zero is None for e in experts]
    stacked = stack_qtensors(experts)
    for e, expert in enumerate(experts):
        assert torch.equal(dequantize(stacked)[e], dequantize(expert)), f"expert {e} differs once stacked (exact)"
