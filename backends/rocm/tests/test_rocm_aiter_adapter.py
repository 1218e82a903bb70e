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

    def fused_moe(hidden_states, w1, w2, topk_weight, topk_ids, expert_mask=None, activation=ActivationType.Silu,
                  quant_type=QuantType.No, doweight_stage1=False, w1_scale=None, w2_scale=None, a1_scale=None,
                  a2_scale=None, block_size_M=None, num_local_tokens=None, moe_sorting_dispatch_policy=0, dtype=None,
                  hidden_pad=0, intermediate_pad=0, bias1=None, bias2=None, splitk=0, swiglu_limit=None, beta=None,
                  linear_beta=None, gate_mode="separated", shared_w1=None, shared_w2=None, shared_w1_scale=None,
                  shared_w2_scale=None, shared_expert_id=-1, stage2_scatter=None):
        assert quant_type is QuantType.per_1x32 and activation is ActivationType.Silu and not doweight_stage1
        assert a1_scale is None and a2_scale is None and expert_mask is None and gate_mode == "separated"
        M, h = hidden_states.shape
        E, two_i, hb = w1.shape
        inter = two_i // 2
        assert hidden_states.dtype in (torch.bfloat16, torch.float16) and hb * 2 == h
        assert w1.dtype == w2.dtype == FP4X2 and getattr(w1, "is_shuffled", False) and getattr(w2, "is_shuffled", False)
        assert w2.shape == (E, h, inter // 2), w2.shape
        assert w1_scale.dtype == w2_scale.dtype == E8M0
        assert w1_scale.shape == padded(E * two_i, h // 32) and w2_scale.shape == padded(E * h, inter // 32)
        assert topk_ids.dtype == torch.int32 and topk_weight.dtype == torch.float32
        assert topk_ids.shape == topk_weight.shape and topk_ids.shape[0] == M
        g_u = dequant(adapter.unshuffle_weight(w1.view(torch.uint8)).reshape(E * two_i, hb), w1_scale, E * two_i, h)
        down = dequant(adapter.unshuffle_weight(w2.view(torch.uint8)).reshape(E * h, inter // 2), w2_scale, E * h, inter)
        g_u, down = g_u.reshape(E, two_i, h), down.reshape(E, h, inter)
        experts = ExpertWeights(g_u[:, :inter], g_u[:, inter:], down, format="mxfp4", num_experts=E, act_format="mxfp4")
        out = torch.zeros(M, h)
        for m in range(M):
            for j in range(topk_ids.shape[1]):
                out[m] += topk_weight[m, j] * ref.expert_forward(hidden_states[m:m + 1], experts, int(topk_ids[m, j]))[0]
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
    fp4_utils = types.ModuleType("aiter.utility.fp4_utils")
    fp4_utils.e8m0_shuffle = e8m0_shuffle
    return {"aiter": aiter, "aiter.fused_moe": fused, "aiter.ops": types.ModuleType("aiter.ops"),
            "aiter.ops.shuffle": shuffle, "aiter.utility": types.ModuleType("aiter.utility"),
            "aiter.utility.fp4_utils": fp4_utils}


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
