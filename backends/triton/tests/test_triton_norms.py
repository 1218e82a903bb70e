"""Fused row kernels (rms_norm, residual_norm, qk_norm_rope, head_norm_gate) against the reference."""

from __future__ import annotations

import pytest
import torch

from musecore.ops import reference as ref
from musecore.ops import tolerance

from musecore_triton.testing import DEVICE, SMALL_DTYPES, assert_nmse

from musecore_triton.kernels import norms

DTYPES = SMALL_DTYPES + [torch.float32]
NORM_KINDS = ["weighted", "weightless", "scale_first"]


def rope_tables(B: int, T: int, d: int):
    inv_freq = 10000.0 ** (-torch.arange(0, d, 2).float() / d)
    pos = torch.arange(T).float()[None, :, None] + torch.arange(B).float()[:, None, None] * 3
    angles = torch.cat([pos * inv_freq, pos * inv_freq], dim=-1)  # [B,T,d]
    return angles.cos().to(DEVICE), angles.sin().to(DEVICE)


def centred_weight(n: int, dtype: torch.dtype) -> torch.Tensor:
    """``1 + w`` as the loader folds a centred norm weight, in the model dtype."""
    return (1.0 + 0.5 * torch.randn(n, device=DEVICE)).to(dtype)


@pytest.mark.parametrize("kind", NORM_KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_reference(kind, dtype):
    x = (torch.randn(3, 5, 200, device=DEVICE) * 3).to(dtype)  # 200: not a power of two
    w = None if kind == "weightless" else centred_weight(200, dtype)
    y = norms.rms_norm(x, w, 1e-6, scale_first=kind == "scale_first")
    assert y.dtype == dtype
    assert_nmse(ref.rms_norm(x, w, 1e-6, kind == "scale_first"), y, tolerance("rms_norm"), f"rms_norm {kind} {dtype}")


@pytest.mark.skipif(DEVICE.type != "cpu", reason="fp16 rounding of x*w is shown on the interpreter's fp16 run")
def test_scale_first_norm_rounds_the_scaled_input_before_normalising():
    """Values whose product with the weight is not representable in fp16: the kernel must round it first
    (bit-exact against the reference here, where an unrounded product differs)."""
    x = (torch.randn(4, 64, device=DEVICE) * 3).half()
    w = torch.full((64,), 1.0 + 2 ** -9, device=DEVICE).half()  # x*w falls between fp16 neighbours
    y = norms.rms_norm(x, w, 1e-8, scale_first=True)
    unrounded = ref.rms(x.float() * w.float(), 1e-8).half()
    assert torch.equal(y, ref.rms_norm(x, w, 1e-8, scale_first=True))
    assert not torch.equal(y, unrounded)


@pytest.mark.parametrize("post", ["weightless", "scale_first"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_residual_norm_gates_the_residual_and_rounds_it_before_the_next_norm(post, dtype):
    res = torch.randn(4, 256, device=DEVICE).to(dtype)
    out = (torch.randn(4, 256, device=DEVICE) * 4).to(dtype)
    post_w = None if post == "weightless" else centred_weight(256, dtype)
    alpha, beta = ref.residual_gate_coefficients(torch.randn(256, device=DEVICE), 0.3)
    nxt = centred_weight(256, dtype)
    new_res, normed = norms.residual_norm(res, out, post_w, alpha, beta, nxt, 1e-8, 1e-5)
    exp_res, exp_normed = ref.residual_norm(res, out, post_w, alpha, beta, nxt, 1e-8, 1e-5)
    assert new_res.dtype == normed.dtype == dtype
    assert_nmse(exp_res, new_res, tolerance("residual_norm"), f"residual ({post} post norm, {dtype})")
    assert_nmse(exp_normed, normed, tolerance("residual_norm"), f"normed ({post} post norm, {dtype})")


def test_residual_gate_weights_the_residual_and_the_sublayer_separately():
    """alpha = 0 keeps only the normed sublayer output, beta = 0 only the residual (fp32 gate, exact)."""
    res, out = torch.randn(2, 128, device=DEVICE).half(), torch.randn(2, 128, device=DEVICE).half()
    ones, zeros = torch.ones(128, device=DEVICE), torch.zeros(128, device=DEVICE)
    be = norms  # the kernel module offers the ops by their names
    only_res, _ = be.residual_norm(res, out, None, ones, zeros, None, 1e-8, 1e-5)
    only_out, _ = be.residual_norm(res, out, None, zeros, ones, None, 1e-8, 1e-5)
    assert torch.equal(only_res, res)
    assert torch.equal(only_out, ref.rms_norm(out, None, 1e-8))


@pytest.mark.parametrize("rope", [True, False], ids=["rope", "nope"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norm_rope_matches_reference(rope, dtype):
    B, T, nq, nkv, d = 2, 3, 4, 2, 64
    q = torch.randn(B, T, nq, d, device=DEVICE).to(dtype)
    k = torch.randn(B, T, nkv, d, device=DEVICE).to(dtype)
    cos, sin = rope_tables(B, T, d) if rope else (None, None)
    q2, k2 = norms.qk_norm_rope(q, k, cos, sin, 1e-5, 5.4730064863875)
    eq, ek = ref.qk_norm_rope(q, k, cos, sin, 1e-5, 5.4730064863875)
    assert_nmse(eq, q2, tolerance("qk_norm_rope"), f"q ({'rope' if rope else 'nope'}, {dtype})")
    assert_nmse(ek, k2, tolerance("qk_norm_rope"), f"k ({'rope' if rope else 'nope'}, {dtype})")


def test_q_scale_multiplies_q_only():
    q, k = torch.randn(1, 2, 2, 64, device=DEVICE), torch.randn(1, 2, 1, 64, device=DEVICE)
    be = norms  # the kernel module offers the ops by their names
    q1, k1 = be.qk_norm_rope(q, k, None, None, 1e-5, 1.0)
    q3, k3 = be.qk_norm_rope(q, k, None, None, 1e-5, 3.0)
    assert torch.equal(k1, k3)
    assert_nmse(q1 * 3.0, q3, 1e-12, "q scaled by 3")


@pytest.mark.parametrize("dtype", DTYPES)
def test_head_norm_gate_gates_each_element(dtype):
    o = torch.randn(2, 3, 4, 64, device=DEVICE).to(dtype)
    g = (torch.randn(2, 3, 4, 64, device=DEVICE) * 2).to(dtype)
    y = norms.head_norm_gate(o, g, 1e-5)
    assert_nmse(ref.head_norm_gate(o, g, 1e-5), y, tolerance("head_norm_gate"), f"head_norm_gate {dtype}")


@pytest.mark.parametrize("B,T", [(1, 1), (2, 1), (1, 3), (2, 3)])
def test_head_kernels_read_slices_of_a_fused_projection(B, T):
    """q, k and the gates as views into one ``[B,T,(nq+2nkv)*d + nq*d]`` projection output (how the
    model's fused q/k/v/gate linear hands them over), and a k that is not token-evenly spaced."""
    nq, nkv, d = 4, 2, 64
    fused = torch.randn(B, T, (nq + 2 * nkv) * d + nq * d, device=DEVICE).half()
    q, k, _v, g = fused.split((nq * d, nkv * d, nkv * d, nq * d), dim=-1)
    q, k, g = q.view(B, T, nq, d), k.view(B, T, nkv, d), g.view(B, T, nq, d)
    cos, sin = rope_tables(B, T, d)
    be = norms  # the kernel module offers the ops by their names
    for name, kk in (("k slice", k), ("k transposed", torch.randn(B, nkv, T, d, device=DEVICE).half().transpose(1, 2))):
        q2, k2 = be.qk_norm_rope(q, kk, cos, sin, 1e-5, 2.0)
        eq, ek = ref.qk_norm_rope(q, kk, cos, sin, 1e-5, 2.0)
        assert_nmse(eq, q2, tolerance("qk_norm_rope"), f"q ({name}, B={B} T={T})")
        assert_nmse(ek, k2, tolerance("qk_norm_rope"), f"k ({name}, B={B} T={T})")
    o = torch.randn(B, T, nq, d, device=DEVICE).half()
    assert_nmse(ref.head_norm_gate(o, g, 1e-5), be.head_norm_gate(o, g, 1e-5), tolerance("head_norm_gate"),
                f"head_norm_gate, gates sliced (B={B} T={T})")


def test_head_norm_gate_rejects_one_gate_per_head():
    o = torch.randn(1, 1, 4, 64, device=DEVICE).half()
    with pytest.raises(ValueError, match=r"\[B,T,nq,d\]"):
        norms.head_norm_gate(o, torch.randn(1, 1, 4, device=DEVICE).half(), 1e-5)


@pytest.mark.parametrize("ring,position", [(False, 5), (True, 11), (False, -1)])
@pytest.mark.parametrize("rope", [True, False], ids=["rope", "nope"])
def test_qk_norm_rope_kv_write_gives_the_cache_of_the_two_ops(ring, position, rope):
    """The q/k norms and RoPE writing k and v straight into a static cache: the same q, and the same cache bits as
    qk_norm_rope followed by write_static (a ring wraps the slot; padding goes to the trash slot)."""
    from musecore.kv_cache import write_static
    B, T, nq, nkv, d, capacity = 1, 1, 4, 2, 32, 8
    y = torch.randn(B, T, (2 * nq + 2 * nkv) * d, device=DEVICE).half().view(B, T, -1, d)
    q, k, v, _ = y.split_with_sizes([nq, nkv, nkv, nq], -2)
    cos, sin = rope_tables(B, T, d) if rope else (None, None)
    pos = torch.tensor([[position]], device=DEVICE)
    caches = [[torch.randn(B, capacity + 1, nkv, d, device=DEVICE).half() for _ in range(2)]
              + [torch.randint(-1, 9, (B, capacity + 1), device=DEVICE)] for _ in range(2)]
    caches[1] = [c.clone() for c in caches[0]]
    want_q, want_k = norms.qk_norm_rope(q, k, cos, sin, 1e-6, 0.7)
    write_static(*caches[0], want_k, v, pos, capacity, ring)
    got_q = norms.qk_norm_rope_kv_write(q, k, v, cos, sin, 1e-6, 0.7, *caches[1], pos, capacity, ring)
    assert torch.equal(got_q, want_q)
    for name, want, got in zip(("k", "v", "positions"), caches[0], caches[1]):
        assert torch.equal(want, got), f"cache {name} differs (ring={ring}, position {position})"


@pytest.mark.parametrize("nq,nkv,d,k,ring,rope,cut", [(4, 2, 32, 64, False, True, None),
                                                      (6, 1, 64, 200, True, True, None),
                                                      (4, 2, 32, 96, False, False, None),
                                                      (6, 1, 64, 200, True, True, (16, 4))])
def test_qkv_gemv_rope_gives_the_gemv_then_qk_norm_rope_kv_write(nq, nkv, d, k, ring, rope, cut, monkeypatch):
    """``qkv_gemv_rope``: the fused q/k/v/gate GEMV whose heads' last programs run the q/k norms, RoPE and the KV
    write: the same projection, the same normed q and cache as ``dense_gemv`` then ``qk_norm_rope_kv_write`` (the
    norms' sums may group differently in another number of warps on a GPU: q and k within the op tolerance, exact
    in the interpreter), launch after launch, the head tickets given back at zero. ``cut``: the launch at that many
    rows x warps per program (``QKV_BLOCK_N`` / ``QKV_WARPS``: 4 programs per head, each ticket counting them)."""
    from musecore_triton.kernels import dense_gemv as module
    from musecore_triton.kernels.dense_gemv import dense_gemv, qkv_gemv_rope
    if cut is not None:
        monkeypatch.setattr(module, "QKV_BLOCK_N", cut[0])
        monkeypatch.setattr(module, "QKV_WARPS", cut[1])
    capacity, dtype = 8, torch.float16
    x = torch.randn(1, k, device=DEVICE).to(dtype)
    w = (torch.randn((2 * nq + 2 * nkv) * d, k, device=DEVICE) * 0.1).to(dtype)
    cos, sin = rope_tables(1, 1, d) if rope else (None, None)
    counters = torch.zeros(nq + nkv, 1, dtype=torch.int32, device=DEVICE)
    want_y = dense_gemv(x, w)
    q, kk, v, _ = want_y.view(1, 1, -1, d).split_with_sizes([nq, nkv, nkv, nq], -2)
    for position in (5, 11):
        pos = torch.tensor([[position]], device=DEVICE)
        caches = [[torch.randn(1, capacity + 1, nkv, d, device=DEVICE).half() for _ in range(2)]
                  + [torch.randint(-1, 9, (1, capacity + 1), device=DEVICE)] for _ in range(2)]
        caches[1] = [c.clone() for c in caches[0]]
        want_q = norms.qk_norm_rope_kv_write(q, kk, v, cos, sin, 1e-6, 0.7, *caches[0], pos, capacity, ring)
        y, got_q = qkv_gemv_rope(x, w, nq, nkv, cos, sin, 1e-6, 0.7, *caches[1], pos, capacity, ring, counters)
        assert torch.equal(y, want_y), "the projection differs from dense_gemv's"
        assert counters.eq(0).all(), f"position {position}: tickets left at {counters.flatten().tolist()}"
        assert_nmse(want_q, got_q, tolerance("qk_norm_rope"), f"q, nq={nq} nkv={nkv} d={d} position {position}")
        assert_nmse(caches[0][0], caches[1][0], tolerance("qk_norm_rope"), f"cache k, position {position}")
        for name, want, got in zip(("v", "positions"), caches[0][1:], caches[1][1:]):
            assert torch.equal(want, got), f"cache {name} differs (ring={ring}, position {position})"
    with pytest.raises(ValueError, match="int32 counters"):
        qkv_gemv_rope(x, w, nq, nkv, cos, sin, 1e-6, 0.7, *caches[1], pos, capacity, ring, counters.long())
    with pytest.raises(ValueError, match="qkv_gemv_rope takes"):
        qkv_gemv_rope(x, w[:-d], nq, nkv, cos, sin, 1e-6, 0.7, *caches[1], pos, capacity, ring, counters)


@pytest.mark.parametrize("nq,nkv,d,k,post,cut", [(4, 2, 32, 64, True, None), (6, 1, 64, 200, False, None),
                                                 (6, 1, 64, 200, True, (16, 4)), (4, 2, 32, 96, False, (8, 8)),
                                                 (24, 3, 64, 1536, True, (8, 8))])
def test_qkv_gemv_rope_takes_the_deferred_residual_norm(nq, nkv, d, k, post, cut, monkeypatch):
    """``qkv_gemv_rope_deferred``: the residual norm after the layer before (a scale-first or weightless post norm,
    the gate's alpha / beta, this layer's input norm) run in every program of the q/k/v/gate launch, against the
    ``residual_norm`` kernel then ``qkv_gemv_rope`` on its normed row: the same new residual, projection, q and
    cache (bit for bit in the interpreter, whose row sums run in one order; on a GPU the projection within the
    linear op's tolerance and q, k within the q/k norm's), the head tickets back at zero. ``cut``: as above (8 x 8:
    the CUDA backend's ``qkv_deferred`` cut; the last case muse-small's shapes, a K that is not a power of two)."""
    from musecore_triton.kernels import dense_gemv as module
    from musecore_triton.kernels.dense_gemv import qkv_gemv_rope, qkv_gemv_rope_deferred
    if cut is not None:
        monkeypatch.setattr(module, "QKV_BLOCK_N", cut[0])
        monkeypatch.setattr(module, "QKV_WARPS", cut[1])
    capacity, dtype = 8, torch.float16
    out, residual = torch.randn(1, k, device=DEVICE).to(dtype), (torch.randn(1, k, device=DEVICE) * 3).to(dtype)
    post_w = (1 + 0.1 * torch.randn(k, device=DEVICE)).to(dtype) if post else None
    alpha, beta = 1 + 0.1 * torch.randn(k, device=DEVICE), 0.5 * torch.randn(k, device=DEVICE)
    next_w = (1 + 0.1 * torch.randn(k, device=DEVICE)).to(dtype)
    w = (torch.randn((2 * nq + 2 * nkv) * d, k, device=DEVICE) * 0.1).to(dtype)
    cos, sin = rope_tables(1, 1, d)
    counters = torch.zeros(nq + nkv, 1, dtype=torch.int32, device=DEVICE)
    want_res, x = norms.residual_norm(residual, out, post_w, alpha, beta, next_w, 1e-6, 1e-5)
    pos = torch.tensor([[5]], device=DEVICE)
    caches = [[torch.randn(1, capacity + 1, nkv, d, device=DEVICE).half() for _ in range(2)]
              + [torch.randint(-1, 9, (1, capacity + 1), device=DEVICE)] for _ in range(2)]
    caches[1] = [c.clone() for c in caches[0]]
    want_y, want_q = qkv_gemv_rope(x, w, nq, nkv, cos, sin, 1e-6, 0.7, *caches[0], pos, capacity, False, counters)
    deferred = (out, residual, post_w, alpha, beta, next_w, 1e-6, 1e-5)
    for launch in range(2):
        y, q, new_res = qkv_gemv_rope_deferred(deferred, w, nq, nkv, cos, sin, 1e-6, 0.7, *caches[1], pos, capacity,
                                               False, counters)
        assert counters.eq(0).all(), f"launch {launch}: tickets left at {counters.flatten().tolist()}"
        if DEVICE.type == "cpu":
            for name, want, got in (("new residual", want_res, new_res), ("projection", want_y, y), ("q", want_q, q),
                                    ("cache k", caches[0][0], caches[1][0])):
                assert torch.equal(want, got), f"{name} differs by {(want - got).abs().max().item():.3g}"
        assert_nmse(want_res, new_res, tolerance("residual_norm"), "the new residual")
        assert_nmse(want_y, y, tolerance("linear"), "the projection")
        assert_nmse(want_q, q, tolerance("qk_norm_rope"), f"q, nq={nq} nkv={nkv} d={d}")
        assert_nmse(caches[0][0], caches[1][0], tolerance("qk_norm_rope"), "cache k")
        for name, want, got in zip(("v", "positions"), caches[0][1:], caches[1][1:]):
            if DEVICE.type == "cpu" or name == "positions":
                assert torch.equal(want, got), f"cache {name} differs"
    with pytest.raises(ValueError, match="residual norm's weights"):
        qkv_gemv_rope_deferred((out, residual, post_w, alpha[:-1], beta, next_w, 1e-6, 1e-5), w, nq, nkv, cos, sin,
                               1e-6, 0.7, *caches[1], pos, capacity, False, counters)


@pytest.mark.parametrize("nq,nkv,d,k,ring,rope,window,step,capacity", [
    (4, 2, 32, 64, False, True, None, 64, 8), (6, 1, 64, 200, True, True, 3, 64, 8),
    (4, 2, 32, 96, False, False, None, 64, 8), (4, 2, 32, 64, False, True, None, 32, 80),  # 81 keys: 3 steps
    (4, 2, 32, 64, True, True, 40, 128, 300)])  # 301 keys: 3 steps, a window
def test_qkv_attention_gives_qkv_gemv_rope_then_gated_attention(nq, nkv, d, k, ring, rope, window, step, capacity,
                                                                monkeypatch):
    """``qkv_attention``: ``qkv_gemv_rope`` whose KV-head groups' last programs then attend with the head norm and
    gate: the same output as ``qkv_gemv_rope`` then ``attention(gate=)`` over the written cache (within the op
    tolerance: the attention's sums run in the GEMV's warps), the same cache, launch after launch, every ticket
    given back at zero; a cache longer than ``ATTEND_MAX_KEYS`` is refused."""
    from musecore_triton.kernels import dense_gemv as dg
    from musecore_triton.kernels.attention import attention
    monkeypatch.setattr(dg, "ATTEND_BLOCK_N", step)  # keys per attention step in the tail
    dtype = torch.float16
    x = torch.randn(1, k, device=DEVICE).to(dtype)
    w = (torch.randn((2 * nq + 2 * nkv) * d, k, device=DEVICE) * 0.1).to(dtype)
    cos, sin = rope_tables(1, 1, d) if rope else (None, None)
    counters = [torch.zeros(nq + 2 * nkv, dtype=torch.int32, device=DEVICE) for _ in range(2)]
    for position in (5, 11):
        pos = torch.tensor([[position]], device=DEVICE)
        caches = [[torch.randn(1, capacity + 1, nkv, d, device=DEVICE).half() for _ in range(2)]
                  + [torch.randint(-1, capacity + 1, (1, capacity + 1), device=DEVICE)] for _ in range(2)]
        caches[1] = [c.clone() for c in caches[0]]
        y, q = dg.qkv_gemv_rope(x, w, nq, nkv, cos, sin, 1e-6, 0.7, *caches[0], pos, capacity, ring, counters[0])
        gate = y.view(1, 1, -1, d)[:, :, nq + 2 * nkv:]
        want = attention(q, caches[0][0], caches[0][1], pos, caches[0][2], window, d ** -0.5, gate=(gate, 1e-6))
        got = dg.qkv_attention(x, w, nq, nkv, cos, sin, 1e-6, 0.7, *caches[1], pos, capacity, ring, counters[1],
                               tuple(caches[1]), window, d ** -0.5, 1e-6)
        assert counters[1].eq(0).all(), f"position {position}: tickets left at {counters[1].tolist()}"
        assert_nmse(want, got, tolerance("head_norm_gate"), f"gated attention, nq={nq} nkv={nkv} position {position}")
        assert_nmse(caches[0][0], caches[1][0], tolerance("qk_norm_rope"), f"cache k, position {position}")
        for name, a, b in zip(("v", "positions"), caches[0][1:], caches[1][1:]):
            assert torch.equal(a, b), f"cache {name} differs (ring={ring}, position {position})"
    long = [torch.zeros(1, dg.ATTEND_MAX_KEYS + 1, nkv, d, device=DEVICE).half() for _ in range(2)]
    with pytest.raises(ValueError, match="qkv_attention takes"):
        dg.qkv_attention(x, w, nq, nkv, cos, sin, 1e-6, 0.7, *caches[1], pos, capacity, ring, counters[1],
                         (*long, torch.zeros(1, dg.ATTEND_MAX_KEYS + 1, dtype=torch.long, device=DEVICE)), window,
                         d ** -0.5, 1e-6)
    with pytest.raises(ValueError, match="int32 counters"):
        dg.qkv_attention(x, w, nq, nkv, cos, sin, 1e-6, 0.7, *caches[1], pos, capacity, ring, counters[1][:-1],
                         tuple(caches[1]), window, d ** -0.5, 1e-6)
