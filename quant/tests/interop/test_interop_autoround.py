"""AutoRound's own RTN functions against ``int4_quantize`` (scales, zeros and dequantized values).

Skipped unless auto-round is importable. AutoRound's ``quant_tensor_sym`` / ``quant_tensor_asym``
do their min/max arithmetic in the tensor's dtype; ``int4_quantize`` always works in fp32, so the
two agree on fp32 weights in both modes, and on bf16 weights in the symmetric mode (whose only
arithmetic before the fp16 cast is an exact division by 8).
"""

import pytest
import torch

autoround_int = pytest.importorskip("auto_round.data_type.int", reason="auto-round is not installed")

from musecore_quant.formats.int4 import int4_dequantize, int4_quantize  # noqa: E402


def _weights(dtype: torch.dtype) -> torch.Tensor:
    torch.manual_seed(0)
    w = torch.randn(64, 512) * torch.logspace(-2, 2, 64).view(64, 1)
    w[3, :128] = 0.0                                              # an all-zero group: the 1e-5 scale floor
    return w.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_symmetric_rtn_matches_autoround_quant_tensor_sym(dtype):
    w = _weights(dtype)
    qdq, scale, _ = autoround_int.quant_tensor_sym(w, bits=4, group_size=128)
    ours = int4_quantize(w, group_size=128, sym=True)
    assert torch.equal(scale.reshape(ours.scale.shape).to(torch.float16), ours.scale)
    assert bool((ours.scale < 0).any()), "full-range symmetric RTN must produce some negative scales"
    assert torch.equal(qdq, int4_dequantize(ours).to(dtype))


def test_asymmetric_rtn_matches_autoround_quant_tensor_asym_on_fp32():
    w = _weights(torch.float32)
    qdq, scale, zero = autoround_int.quant_tensor_asym(w, bits=4, group_size=128)
    ours = int4_quantize(w, group_size=128, sym=False)
    assert torch.equal(scale.reshape(ours.scale.shape).to(torch.float16), ours.scale)
    assert torch.equal(zero.reshape(ours.zero.shape).to(torch.uint8), ours.zero)
    assert torch.equal(qdq, int4_dequantize(ours))
