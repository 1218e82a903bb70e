"""FP8 E4M3 bytes against nvidia-modelopt's own export functions, on bf16, fp16 and fp32 weights.

Skipped unless modelopt's export utilities import (``pip install --no-deps nvidia-modelopt`` plus
its small pure-Python needs; see test_interop_modelopt.py). Per tensor, ModelOpt's HF export
writes ``to_quantized_weight(weight, weight_scale, "fp8")`` = ``(weight / weight_scale)
.to(float8_e4m3fn)`` with ``weight_scale = amax.float() / 448`` (``get_scaling_factor``); a 2-D
bf16/fp16 weight divided by that 0-dim fp32 scale gives a bf16/fp16 quotient, rounded again by the
cast. 128x128 blocks go through ``FP8QTensor.quantize`` with fp32 block scales (one rounding).
"""

import pytest
import torch

quant_utils = pytest.importorskip("modelopt.torch.export.quant_utils",
                                  reason="nvidia-modelopt is not installed (pip install --no-deps nvidia-modelopt)")
fp8_tensor = pytest.importorskip("modelopt.torch.quantization.qtensor.fp8_tensor")

from musecore_quant import quantize  # noqa: E402
from musecore_quant.formats.fp8 import E4M3_MAX  # noqa: E402

QUANTIZATION_FP8 = "fp8"            # modelopt.torch.export.model_config.QUANTIZATION_FP8
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _modelopt_per_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What ModelOpt's export writes for one weight: e4m3 ``weight`` and fp32 ``weight_scale``."""
    scale = w.abs().amax().float() / 448.0                      # get_scaling_factor: amax.float() / maxbound
    return quant_utils.to_quantized_weight(w, scale, QUANTIZATION_FP8), scale


def _random(shape: tuple[int, ...], seed: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    rows = torch.logspace(-2, 2, shape[-2]).view(shape[-2], 1)  # magnitudes over 4 decades per matrix
    return (torch.randn(shape, generator=gen) * rows).to(dtype)


def _near_e4m3_midpoints(amax: float, dtype: torch.dtype) -> torch.Tensor:
    """Weights whose quotients ``w / (amax/448)`` lie at, just above and just below E4M3 midpoints.

    These are where rounding the quotient to bf16/fp16 first can turn a value above a midpoint into
    the midpoint itself (a tie, then to even): the double-rounding cases.
    """
    grid = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float().unique()  # 0 .. 448
    midpoints = (grid[1:] + grid[:-1]) / 2
    exact = (midpoints * (amax / E4M3_MAX)).to(dtype)
    up = torch.nextafter(exact, torch.tensor(float("inf"), dtype=dtype))
    down = torch.nextafter(exact, torch.tensor(0.0, dtype=dtype))
    values = torch.cat([torch.tensor([amax], dtype=dtype), exact, up, down])
    values = torch.cat([values, -values])
    return values[: values.numel() // 16 * 16].reshape(-1, 16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,seed", [((64, 512), 0), ((96, 200), 1), ((7, 33), 2), ((256, 1024), 3)])
def test_per_tensor_bytes_match_modelopt_export_on_random_weights(dtype, shape, seed):
    w = _random(shape, seed, dtype)
    data, scale = _modelopt_per_tensor(w)
    ours = quantize(w, "fp8")
    assert ours.scale.view(torch.int32).item() == scale.view(torch.int32).item()
    differing = (ours.data.view(torch.uint8) != data.view(torch.uint8)).sum().item()
    assert differing == 0, f"{differing} of {data.numel()} FP8 bytes differ from ModelOpt's"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("amax", [320.0, 500.0, 1.0, 3.0e-3, 1.5e4])
def test_per_tensor_bytes_match_modelopt_export_near_rounding_boundaries(dtype, amax):
    w = _near_e4m3_midpoints(amax, dtype)
    data, _ = _modelopt_per_tensor(w)
    ours = quantize(w, "fp8")
    differing = (ours.data.view(torch.uint8) != data.view(torch.uint8)).sum().item()
    assert differing == 0, f"{differing} of {data.numel()} FP8 bytes differ from ModelOpt's"


def test_bf16_double_rounding_matters_on_these_weights():
    # Guards the boundary test above: on its weights one rounding of the fp32 quotient is not
    # ModelOpt's answer, so matching it exercises the bf16 rounding step.
    w = _near_e4m3_midpoints(320.0, torch.bfloat16)
    data, _ = _modelopt_per_tensor(w)
    single = quantize(w.float(), "fp8")
    assert (single.data.view(torch.uint8) != data.view(torch.uint8)).any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_stacked_experts_match_modelopt_export_with_a_dimensioned_scale(dtype):
    # ModelOpt divides a 3-D weight by ``weight_scale.unsqueeze(-1)`` (here per expert, [E, 1] ->
    # [E, 1, 1]): a dimensioned fp32 scale promotes the quotient to fp32, one rounding.
    w = torch.cat([_random((1, 64, 128), seed, dtype) for seed in range(4)])
    boundary = _near_e4m3_midpoints(320.0, dtype).flatten()
    w = torch.cat([w, boundary.repeat(-(-64 * 128 // boundary.numel()))[: 64 * 128].view(1, 64, 128)])
    scale = w.flatten(-2).abs().amax(-1).float() / 448.0                    # [E]
    data = quant_utils.to_quantized_weight(w, scale.view(-1, 1), QUANTIZATION_FP8)
    ours = quantize(w, "fp8")
    assert torch.equal(ours.scale, scale)
    assert torch.equal(ours.data.view(torch.uint8), data.view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(256, 384), (300, 200)])
def test_128_blocks_match_modelopt_fp8_qtensor(dtype, shape):
    w = _random(shape, 5, dtype)
    ours = quantize(w, "fp8", block_size=128)
    # ModelOpt's FP8_PB_WO export: FP8QTensor.quantize(weight, weight_scale, block_sizes) with fp32
    # block scales amax / 448 (ragged edges padded with zeros, then cropped).
    packed, _ = fp8_tensor.FP8QTensor.quantize(w, ours.scale, block_sizes={-1: 128, -2: 128})
    expected_scale = fp8_tensor.FP8QTensor.quantize(w.float(), block_sizes={-1: 128, -2: 128})[1]
    assert torch.equal(ours.scale, expected_scale)
    assert torch.equal(ours.data.view(torch.uint8), packed._quantized_data.view(torch.uint8))
