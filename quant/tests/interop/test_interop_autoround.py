"""AutoRound's own RTN functions against ``int4_quantize`` (scales, zeros and dequantized values).

Skipped unless auto-round is importable. AutoRound's ``quant_tensor_sym`` / ``quant_tensor_asym``
compute in the tensor's dtype (for bf16, the asymmetric ``(max - min) / 15`` is rounded to bf16
twice before the fp16 cast; for fp16, the quotients by the fp16 scale are fp16 too).
``int4_quantize`` reproduces that, so the two agree on fp32, bf16 and fp16 weights in both modes:
on random weights of several shapes and seeds, and on weights built to sit near the rounding
boundaries (group ranges whose ``/ 15`` lands near bf16/fp16 ties, and elements one ulp either
side of the code midpoints ``(k + 0.5) * scale``).
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


DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _random(shape: tuple[int, int], seed: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=gen) * torch.logspace(-3, 2, shape[0]).view(shape[0], 1)
    w[:, :4] += 0.3                                               # lopsided groups: zero points far from 8
    return w.to(dtype)


def _near_boundaries(dtype: torch.dtype, group_size: int, sym: bool, seed: int = 0) -> torch.Tensor:
    """One group per row: a dense sweep of (min, max), the rest one ulp around code midpoints."""
    gen = torch.Generator().manual_seed(seed)
    rows = 256
    high = torch.linspace(0.05, 3.0, rows).to(dtype)
    low = -(high * torch.rand(rows, generator=gen) * 1.5).to(dtype)
    w = torch.zeros(rows, group_size, dtype=dtype)
    w[:, 0], w[:, 1] = high, low
    # The scale depends only on min and max, so AutoRound's scale of this tensor is the final one.
    func = autoround_int.quant_tensor_sym if sym else autoround_int.quant_tensor_asym
    _, scale, zero = func(w, bits=4, group_size=group_size)
    zero = torch.full_like(scale, 8.0) if sym else zero.float()
    k = torch.randint(0, 15, (rows, group_size - 2), generator=gen).float()
    midpoints = ((k + 0.5 - zero) * scale.float()).to(dtype)
    nudge = torch.randint(-1, 2, midpoints.shape, generator=gen)
    towards = torch.where(nudge > 0, torch.tensor(float("inf")), torch.tensor(float("-inf"))).to(dtype)
    midpoints = torch.where(nudge == 0, midpoints, torch.nextafter(midpoints, towards))
    inside = (midpoints.float() <= high.float().view(-1, 1)) & (midpoints.float() >= low.float().view(-1, 1))
    w[:, 2:] = torch.where(inside, midpoints, torch.zeros_like(midpoints))  # keep min and max as built
    return w


def _assert_matches(w: torch.Tensor, group_size: int, sym: bool) -> None:
    func = autoround_int.quant_tensor_sym if sym else autoround_int.quant_tensor_asym
    qdq, scale, zero = func(w, bits=4, group_size=group_size)
    ours = int4_quantize(w, group_size=group_size, sym=sym)
    scale = scale.reshape(ours.scale.shape).to(torch.float16)
    differing = (scale.view(torch.int16) != ours.scale.view(torch.int16)).sum().item()
    assert differing == 0, f"{differing} of {scale.numel()} fp16 scales differ from AutoRound's"
    if not sym:
        assert torch.equal(zero.reshape(ours.zero.shape).to(torch.uint8), ours.zero)
    differing = (qdq != int4_dequantize(ours).to(w.dtype)).sum().item()
    assert differing == 0, f"{differing} of {qdq.numel()} dequantized values differ from AutoRound's"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sym", [False, True])
@pytest.mark.parametrize("shape,group_size,seed", [((64, 512), 128, 0), ((48, 256), 32, 1),
                                                   ((8, 1024), -1, 2), ((128, 384), 128, 3)])
def test_rtn_matches_autoround_on_random_weights(dtype, sym, shape, group_size, seed):
    _assert_matches(_random(shape, seed, dtype), group_size, sym)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sym", [False, True])
@pytest.mark.parametrize("group_size", [16, 128])
def test_rtn_matches_autoround_near_rounding_boundaries(dtype, sym, group_size):
    _assert_matches(_near_boundaries(dtype, group_size, sym), group_size, sym)


def test_bf16_asymmetric_scales_differ_from_the_fp32_computation_on_these_weights():
    # Guards the tests above: AutoRound's bf16 arithmetic does change scales here, so matching it is
    # not the fp32 computation passing by luck.
    w = _near_boundaries(torch.bfloat16, 128, sym=False)
    _, scale, _ = autoround_int.quant_tensor_asym(w, bits=4, group_size=128)
    fp32 = int4_quantize(w.float(), group_size=128, sym=False)
    assert (scale.reshape(fp32.scale.shape).to(torch.float16) != fp32.scale).any()
