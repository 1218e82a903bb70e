"""The towers' ops in ``musecore_triton`` (varlen attention, causal conv, rope kernels; layer_norm and gelu
through PyTorch) against ``musecore.ops.reference``: head dims that are not powers of two, packed segments
of odd, one-token and empty lengths, strided views, the conv's streaming state, and one-line errors.
Without a GPU the kernels run in Triton's interpreter on small fp16/fp32 shapes; the ``gpu`` tests run the
816B tower shapes in bf16."""

from __future__ import annotations

import pytest
import torch

from musecore.ops import reference as ref
from musecore.ops import tolerance

from musecore_triton.testing import DEVICE, SMALL_DTYPES, assert_nmse

from musecore_triton import towers
from musecore_triton.kernels.causal_conv import causal_conv1d
from musecore_triton.kernels.rope import rope
from musecore_triton.kernels.varlen_attention import varlen_attention

FP32_EXACT = 1e-9  # fp32 inputs must not go through TF32 (that would be ~1e-7)


def cu(*lengths: int) -> torch.Tensor:
    return torch.tensor((0,) + lengths, device=DEVICE).cumsum(0).to(torch.int32)


def qkv(n: int, heads: int, d: int, dtype: torch.dtype):
    """q, k, v as strided views of one fused ``[N, 3, heads, d]`` projection, as a tower produces them."""
    fused = torch.randn(n, 3, heads, d, device=DEVICE).to(dtype)
    return fused[:, 0], fused[:, 1], fused[:, 2]


@pytest.mark.parametrize("d", [16, 32, 64, 72, 80, 96, 128])
@pytest.mark.parametrize("dtype", SMALL_DTYPES)
def test_varlen_attention_matches_reference_for_every_head_dim(d, dtype):
    seqlens = cu(17, 1, 0, 40, 3)  # odd lengths, a one-patch segment, an empty one; blocks straddle segments
    q, k, v = qkv(61, 2, d, dtype)
    out = varlen_attention(q, k, v, seqlens, d ** -0.5)
    assert out.dtype == dtype and out.shape == q.shape
    assert_nmse(ref.varlen_attention(q, k, v, seqlens, d ** -0.5), out, tolerance("varlen_attention"),
                f"varlen_attention d={d} {dtype}")


def test_varlen_attention_fp32_is_exact():
    seqlens = cu(30, 35)
    q, k, v = qkv(65, 2, 40, torch.float32)
    out = varlen_attention(q, k, v, seqlens, 0.3)
    assert_nmse(ref.varlen_attention(q, k, v, seqlens, 0.3), out, FP32_EXACT, "varlen_attention fp32")


def test_packed_segments_equal_each_segment_alone():
    lengths = (20, 45, 7)
    q, k, v = qkv(sum(lengths), 2, 32, torch.float16)
    packed = varlen_attention(q, k, v, cu(*lengths), 32 ** -0.5)
    start = 0
    for n in lengths:
        alone = varlen_attention(q[start:start + n], k[start:start + n], v[start:start + n], cu(n), 32 ** -0.5)
        assert_nmse(alone, packed[start:start + n], 1e-6, f"segment of {n} packed vs alone")
        start += n


@pytest.mark.parametrize("bad, message", [
    (torch.tensor([1, 10], dtype=torch.int32), "rise from 0 to N=10"),
    (torch.tensor([0, 9], dtype=torch.int32), "rise from 0 to N=10"),
    (torch.tensor([0, 6, 4, 10], dtype=torch.int32), "smallest step -2"),
    (torch.tensor([0.0, 10.0]), "cu_seqlens must be int32"),
])
def test_varlen_attention_rejects_a_malformed_cu_seqlens_in_one_line(bad, message):
    q, k, v = qkv(10, 1, 16, torch.float16)
    with pytest.raises(ValueError, match=message):
        varlen_attention(q, k, v, bad.to(DEVICE), 0.25)


def conv_inputs(B, C, T, K, dtype, layout="btc", state=True, bias=True):
    x = (torch.randn(B, T, C, device=DEVICE).to(dtype).transpose(1, 2) if layout == "btc"
         else torch.randn(B, C, T, device=DEVICE).to(dtype))
    w = (torch.randn(C, 1, K, device=DEVICE) * K ** -0.5).to(dtype)
    b = torch.randn(C, device=DEVICE).to(dtype) if bias else None
    s = torch.randn(B, C, K - 1, device=DEVICE).to(dtype) if state else None
    return x, w, b, s


@pytest.mark.parametrize("layout", ["btc", "bct"])
@pytest.mark.parametrize("T", [1, 5, 37, 130])
@pytest.mark.parametrize("dtype", SMALL_DTYPES + [torch.float32])
def test_causal_conv1d_matches_reference(layout, T, dtype):
    for state, bias in ((True, True), (False, False)):
        x, w, b, s = conv_inputs(2, 70, T, 7, dtype, layout, state, bias)
        y, new_state = causal_conv1d(x, w, b, s)
        want_y, want_state = ref.causal_conv1d(x, w, b, s)
        assert y.dtype == dtype and new_state.dtype == dtype
        assert_nmse(want_y, y, tolerance("causal_conv1d"), f"causal_conv1d {layout} T={T} state={state} {dtype}")
        assert torch.equal(new_state, want_state), "state' must be the last K-1 input columns, exactly"


def test_causal_conv1d_in_chunks_equals_one_pass_exactly():
    x, w, b, _ = conv_inputs(1, 24, 50, 7, torch.float16, state=False)
    whole, _ = causal_conv1d(x, w, b)
    parts, state = [], None
    for lo, hi in ((0, 3), (3, 4), (4, 20), (20, 50)):  # chunks shorter and longer than K-1
        y, state = causal_conv1d(x[..., lo:hi], w, b, state)
        parts.append(y)
    assert torch.equal(torch.cat(parts, -1), whole), "streaming with the returned state must equal one pass"


def test_causal_conv1d_output_keeps_the_inputs_layout():
    x, w, b, s = conv_inputs(2, 16, 9, 7, torch.float16, "btc")
    y, _ = causal_conv1d(x, w, b, s)
    assert y.transpose(1, 2).is_contiguous(), "a [B,T,C] view in gives a [B,T,C] layout out (no copy back)"


@pytest.mark.parametrize("args, message", [
    (dict(weight=torch.randn(8, 7)), r"weight must be \[channels=8, 1, kernel\]"),
    (dict(bias=torch.randn(5)), r"bias must be \[8\]"),
    (dict(state=torch.randn(2, 8, 7)), r"state must be \[batch=2, channels=8, kernel-1=6\]"),
])
def test_causal_conv1d_rejects_bad_shapes_in_one_line(args, message):
    given = dict(weight=torch.randn(8, 1, 7), bias=None, state=None)
    given.update(args)
    x = torch.randn(2, 8, 10, device=DEVICE).half()
    with pytest.raises(ValueError, match=message):
        causal_conv1d(x, *(None if t is None else t.to(DEVICE).half() for t in given.values()))


@pytest.mark.parametrize("d", [16, 32, 72, 96])
@pytest.mark.parametrize("dtype", SMALL_DTYPES + [torch.float32])
def test_rope_matches_reference(d, dtype):
    q, _, _ = qkv(37, 3, d, dtype)  # a strided view
    angles = torch.rand(37, d // 2, device=DEVICE) * 30
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    out = rope(q, cos, sin)
    assert out.dtype == dtype
    assert_nmse(ref.rope(q, cos, sin), out, tolerance("rope"), f"rope d={d} {dtype}")


def test_rope_rejects_an_odd_head_dim_and_mismatched_tables():
    x = torch.randn(4, 2, 15, device=DEVICE).half()
    with pytest.raises(ValueError, match="even head_dim"):
        rope(x, torch.ones(4, 15, device=DEVICE), torch.ones(4, 15, device=DEVICE))
    with pytest.raises(ValueError, match=r"cos and sin must be \[N=4, head_dim=16\]"):
        rope(torch.randn(4, 2, 16, device=DEVICE).half(), torch.ones(3, 16, device=DEVICE),
             torch.ones(3, 16, device=DEVICE))


@pytest.mark.parametrize("dtype", SMALL_DTYPES + [torch.float32])
def test_layer_norm_and_gelu_match_reference(dtype):
    x = (torch.randn(5, 200, device=DEVICE) * 3 + 0.5).to(dtype)
    w, b = (1 + 0.2 * torch.randn(200, device=DEVICE)).to(dtype), (0.1 * torch.randn(200, device=DEVICE)).to(dtype)
    assert_nmse(ref.layer_norm(x, w, b, 1e-5), towers.layer_norm(x, w, b, 1e-5), tolerance("layer_norm"),
                f"layer_norm {dtype}")
    assert_nmse(ref.layer_norm(x, w.float(), None, 1e-5), towers.layer_norm(x, w.float(), None, 1e-5),
                tolerance("layer_norm"), f"layer_norm fp32 weight {dtype}")
    for approximate in ("none", "tanh"):
        assert_nmse(ref.gelu(x, approximate), towers.gelu(x, approximate), tolerance("gelu"),
                    f"gelu {approximate} {dtype}")
    with pytest.raises(ValueError, match="approximate='sigmoid'"):
        towers.gelu(x, "sigmoid")


# -- the 816B tower shapes on a GPU (bf16) ---------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("lengths", [(1024,), (1024, 1024, 1024, 1024, 1024, 1024), (4096, 1, 0, 333, 1024)],
                         ids=["window", "six-windows", "full-image-and-odd"])
def test_varlen_attention_816b_vision_shapes_on_gpu(lengths):
    heads, d = 16, 96  # MuseSparkVisionConfig(): hidden 1536, 16 heads
    q, k, v = qkv(sum(lengths), heads, d, torch.bfloat16)
    seqlens = cu(*lengths)
    out = varlen_attention(q, k, v, seqlens, d ** -0.5)
    assert_nmse(ref.varlen_attention(q, k, v, seqlens, d ** -0.5), out, tolerance("varlen_attention"),
                f"varlen_attention 816b {lengths}")


@pytest.mark.gpu
@pytest.mark.parametrize("C", [256, 512, 1024, 2048])
def test_causal_conv1d_816b_audio_widths_on_gpu(C):
    x, w, b, s = conv_inputs(2, C, 1501, 7, torch.bfloat16)  # ~2 s of 24 kHz audio after the first stage
    y, state = causal_conv1d(x, w, b, s)
    want_y, want_state = ref.causal_conv1d(x, w, b, s)
    assert_nmse(want_y, y, tolerance("causal_conv1d"), f"causal_conv1d 816b C={C}")
    assert torch.equal(state, want_state)


@pytest.mark.gpu
def test_rope_816b_vision_shape_on_gpu():
    q, _, _ = qkv(4096, 16, 96, torch.bfloat16)
    angles = torch.rand(4096, 48, device=DEVICE) * 30
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    assert_nmse(ref.rope(q, cos, sin), rope(q, cos, sin), tolerance("rope"), "rope 816b")
