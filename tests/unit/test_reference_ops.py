"""Each reference op against a direct, hand-written formula."""

import math

import pytest
import torch

from musecore.backends.reference import ReferenceBackend
from musecore.ops import ExpertWeights, Weight
from musecore.ops import reference as ref_ops
from musecore.rope import RotaryTable
from tests.conftest import nmse

ref = ReferenceBackend()


def test_rms_norm_is_x_times_rsqrt_mean_square_plus_eps_times_weight():
    x, w = torch.tensor([[3.0, 4.0]]), torch.tensor([2.0, 0.5])
    expected = torch.tensor([[3.0, 4.0]]) / math.sqrt((9 + 16) / 2 + 1e-6) * w
    assert torch.allclose(ref.rms_norm(x, w, 1e-6), expected)


def test_rms_norm_computes_in_fp32_and_returns_input_dtype():
    x = torch.randn(4, 64, dtype=torch.bfloat16) * 100
    out = ref.rms_norm(x, torch.ones(64), 1e-6)
    assert out.dtype == torch.bfloat16
    assert nmse(ref.rms_norm(x.float(), torch.ones(64), 1e-6), out) < 1e-4


def test_weightless_and_scale_first_norms():
    x, w = torch.tensor([[3.0, 4.0]]), torch.tensor([2.0, 0.5])
    rms = lambda v: v / v.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()  # noqa: E731
    assert torch.allclose(ref.rms_norm(x, None, 1e-6), rms(x))
    assert torch.allclose(ref.rms_norm(x, w, 1e-6, scale_first=True), rms(x * w))
    xb = torch.randn(4, 64, dtype=torch.bfloat16) * 10
    wb = (1 + 0.3 * torch.randn(64)).to(torch.bfloat16)
    rounded_first = rms((xb.float() * wb.float()).to(torch.bfloat16).float()).to(torch.bfloat16)
    assert torch.equal(ref.rms_norm(xb, wb, 1e-6, scale_first=True), rounded_first)  # x*w rounded to bf16 first


def test_residual_gate_coefficients_follow_the_formula():
    g = torch.tensor([-2.0, 0.0, 0.5, 3.0])
    alpha, beta = ref_ops.residual_gate_coefficients(g, 0.3)
    w = g / 0.3
    assert torch.allclose(beta, torch.sigmoid(w))
    assert torch.allclose(alpha, torch.sqrt(torch.clamp(torch.sigmoid(-w) * (1 + torch.sigmoid(w)), min=1e-3)))
    assert alpha[-1] == pytest.approx(math.sqrt(1e-3))  # the floor: a gate far open keeps sqrt(eps) of the residual
    assert alpha.dtype == torch.float32 and beta.dtype == torch.float32


def test_residual_norm_is_post_norm_gated_residual_then_next_norm():
    r, o = torch.randn(3, 8), torch.randn(3, 8)
    pw, nw = torch.rand(8) + 0.5, torch.rand(8) + 0.5
    alpha, beta = ref_ops.residual_gate_coefficients(torch.randn(8), 0.3)
    new_r, normed = ref.residual_norm(r, o, pw, alpha, beta, nw, 1e-8, 1e-6)
    want_r = alpha * r + beta * ref.rms_norm(o, pw, 1e-8, scale_first=True)
    assert torch.allclose(new_r, want_r, atol=1e-6)
    assert torch.allclose(normed, ref.rms_norm(want_r, nw, 1e-6), atol=1e-6)
    weightless, _ = ref.residual_norm(r, o, None, alpha, beta, nw, 1e-8, 1e-6)
    assert torch.allclose(weightless, alpha * r + beta * ref.rms_norm(o, None, 1e-8), atol=1e-6)


def test_rope_rotates_halves_hf_convention():
    d = 4
    table = RotaryTable(d, {"rope_theta": 100.0}, 128)
    cos, sin = table(torch.tensor([[3]]))
    x = torch.tensor([[[[1.0, 2.0, 3.0, 4.0]]]])  # [1,1,1,4]
    q, _ = ref.qk_norm_rope(x, x, cos, sin, 0.0, 1.0)
    xn = x / x.pow(2).mean().sqrt()
    a0, a1 = 3 * 1.0, 3 * 100 ** (-2 / 4)  # angles for the two frequencies
    x1, x2 = xn[..., :2], xn[..., 2:]
    c, s = torch.tensor([math.cos(a0), math.cos(a1)]), torch.tensor([math.sin(a0), math.sin(a1)])
    want = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)
    assert torch.allclose(q, want, atol=1e-6)


def test_qk_norm_scales_q_only_and_nope_skips_the_rotation():
    q, k = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 2, 8)
    qn, kn = ref.qk_norm_rope(q, k, None, None, 1e-6, 5.5)
    assert torch.allclose(qn, 5.5 * ref.rms_norm(q, None, 1e-6), atol=1e-5)
    assert torch.allclose(kn, ref.rms_norm(k, None, 1e-6), atol=1e-6)


def test_yarn_keeps_high_frequencies_and_divides_low_ones_by_factor():
    d, params = 128, {"rope_type": "yarn", "rope_theta": 1e6, "factor": 8.0, "original_max_position_embeddings": 4096}
    yarn, plain = RotaryTable(d, params, 32768), RotaryTable(d, {"rope_theta": 1e6}, 32768)
    assert torch.allclose(yarn.inv_freq[0], plain.inv_freq[0])
    assert torch.allclose(yarn.inv_freq[-1], plain.inv_freq[-1] / 8)
    assert yarn.attention_factor == pytest.approx(0.1 * math.log(8) + 1)


def test_attention_matches_softmax_formula_with_padding_slot_ignored():
    B, T, S, d = 1, 2, 3, 4
    q, k, v = torch.randn(B, T, 2, d), torch.randn(B, S, 1, d), torch.randn(B, S, 1, d)
    k_pos = torch.tensor([[0, -1, 1]])  # slot 1 is empty
    q_pos = torch.tensor([[0, 1]])
    out = ref.attention(q, k, v, q_pos, k_pos, None, 0.5)
    for h in range(2):
        s = torch.stack([q[0, 1, h] @ k[0, 0, 0], q[0, 1, h] @ k[0, 2, 0]]) * 0.5
        want = torch.softmax(s, 0) @ torch.stack([v[0, 0, 0], v[0, 2, 0]])
        assert torch.allclose(out[0, 1, h], want, atol=1e-6)
        assert torch.allclose(out[0, 0, h], v[0, 0, 0], atol=1e-6)  # position 0 sees only itself


def test_attention_query_that_sees_nothing_returns_zeros():
    q, k, v = torch.randn(1, 1, 1, 4), torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4)
    out = ref.attention(q, k, v, torch.tensor([[-1]]), torch.tensor([[0, 1]]), None, 1.0)
    assert torch.equal(out, torch.zeros_like(out))


def test_fp8_kv_is_dequantized_with_its_scale():
    q, k, v = torch.randn(1, 1, 1, 4), torch.randn(1, 1, 1, 4), torch.randn(1, 1, 1, 4)
    pos = torch.tensor([[0]])
    out = ref.attention(q, (k / 2).to(torch.float8_e4m3fn), (v / 2).to(torch.float8_e4m3fn), pos, pos, None, 1.0,
                        k_scale=2.0, v_scale=2.0)
    assert torch.allclose(out, (v / 2).to(torch.float8_e4m3fn).float() * 2)


def test_head_norm_gate_is_weightless_norm_times_elementwise_sigmoid():
    o, g = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8)
    out = ref.head_norm_gate(o, g, 1e-6)
    assert torch.allclose(out, ref.rms_norm(o, None, 1e-6) * torch.sigmoid(g), atol=1e-6)


def test_linear_is_x_matmul_w_transposed():
    x, w = torch.randn(3, 5), torch.randn(7, 5)
    out = ref.linear(x, Weight(w, "fp32", 7, 5))
    assert torch.allclose(out, x @ w.T, atol=1e-5)


def test_router_chooses_with_the_bias_but_weights_without_it():
    x = torch.tensor([[1.0, 0.0]], dtype=torch.bfloat16)
    weight = torch.tensor([[1.0, 0.0], [3.0, 0.0], [2.0, 0.0], [0.0, 0.0]])  # logits 1, 3, 2, 0
    bias = torch.tensor([0.0, 0.0, 0.0, 10.0])  # expert 3 is chosen for its bias alone
    w, ids = ref.router_topk(x, weight, bias, 2, 0.5, 2.5)
    s = torch.sigmoid(torch.tensor([1.0, 3.0, 2.0, 0.0]) * 0.5)
    assert sorted(ids[0].tolist()) == [1, 3]
    picked = {e: s[e] / (s[1] + s[3]) * 2.5 for e in (1, 3)}
    assert torch.allclose(w[0], torch.stack([picked[e] for e in ids[0].tolist()]))
    assert w.dtype == torch.float32 and ids.dtype == torch.long


def test_moe_runs_only_routed_experts_with_the_shared_post_norm_and_sums_in_fp32():
    E, h, inter = 3, 4, 6
    gate, up, down = torch.randn(E, inter, h), torch.randn(E, inter, h), torch.randn(E, h, inter)
    gate[2] = float("nan")  # expert 2 is never routed to: its weights must never be read
    experts = ExpertWeights(gate, up, down, "fp32", E)
    z = torch.randn(2, h, dtype=torch.bfloat16)
    ids, w = torch.tensor([[0, 1], [1, 0]]), torch.tensor([[0.7, 0.3], [0.6, 0.4]])
    norm = (torch.rand(h) + 0.5).to(torch.bfloat16)
    y = ref.moe(z, w, ids, experts, norm, 1e-8)
    assert y.dtype == torch.float32 and torch.isfinite(y).all()
    zf = z.float()

    def expert(e, t):
        out = ((torch.nn.functional.silu(zf[t] @ gate[e].T) * (zf[t] @ up[e].T)) @ down[e].T).to(torch.bfloat16)
        return ref.rms_norm(out, norm, 1e-8, scale_first=True).float()
    assert torch.allclose(y[0], 0.7 * expert(0, 0) + 0.3 * expert(1, 0), atol=1e-5)
    assert torch.allclose(y[1], 0.6 * expert(1, 1) + 0.4 * expert(0, 1), atol=1e-5)


def test_silu_mul_and_logit_softcap():
    g, u = torch.randn(3, 5), torch.randn(3, 5)
    assert torch.allclose(ref.silu_mul(g, u), torch.nn.functional.silu(g) * u)
    logits = torch.tensor([-100.0, 0.0, 3.0, 100.0], dtype=torch.bfloat16)
    capped = ref.logit_softcap(logits, 0.5, 20.0)
    assert capped.dtype == torch.float32
    assert torch.allclose(capped, 20 * torch.tanh(logits.float() * 0.5 / 20))
    assert capped.abs().max() < 20


def test_sample_greedy_and_seeded_top_p():
    logits = torch.tensor([[0.0, 5.0, 1.0]])
    assert ref.sample(logits, 0.0).tolist() == [1]
    draws = {ref.sample(logits, 1.0, top_p=0.5, generator=torch.Generator().manual_seed(s)).item() for s in range(20)}
    assert draws == {1}, "top_p=0.5 keeps only the most likely token here"
    a = [ref.sample(torch.zeros(1, 50), 1.0, generator=torch.Generator().manual_seed(7)).item() for _ in range(3)]
    assert len(set(a)) == 1, "the same seed gives the same draw"


def test_embedding_looks_up_rows():
    table = torch.randn(10, 4)
    assert torch.equal(ref.embedding(torch.tensor([[3, 1]]), Weight(table, "fp32", 10, 4))[0], table[[3, 1]])


def test_sample_at_a_tiny_temperature_is_greedy_not_nan():
    logits = torch.tensor([[1.0, 30.0, 29.0, -5.0], [float("-inf"), 2.0, 2.5, 0.0]])
    for t in (1e-40, 1e-30, 1e-8):
        got = ref.sample(logits, t, generator=torch.Generator().manual_seed(0))
        assert got.tolist() == [1, 2], f"temperature {t}: {got.tolist()}"
