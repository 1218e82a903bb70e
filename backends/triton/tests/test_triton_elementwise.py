"""The router's top-k kernels (alone and beside the pooler GEMV), silu_mul and logit_softcap against the reference."""

from __future__ import annotations

import pytest
import torch

from musecore.ops import reference as ref
from musecore.ops import tolerance

from musecore_triton.testing import DEVICE, SMALL_DTYPES, assert_nmse

from musecore_triton.kernels import elementwise, router
from musecore_triton.kernels.dense_gemv import dense_gemv


def router_case(tokens: int, experts: int, hidden: int, dtype: torch.dtype):
    """Scores spread enough that no two experts tie after the bias (the order of tied experts is not defined)."""
    x = torch.randn(tokens, hidden, device=DEVICE).to(dtype)
    weight = torch.randn(experts, hidden, device=DEVICE) * 4 * hidden ** -0.5
    bias = torch.randn(experts, device=DEVICE) * 0.3
    return x, weight, bias


@pytest.mark.parametrize("e,k", [(16, 4), (12, 3), (256, 8), (64, 8), (40, 6)])
def test_router_topk_matches_reference(e, k):
    """Same ids in the same order (descending score + bias) and fp32 weights within the op tolerance."""
    x, weight, bias = router_case(5, e, 96, torch.float16)
    w, ids = router.router_topk(x, weight, bias, k, 0.1767766952966369, 2.5)
    ew, eids = ref.router_topk(x, weight, bias, k, 0.1767766952966369, 2.5)
    assert torch.equal(ids, eids), f"E={e} k={k}: ids {ids.tolist()} vs reference {eids.tolist()}"
    assert w.dtype == torch.float32 and w.shape == (5, k)
    assert_nmse(ew, w, tolerance("router_topk"), f"router weights E={e} k={k}")


@pytest.mark.parametrize("e,k,hidden,block_k", [(64, 8, 1536, None), (12, 3, 96, None), (256, 8, 200, None),
                                               (40, 6, 33, None), (64, 8, 1536, 64), (40, 6, 100, 64)])
def test_router_in_one_launch_matches_the_reference(e, k, hidden, block_k, monkeypatch):
    """The split-K product and the choice in one launch (the last program chooses): the reference's ids, weights
    within the op tolerance, and the counter back at zero after each launch. ``block_k``: hidden columns per
    program (``ONE_LAUNCH_BLOCK_K``; the CUDA backend's 64; 100 columns: a last K range of 36)."""
    if block_k is not None:
        monkeypatch.setattr(router, "ONE_LAUNCH_BLOCK_K", block_k)
    x, weight, bias = router_case(1, e, hidden, torch.float16)
    counter = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    ew, eids = ref.router_topk(x, weight, bias, k, 0.1767766952966369, 2.5)
    for launch in range(2):
        w, ids = router.router_topk_one_launch(x, weight, bias, k, 0.1767766952966369, 2.5, counter)
        assert torch.equal(ids, eids), f"E={e} k={k}: ids {ids.tolist()} vs reference {eids.tolist()}"
        assert_nmse(ew, w, tolerance("router_topk"), f"one-launch router weights E={e} k={k}")
        assert int(counter) == 0, f"launch {launch}: the counter was left at {int(counter)}"
    with pytest.raises(ValueError, match="router_topk_one_launch takes one token"):
        router.router_topk_one_launch(torch.cat([x, x]), weight, bias, k, 1.0, 1.0, counter)


@pytest.mark.parametrize("e,k,hidden,n,cut", [(64, 8, 1536, 768, None), (12, 3, 96, 40, None),
                                             (256, 8, 200, 130, None), (12, 3, 96, 130, (16, 4))])
def test_router_and_pooler_in_one_launch_equal_the_two_launches(e, k, hidden, n, cut, monkeypatch):
    """The router's programs beside the pooler GEMV's (its norm in its last program) in one launch against
    ``router_topk_one_launch`` and ``dense_gemv(norm=)`` launched one after the other: the same ids, the same pooler
    bits, the weights within the op tolerance (on a GPU the choice runs in the pooler's warps, not one: its sums
    group differently, ~1e-8), both counters back at zero. ``cut``: the pooler at that many rows x warps per program
    (``ROUTER_POOLER_BLOCK_N`` / ``_WARPS``; 130 rows: a last program of 2)."""
    if cut is not None:
        monkeypatch.setattr(router, "ROUTER_POOLER_BLOCK_N", cut[0])
        monkeypatch.setattr(router, "ROUTER_POOLER_WARPS", cut[1])
    x, weight, bias = router_case(1, e, hidden, torch.bfloat16)
    pooler = (torch.randn(n, hidden, device=DEVICE) * hidden ** -0.5).to(torch.bfloat16)
    norm_w = (1 + 0.1 * torch.randn(n, device=DEVICE)).to(torch.bfloat16)
    counters = torch.zeros(2, 1, dtype=torch.int32, device=DEVICE)
    ew, eids = router.router_topk_one_launch(x, weight, bias, k, 0.1767766952966369, 2.5, counters[0])
    ez = dense_gemv(x, pooler, norm=(norm_w, 1e-6, counters[1]))
    for launch in range(2):
        w, ids, z = router.router_pooler_one_launch(x, weight, bias, k, 0.1767766952966369, 2.5, pooler, norm_w, 1e-6,
                                                    counters)
        assert torch.equal(ids, eids), f"E={e} k={k}: ids {ids.tolist()} vs two launches {eids.tolist()}"
        assert_nmse(ew, w, tolerance("router_topk"), f"router weights beside the pooler E={e} k={k}")
        assert torch.equal(z, ez), f"pooler {n}x{hidden}: normed output differs by {(z - ez).abs().max().item():.3g}"
        assert counters.tolist() == [[0], [0]], f"launch {launch}: counters left at {counters.tolist()}"
    with pytest.raises(ValueError, match="two int32 counters"):
        router.router_pooler_one_launch(x, weight, bias, k, 1.0, 1.0, pooler, norm_w, 1e-6, counters[0])
    with pytest.raises(ValueError, match="16-bit pooler"):
        router.router_pooler_one_launch(x, weight, bias, k, 1.0, 1.0, pooler.float(), norm_w, 1e-6, counters)


def test_router_bias_chooses_but_does_not_weight():
    """A large bias forces experts 3 and 5 into every token's choice; their weights stay the renormalised
    sigmoid scores (bias left out), times the scaling."""
    x, weight, _ = router_case(4, 8, 64, torch.float32)
    bias = torch.zeros(8, device=DEVICE)
    bias[3], bias[5] = 10.0, 9.0
    w, ids = router.router_topk(x, weight, bias, 2, 1.0, 3.0)
    assert ids.tolist() == [[3, 5]] * 4
    scores = torch.sigmoid(x.float() @ weight.T)[:, [3, 5]]
    assert_nmse(scores / scores.sum(-1, keepdim=True) * 3.0, w, 1e-10, "weights of the biased choice")


def test_router_refuses_a_16bit_router_weight():
    x, weight, bias = router_case(2, 8, 64, torch.float16)
    with pytest.raises(TypeError, match="fp32"):
        router.router_topk(x, weight.half(), bias, 2, 1.0, 1.0)


@pytest.mark.parametrize("dtype", SMALL_DTYPES + [torch.float32])
def test_silu_mul_matches_reference_on_slices_of_a_fused_projection(dtype):
    """gate and up as the two halves of one ``[B,T,2n]`` projection output (strided views), n not a
    multiple of the block."""
    fused = (torch.randn(2, 3, 2 * 1300, device=DEVICE) * 4).to(dtype)
    gate, up = fused.split(1300, dim=-1)
    y = elementwise.silu_mul(gate, up)
    assert y.dtype == dtype and y.shape == gate.shape
    assert_nmse(ref.silu_mul(gate, up), y, tolerance("silu_mul"), f"silu_mul {dtype}")


@pytest.mark.parametrize("dtype", SMALL_DTYPES + [torch.float32])
def test_logit_softcap_matches_reference(dtype):
    logits = (torch.randn(2, 3, 3000, device=DEVICE) * 300).to(dtype)  # some far beyond the cap
    logits[0, 0, :4] = torch.tensor([0.0, 1e-3, -1e-3, 6e4]).to(dtype)
    y = elementwise.logit_softcap(logits, 0.1767766952966369, 20.0)
    assert y.dtype == torch.float32 and y.abs().max() <= 20.0
    assert_nmse(ref.logit_softcap(logits, 0.1767766952966369, 20.0), y, tolerance("logit_softcap"),
                f"logit_softcap {dtype}")


@pytest.mark.parametrize("e,k,hidden,n,post,cut", [(64, 8, 1536, 768, False, None), (12, 3, 96, 40, True, None),
                                                   (40, 6, 100, 130, False, (16, 4)), (12, 3, 96, 72, True, (4, 4))])
def test_router_and_pooler_take_the_deferred_residual_norm(e, k, hidden, n, post, cut, monkeypatch):
    """``router_pooler_deferred``: the residual norm of the sublayer before (its output, the residual, a weightless
    or scale-first post norm, the gate's alpha / beta, the next norm) run in the router + pooler launch's own
    programs, against the ``residual_norm`` kernel and then ``router_pooler_one_launch`` on its normed row: the same
    new residual and pooler output (bit for bit in the interpreter, whose sums over the row run in one order; within
    the op tolerances on a GPU, whose warps may group them otherwise), the same ids, the weights within the router's
    tolerance, both counters back at zero. 100 hidden columns: a ragged last router K range; 130 pooler rows at 16
    per program: a last program of 2."""
    from musecore_triton.kernels import norms

    if cut is not None:
        monkeypatch.setattr(router, "ROUTER_POOLER_BLOCK_N", cut[0])
        monkeypatch.setattr(router, "ROUTER_POOLER_WARPS", cut[1])
    dtype = SMALL_DTYPES[-1]
    out, weight, bias = router_case(1, e, hidden, dtype)
    residual = (torch.randn(1, hidden, device=DEVICE) * 3).to(dtype)
    post_w = (1 + 0.1 * torch.randn(hidden, device=DEVICE)).to(dtype) if post else None
    alpha, beta = 1 + 0.1 * torch.randn(hidden, device=DEVICE), 0.5 * torch.randn(hidden, device=DEVICE)
    next_w = (1 + 0.1 * torch.randn(hidden, device=DEVICE)).to(dtype)
    pooler = (torch.randn(n, hidden, device=DEVICE) * hidden ** -0.5).to(dtype)
    norm_w = (1 + 0.1 * torch.randn(n, device=DEVICE)).to(dtype)
    counters = torch.zeros(2, 1, dtype=torch.int32, device=DEVICE)
    want_res, want_normed = norms.residual_norm(residual, out, post_w, alpha, beta, next_w, 1e-6, 1e-5)
    ew, eids, ez = router.router_pooler_one_launch(want_normed, weight, bias, k, 0.1767766952966369, 2.5, pooler,
                                                   norm_w, 1e-6, counters)
    deferred = (out, residual, post_w, alpha, beta, next_w, 1e-6, 1e-5)
    for launch in range(2):
        w, ids, z, new_res = router.router_pooler_deferred(deferred, weight, bias, k, 0.1767766952966369, 2.5, pooler,
                                                           norm_w, 1e-6, counters)
        assert torch.equal(ids, eids), f"E={e} k={k}: ids {ids.tolist()} vs the op then the launch {eids.tolist()}"
        assert_nmse(ew, w, tolerance("router_topk"), f"router weights on the deferred norm E={e} k={k}")
        if DEVICE.type == "cpu":
            assert torch.equal(new_res, want_res), \
                f"new residual differs by {(new_res.float() - want_res.float()).abs().max().item():.3g}"
            assert torch.equal(z, ez), f"pooler {n}x{hidden}: normed output differs by {(z - ez).abs().max().item():.3g}"
        assert_nmse(want_res, new_res, tolerance("residual_norm"), "the new residual")
        assert_nmse(ez, z, tolerance("rms_norm"), "the pooler's normed output")
        assert counters.tolist() == [[0], [0]], f"launch {launch}: counters left at {counters.tolist()}"
    with pytest.raises(ValueError, match="residual norm's weights"):
        router.router_pooler_deferred((out, residual, post_w, alpha[:-1], beta, next_w, 1e-6, 1e-5), weight, bias, k,
                                      1.0, 1.0, pooler, norm_w, 1e-6, counters)
    with pytest.raises(ValueError, match="router_pooler_deferred takes one token"):
        router.router_pooler_deferred((torch.cat([out, out]),) + deferred[1:], weight, bias, k, 1.0, 1.0, pooler,
                                      norm_w, 1e-6, counters)
