"""The dot_scaled MXFP4 kernels against musecore's reference: activation quantization bit for bit
(the emulated mi355x plan's rule), W4A4 / W4A16 linears and the W4A4 MoE. In Triton's interpreter
without a GPU; on a GPU (``-m gpu``) the same kernels compiled for it at the 816B shapes."""

from __future__ import annotations

import pytest
import torch

import musecore_quant
from musecore.ops import ExpertWeights, Weight
from musecore.ops import reference as ref
from musecore_triton.kernels.mx_gemm import activation_rule, mxfp4_linear, mxfp4_quantize_activation
from musecore_triton.kernels.mx_moe import mx_experts, mx_moe_forward
from musecore_triton.testing import DEVICE, assert_nmse

DTYPE = torch.float16 if DEVICE.type == "cpu" else torch.bfloat16


def awkward_activations(rows: int, k: int) -> torch.Tensor:
    """Random rows plus blocks that hit every rounding edge: zeros, E2M1 ties, the EVEN carry at a
    1.75 mantissa, saturation, values far below the block max, negatives that round to zero."""
    x = torch.randn(rows, k) * torch.logspace(-3, 2, rows)[:, None]
    x[0, :32] = 0.0
    x[1, :32] = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0] * 4)
    x[2, :32] = torch.tensor([7.0, -3.3, 1.25, 0.3, 2.5, 5.0, -0.75, 0.1] + [0.0] * 24)  # FORMATS.md vector
    x[3, :32] = torch.tensor([1.75 * 4, -0.01, 0.5, -0.2] * 8)
    x[4, :32] = torch.tensor([-1e-3] * 31 + [8.0])
    return x


def test_the_kernels_use_the_emulated_plans_activation_rule():
    assert activation_rule() == {"scale_mode": "even", "rounding": "rne"}  # read from musecore_quant, not typed


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_activation_quantization_is_bit_identical_to_musecore_quant(dtype):
    x = awkward_activations(24, 256).to(dtype)
    packed, scales = mxfp4_quantize_activation(x.to(DEVICE))
    expected = musecore_quant.quantize(x.float(), "mxfp4")  # the codec the emulated plan runs
    assert torch.equal(scales.cpu(), expected.scale), "E8M0 scales differ"
    assert torch.equal(packed.cpu(), expected.data), "E2M1 codes differ"
    fake = ref.fake_quantize_activation(x, "mxfp4", None)  # what reference.linear multiplies with
    back = musecore_quant.dequantize(musecore_quant.QTensor(format="mxfp4", data=packed.cpu(), scale=scales.cpu(),
                                                            shape=tuple(x.shape), group_size=32)).to(dtype)
    assert torch.equal(back, fake)


def _reference_linear(x, qt, act_format):
    w = Weight(data=musecore_quant.dequantize(qt), format="mxfp4", out_features=qt.shape[0],
               in_features=qt.shape[1], act_format=act_format)
    return ref.linear(x, w)


@pytest.mark.parametrize("tokens", [1, 5, 33, 80])  # 80 > PREQUANTIZE_MIN_M: quantize kernel + packed GEMM
@pytest.mark.parametrize("act_format", ["mxfp4", None])
def test_mxfp4_linear_matches_the_reference(tokens, act_format):
    x = awkward_activations(tokens + 5, 256)[5:].to(DTYPE) if tokens > 1 else torch.randn(1, 256).to(DTYPE)
    qt = musecore_quant.quantize(torch.randn(96, 256) * 0.05, "mxfp4")
    y = mxfp4_linear(x.to(DEVICE), qt.data.to(DEVICE), qt.scale.to(DEVICE), quantize_activations=act_format == "mxfp4")
    assert_nmse(_reference_linear(x, qt, act_format).float(), y.float().cpu(), 1e-5, f"mxfp4 linear a{act_format}")


@pytest.mark.parametrize("act_format", ["mxfp4", None])
def test_mxfp4_moe_matches_the_reference(act_format):
    E, h, inter, T, k = 6, 128, 256, 5, 2
    z = torch.randn(T, h).to(DTYPE)
    stacks = [musecore_quant.quantize(torch.randn(E, o, i) * 0.05, "mxfp4") for o, i in ((inter, h), (inter, h), (h, inter))]
    weights, ids = torch.rand(T, E).topk(k)
    post = (torch.rand(h) + 0.5).to(DTYPE)
    got = mx_moe_forward(z.to(DEVICE), weights.to(DEVICE), ids.to(DEVICE), mx_experts(*stacks, DEVICE),
                         post.to(DEVICE), 1e-6, quantize_activations=act_format == "mxfp4")
    experts = ExpertWeights(*[musecore_quant.dequantize(s) for s in stacks], format="mxfp4", num_experts=E,
                            act_format=act_format)
    want = ref.moe(z, weights, ids, experts, post, 1e-6)
    assert_nmse(want, got.cpu(), 2e-5, f"mxfp4 moe a{act_format}")


SHAPES_816B = {"q_proj": (8192, 8192), "pooler": (4096, 8192), "expert_down": (4096, 4096)}


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(SHAPES_816B))
@pytest.mark.parametrize("tokens", [1, 16, 256])
def test_mxfp4_w4a4_linear_at_816b_shapes_on_a_gpu(name, tokens):
    n, k = SHAPES_816B[name]
    x = torch.randn(tokens, k, device="cuda").to(torch.bfloat16)
    qt = musecore_quant.quantize(torch.randn(n, k, device="cuda") * k ** -0.5, "mxfp4")
    for act_format in ("mxfp4", None):
        y = mxfp4_linear(x, qt.data, qt.scale, quantize_activations=act_format == "mxfp4")
        assert_nmse(_reference_linear(x, qt, act_format).float(), y.float(), 1e-4, f"{name} M={tokens} a{act_format}")
    packed, scales = mxfp4_quantize_activation(x)
    expected = musecore_quant.quantize(x.float(), "mxfp4")
    assert torch.equal(packed, expected.data) and torch.equal(scales, expected.scale)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 64])
def test_mxfp4_w4a4_moe_at_816b_expert_shapes_on_a_gpu(tokens):
    E, h, inter, k = 8, 4096, 4096, 2  # 8 of the 256 experts of 4096x4096, top-2 (the conformance 816b rule)
    z = torch.randn(tokens, h, device="cuda").to(torch.bfloat16)
    stacks = [musecore_quant.quantize(torch.randn(E, o, i, device="cuda") * i ** -0.5, "mxfp4")
              for o, i in ((inter, h), (inter, h), (h, inter))]
    weights, ids = torch.rand(tokens, E, device="cuda").topk(k)
    post = (torch.rand(h, device="cuda") + 0.5).to(torch.bfloat16)
    experts = ExpertWeights(*[musecore_quant.dequantize(s) for s in stacks], format="mxfp4", num_experts=E,
                            act_format="mxfp4")
    got = mx_moe_forward(z, weights, ids, mx_experts(*stacks, z.device), post, 1e-6, quantize_activations=True)
    assert_nmse(ref.moe(z, weights, ids, experts, post, 1e-6), got, 2e-4, f"816b moe W4A4 T={tokens}")
