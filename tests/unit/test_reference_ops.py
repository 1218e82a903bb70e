"""Each reference op against a direct, hand-written formula."""

import math

import pytest
import torch

from musecore.backends.reference import ReferenceBackend
from musecore.ops import ExpertWeights, Weight
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


def test_residual_norm_is_gated_add_then_next_norm():
    r, o = torch.randn(3, 8), torch.randn(3, 8)
    pw, g, nw = torch.rand(8) + 0.5, torch.rand(8), torch.rand(8) + 0.5
    new_r, normed = ref.residual_norm(r, o, pw, g, nw, 1e-6)
    want_r = r + g * ref.rms_norm(o, pw, 1e-6)
    assert torch.allclose(new_r, want_r, atol=1e-6)
    assert torch.allclose(normed, ref.rms_norm(want_r, nw, 1e-6), atol=1e-6)


def test_rope_rotates_halves_hf_convention():
    d = 4
    table = RotaryTable(d, {"rope_theta": 100.0}, 128)
    cos, sin = table(torch.tensor([[3]]))
    x = torch.tensor([[[[1.0, 2.0, 3.0, 4.0]]]])  # [1,1,1,4]
    q, _ = ref.qk_norm_rope(x, x, torch.ones(d), torch.ones(d), cos, sin, 0.0)
    xn = x / x.pow(2).mean().sqrt()
    a0, a1 = 3 * 1.0, 3 * 100 ** (-2 / 4)  # angles for the two frequencies
    x1, x2 = xn[..., :2], xn[..., 2:]
    c, s = torch.tensor([math.cos(a0), math.cos(a1)]), torch.tensor([math.sin(a0), math.sin(a1)])
    want = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)
    assert torch.allclose(q, want, atol=1e-6)


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


def test_head_norm_gate_is_norm_times_sigmoid_per_head():
    o, w, g = torch.randn(1, 2, 3, 8), torch.rand(8) + 0.5, torch.randn(1, 2, 3)
    out = ref.head_norm_gate(o, w, g, 1e-6)
    assert torch.allclose(out, ref.rms_norm(o, w, 1e-6) * torch.sigmoid(g)[..., None], atol=1e-6)


def test_linear_is_x_matmul_w_transposed():
    x, w = torch.randn(3, 5), torch.randn(7, 5)
    out = ref.linear(x, Weight(w, "fp32", 7, 5))
    assert torch.allclose(out, x @ w.T, atol=1e-5)


def test_router_topk_softmax_over_all_then_renormalise():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    w, ids = ref.router_topk(logits, 2, True)
    p = torch.softmax(logits, -1)[0]
    assert ids.tolist() == [[1, 2]]
    assert torch.allclose(w[0], torch.stack([p[1], p[2]]) / (p[1] + p[2]))
    w_raw, _ = ref.router_topk(logits, 2, False)
    assert torch.allclose(w_raw[0], torch.stack([p[1], p[2]]))
    assert w.dtype == torch.float32


def test_moe_runs_only_routed_experts_and_sums_in_fp32():
    E, l, inter = 3, 4, 6
    gate, up, down = torch.randn(E, inter, l), torch.randn(E, inter, l), torch.randn(E, l, inter)
    gate[2] = float("nan")  # expert 2 is never routed to: its weights must never be read
    experts = ExpertWeights(gate, up, down, "fp32", E)
    z = torch.randn(2, l, dtype=torch.bfloat16)
    ids, w = torch.tensor([[0, 1], [1, 0]]), torch.tensor([[0.7, 0.3], [0.6, 0.4]])
    norm = torch.rand(E, l) + 0.5
    y = ref.moe(z, w, ids, experts, norm, 1e-6)
    assert y.dtype == torch.float32 and torch.isfinite(y).all()
    zf = z.float()
    def expert(e, t):
        h = torch.nn.functional.silu(zf[t] @ gate[e].T) * (zf[t] @ up[e].T)
        return ref.rms_norm(h @ down[e].T, norm[e], 1e-6)
    assert torch.allclose(y[0], 0.7 * expert(0, 0) + 0.3 * expert(1, 0), atol=1e-5)
    assert torch.allclose(y[1], 0.6 * expert(1, 1) + 0.4 * expert(0, 1), atol=1e-5)


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
