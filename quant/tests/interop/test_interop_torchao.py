"""Byte comparison with torchao's MX reference (``to_mx``) on random bf16/fp32 weights.

Skipped unless torchao is importable. torchao pulls no CUDA torch when installed with
``pip install --no-deps torchao`` (its compiled kernels then fail to load, the Python reference we
compare against does not need them).
"""

import pytest
import torch

mx_tensor = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor",
                                reason="torchao is not installed (pip install --no-deps torchao)")
mx_config = pytest.importorskip("torchao.prototype.mx_formats.config")

from musecore_quant.formats.mxfp4 import mxfp4_dequantize, mxfp4_quantize  # noqa: E402

# torchao's names for the rules; its RCEIL is ceil(log2(amax / 6)), the rule we call "ceil" (ModelOpt's).
MODES = {"floor": "FLOOR", "even": "EVEN", "ceil": "RCEIL"}


def _weights(dtype: torch.dtype) -> torch.Tensor:
    torch.manual_seed(0)
    rows = torch.logspace(-6, 6, 96).view(96, 1)                 # many binades, so every scale rule is exercised
    return (torch.randn(96, 512) * rows).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("scale_mode", list(MODES))
def test_mxfp4_bytes_match_torchao_to_mx(scale_mode, dtype):
    w = _weights(dtype)
    mode = getattr(mx_config.ScaleCalculationMode, MODES[scale_mode])
    scale, data = mx_tensor.to_mx(w, torch.float4_e2m1fn_x2, 32, mode)
    ours = mxfp4_quantize(w, scale_mode=scale_mode)
    their_scale = scale.view(torch.uint8).reshape(ours.scale.shape)
    their_data = data.view(torch.uint8).reshape(ours.data.shape)
    assert torch.equal(their_scale, ours.scale), f"{(their_scale != ours.scale).sum().item()} scale bytes differ"
    differing = (their_data != ours.data).sum().item()
    assert differing == 0, f"{differing} of {ours.data.numel()} data bytes differ"


def test_mxfp4_dequantization_matches_torchao_to_dtype():
    w = _weights(torch.float32)
    scale, data = mx_tensor.to_mx(w, torch.float4_e2m1fn_x2, 32, mx_config.ScaleCalculationMode.EVEN)
    theirs = mx_tensor.to_dtype(data, scale, torch.float4_e2m1fn_x2, 32, torch.float32)
    assert torch.equal(theirs.reshape(w.shape), mxfp4_dequantize(mxfp4_quantize(w, "even")))
