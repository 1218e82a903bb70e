"""The non-GEMM ops against the reference with the interface's NMSE tolerances."""

from __future__ import annotations

import pytest
import torch

from musecore.testing import assert_nmse
from musecore.ops import reference as ref
from musecore.ops import tolerance
from musecore_xeon import XeonBackend

DTYPES = [torch.bfloat16, torch.float32]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm(xeon: XeonBackend, dtype) -> None:
    x, w = torch.randn(5, 7, 256, dtype=dtype) * 3, 1 + 0.2 * torch.randn(256)
    y = xeon.rms_norm(x, w, 1e-6)
    assert y.dtype == dtype
    assert_nmse(ref.rms_norm(x, w, 1e-6), y, tolerance("rms_norm"), f"rms_norm {dtype}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_residual_norm(xeon: XeonBackend, dtype) -> None:
    args = (torch.randn(3, 9, 128, dtype=dtype), torch.randn(3, 9, 128, dtype=dtype), 1 + 0.2 * torch.randn(128),
            1 + 0.2 * torch.randn(128), 1 + 0.2 * torch.randn(128), 1e-6)
    for i, (want, got) in enumerate(zip(ref.residual_norm(*args), xeon.residual_norm(*args))):
        assert got.dtype == dtype
        assert_nmse(want, got, tolerance("residual_norm"), f"residual_norm[{i}] {dtype}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norm_rope(xeon: XeonBackend, dtype) -> None:
    B, T, nq, nkv, d = 2, 5, 4, 2, 64
    q, k = torch.randn(B, T, nq, d, dtype=dtype), torch.randn(B, T, nkv, d, dtype=dtype)
    pos = torch.arange(T)[None].expand(B, T).float() + torch.tensor([[0.0], [17.0]])
    inv_freq = 10000.0 ** (-torch.arange(0, d, 2).float() / d)
    angles = torch.cat([pos[..., None] * inv_freq] * 2, dim=-1)  # [B,T,d]
    args = (q, k, 1 + 0.2 * torch.randn(d), 1 + 0.2 * torch.randn(d), angles.cos(), angles.sin(), 1e-6)
    for name, want, got in zip("qk", ref.qk_norm_rope(*args), xeon.qk_norm_rope(*args)):
        assert_nmse(want, got, tolerance("qk_norm_rope"), f"qk_norm_rope {name} {dtype}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_head_norm_gate(xeon: XeonBackend, dtype) -> None:
    args = (torch.randn(2, 3, 4, 32, dtype=dtype), 1 + 0.2 * torch.randn(32), torch.randn(2, 3, 4, dtype=dtype), 1e-6)
    assert_nmse(ref.head_norm_gate(*args), xeon.head_norm_gate(*args), tolerance("head_norm_gate"),
                      f"head_norm_gate {dtype}")


def test_router_topk_and_sample_are_exact(xeon: XeonBackend) -> None:
    logits = torch.randn(7, 64)
    for renorm in (True, False):
        (w0, i0), (w1, i1) = ref.router_topk(logits, 8, renorm), xeon.router_topk(logits, 8, renorm)
        assert torch.equal(i0, i1)
        assert_nmse(w0, w1, tolerance("router_topk"), f"router_topk renormalize={renorm}")
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


@pytest.mark.parametrize("nq,nkv", [(8, 2), (8, 8), (8, 1)])  # GQA, MHA, MQA
def test_native_attention_gives_the_same_bits_for_every_thread_count(nq: int, nkv: int) -> None:
    """The C loop takes all query heads of a kv head per item (each K/V row converted once), or fewer where that
    leaves fewer items than threads: the per-head arithmetic is the same either way, so the outputs are equal bit for
    bit at 1, 2, 8 and 64 threads (64: one head per item), and match the reference."""
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
    takes its other path): fp16, non-contiguous, more than NATIVE_NORM_MAX_ELEMENTS elements, mismatched shapes."""
    from musecore_xeon import ops as xops
    from musecore_xeon.kernels import native
    fast = xops._fast()
    if fast is None:
        pytest.skip(f"no extension here: {native.binding.UNAVAILABLE or native.UNAVAILABLE}")
    x, w = torch.randn(1, 1, 1536, dtype=torch.bfloat16), 1 + 0.2 * torch.randn(1536)
    y = fast.rms_norm(x, w, 1e-6)
    lib, want = native.load(), torch.empty_like(x)
    lib.musecore_rms_norm(x.data_ptr(), 1, w.data_ptr(), 0, want.data_ptr(), 1, 1, 1536, 1e-6)
    assert y is not None and torch.equal(y, want)
    gate = torch.rand(1536)
    new_res, normed = fast.residual_norm(x, x * 2, w, gate, w, 1e-6)
    for got, ref_out in zip((new_res, normed), ref.residual_norm(x, x * 2, w, gate, w, 1e-6)):
        assert_nmse(ref_out, got, tolerance("residual_norm"), "extension residual_norm")
    assert fast.rms_norm(x.half(), w, 1e-6) is None
    assert fast.rms_norm(torch.randn(1536, 2).T, w[:2], 1e-6) is None
    assert fast.rms_norm(torch.randn(xops.NATIVE_NORM_MAX_ELEMENTS + 1), torch.ones(xops.NATIVE_NORM_MAX_ELEMENTS + 1),
                         1e-6) is None
    assert fast.residual_norm(x, torch.randn(1, 2, 1536, dtype=torch.bfloat16), w, gate, w, 1e-6) is None
    assert fast.head_norm_gate(torch.randn(2, 4, 32), torch.ones(32), torch.randn(2, 5), 1e-6) is None
    assert fast.router_topk(torch.randn(3, 8), 9, True) is None
    with pytest.raises(TypeError, match="takes 3 arguments"):
        fast.rms_norm(x, w)
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
def test_native_router_topk_picks_the_reference_experts(xeon: XeonBackend, dtype) -> None:
    for T, E, k in ((1, 64, 8), (5, 256, 8), (3, 12, 12)):
        logits = ((torch.argsort(torch.randn(T, E), dim=-1) - E // 2).float() / 16).to(dtype)  # distinct values
        for renorm in (True, False):
            (w0, i0), (w1, i1) = ref.router_topk(logits, k, renorm), xeon.router_topk(logits, k, renorm)
            assert torch.equal(i0, i1), f"T={T} E={E} k={k} {dtype}: ids {i1.tolist()} != {i0.tolist()}"
            assert w1.dtype == torch.float32 and w1.shape == (T, k)
            assert_nmse(w0, w1, tolerance("router_topk"), f"router_topk T={T} E={E} k={k} renormalize={renorm} {dtype}")
