"""The aiter adapter against a stand-in ``aiter`` module (AMD's aiter needs a ROCm host; none was reachable).

The stand-in has the real signatures of the functions the adapter calls (``aiter.fused_moe.fused_moe``,
``aiter.gemm_a4w4``, ``aiter.ops.shuffle.shuffle_weight``, ``aiter.utility.fp4_utils.e8m0_shuffle``, as of
ROCm/aiter@e404860), so a misspelt or missing keyword fails here; it checks every argument's dtype, shape and
layout (preshuffled weights, padded shuffled E8M0 scales, int32 ids, fp32 weights), undoes the shuffles with
aiter's permutations and computes the reference numerics from what it was given. What this proves: the
adapter hands aiter the right data in the right layout and maps Muse Spark's MoE (post norm before the
routing weight) onto it. What it cannot: that the real aiter accepts it or how fast it runs.
"""

from __future__ import annotations

import enum
import importlib.machinery
import sys
import types

import pytest
import torch

import musecore_quant
from musecore.backends.base import LinearShape
from musecore.devices import CATALOG
from musecore.ops import ExpertWeights, Weight
from musecore.ops import reference as ref
from musecore_rocm import RocmBackend
from musecore_rocm import aiter_adapter as adapter
from musecore_triton.testing import assert_nmse

FP4X2, E8M0 = torch.float4_e2m1fn_x2, torch.float8_e8m0fnu


def padded(rows: int, cols: int) -> tuple[int, int]:
    return (rows + 255) // 256 * 256, (cols + 7) // 8 * 8


def dequant(packed: torch.Tensor, shuffled_scales: torch.Tensor, rows: int, k: int) -> torch.Tensor:
    """Preshuffled fp4x2 ``[rows, k/2]`` (or canonical when ``packed`` is unshuffled already) + shuffled scales."""
    scales = adapter.unshuffle_scale(shuffled_scales.view(torch.uint8), rows, k // 32)
    return musecore_quant.dequantize(musecore_quant.QTensor(format="mxfp4", data=packed.view(torch.uint8),
                                                            scale=scales.contiguous(), shape=(rows, k), group_size=32))


def dequant_plain(packed: torch.Tensor, scales: torch.Tensor, rows: int, k: int) -> torch.Tensor:
    """Canonical MXFP4 bytes ``[rows, k/2]`` and row-major E8M0 scales ``[rows, k/32]`` -> fp32."""
    return musecore_quant.dequantize(musecore_quant.QTensor(format="mxfp4", data=packed.view(torch.uint8).contiguous(),
                                                            scale=scales.view(torch.uint8).contiguous(), shape=(rows, k),
                                                            group_size=32))


def stand_in_unified_attention(calls: list):
    """aiter's ``unified_attention`` (ROCm/aiter@e404860, aiter/ops/triton/attention/unified_attention.py) as a
    checker plus the kernel's semantics: key j of sequence b is ``k[block_table[b, j // bs], j % bs]``; query i of
    b sits at logical ``seqused_k[b] - T_b + i``; causal, ``SLIDING_WINDOW = 1 + window_size[0]``; K/V descales."""

    def unified_attention(q, k, v, out, cu_seqlens_q, max_seqlen_q, seqused_k, max_seqlen_k, softmax_scale, causal,
                          window_size, block_table, softcap, q_descale, k_descale, v_descale, q_scales=None,
                          alibi_slopes=None, output_scale=None, qq_bias=None, sinks=None, shuffled_kv_cache=False,
                          skip_reduce=False):
        assert causal and softcap == 0 and q_descale is None and q_scales is None and alibi_slopes is None
        assert output_scale is None and qq_bias is None and sinks is None and not shuffled_kv_cache and not skip_reduce
        N, nq, d = q.shape
        nb, bs, nkv, dk = k.shape
        assert q.is_contiguous() and q.dtype in (torch.bfloat16, torch.float16) and dk == d and nq % nkv == 0
        assert v.shape == k.shape and v.stride() == k.stride() and k.stride(3) == 1 and k.stride(2) == d
        assert out.shape == q.shape and out.dtype == q.dtype
        assert bs in (16, 32, 64), bs  # tl.dot needs >= 16 keys per tile; tiles are min(64, next_pow2(bs))
        fp8 = k.dtype == torch.float8_e4m3fn  # aiter's e4m3 dtype on gfx950
        assert k.dtype == v.dtype and (fp8 or k.dtype == q.dtype), (k.dtype, q.dtype)
        assert (k_descale is not None) == fp8 == (v_descale is not None)
        if fp8:
            assert k_descale.dtype == v_descale.dtype == torch.float32 and k_descale.numel() == v_descale.numel() == 1
        B = seqused_k.shape[0]
        assert cu_seqlens_q.dtype == seqused_k.dtype == block_table.dtype == torch.int32
        assert cu_seqlens_q.shape == (B + 1,) and block_table.dim() == 2 and block_table.shape[0] == B
        assert int(cu_seqlens_q[0]) == 0 and int(cu_seqlens_q[-1]) == N
        assert isinstance(max_seqlen_q, int) and isinstance(max_seqlen_k, int)
        lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
        assert int(lens.max()) <= max_seqlen_q and int(seqused_k.max()) <= max_seqlen_k
        assert int(block_table.min()) >= 0 and int(block_table.max()) < nb
        sliding = 1 + window_size[0]
        kd = float(k_descale) if fp8 else 1.0
        vd = float(v_descale) if fp8 else 1.0
        for b in range(B):
            lo, hi, L = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1]), int(seqused_k[b])
            Tb = hi - lo
            if Tb == 0:
                continue
            j = torch.arange(max(L, 0))
            assert (L + bs - 1) // bs <= block_table.shape[1], "block table narrower than the sequence"
            pages = block_table[b, j // bs].long()
            kk = (k[pages, j % bs].float() * kd).repeat_interleave(nq // nkv, dim=1)  # [L, nq, d]
            vv = (v[pages, j % bs].float() * vd).repeat_interleave(nq // nkv, dim=1)
            qpos = (L - Tb) + torch.arange(Tb)
            visible = j[None, :] <= qpos[:, None]
            if sliding > 0:
                visible &= (qpos[:, None] - j[None, :]) < sliding
            scores = torch.einsum("thd,shd->hts", q[lo:hi].float(), kk) * softmax_scale
            probs = torch.softmax(scores.masked_fill(~visible[None], float("-inf")), -1).nan_to_num(0.0)
            out[lo:hi] = torch.einsum("hts,shd->thd", probs, vv).to(out.dtype)
        calls.append(("unified_attention", N, B, bs))
        return out

    return unified_attention



def routed_sum(hidden_states: torch.Tensor, experts, topk_ids: torch.Tensor, topk_weight: torch.Tensor) -> torch.Tensor:
    """The stand-in's numbers: each row's routed experts by the reference, weighted and summed in fp32."""
    out = torch.zeros(hidden_states.shape[0], hidden_states.shape[1])
    for m in range(hidden_states.shape[0]):
        for j in range(topk_ids.shape[1]):
            out[m] += topk_weight[m, j] * ref.expert_forward(hidden_states[m:m + 1], experts, int(topk_ids[m, j]))[0]
    return out


def make_stand_in(calls: list) -> dict[str, types.ModuleType]:
    QuantType = enum.Enum("QuantType", "No per_Tensor per_Token per_1x32 per_1x128")
    ActivationType = enum.Enum("ActivationType", "Silu Gelu Swiglu")

    def shuffle_weight(x, layout=(16, 16), use_int4=False, is_guinterleave=False, gate_up=False, pad_k_to=0):
        assert layout == (16, 16) and not (use_int4 or is_guinterleave or gate_up or pad_k_to)
        assert x.dtype == FP4X2, x.dtype
        y = adapter.shuffle_weight(x.view(torch.uint8)).view(FP4X2)
        y.is_shuffled = True
        return y

    def e8m0_shuffle(scale):
        assert scale.dim() == 2 and scale.dtype == E8M0, (scale.shape, scale.dtype)
        return adapter.shuffle_scale(scale.view(torch.uint8)).view(E8M0)

    def shuffle_weight_a16w4(src, NLane, gate_up):
        assert NLane == 16 and src.dtype == FP4X2 and src.dim() == 3, (NLane, src.dtype, src.shape)
        y = adapter.shuffle_weight_a16w4(src.view(torch.uint8), gate_up).view(FP4X2)
        y.is_shuffled, y.a16w4_gate_up = True, gate_up
        return y

    def shuffle_scale_a16w4(src, experts_cnt, gate_up):
        assert src.dim() == 2 and src.dtype == E8M0, (src.shape, src.dtype)
        y = adapter.shuffle_scale_a16w4(src.view(torch.uint8), experts_cnt, gate_up).view(E8M0)
        y.a16w4_layout = (experts_cnt, gate_up)
        return y

    def fused_moe_a16w4(hidden_states, w1, w2, topk_weight, topk_ids, w1_scale, w2_scale):
        """bf16 activations: aiter keeps them bf16 (gate_mode interleave, Silu) on gfx942 always and on gfx950 below
        AITER_BF16_FP8_MOE_BOUND rows; the stand-in refuses a call that would have gone to fp8 on gfx950."""
        M, h = hidden_states.shape
        E, two_i, hb = w1.shape
        inter = two_i // 2
        bound = int(__import__("os").environ.get("AITER_BF16_FP8_MOE_BOUND", "256"))
        assert stand_in_gfx["gfx"] != "gfx950" or M < bound, f"{M} rows >= {bound}: aiter would quantize to fp8 on gfx950"
        assert w1.a16w4_gate_up is True and w2.a16w4_gate_up is False and w2.shape == (E, h, inter // 2)
        assert w1_scale.a16w4_layout == (E, True) and w2_scale.a16w4_layout == (E, False)
        assert w1_scale.shape == (E * two_i, h // 32) and w2_scale.shape == (E * h, inter // 32)
        g_u = dequant_plain(adapter.unshuffle_weight_a16w4(w1.view(torch.uint8), True).reshape(E * two_i, hb),
                            adapter.unshuffle_scale_a16w4(w1_scale.view(torch.uint8), E, True), E * two_i, h)
        down = dequant_plain(adapter.unshuffle_weight_a16w4(w2.view(torch.uint8), False).reshape(E * h, inter // 2),
                             adapter.unshuffle_scale_a16w4(w2_scale.view(torch.uint8), E, False), E * h, inter)
        g_u, down = g_u.reshape(E, two_i, h), down.reshape(E, h, inter)
        experts = ExpertWeights(g_u[:, :inter], g_u[:, inter:], down, format="mxfp4", num_experts=E)
        out = routed_sum(hidden_states, experts, topk_ids, topk_weight)
        calls.append(("fused_moe_a16w4", M, topk_ids.shape[1]))
        return out.to(hidden_states.dtype)

    def fused_moe(hidden_states, w1, w2, topk_weight, topk_ids, expert_mask=None, activation=ActivationType.Silu,
                  quant_type=QuantType.No, doweight_stage1=False, w1_scale=None, w2_scale=None, a1_scale=None,
                  a2_scale=None, block_size_M=None, num_local_tokens=None, moe_sorting_dispatch_policy=0, dtype=None,
                  hidden_pad=0, intermediate_pad=0, bias1=None, bias2=None, splitk=0, swiglu_limit=None, beta=None,
                  linear_beta=None, gate_mode="separated", shared_w1=None, shared_w2=None, shared_w1_scale=None,
                  shared_w2_scale=None, shared_expert_id=-1, stage2_scatter=None):
        assert quant_type is QuantType.per_1x32 and activation is ActivationType.Silu and not doweight_stage1
        assert a1_scale is None and a2_scale is None and expert_mask is None
        assert topk_ids.dtype == torch.int32 and topk_weight.dtype == torch.float32
        assert topk_ids.shape == topk_weight.shape and topk_ids.shape[0] == hidden_states.shape[0]
        if gate_mode == "interleave":
            assert hidden_states.dtype in (torch.bfloat16, torch.float16) and w1.dtype == w2.dtype == FP4X2
            return fused_moe_a16w4(hidden_states, w1, w2, topk_weight, topk_ids, w1_scale, w2_scale)
        assert gate_mode == "separated"
        M, h = hidden_states.shape
        E, two_i, hb = w1.shape
        inter = two_i // 2
        assert hidden_states.dtype in (torch.bfloat16, torch.float16) and hb * 2 == h
        assert w1.dtype == w2.dtype == FP4X2 and getattr(w1, "is_shuffled", False) and getattr(w2, "is_shuffled", False)
        assert not hasattr(w1, "a16w4_gate_up") and not hasattr(w2, "a16w4_gate_up")  # the (16, 16) layout here
        assert w2.shape == (E, h, inter // 2), w2.shape
        assert w1_scale.dtype == w2_scale.dtype == E8M0
        assert w1_scale.shape == padded(E * two_i, h // 32) and w2_scale.shape == padded(E * h, inter // 32)
        g_u = dequant(adapter.unshuffle_weight(w1.view(torch.uint8)).reshape(E * two_i, hb), w1_scale, E * two_i, h)
        down = dequant(adapter.unshuffle_weight(w2.view(torch.uint8)).reshape(E * h, inter // 2), w2_scale, E * h, inter)
        g_u, down = g_u.reshape(E, two_i, h), down.reshape(E, h, inter)
        experts = ExpertWeights(g_u[:, :inter], g_u[:, inter:], down, format="mxfp4", num_experts=E, act_format="mxfp4")
        out = routed_sum(hidden_states, experts, topk_ids, topk_weight)
        calls.append(("fused_moe", M, topk_ids.shape[1]))
        return out.to(hidden_states.dtype)

    def gemm_a4w4(A, B, A_scale, B_scale, bias=None, dtype=torch.bfloat16, alpha=1.0, beta=0.0, bpreshuffle=True,
                  apreshuffle=False, global_A_scale=None, global_B_scale=None):
        assert A.dtype == B.dtype == FP4X2 and A_scale.dtype == B_scale.dtype == E8M0
        assert bpreshuffle and not apreshuffle and getattr(B, "is_shuffled", False) and not getattr(A, "is_shuffled", False)
        assert global_A_scale is None and global_B_scale is None and bias is None and dtype in (torch.bfloat16, torch.float16)
        (m, kb), (n, kb2) = A.shape, B.shape
        assert kb == kb2 and A_scale.shape == padded(m, kb // 16) and B_scale.shape == padded(n, kb // 16)
        a = dequant(A, A_scale, m, kb * 2)
        b = dequant(adapter.unshuffle_weight(B.view(torch.uint8)), B_scale, n, kb * 2)
        calls.append(("gemm_a4w4", m, n))
        return (a @ b.T).to(dtype)

    aiter = types.ModuleType("aiter")
    aiter.__spec__ = importlib.machinery.ModuleSpec("aiter", None)
    aiter.QuantType, aiter.ActivationType, aiter.gemm_a4w4 = QuantType, ActivationType, gemm_a4w4
    aiter.dtypes = types.SimpleNamespace(fp4x2=FP4X2, fp8_e8m0=E8M0)
    fused = types.ModuleType("aiter.fused_moe")
    fused.fused_moe = fused_moe
    aiter.fused_moe = fused  # as in aiter: the attribute is the submodule
    shuffle = types.ModuleType("aiter.ops.shuffle")
    shuffle.shuffle_weight = shuffle_weight
    shuffle.shuffle_weight_a16w4, shuffle.shuffle_scale_a16w4 = shuffle_weight_a16w4, shuffle_scale_a16w4
    fp4_utils = types.ModuleType("aiter.utility.fp4_utils")
    fp4_utils.e8m0_shuffle = e8m0_shuffle
    unified = types.ModuleType(adapter.UNIFIED_ATTENTION_MODULE)
    unified.unified_attention = stand_in_unified_attention(calls)
    return {"aiter": aiter, "aiter.fused_moe": fused, "aiter.ops": types.ModuleType("aiter.ops"),
            "aiter.ops.shuffle": shuffle, "aiter.utility": types.ModuleType("aiter.utility"),
            "aiter.utility.fp4_utils": fp4_utils, "aiter.ops.triton": types.ModuleType("aiter.ops.triton"),
            "aiter.ops.triton.attention": types.ModuleType("aiter.ops.triton.attention"),
            adapter.UNIFIED_ATTENTION_MODULE: unified}


stand_in_gfx = {"gfx": "gfx950"}  # the arch the stand-in pretends to run on (aiter's get_gfx())


@pytest.fixture
def stand_in(monkeypatch):
    calls: list = []
    for name, module in make_stand_in(calls).items():
        monkeypatch.setitem(sys.modules, name, module)
    return calls


def test_w4a4_linear_through_aiter_gemm_a4w4_matches_the_reference(stand_in, monkeypatch):
    monkeypatch.setenv(adapter.ENV, "1")
    be = RocmBackend("cpu", arch="gfx950")
    qt = musecore_quant.quantize(torch.randn(96, 256) * 0.05, "mxfp4")
    w = be.prepare_weight(qt, "q_proj", act_format="mxfp4")
    assert isinstance(w.data, adapter.AiterLinear)
    x = torch.randn(2, 5, 256).to(torch.float16)
    y = be.linear(x, w)
    want = ref.linear(x, Weight(data=musecore_quant.dequantize(qt), format="mxfp4", out_features=96, in_features=256,
                                act_format="mxfp4"))
    assert stand_in == [("gemm_a4w4", 10, 96)]
    assert y.shape == (2, 5, 96) and y.dtype == x.dtype
    assert_nmse(want.float(), y.float(), 1e-5, "aiter W4A4 linear (stand-in)")  # the interpreter tests' tolerance


def test_moe_through_aiter_fused_moe_matches_the_reference(stand_in, monkeypatch):
    """Post norm before the routing weight: one aiter row per assignment (top-1, weight 1), then the finalize."""
    monkeypatch.setenv(adapter.ENV, "1")
    be = RocmBackend("cpu", arch="gfx950")
    E, h, inter, T, k = 4, 128, 128, 3, 2
    stacks = [musecore_quant.quantize(torch.randn(E, o, i) * 0.05, "mxfp4") for o, i in ((inter, h), (inter, h), (h, inter))]
    experts = be.prepare_experts(*stacks, act_format="mxfp4")
    assert isinstance(experts.gate, adapter.AiterExperts)
    z = torch.randn(T, h).to(torch.float16)
    weights, ids = torch.rand(T, E).topk(k)
    post = (torch.rand(h) + 0.5).to(torch.float16)
    got = be.moe(z, weights, ids, experts, post, 1e-6)
    want = ref.moe(z, weights, ids, ExpertWeights(*[musecore_quant.dequantize(s) for s in stacks], format="mxfp4",
                                                   num_experts=E, act_format="mxfp4"), post, 1e-6)
    assert stand_in == [("fused_moe", T * k, 1)]
    assert_nmse(want, got, 2e-5, "aiter MoE (stand-in)")  # the interpreter tests' tolerance


def test_aiter_present_but_not_asked_for_is_a_candidate_with_its_reason(stand_in, monkeypatch):
    monkeypatch.delenv(adapter.ENV, raising=False)
    be = RocmBackend("cpu", arch="gfx950")
    w = be.prepare_weight(musecore_quant.quantize(torch.randn(64, 128), "mxfp4"), "q_proj", act_format="mxfp4")
    assert not isinstance(w.data, adapter.AiterLinear) and not stand_in
    linears = [LinearShape("q_proj", 8192, 8192, "mxfp4", "mxfp4"),
               LinearShape("experts gate/up", 8192, 4096, "mxfp4", "mxfp4", experts=256, top_k=8)]
    lin, moe = be.kernel_choices(linears, CATALOG["mi355x"])[:2]
    assert "dot_scaled" in lin.choice and "never called the real aiter" in lin.reason and adapter.ENV in lin.reason
    assert "Triton" in moe.choice and "aiter fused_moe: AMD aiter is importable" in moe.reason
    monkeypatch.setenv(adapter.ENV, "1")
    lin, moe = be.kernel_choices(linears, CATALOG["mi355x"])[:2]
    assert lin.choice.startswith("aiter gemm_a4w4") and lin.env == adapter.ENV
    assert moe.choice.startswith("aiter fused_moe") and "never been run against the real aiter" in moe.reason
    assert "gfx950" in be.kernel_choices(linears, CATALOG["mi300x"])[1].reason  # gfx942: aiter's MXFP4 needs gfx950


def test_without_aiter_the_plan_says_so_and_nothing_changes(monkeypatch):
    monkeypatch.setenv(adapter.ENV, "1")
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    assert adapter.aiter_selected("gfx950") == (False, "aiter is not installed (AMD's ROCm/aiter, PyPI amd-aiter; "
                                                       "optional)")
    be = RocmBackend("cpu", arch="gfx950")
    w = be.prepare_weight(musecore_quant.quantize(torch.randn(64, 128), "mxfp4"), "q_proj", act_format="mxfp4")
    assert not isinstance(w.data, adapter.AiterLinear)


# -- a16w4: MXFP4 experts with BF16 activations (gfx942; gfx950 below aiter's bf16/fp8 bound) -------------

def a16w4_case(be, E=4, h=256, inter=256, T=3, k=2):
    stacks = [musecore_quant.quantize(torch.randn(E, o, i) * 0.05, "mxfp4") for o, i in ((inter, h), (inter, h), (h, inter))]
    experts = be.prepare_experts(*stacks, act_format=None)
    z = torch.randn(T, h).to(torch.bfloat16)
    weights, ids = torch.rand(T, E).topk(k)
    post = (torch.rand(h) + 0.5).to(torch.bfloat16)
    want = ref.moe(z, weights, ids, ExpertWeights(*[musecore_quant.dequantize(s) for s in stacks], format="mxfp4",
                                                   num_experts=E), post, 1e-6)
    return experts, z, weights, ids, post, want


@pytest.mark.parametrize("gfx", ["gfx942", "gfx950"])
def test_a16w4_moe_through_aiter_fused_moe_matches_the_w4a16_reference(stand_in, monkeypatch, gfx):
    """bf16 activations, never quantized: on gfx950 the adapter cuts the rows below aiter's bf16/fp8 bound (set to 4
    here, so 6 rows go as 3 + 3); the stand-in fails any call that aiter would have run with fp8 activations."""
    monkeypatch.setenv(adapter.ENV, "1")
    monkeypatch.setenv(adapter.A16W4_BOUND_ENV, "4")
    monkeypatch.setitem(stand_in_gfx, "gfx", gfx)
    be = RocmBackend("cpu", arch=gfx)
    experts, z, weights, ids, post, want = a16w4_case(be)
    assert isinstance(experts.gate, adapter.AiterExperts) and experts.gate.a16w4
    got = be.moe(z, weights, ids, experts, post, 1e-6)
    assert stand_in == ([("fused_moe_a16w4", 6, 1)] if gfx == "gfx942" else [("fused_moe_a16w4", 3, 1)] * 2)
    assert_nmse(want, got, 5e-5, f"aiter a16w4 MoE on {gfx} (stand-in)")  # expert outputs rounded to bf16 (8-bit mantissa)


def test_a16w4_candidate_and_its_reasons_in_the_plan(stand_in, monkeypatch):
    shape = [LinearShape("experts gate/up", 8192, 4096, "mxfp4", None, experts=256, top_k=8),
             LinearShape("q_proj", 8192, 8192, "mxfp4", None)]
    monkeypatch.delenv(adapter.ENV, raising=False)
    be = RocmBackend("cpu", arch="gfx942")
    moe, lin = be.kernel_choices(shape, CATALOG["mi300x"])[:2]
    assert "aiter a16w4 fused_moe" in moe.reason and "not selected" in moe.reason and "Triton" in moe.choice
    assert "gemm_a16wfp4" in lin.reason and "W4A4, not W4A16" in lin.reason
    monkeypatch.setenv(adapter.ENV, "1")
    moe = be.kernel_choices(shape, CATALOG["mi300x"])[0]
    assert moe.choice.startswith("aiter fused_moe a16w4") and moe.env == adapter.ENV
    experts = a16w4_case(RocmBackend("cpu", arch="gfx942"), h=128, inter=128)[0]  # 128 % 256 != 0: the Triton MoE
    assert not isinstance(experts.gate, adapter.AiterExperts)


# -- unified attention on the static KV cache ------------------------------------------------------------

from musecore.kv_cache import LayerCache  # noqa: E402

NQ, NKV, D = 4, 2, 32


def static_cache(B, capacity, ring, kv_format="bf16", k_scale=1.0, v_scale=1.0):
    return LayerCache(B, capacity, NKV, D, ring=ring, kv_format=kv_format, dtype=torch.bfloat16, device="cpu",
                      k_scale=k_scale, v_scale=v_scale, static=True)


def fill(cache, lengths):
    """Write positions 0..n-1 of each row (left-padded to the longest), as a prompt's prefill does."""
    B, T = len(lengths), max(lengths)
    pos = torch.tensor([[-1] * (T - n) + list(range(n)) for n in lengths])
    k, v = cache.encode(torch.randn(B, T, NKV, D), torch.randn(B, T, NKV, D))
    cache.write(k, v, pos)
    return pos


def step(cache, q_pos):
    """One attention step at positions ``q_pos [B, T]``: Muse's view (written after for prefill, before for decode)
    and the reference output on it; the cache then holds the step's entries, as aiter needs."""
    B, T = q_pos.shape
    q = torch.randn(B, T, NQ, D).to(torch.bfloat16)
    k, v = cache.encode(torch.randn(B, T, NKV, D), torch.randn(B, T, NKV, D))
    view = cache.update(k, v, q_pos)
    return q, view


def compare(cache, q, view, q_pos, window, api, table_fault=None, monkeypatch=None):
    scale = D ** -0.5
    want = ref.attention(q, view.k, view.v, q_pos, view.positions, window, scale, view.k_scale, view.v_scale)
    if table_fault is not None:
        real = adapter.paged_kv
        monkeypatch.setattr(adapter, "paged_kv", lambda *a: table_fault(real(*a)))
    got = adapter.aiter_attention(q, cache.k, cache.v, q_pos, cache.capacity, window, scale, api,
                                  cache.k_scale, cache.v_scale)
    return want, got


CASES = {  # name: (capacity, ring, window, history lengths per row, step length)
    "full decode": (64, False, None, [40, 23], 1),
    "full prefill, left-padded": (64, False, None, [0, 0], 9),
    "full prefill after a prefix": (64, False, None, [17, 30], 6),
    "sliding decode, ring wrapped": (32, True, 32, [75, 40], 1),
    "sliding decode, ring not full": (32, True, 32, [10, 3], 1),
    "sliding prefill, ring not wrapped": (48, True, 48, [12, 20], 7),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("kv_format", ["bf16", "fp8"])
def test_unified_attention_on_the_paged_static_cache_matches_muse_attention(stand_in, name, kv_format):
    """Tolerance: nmse 1e-5 (both sides compute in fp32 from the same bf16/e4m3 bytes and round to bf16)."""
    capacity, ring, window, lengths, T = CASES[name]
    cache = static_cache(len(lengths), capacity, ring, kv_format, k_scale=0.5, v_scale=2.0)
    fill(cache, lengths) if max(lengths) else None
    last = torch.tensor(lengths)
    q_pos = last[:, None] + torch.arange(T)[None, :]
    if name.endswith("left-padded"):
        q_pos = torch.tensor([[-1, -1, -1] + list(range(6)), list(range(9))])
    assert adapter.attention_declines("gfx950", cache.k, capacity, T, window, kv_format == "fp8",
                                      int(q_pos.max())) is None
    q, view = step(cache, q_pos)
    api = adapter.load_aiter()
    want, got = compare(cache, q, view, q_pos, window, api)
    assert stand_in and stand_in[-1][0] == "unified_attention"
    assert_nmse(want.float(), got.float(), 1e-5, f"aiter unified attention, {name}, {kv_format} KV (stand-in)")


@pytest.mark.parametrize("fault", ["rows swapped", "pages shifted"])
def test_a_wrong_block_table_is_caught(stand_in, monkeypatch, fault):
    """The comparison above would fail on a wrong mapping: the same case with a corrupted table errs far past 1e-5."""
    cache = static_cache(2, 64, False)
    fill(cache, [40, 23])
    q_pos = torch.tensor([[40], [23]])
    q, view = step(cache, q_pos)

    def corrupt(paged):
        table = paged.block_table.flip(0) if fault == "rows swapped" else paged.block_table + 1
        return adapter.PagedKV(paged.k, paged.v, table.contiguous(), paged.seqused_k, paged.block_size,
                               paged.max_seqlen_k)

    want, got = compare(cache, q, view, q_pos, None, adapter.load_aiter(), corrupt, monkeypatch)
    err = ((want.float() - got.float()) ** 2).sum() / (want.float() ** 2).sum()
    assert err > 1e-2, f"a {fault} block table gave nmse {err:.3g}: the check could not catch it"


def test_attention_declines_what_it_cannot_do_exactly():
    cache = static_cache(1, 32, True)
    assert "after the ring wrapped" in adapter.attention_declines("gfx950", cache.k, 32, 5, 32, False, 40)
    assert adapter.attention_declines("gfx950", cache.k, 32, 1, 32, False, 40) is None  # decode after a wrap: exact
    assert "e4m3fnuz" in adapter.attention_declines("gfx942", cache.k, 32, 1, 32, True)
    assert "multiple of 16" in adapter.attention_declines("gfx950", static_cache(1, 40, False).k, 40, 1, None, False)
    assert "not a static cache" in adapter.attention_declines("gfx950", torch.zeros(1, 32, NKV, D), 32, 1, None, False)


def test_backend_decode_goes_to_aiter_only_when_selected_and_exact(stand_in, monkeypatch):
    cache = static_cache(2, 64, False)
    fill(cache, [40, 23])
    q_pos = torch.tensor([[40], [23]])
    q, view = step(cache, q_pos)
    args = (q, view.k, view.v, q_pos, view.positions, None, D ** -0.5)
    want = ref.attention(*args)
    monkeypatch.delenv(adapter.ENV, raising=False)
    RocmBackend("cpu", arch="gfx950").attention(*args)
    assert not stand_in  # not asked for: the Triton kernel
    monkeypatch.setenv(adapter.ENV, "1")
    be = RocmBackend("cpu", arch="gfx950")
    assert_nmse(want.float(), be.attention(*args).float(), 1e-5, "backend decode through aiter (stand-in)")
    assert stand_in == [("unified_attention", 2, 2, 64)]
    be.attention(q, view.k.contiguous(), view.v.contiguous(), q_pos, view.positions, None, D ** -0.5)
    assert len(stand_in) == 1  # a contiguous [B, S] tensor is no static cache view: the Triton kernel
    plan = be.kernel_choices([], CATALOG["mi355x"])
    attn = next(c for c in plan if c.what == "attention")
    assert attn.choice.startswith("aiter unified_attention") and "static cache" in attn.choice


def test_a_contiguous_cache_is_partitioned_into_pages_with_the_plain_block_table(stand_in):
    """Rows of C slots with bs | C: pages are plain partitions and block_table[b] = b*C/bs + arange (the last entry
    wraps to the row's first page, past every query); the result equals Muse's attention on the same slots."""
    B, C, n = 2, 64, [50, 37]
    k, v = torch.randn(B, C, NKV, D).to(torch.bfloat16), torch.randn(B, C, NKV, D).to(torch.bfloat16)
    positions = torch.tensor([[p if p < m else -1 for p in range(C)] for m in n])
    q_pos = torch.tensor([[m - 1] for m in n])
    paged = adapter.paged_kv(k, v, q_pos[:, 0], C)
    assert paged.block_size == 64 and paged.k.shape == (B, 64, NKV, D) and paged.k.data_ptr() == k.data_ptr()
    assert paged.block_table.tolist() == [[0, 0], [1, 1]] and paged.seqused_k.tolist() == n
    q = torch.randn(B, 1, NQ, D).to(torch.bfloat16)
    got = adapter.aiter_attention(q, k, v, q_pos, C, None, D ** -0.5, adapter.load_aiter())
    want = ref.attention(q, k, v, q_pos, positions, None, D ** -0.5)
    assert_nmse(want.float(), got.float(), 1e-5, "aiter attention on partition pages (stand-in)")
    small = adapter.paged_kv(k, v, q_pos[:, 0], 32)  # capacity 32 in rows of 64 slots: bs 32 divides both
    assert small.block_size == 32 and small.block_table[1, 0] == 64 // 32
