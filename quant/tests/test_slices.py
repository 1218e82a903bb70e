"""Reading and cutting parts of weights for one rank of a distributed run: leading-dimension reads of
stacked tensors (only those rows leave the file) and the QTensor slices a rank keeps (codes and
scales cut, never requantized: the slice dequantizes to the whole tensor's values)."""

import pytest
import torch
from safetensors.torch import save_file

from musecore_quant import dequantize, quantize, slice_cols, slice_experts
from musecore_quant.checkpoint import open_checkpoint


def test_leading_rows_of_a_stacked_tensor_are_read_alone(tmp_path):
    w = torch.randn(6, 8, 4, dtype=torch.bfloat16)
    save_file({"model.layers.0.mlp.experts.down_proj": w, "other.weight": torch.ones(3, 3)},
              str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text("{}")
    reader = open_checkpoint(tmp_path)
    name = "model.layers.0.mlp.experts.down_proj"
    assert reader.can_slice(name)
    got = {n: v for _, part in reader.iter_shards([name, "other.weight"], leading={name: [(2, 5)]})
           for n, v in part.items()}
    assert torch.equal(got[name], w[2:5]), "the rows read differ from the file's"
    assert got["other.weight"].shape == (3, 3)
    heads = {n: v for _, part in reader.iter_shards([name], leading={name: [(0, 1), (4, 6)]}) for n, v in part.items()}
    assert torch.equal(heads[name], torch.cat([w[0:1], w[4:6]])), "several ranges are read and joined in order"


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "int4", "fp8"])
def test_qtensor_column_and_expert_slices_dequantize_to_the_whole_tensors_values(fmt):
    w = torch.randn(4, 16, 256)
    qt = quantize(w, fmt) if fmt != "int4" else quantize(w, fmt, group_size=128)
    whole = dequantize(qt, torch.float32)
    part = slice_experts(qt, 1, 3)
    assert torch.equal(dequantize(part, torch.float32), whole[1:3])
    cols = slice_cols(part, 128, 256)
    err = (dequantize(cols, torch.float32) - whole[1:3, :, 128:]).abs().max().item()
    assert err == 0.0, f"{fmt}: a column slice dequantizes {err} away from the whole tensor's columns"


def test_column_slice_inside_a_scale_block_is_refused():
    qt = quantize(torch.randn(8, 64), "mxfp4")
    with pytest.raises(ValueError, match="scale-block edges"):
        slice_cols(qt, 16, 64)
