"""NVFP4: ModelOpt's checked vector, shared and per-expert global scales, error bound, activations."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from formats_md_vectors import FORMATS_MD_ROW
from musecore_quant.formats.nvfp4 import (nvfp4_dequantize, nvfp4_fake_quantize_activation, nvfp4_global_amax,
                                          nvfp4_input_scale, nvfp4_quantize, nvfp4_shared_global_amax)


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)  # fixed data; the assertions hold for any seed, a failure must reproduce


def test_formats_md_modelopt_vector_is_reproduced_byte_for_byte():
    qt = nvfp4_quantize(FORMATS_MD_ROW)
    assert qt.global_scale.shape == ()
    assert qt.global_scale.view(torch.int32).item() == 0x39430C31, f"weight_scale_2 {qt.global_scale.item()!r}"
    assert qt.scale.dtype == torch.float8_e4m3fn
    assert qt.scale.view(torch.uint8).tolist() == [[0x7E, 0x6B]]
    assert qt.data.numpy().tobytes().hex(" ") == "d7 63 0a f0 44 44 44 44 d7 23 f6 40 44 44 44 44"


def test_block_max_above_six_after_scale_rounding_saturates():
    # 0x6B = 88 rounds 89.6 down, so 0.1 sits above 6 * scale and comes back as 0.0982 (FORMATS.md).
    w_hat = nvfp4_dequantize(nvfp4_quantize(FORMATS_MD_ROW))
    assert abs(w_hat[0, 16].item() - 0.0982) < 5e-5, f"got {w_hat[0, 16].item()}"


def test_all_zero_block_gets_scale_one_and_zero_matrix_stays_finite():
    w = torch.zeros(2, 32)
    w[0, :16] = torch.linspace(-1, 1, 16)
    qt = nvfp4_quantize(w)
    assert qt.scale.float()[0, 1].item() == 1.0 and qt.scale.float()[1].tolist() == [1.0, 1.0]
    zero = nvfp4_quantize(torch.zeros(4, 16))
    assert torch.isfinite(zero.global_scale).all() and torch.isfinite(zero.scale.float()).all()
    assert torch.equal(nvfp4_dequantize(zero), torch.zeros(4, 16))
    subnormal = nvfp4_quantize(torch.full((1, 16), 1e-45))              # amax / 2688 underflows fp32
    assert subnormal.global_scale.item() > 0 and torch.isfinite(nvfp4_dequantize(subnormal)).all()


def test_stacked_experts_get_one_global_scale_each_and_match_per_expert_quantization():
    experts = torch.randn(3, 8, 64) * torch.tensor([1.0, 100.0, 1e-3]).view(3, 1, 1)
    stacked = nvfp4_quantize(experts)
    assert stacked.global_scale.shape == (3,)
    for e in range(3):
        single = nvfp4_quantize(experts[e])
        assert torch.equal(stacked.data[e], single.data)
        assert torch.equal(stacked.scale[e].view(torch.uint8), single.scale.view(torch.uint8))
        assert torch.equal(stacked.global_scale[e], single.global_scale)


def test_fused_siblings_share_weight_scale_2_from_the_larger_amax():
    gate, up = torch.randn(16, 32), 3 * torch.randn(16, 32)
    shared = nvfp4_shared_global_amax(gate, up)
    assert shared.item() == max(gate.abs().max().item(), up.abs().max().item())
    qg, qu = nvfp4_quantize(gate, global_amax=shared), nvfp4_quantize(up, global_amax=shared)
    assert torch.equal(qg.global_scale, qu.global_scale)
    assert torch.equal(qu.global_scale, nvfp4_quantize(up).global_scale)


def test_shared_global_amax_is_per_expert_for_stacked_siblings():
    gate, up = torch.randn(4, 8, 32), torch.randn(4, 8, 32)
    shared = nvfp4_shared_global_amax(gate, up)
    assert torch.equal(shared, torch.maximum(nvfp4_global_amax(gate), nvfp4_global_amax(up)))
    assert nvfp4_quantize(gate, global_amax=shared).global_scale.shape == (4,)


def test_global_amax_below_the_tensor_amax_is_an_error():
    with pytest.raises(ValueError, match="below the tensor's own amax"):
        nvfp4_quantize(torch.ones(2, 16), global_amax=0.5)


def _fp4_half_step(y: torch.Tensor) -> torch.Tensor:
    """Half the E2M1 grid spacing around magnitude ``y`` (0.5 below 2, 1 below 4, 2 up to 6)."""
    return torch.where(y < 2, 0.25, torch.where(y < 4, 0.5, 1.0))


def assert_fp4_error_bound(w: torch.Tensor, w_hat: torch.Tensor, block_scale: torch.Tensor, block: int) -> None:
    """No element further than half a grid step at its block scale, except saturated ones (clamped to 6s)."""
    s = block_scale.repeat_interleave(block, dim=-1)
    y = w.abs() / s
    within = y <= 6
    bound = _fp4_half_step(y) * s * (1 + 1e-6) + 1e-30
    err = (w - w_hat).abs()
    excess = torch.where(within, err - bound, (w_hat.abs() - 6 * s).abs() - 1e-6 * s)
    worst = excess.max().item()
    assert worst <= 0, f"error exceeds half a grid step by {worst:.3g} (max error {err.max().item():.3g})"
    assert bool((torch.sign(w_hat) * torch.sign(w) >= 0).all()), "dequantized value changed sign"


weights = hnp.arrays(np.float32, st.tuples(st.integers(1, 3), st.sampled_from([16, 32, 64])),
                     elements=st.floats(-1000, 1000, width=32))


@settings(max_examples=50, deadline=None)
@given(weights, st.sampled_from(["rne", "away"]), st.integers(-20, 20))
def test_every_element_is_within_half_a_grid_step_of_its_block_scale(values, rounding, exponent):
    w = torch.from_numpy(values) * 2.0 ** exponent
    qt = nvfp4_quantize(w, rounding=rounding)
    block_scale = qt.scale.float() * qt.global_scale
    assert_fp4_error_bound(w, nvfp4_dequantize(qt), block_scale, 16)


def test_bf16_weights_quantize_like_their_fp32_values():
    w = torch.randn(32, 128).to(torch.bfloat16)
    a, b = nvfp4_quantize(w), nvfp4_quantize(w.float())
    assert torch.equal(a.data, b.data) and torch.equal(a.global_scale, b.global_scale)


def test_activation_fake_quant_with_the_weight_scale_equals_the_weight_round_trip():
    x = torch.randn(6, 128)
    qt = nvfp4_quantize(x)
    x_hat = nvfp4_fake_quantize_activation(x, qt.global_scale)
    assert torch.equal(x_hat, nvfp4_dequantize(qt))


def test_activation_fake_quant_keeps_dtype_and_clamps_beyond_the_calibrated_range():
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    input_scale = nvfp4_input_scale(x.float().abs().max())
    x_hat = nvfp4_fake_quantize_activation(x, input_scale)
    assert x_hat.dtype == torch.bfloat16 and x_hat.shape == x.shape
    loud = nvfp4_fake_quantize_activation(x.float() * 10, input_scale)
    assert torch.isfinite(loud).all()
    assert loud.abs().max().item() <= 6 * 448 * input_scale.item() * (1 + 1e-6)


def test_activation_input_scale_may_be_per_row():
    x = torch.randn(3, 5, 32)
    per_expert = torch.tensor([0.01, 0.02, 0.03]).view(3, 1)
    out = nvfp4_fake_quantize_activation(x, per_expert)
    for e in range(3):
        assert torch.equal(out[e], nvfp4_fake_quantize_activation(x[e], per_expert[e, 0]))


def test_activation_fake_quant_rejects_bad_input_scale_and_ragged_last_dim():
    with pytest.raises(ValueError, match="input_scale must be finite and > 0"):
        nvfp4_fake_quantize_activation(torch.randn(2, 16), 0.0)
    with pytest.raises(ValueError, match="divisible by 16"):
        nvfp4_fake_quantize_activation(torch.randn(2, 20), 0.01)
