"""Byte comparison with nvidia-modelopt's quantized-tensor classes on random weights.

Skipped unless modelopt is importable (``pip install --no-deps nvidia-modelopt`` plus its small
pure-Python needs: omegaconf with antlr4-python3-runtime 4.9, pulp, nvidia-ml-py, ninja). These
are the same code paths ModelOpt's HF export calls (``NVFP4QTensor.quantize`` with the scales
from ``get_weights_scaling_factor``), run on CPU.
"""

import pytest
import torch

nvfp4_tensor = pytest.importorskip("modelopt.torch.quantization.qtensor.nvfp4_tensor",
                                   reason="nvidia-modelopt is not installed (pip install --no-deps nvidia-modelopt)")
mxfp4_tensor = pytest.importorskip("modelopt.torch.quantization.qtensor.mxfp4_tensor")

from musecore_quant.formats.fp4 import fp4_decode, unpack_nibbles  # noqa: E402
from musecore_quant.formats.mxfp4 import mxfp4_quantize  # noqa: E402
from musecore_quant.formats.nvfp4 import nvfp4_dequantize, nvfp4_quantize, nvfp4_shared_global_amax  # noqa: E402

NVFP4QTensor = nvfp4_tensor.NVFP4QTensor


def _weights(dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    torch.manual_seed(seed)
    rows = torch.logspace(-3, 3, 64).view(64, 1)               # small rows get subnormal E4M3 block scales
    return (torch.randn(64, 512) * rows).to(dtype)


def _modelopt_nvfp4(w: torch.Tensor, weight_scale_2: torch.Tensor | None = None):
    packed, scale, scale_2 = NVFP4QTensor.quantize(w, 16, weights_scaling_factor_2=weight_scale_2)
    return packed._quantized_data, scale, scale_2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_nvfp4_bytes_match_modelopt(dtype):
    w = _weights(dtype)
    data, scale, scale_2 = _modelopt_nvfp4(w)
    ours = nvfp4_quantize(w)
    assert ours.global_scale.view(torch.int32).item() == scale_2.float().view(torch.int32).item()
    assert torch.equal(ours.scale.view(torch.uint8), scale.view(torch.uint8))
    differing = (ours.data != data).sum().item()
    assert differing == 0, f"{differing} of {data.numel()} weight bytes differ"


def test_nvfp4_shared_weight_scale_2_matches_modelopt_given_the_same_scale():
    gate, up = _weights(torch.bfloat16, 1), _weights(torch.bfloat16, 2) * 4
    shared = nvfp4_shared_global_amax(gate, up)
    for w in (gate, up):
        data, scale, _ = _modelopt_nvfp4(w, shared / (6.0 * 448.0))
        ours = nvfp4_quantize(w, global_amax=shared)
        assert torch.equal(ours.scale.view(torch.uint8), scale.view(torch.uint8))
        assert torch.equal(ours.data, data)


def test_nvfp4_dequantization_matches_modelopt():
    w = _weights(torch.float32)
    packed, scale, scale_2 = NVFP4QTensor.quantize(w, 16)
    theirs = packed.dequantize(dtype=torch.float32, scale=scale, double_scale=scale_2, block_sizes={-1: 16})
    assert torch.equal(theirs, nvfp4_dequantize(nvfp4_quantize(w)))


def test_mxfp4_ceil_scales_match_modelopt_and_elements_differ_only_at_ties():
    # ModelOpt's MXFP4 element cast rounds ties toward zero and writes 0 as 0x8 (torch.sign(0) = 0);
    # our "ceil" mode reproduces its scale bytes, and its values wherever no tie is involved.
    w = _weights(torch.float32)
    packed, scale = mxfp4_tensor.MXFP4QTensor.quantize(w, 32)
    ours = mxfp4_quantize(w, scale_mode="ceil")
    assert torch.equal(scale.reshape(ours.scale.shape), ours.scale)
    theirs_values = fp4_decode(unpack_nibbles(packed._quantized_data.reshape(ours.data.shape)))
    ours_values = fp4_decode(unpack_nibbles(ours.data))
    scaled = (w.unflatten(-1, (-1, 32)) / 2.0 ** (ours.scale.float() - 127).unsqueeze(-1)).flatten(-2).abs()
    ties = torch.isin(scaled, torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]))
    assert torch.equal(theirs_values[~ties], ours_values[~ties])
