"""Fused row kernels (rms_norm, residual_norm, qk_norm_rope, head_norm_gate) against the reference."""

from __future__ import annotations

import pytest
import torch

from musecore.ops import reference as ref
from musecore.ops import tolerance

from musecore_cuda.testing import DEVICE, SMALL_DTYPES, assert_nmse

from musecore_cuda import CudaBackend

DTYPES = SMALL_DTYPES + [torch.float32]


def rope_tables(B: int, T: int, d: int):
    inv_freq = 10000.0 ** (-torch.arange(0, d, 2).float() / d)
    pos = torch.arange(T).float()[None, :, None] + torch.arange(B).float()[:, None, None] * 3
    angles = torch.cat([pos * inv_freq, pos * inv_freq], dim=-1)  # [B,T,d]
    return angles.cos().to(DEVICE), angles.sin().to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_reference(dtype):
    x = (torch.randn(3, 5, 200, device=DEVICE) * 3).to(dtype)  # 200: not a power of two
    w = torch.randn(200, device=DEVICE)
    y = CudaBackend(DEVICE).rms_norm(x, w, 1e-6)
    assert y.dtype == dtype
    assert_nmse(ref.rms_norm(x, w, 1e-6), y, tolerance("rms_norm"), f"rms_norm {dtype}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_residual_norm_rounds_the_new_residual_before_the_next_norm(dtype):
    res = torch.randn(4, 256, device=DEVICE).to(dtype)
    out = torch.randn(4, 256, device=DEVICE).to(dtype)
    post, gate, nxt = (torch.randn(256, device=DEVICE) for _ in range(3))
    new_res, normed = CudaBackend(DEVICE).residual_norm(res, out, post, gate, nxt, 1e-6)
    exp_res, exp_normed = ref.residual_norm(res, out, post, gate, nxt, 1e-6)
    assert_nmse(exp_res, new_res, tolerance("residual_norm"), "residual")
    assert_nmse(exp_normed, normed, tolerance("residual_norm"), "normed")


@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norm_rope_matches_reference(dtype):
    B, T, nq, nkv, d = 2, 3, 4, 2, 64
    q = torch.randn(B, T, nq, d, device=DEVICE).to(dtype)
    k = torch.randn(B, T, nkv, d, device=DEVICE).to(dtype)
    qw, kw = torch.randn(d, device=DEVICE), torch.randn(d, device=DEVICE)
    cos, sin = rope_tables(B, T, d)
    q2, k2 = CudaBackend(DEVICE).qk_norm_rope(q, k, qw, kw, cos, sin, 1e-6)
    eq, ek = ref.qk_norm_rope(q, k, qw, kw, cos, sin, 1e-6)
    assert_nmse(eq, q2, tolerance("qk_norm_rope"), "q")
    assert_nmse(ek, k2, tolerance("qk_norm_rope"), "k")


@pytest.mark.parametrize("dtype", DTYPES)
def test_head_norm_gate_matches_reference(dtype):
    o = torch.randn(2, 3, 4, 64, device=DEVICE).to(dtype)
    w = torch.randn(64, device=DEVICE)
    g = torch.randn(2, 3, 4, device=DEVICE).to(dtype)
    y = CudaBackend(DEVICE).head_norm_gate(o, w, g, 1e-6)
    assert_nmse(ref.head_norm_gate(o, w, g, 1e-6), y, tolerance("head_norm_gate"), "head_norm_gate")


@pytest.mark.parametrize("B,T", [(1, 1), (2, 1), (1, 3), (2, 3)])
def test_head_kernels_read_slices_of_a_fused_projection(B, T):
    """q, k and the gates as views into one ``[B,T,(nq+nkv)*d + nq]`` projection output (how the
    model's fused q/k/v/gate linear hands them over), and a k that is not token-evenly spaced."""
    nq, nkv, d = 4, 2, 64
    fused = torch.randn(B, T, (nq + 2 * nkv) * d + nq, device=DEVICE).half()
    q, k, _v, g = fused.split((nq * d, nkv * d, nkv * d, nq), dim=-1)
    q, k = q.view(B, T, nq, d), k.view(B, T, nkv, d)
    qw, kw, ow = (torch.randn(d, device=DEVICE) for _ in range(3))
    cos, sin = rope_tables(B, T, d)
    be = CudaBackend(DEVICE)
    for name, kk in (("k slice", k), ("k transposed", torch.randn(B, nkv, T, d, device=DEVICE).half().transpose(1, 2))):
        q2, k2 = be.qk_norm_rope(q, kk, qw, kw, cos, sin, 1e-6)
        eq, ek = ref.qk_norm_rope(q, kk, qw, kw, cos, sin, 1e-6)
        assert_nmse(eq, q2, tolerance("qk_norm_rope"), f"q ({name}, B={B} T={T})")
        assert_nmse(ek, k2, tolerance("qk_norm_rope"), f"k ({name}, B={B} T={T})")
    o = torch.randn(B, T, nq, d, device=DEVICE).half()
    assert_nmse(ref.head_norm_gate(o, ow, g, 1e-6), be.head_norm_gate(o, ow, g, 1e-6), tolerance("head_norm_gate"),
                f"head_norm_gate, gates sliced (B={B} T={T})")


@pytest.mark.parametrize("e,k,renormalize", [(16, 4, True), (12, 3, True), (256, 8, True), (64, 8, False),
                                               (40, 6, False)])
def test_router_topk_matches_reference(e, k, renormalize):
    """Same ids in the same order (descending weight) and fp32 weights within the op tolerance.
    Logits are distinct (a permutation / 16, exact in fp16): the order of tied experts is not defined."""
    logits = (torch.stack([torch.randperm(e) for _ in range(5)]).float() / 16).to(DEVICE).half()
    w, ids = CudaBackend(DEVICE).router_topk(logits, k, renormalize)
    ew, eids = ref.router_topk(logits, k, renormalize)
    assert torch.equal(ids, eids), f"E={e} k={k}: ids {ids.tolist()} vs reference {eids.tolist()}"
    assert w.dtype == torch.float32 and w.shape == (5, k)
    assert_nmse(ew, w, tolerance("router_topk"), f"router weights E={e} k={k}")
