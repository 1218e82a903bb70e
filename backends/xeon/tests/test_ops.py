"""The non-GEMM ops against the reference with the interface's NMSE tolerances."""

from __future__ import annotations

import pytest
import torch

from musecore.testing import assert_nmse
from musecore.ops import reference as ref
from musecore.ops import tolerance
from musecore_xeon import XeonBackend

DTYPES = [torch.bfloat16, torch.float32]
# decode sizes run one C call through the extension; prefill sizes (more than NATIVE_NORM_MAX_ELEMENTS) run PyTorch
SIZES = {"decode": (2, 3), "prefill": (4, 80)}  # leading dims; the prefill ones reach 320 rows x 256 = 81920 elements


def rows(size: str, n: int, dtype: torch.dtype, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(*SIZES[size], n, dtype=dtype) * scale


@pytest.fixture(params=list(SIZES))
def size(request) -> str:
    return request.param


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", ["scale_after", "weightless", "scale_first"])
def test_rms_norm_matches_reference(xeon: XeonBackend, dtype, variant: str, size: str) -> None:
    n = 256
    x = rows(size, n, dtype)
    w = None if variant == "weightless" else (1 + 0.5 * torch.randn(n)).to(dtype)  # centred weights arrive as 1 + w
    scale_first = variant == "scale_first"
    y = xeon.rms_norm(x, w, 1e-6, scale_first)
    assert y.dtype == dtype and y.shape == x.shape
    assert_nmse(ref.rms_norm(x, w, 1e-6, scale_first), y, tolerance("rms_norm"), f"rms_norm {variant} {dtype} {size}")


def test_scale_first_norm_rounds_the_product_before_normalising(xeon: XeonBackend, size: str) -> None:
    """InputScaledRMSNorm: rms(round(x * w)), the product rounded to x's dtype (bf16 here, where the rounding is
    visible): the outputs are the reference's bf16 values (all but a few last-bit differences of the fp32 sum order),
    and the case tells that apart from rms(x * w) with one rounding at the end."""
    n = 256
    x, w = rows(size, n, torch.bfloat16), (1 + 0.5 * torch.randn(n)).to(torch.bfloat16)
    y, want = xeon.rms_norm(x, w, 1e-6, True), ref.rms_norm(x, w, 1e-6, True)
    unrounded = ref.rms(x.float() * w.float(), 1e-6).to(torch.bfloat16)
    differ = lambda a, b: (a != b).float().mean().item()  # noqa: E731
    assert differ(y, want) < 0.01, f"{differ(y, want):.2%} of the outputs differ from the reference's bf16 values"
    assert differ(unrounded, want) > 5 * differ(y, want), (
        f"the case does not tell a rounded product from an unrounded one ({differ(unrounded, want):.2%} differ)")


def test_scale_first_without_weight_is_an_error(xeon: XeonBackend) -> None:
    with pytest.raises(ValueError, match="scale_first=True needs a weight"):
        xeon.rms_norm(torch.randn(2, 8), None, 1e-6, True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("post", ["weightless", "scale_first"])
def test_residual_norm_matches_reference(xeon: XeonBackend, dtype, post: str, size: str) -> None:
    n = 256
    residual, out = rows(size, n, dtype), rows(size, n, dtype, 40.0)
    post_weight = None if post == "weightless" else (1 + 0.5 * torch.randn(n)).to(dtype)
    alpha, beta = ref.residual_gate_coefficients(torch.randn(n), 0.3)
    args = (residual, out, post_weight, alpha, beta, (1 + 0.2 * torch.randn(n)).to(dtype), 1e-8, 1e-5)
    for i, (want, got) in enumerate(zip(ref.residual_norm(*args), xeon.residual_norm(*args))):
        assert got.dtype == dtype and got.shape == residual.shape
        assert_nmse(want, got, tolerance("residual_norm"), f"residual_norm[{i}] post={post} {dtype} {size}")


def rope_tables(B: int, T: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    pos = torch.arange(T)[None].expand(B, T).float() + torch.arange(B)[:, None].float() * 17.0
    inv_freq = 500000.0 ** (-torch.arange(0, d, 2).float() / d)
    angles = torch.cat([pos[..., None] * inv_freq] * 2, dim=-1)  # [B,T,d]
    return angles.cos(), angles.sin()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rope", [True, False], ids=["rope", "nope"])
def test_qk_norm_rope_matches_reference(xeon: XeonBackend, dtype, rope: bool, size: str) -> None:
    B, T, nq, nkv, d = (2, 3, 8, 2, 64) if size == "decode" else (2, 160, 8, 2, 64)
    q, k = torch.randn(B, T, nq, d, dtype=dtype) * 3, torch.randn(B, T, nkv, d, dtype=dtype) * 3
    cos, sin = rope_tables(B, T, d) if rope else (None, None)
    args = (q, k, cos, sin, 1e-5, 5.4730064863875)
    got = xeon.qk_norm_rope(*args)
    for name, want, mine in zip("qk", ref.qk_norm_rope(*args), got):
        assert mine.dtype == dtype
        assert_nmse(want, mine, tolerance("qk_norm_rope"), f"qk_norm_rope {name} rope={rope} {dtype} {size}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,T", [(1, 1), (2, 1), (2, 3)])
def test_views_of_the_fused_projection_take_the_native_path(xeon: XeonBackend, dtype, B: int, T: int) -> None:
    """q, k and the gate come from one fused q/k/v/gate projection as non-contiguous views: the extension reads their head
    rows in place (no copy, no PyTorch fallback) and returns contiguous results equal to the reference's."""
    from musecore_xeon import ops as xops
    fast = xops.fast_ops()
    if fast is None:
        pytest.skip("no extension here")
    nq, nkv, d = 8, 2, 64
    fused = torch.randn(B, T, (2 * nq + 2 * nkv) * d, dtype=dtype) * 3
    q, k, _, gate = fused.split([nq * d, nkv * d, nkv * d, nq * d], dim=-1)
    q, k, gate = q.view(B, T, nq, d), k.view(B, T, nkv, d), gate.view(B, T, nq, d)
    assert B * T == 1 or not gate.is_contiguous()  # one token: a slice is contiguous (at an offset)
    for cos, sin in (rope_tables(B, T, d), (None, None)):
        got = fast.qk_norm_rope(q, k, cos, sin, 1e-5, 5.47)
        assert got is not None, "the native path declined a view of the fused projection"
        for name, want, mine in zip("qk", ref.qk_norm_rope(q, k, cos, sin, 1e-5, 5.47), got):
            assert mine.is_contiguous()
            assert_nmse(want, mine, tolerance("qk_norm_rope"), f"fused-view qk_norm_rope {name} {dtype} B={B} T={T}")
    o = torch.randn(B, T, nq, d, dtype=dtype)
    got = fast.head_norm_gate(o, gate, 1e-5)
    assert got is not None, "the native path declined a view of the fused projection"
    assert_nmse(ref.head_norm_gate(o, gate, 1e-5), got, tolerance("head_norm_gate"), f"fused-view gate {dtype}")
    assert fast.head_norm_gate(o, torch.randn(B, T, nq, 2 * d, dtype=dtype)[..., ::2], 1e-5) is None  # strided rows


def test_qk_norm_rope_scales_only_q(xeon: XeonBackend) -> None:
    q, k = torch.randn(1, 2, 4, 64), torch.randn(1, 2, 2, 64)
    q1, k1 = xeon.qk_norm_rope(q, k, None, None, 1e-5, 1.0)
    q5, k5 = xeon.qk_norm_rope(q, k, None, None, 1e-5, 5.0)
    assert torch.allclose(q5, 5 * q1, rtol=1e-6) and torch.equal(k5, k1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_head_norm_gate_is_element_wise(xeon: XeonBackend, dtype, size: str) -> None:
    shape = (2, 3, 4, 64) if size == "decode" else (2, 80, 8, 64)
    o, gate = torch.randn(*shape, dtype=dtype) * 3, torch.randn(*shape, dtype=dtype) * 2
    got = xeon.head_norm_gate(o, gate, 1e-5)
    assert got.dtype == dtype
    assert_nmse(ref.head_norm_gate(o, gate, 1e-5), got, tolerance("head_norm_gate"), f"head_norm_gate {dtype} {size}")
    with pytest.raises(ValueError, match="one gate per element"):
        xeon.head_norm_gate(o, gate[..., 0], 1e-5)


def router_case(T: int, H: int, E: int, dtype: torch.dtype, bias_scale: float = 0.05):
    x = torch.randn(T, H, dtype=dtype)
    weight = torch.randn(E, H) * H ** -0.5 * 4  # fp32, as the checkpoint stores it
    bias = torch.randn(E) * bias_scale
    return x, weight, bias


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,H,E,k", [(1, 256, 64, 8), (5, 256, 256, 8), (3, 128, 12, 12), (300, 128, 16, 4)])
def test_router_topk_matches_reference(xeon: XeonBackend, dtype, T: int, H: int, E: int, k: int) -> None:
    x, weight, bias = router_case(T, H, E, dtype)
    for multiplier, scaling in ((0.1767766952966369, 1.0), (1.0, 2.5)):
        (w0, i0), (w1, i1) = (ref.router_topk(x, weight, bias, k, multiplier, scaling),
                              xeon.router_topk(x, weight, bias, k, multiplier, scaling))
        assert torch.equal(i0, i1), f"T={T} E={E} k={k} {dtype}: ids {i1.tolist()} != {i0.tolist()}"
        assert w1.dtype == torch.float32 and w1.shape == (T, k) and i1.dtype == torch.int64
        assert_nmse(w0, w1, tolerance("router_topk"), f"router_topk T={T} E={E} k={k} mult={multiplier} {dtype}")


def test_router_bias_chooses_but_does_not_weight(xeon: XeonBackend) -> None:
    """A large correction bias on expert 3 puts it in every token's top-k; its weight is still its own sigmoid score
    (renormalised), never score + bias."""
    x, weight, bias = router_case(4, 128, 16, torch.float32, 0.0)
    bias[3] = 100.0
    weights, ids = xeon.router_topk(x, weight, bias, 4, 0.5, 1.0)
    assert torch.all(ids[:, 0] == 3), ids
    scores = torch.sigmoid(x @ weight.T * 0.5)
    chosen = scores.gather(-1, ids)
    assert_nmse(chosen / chosen.sum(-1, keepdim=True), weights, 1e-10, "bias-chosen expert weighted by its score")


def test_silu_mul_and_logit_softcap_match_reference(xeon: XeonBackend) -> None:
    gate, up = torch.randn(3, 512, dtype=torch.bfloat16), torch.randn(3, 512, dtype=torch.bfloat16)
    assert torch.equal(xeon.silu_mul(gate, up), ref.silu_mul(gate, up))
    logits = torch.randn(2, 1000, dtype=torch.bfloat16) * 50
    capped = xeon.logit_softcap(logits, 0.1767766952966369, 20.0)
    assert capped.dtype == torch.float32 and capped.abs().max() <= 20.0
    assert_nmse(ref.logit_softcap(logits, 0.1767766952966369, 20.0), capped, tolerance("logit_softcap"), "softcap")


@pytest.mark.parametrize("dtype", DTYPES)
def test_logit_softcap_in_place_gives_the_reference_bits_and_leaves_its_input(xeon: XeonBackend, dtype) -> None:
    """The xeon softcap runs the reference's ops in place on one fp32 buffer: the same bits (greedy decode must not
    move), and an fp32 input is copied, not overwritten."""
    logits = torch.randn(1, 1, 65536, dtype=dtype) * 40
    before = logits.clone()
    capped, expected = xeon.logit_softcap(logits, 0.2041241452319315, 30.0), ref.logit_softcap(logits, 0.2041241452319315, 30.0)
    differ = (capped != expected).sum().item()
    assert differ == 0, f"{differ} of {capped.numel()} softcapped logits differ from the reference's bits ({dtype})"
    assert torch.equal(logits, before), "logit_softcap overwrote its input"


def test_sample_is_the_reference_sampler(xeon: XeonBackend) -> None:
    vocab_logits = torch.randn(3, 500)
    assert torch.equal(xeon.sample(vocab_logits), ref.sample(vocab_logits))
    for kwargs in ({"temperature": 0.8, "top_k": 20}, {"temperature": 1.0, "top_p": 0.9}):
        a = xeon.sample(vocab_logits, generator=torch.Generator().manual_seed(3), **kwargs)
        b = ref.sample(vocab_logits, generator=torch.Generator().manual_seed(3), **kwargs)
        assert torch.equal(a, b), kwargs


def attention_case(B: int, T: int, S: int, nq: int, nkv: int, d: int, dtype: torch.dtype):
    q = torch.randn(B, T, nq, d, dtype=dtype)
    k, v = torch.randn(B, S, nkv, d, dtype=dtype), torch.randn(B, S, nkv, d, dtype=dtype)
    return q, k, v


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("nq,nkv", [(4, 4), (8, 2)])
def test_attention_prefill(xeon: XeonBackend, dtype, window, nq, nkv) -> None:
    B, T, d = 2, 11, 32
    q, k, v = attention_case(B, T, T, nq, nkv, d, dtype)
    pos = torch.arange(T)[None].repeat(B, 1)
    pos[1, :3] = -1  # left padding: empty key slots, and padded queries that see nothing
    args = (q, k, v, pos, pos, window, d ** -0.5)
    out = xeon.attention(*args)
    assert out.dtype == dtype
    assert torch.all(out[1, :3] == 0), "queries that see no key must return zeros"
    assert_nmse(ref.attention(*args), out, tolerance("attention"), f"prefill {dtype} window={window} {nq}/{nkv}")


@pytest.mark.parametrize("window", [None, 6])
def test_attention_decode_over_ring_buffer(xeon: XeonBackend, window) -> None:
    """One new token per sequence over a cache whose slots hold positions out of order (ring buffer)."""
    B, S, nq, nkv, d = 3, 8, 8, 2, 64
    q, k, v = attention_case(B, 1, S, nq, nkv, d, torch.bfloat16)
    k_pos = torch.tensor([[8, 9, 10, 11, 4, 5, 6, 7],      # wrapped ring: slot order != position order
                          [0, 1, 2, -1, -1, -1, -1, -1],   # short sequence: empty slots
                          [3, 4, 5, 6, 7, 8, 9, 10]])
    q_pos = torch.tensor([[11], [2], [10]])
    args = (q, k, v, q_pos, k_pos, window, d ** -0.5)
    assert_nmse(ref.attention(*args), xeon.attention(*args), tolerance("attention"), f"decode window={window}")


def test_attention_fp8_kv_with_scales(xeon: XeonBackend) -> None:
    B, T, nq, nkv, d = 1, 6, 4, 2, 32
    q, k, v = attention_case(B, T, T, nq, nkv, d, torch.bfloat16)
    k8, v8 = (k.float() / 0.05).to(torch.float8_e4m3fn), (v.float() / 0.07).to(torch.float8_e4m3fn)
    pos = torch.arange(T)[None]
    args = (q, k8, v8, pos, pos, None, d ** -0.5, 0.05, 0.07)
    assert_nmse(ref.attention(*args), xeon.attention(*args), tolerance("attention"), "fp8 kv")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,d,window", [(1, 128, None), (4, 36, 3)])  # d = 36: the dot product's scalar tail
def test_attention_few_queries_native_path_matches_reference(xeon: XeonBackend, dtype, T: int, d: int,
                                                            window) -> None:
    """T <= NATIVE_ATTENTION_MAX_QUERIES runs the C loop: GQA, windows, empty slots, a query that sees nothing."""
    from musecore_xeon import ops as xops
    assert T <= xops.NATIVE_ATTENTION_MAX_QUERIES
    B, S, nq, nkv = 2, 13, 8, 2
    q, k, v = attention_case(B, T, S, nq, nkv, d, dtype)
    k_pos = torch.arange(S)[None].repeat(B, 1)
    k_pos[1, 5:] = -1
    q_pos = torch.arange(S - T, S)[None].repeat(B, 1)
    q_pos[1, 0] = -1  # sees nothing
    args = (q, k, v, q_pos, k_pos, window, d ** -0.5)
    out = xeon.attention(*args)
    assert out.dtype == dtype and torch.all(out[1, 0] == 0)
    assert_nmse(ref.attention(*args), out, 1e-10 if dtype == torch.float32 else tolerance("attention"),
                f"native attention {dtype} T={T} d={d} window={window}")


@pytest.mark.parametrize("nq,nkv", [(8, 2), (8, 8), (8, 1), (24, 3)])  # GQA, MHA, MQA, muse-small (parallel at 2)
def test_native_attention_gives_the_same_bits_for_every_thread_count(nq: int, nkv: int) -> None:
    """The C loop takes all query heads of a kv head per item (each K/V row converted once), or fewer where that
    leaves fewer items than threads or a count the threads cannot share evenly: the per-head arithmetic is the same
    either way, so the outputs are equal bit for bit at 1, 2, 8 and 64 threads (64: one head per item), and match the
    reference. muse-small's heads at 40 keys run in parallel (6 items of 4 heads at 2 threads)."""
    from musecore_xeon import ops as xops
    from musecore_xeon.kernels import native
    lib = native.load()
    if lib is None:
        pytest.skip(f"the native kernels are not built here: {native.UNAVAILABLE}")
    B, T, S, d = 1, 1, 40, 64
    q, k, v = attention_case(B, T, S, nq, nkv, d, torch.bfloat16)
    k_pos = torch.arange(S)[None].clone()
    k_pos[0, 30:] = -1
    q_pos = torch.tensor([[29]])
    outs = []
    for threads in (1, 2, 8, 64):
        out = torch.empty_like(q)
        lib.musecore_attention(q.data_ptr(), 1, k.data_ptr(), v.data_ptr(), 1, q_pos.data_ptr(), k_pos.data_ptr(), 7,
                               d ** -0.5, out.data_ptr(), B, T, S, nq, nkv, d, threads)
        outs.append(out)
    for threads, out in zip((2, 8, 64), outs[1:]):
        diff = (out.float() - outs[0].float()).abs().max().item()
        assert torch.equal(out, outs[0]), f"nq={nq} nkv={nkv}: {threads} threads differ from 1 by {diff:.3g}"
    assert_nmse(ref.attention(q, k, v, q_pos, k_pos, 7, d ** -0.5), outs[0], tolerance("attention"),
                f"native attention nq={nq} nkv={nkv}")
    assert xops.NATIVE_ATTENTION_MAX_QUERIES >= T


def test_decode_ops_go_through_the_extension_and_match_the_ctypes_kernels(xeon: XeonBackend) -> None:
    """The extension calls the same C kernels as ctypes (the same bits); what it cannot take returns None (the op then
    takes its PyTorch path): fp16, non-contiguous, more than NATIVE_NORM_MAX_ELEMENTS elements, mismatched shapes."""
    from musecore_xeon import ops as xops
    from musecore_xeon.kernels import native
    fast = xops.fast_ops()
    if fast is None:
        pytest.skip(f"no extension here: {native.binding.UNAVAILABLE or native.UNAVAILABLE}")
    x, w = torch.randn(1, 1, 1536, dtype=torch.bfloat16), 1 + 0.2 * torch.randn(1536)
    lib = native.load()
    for scale_first in (0, 1):
        y = fast.rms_norm(x, w, 1e-6, bool(scale_first))
        want = torch.empty_like(x)
        lib.musecore_rms_norm(x.data_ptr(), 1, w.data_ptr(), 0, want.data_ptr(), 1, 1, 1536, 1e-6, scale_first)
        assert y is not None and torch.equal(y, want), f"scale_first={scale_first}"
    assert torch.equal(fast.rms_norm(x, None, 1e-6, False), ref.rms_norm(x, None, 1e-6))
    alpha, beta = ref.residual_gate_coefficients(torch.randn(1536), 0.3)
    for post in (None, w):
        pair = fast.residual_norm(x, x * 2, post, alpha, beta, w, 1e-8, 1e-6)
        for got, ref_out in zip(pair, ref.residual_norm(x, x * 2, post, alpha, beta, w, 1e-8, 1e-6)):
            assert_nmse(ref_out, got, tolerance("residual_norm"), f"extension residual_norm post={post is not None}")
    assert fast.rms_norm(x.half(), w, 1e-6, False) is None
    assert fast.rms_norm(x, None, 1e-6, True) is None  # scale first needs a weight: the op raises on its own path
    assert fast.rms_norm(torch.randn(1536, 2).T, w[:2], 1e-6, False) is None
    assert fast.rms_norm(torch.randn(xops.NATIVE_NORM_MAX_ELEMENTS + 1), torch.ones(xops.NATIVE_NORM_MAX_ELEMENTS + 1),
                         1e-6, False) is None
    assert fast.residual_norm(x, torch.randn(1, 2, 1536, dtype=torch.bfloat16), w, alpha, beta, w, 1e-8, 1e-6) is None
    assert fast.residual_norm(x, x, w, alpha.bfloat16(), beta, w, 1e-8, 1e-6) is None  # alpha, beta are fp32
    assert fast.head_norm_gate(torch.randn(2, 4, 32), torch.randn(2, 4), 1e-6) is None
    assert fast.qk_norm_rope(torch.randn(1, 1, 2, 8), torch.randn(1, 1, 1, 8), torch.ones(1, 1, 8), None, 1e-6, 1.0) is None
    assert fast.router_topk(torch.randn(3, 8), None, 9, 1.0, 1.0) is None
    assert fast.router_topk(torch.randn(3, 8).bfloat16(), None, 2, 1.0, 1.0) is None  # the logits are fp32
    with pytest.raises(TypeError, match="takes 4 arguments"):
        fast.rms_norm(x, w, 1e-6)
    # decode attention: the same bits as the ctypes call; a KV cache larger than NATIVE_NORM_MAX_ELEMENTS is taken;
    # int32 positions, fp16, more than NATIVE_ATTENTION_MAX_QUERIES queries and mismatched K/V are not
    q, k, v = attention_case(1, 1, 300, 16, 4, 128, torch.bfloat16)
    assert k.numel() > xops.NATIVE_NORM_MAX_ELEMENTS
    k_pos = torch.arange(300)[None].clone()
    k_pos[0, 200:] = -1
    q_pos = torch.tensor([[199]])
    got = fast.attention(q, k, v, q_pos, k_pos, 64, 0.088, 2)
    want = torch.empty_like(q)
    lib.musecore_attention(q.data_ptr(), 1, k.data_ptr(), v.data_ptr(), 1, q_pos.data_ptr(), k_pos.data_ptr(), 64,
                           0.088, want.data_ptr(), 1, 1, 300, 16, 4, 128, 2)
    assert got is not None and torch.equal(got, want)
    assert fast.attention(q, k, v, q_pos.int(), k_pos, 64, 0.088, 2) is None
    assert fast.attention(q.half(), k.half(), v.half(), q_pos, k_pos, 64, 0.088, 2) is None
    assert fast.attention(q, k, v.float(), q_pos, k_pos, 64, 0.088, 2) is None
    many = torch.randn(1, xops.NATIVE_ATTENTION_MAX_QUERIES + 1, 16, 128, dtype=torch.bfloat16)
    assert fast.attention(many, k, v, q_pos.repeat(1, many.shape[1]), k_pos, 64, 0.088, 2) is None


@pytest.mark.parametrize("dtype", DTYPES)
def test_odd_widths_take_the_scalar_tails(xeon: XeonBackend, dtype) -> None:
    """Widths that are not multiples of 8 (norms) or whose half is not (RoPE): the C loops' scalar tails."""
    n, d = 100, 36
    x, w = torch.randn(3, n, dtype=dtype) * 3, (1 + 0.5 * torch.randn(n)).to(dtype)
    for weight, scale_first in ((w, False), (None, False), (w, True)):
        assert_nmse(ref.rms_norm(x, weight, 1e-6, scale_first), xeon.rms_norm(x, weight, 1e-6, scale_first),
                    tolerance("rms_norm"), f"rms_norm n={n} scale_first={scale_first} {dtype}")
    alpha, beta = ref.residual_gate_coefficients(torch.randn(n), 0.3)
    args = (x, x * 7, w, alpha, beta, w, 1e-8, 1e-5)
    for want, got in zip(ref.residual_norm(*args), xeon.residual_norm(*args)):
        assert_nmse(want, got, tolerance("residual_norm"), f"residual_norm n={n} {dtype}")
    q, k = torch.randn(1, 2, 4, d, dtype=dtype), torch.randn(1, 2, 2, d, dtype=dtype)
    cos, sin = rope_tables(1, 2, d)
    for want, got in zip(ref.qk_norm_rope(q, k, cos, sin, 1e-5, 2.0), xeon.qk_norm_rope(q, k, cos, sin, 1e-5, 2.0)):
        assert_nmse(want, got, tolerance("qk_norm_rope"), f"qk_norm_rope d={d} {dtype}")
    gate = torch.randn_like(q)
    assert_nmse(ref.head_norm_gate(q, gate, 1e-5), xeon.head_norm_gate(q, gate, 1e-5), tolerance("head_norm_gate"),
                f"head_norm_gate d={d} {dtype}")


def test_portable_build_of_the_norm_and_router_kernels_matches_reference() -> None:
    """The ``#ifndef __AVX2__`` paths (built without ISA flags) compute the same contracts."""
    from musecore_xeon.kernels import native
    lib = native.load_portable()
    if lib is None:
        pytest.skip(f"no C compiler here: {native.UNAVAILABLE}")
    n = 256
    x, w = torch.randn(4, n, dtype=torch.bfloat16) * 3, (1 + 0.5 * torch.randn(n)).to(torch.bfloat16)
    for scale_first in (0, 1):
        out = torch.empty_like(x)
        lib.musecore_rms_norm(x.data_ptr(), 1, w.data_ptr(), 1, out.data_ptr(), 1, 4, n, 1e-6, scale_first)
        assert_nmse(ref.rms_norm(x, w, 1e-6, bool(scale_first)), out, tolerance("rms_norm"),
                    f"portable rms_norm scale_first={scale_first}")
    alpha, beta = ref.residual_gate_coefficients(torch.randn(n), 0.3)
    new_res, normed, out = torch.empty_like(x), torch.empty_like(x), x * 5  # out kept alive across the call
    lib.musecore_residual_norm(x.data_ptr(), out.data_ptr(), 1, w.data_ptr(), 1, alpha.data_ptr(), beta.data_ptr(),
                               w.data_ptr(), 1, new_res.data_ptr(), normed.data_ptr(), 1, 4, n, 1e-8, 1e-5)
    for want, got in zip(ref.residual_norm(x, out, w, alpha, beta, w, 1e-8, 1e-5), (new_res, normed)):
        assert_nmse(want, got, tolerance("residual_norm"), "portable residual_norm")
    x, weight, bias = router_case(3, 128, 32, torch.float32)
    logits = x @ weight.T
    weights, ids = torch.empty(3, 8), torch.empty(3, 8, dtype=torch.int64)
    assert lib.musecore_router_topk(logits.data_ptr(), bias.data_ptr(), 3, 32, 8, 0.5, 2.0, weights.data_ptr(),
                                    ids.data_ptr()) == 0
    w0, i0 = ref.router_topk(x, weight, bias, 8, 0.5, 2.0)
    assert torch.equal(i0, ids)
    assert_nmse(w0, weights, tolerance("router_topk"), "portable router_topk")
