"""Each Pallas kernel in JAX's TPU interpreter (``pltpu.InterpretParams``: TPU semantics on the CPU) against its
plain-jnp reference and against musecore's torch reference (``musecore.ops.reference``, tensors through DLPack),
on small shapes, with stated NMSE tolerances (``musecore.ops.tolerance``); each prints its measured error."""

from __future__ import annotations

from typing import Any, Optional

import pytest
import torch

from musecore.ops import ExpertWeights, tolerance
from musecore.ops import reference as ref
from musecore.testing import assert_nmse

pytestmark = pytest.mark.usefixtures("jax_available")
QUANT_OPTIONS = {"int4": {"group_size": 128, "sym": True}, "int4-asym": {"group_size": 128, "sym": False}}


def weight(fmt: str, shape: tuple[int, ...], gen: torch.Generator) -> tuple[Any, torch.Tensor]:
    """(checkpoint weight, its exact fp32 values) for ``fmt`` (bf16 or a musecore_quant format)."""
    w = torch.randn(shape, generator=gen) * shape[-1] ** -0.5
    w[..., :2, :16] *= 8.0  # an outlier block
    if fmt == "bf16":
        return w.to(torch.bfloat16), w.to(torch.bfloat16).float()
    from musecore_quant import dequantize, quantize
    qt = quantize(w, fmt.split("-")[0], **QUANT_OPTIONS.get(fmt, {}))
    return qt, dequantize(qt, torch.float32)


def resident(w: Any) -> tuple[str, dict, int]:
    from musecore_tpu import layouts
    from musecore_tpu.bridge import tree_to_jax
    if isinstance(w, torch.Tensor):
        return "bf16", tree_to_jax(layouts.prepare_dense(w, torch.bfloat16)), 0
    if w.format in layouts.Q8_FORMATS:
        return w.format, tree_to_jax(layouts.prepare_q8(w)), 0
    return w.format, tree_to_jax(layouts.prepare_packed(w)), w.group_size


@pytest.mark.parametrize("fmt,M,K,N", [("bf16", 5, 512, 256), ("int4", 3, 2048, 256), ("int4-asym", 1, 1024, 128),
                                       ("mxfp4", 4, 1024, 384), ("nvfp4", 1, 512, 256)])
def test_matmul_kernel_matches_jnp_and_torch_references(fmt: str, M: int, K: int, N: int) -> None:
    import jax.numpy as jnp
    from musecore_tpu.bridge import to_jax, to_torch
    from musecore_tpu.kernels.matmul import matmul, matmul_reference
    gen = torch.Generator().manual_seed(hash(fmt) % 1000)
    w, values = weight(fmt, (N, K), gen)
    x = torch.randn(M, K, generator=gen).to(torch.bfloat16)
    kfmt, res, group = resident(w)
    got = to_torch(matmul(to_jax(x), res, fmt=kfmt, group=group, out_dtype=jnp.float32, interpret=True))
    jnp_ref = to_torch(matmul_reference(to_jax(x), res, fmt=kfmt, group=group, out_dtype=jnp.float32))
    want = x.float() @ values.T
    assert_nmse(want, got, 1e-10, f"matmul {fmt} {M}x{K}x{N} vs torch")   # f32 math: only the summation order differs
    assert_nmse(jnp_ref, got, 1e-10, f"matmul {fmt} vs jnp reference")


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["bf16", "int4-asym", "nvfp4", "fp8", "int8"])
def test_grouped_moe_kernel_runs_only_routed_experts_and_matches_references(fmt: str) -> None:
    import jax.numpy as jnp  # noqa: F401
    from musecore_tpu.bridge import to_jax, to_torch
    from musecore_tpu.kernels.moe import moe, moe_reference
    gen = torch.Generator().manual_seed(7)
    T, E, k, h, inter = 5, 8, 2, 128, 256
    z = ref.rms_norm(torch.randn(T, h, generator=gen), None, 1e-5).to(torch.bfloat16)
    ids = torch.tensor([[0, 3], [3, 5], [0, 5], [3, 0], [5, 3]])  # experts 1, 2, 4, 6, 7 are empty
    wts = torch.softmax(torch.randn(T, k, generator=gen), -1)
    stacks = [weight(fmt, shape, gen) for shape in ((E, inter, h), (E, inter, h), (E, h, inter))]
    post_norm = (1 + 0.2 * torch.randn(h, generator=gen)).to(torch.bfloat16)
    res = [resident(s[0]) for s in stacks]
    kfmt, group = res[0][0], res[0][2]
    args = (to_jax(z), to_jax(wts), to_jax(ids), res[0][1], res[1][1], res[2][1], to_jax(post_norm))
    got = to_torch(moe(*args, fmt=kfmt, group=group, eps=1e-8, interpret=True))
    jnp_ref = to_torch(moe_reference(*args, fmt=kfmt, group=group, eps=1e-8))
    experts = ExpertWeights(gate=stacks[0][1], up=stacks[1][1], down=stacks[2][1], format=kfmt, num_experts=E)
    want = ref.moe(z, wts, ids, experts, post_norm, 1e-8)
    assert_nmse(want, got, tolerance("moe"), f"moe {fmt} vs torch")
    assert_nmse(jnp_ref, got, tolerance("moe"), f"moe {fmt} vs jnp reference")


@pytest.mark.parametrize("T", [5, 40])
def test_grouped_moe_kernel_fp8_token_matches_references(T: int) -> None:
    """W8A8 FP8 experts (``fp8-token``): z quantized per token, h re-quantized per row, per-expert FP8 scales.
    Against the jnp reference (same codes; only f32 summation order and where the scales multiply differ: 1e-6)
    and musecore's torch reference ``expert_forward`` with ``act_format="fp8-token"`` (the tolerance of moe: its
    E4M3 codes of h may differ by one step where the two f32 h values straddle a rounding boundary)."""
    from musecore_quant import dequantize, quantize
    from musecore_tpu.bridge import to_jax, to_torch
    from musecore_tpu.kernels.moe import moe, moe_reference
    gen = torch.Generator().manual_seed(11 + T)
    E, k, h, inter = 8, 2, 256, 256
    z = ref.rms_norm(torch.randn(T, h, generator=gen), None, 1e-5).to(torch.bfloat16)
    z[1, :8] *= 30.0  # an outlier token: its own scale must not touch the others
    ids = torch.stack([torch.randperm(E - 1, generator=gen)[:k] for _ in range(T)])  # expert 7 empty
    wts = torch.softmax(torch.randn(T, k, generator=gen), -1)
    spread = torch.arange(1, E + 1).view(E, 1, 1)  # a different FP8 scale per expert
    qts = [quantize(torch.randn(s, generator=gen) * s[-1] ** -0.5 * spread, "fp8")
           for s in ((E, inter, h), (E, inter, h), (E, h, inter))]
    assert qts[0].scale.shape == (E,)
    values = [dequantize(q, torch.float32) for q in qts]
    res = [resident(q)[1] for q in qts]
    post_norm = (1 + 0.2 * torch.randn(h, generator=gen)).to(torch.bfloat16)
    args = (to_jax(z), to_jax(wts), to_jax(ids), res[0], res[1], res[2], to_jax(post_norm))
    got = to_torch(moe(*args, fmt="fp8", eps=1e-8, act="fp8-token", interpret=True))
    jnp_ref = to_torch(moe_reference(*args, fmt="fp8", eps=1e-8, act="fp8-token"))
    experts = ExpertWeights(gate=values[0], up=values[1], down=values[2], format="fp8", num_experts=E,
                            act_format="fp8-token")
    want = ref.moe(z, wts, ids, experts, post_norm, 1e-8)
    w16 = ref.moe(z, wts, ids, ExpertWeights(gate=values[0], up=values[1], down=values[2], format="fp8",
                                             num_experts=E), post_norm, 1e-8)
    assert_nmse(jnp_ref, got, 1e-6, f"moe fp8-token T={T} vs jnp reference")
    assert_nmse(want, got, tolerance("moe"), f"moe fp8-token T={T} vs torch reference")
    # not a W8A16 kernel in disguise: the activation quantization is measurably there
    from musecore.testing.check import nmse
    print(f"moe fp8-token T={T}: NMSE vs jnp {nmse(jnp_ref, got):.1e}, vs torch fp8-token {nmse(want, got):.1e}, "
          f"vs torch W8A16 {nmse(w16, got):.1e}")
    assert nmse(w16, got) > nmse(want, got), f"fp8-token closer to W8A16 ({nmse(w16, got):.2e}) than to the rule"


@pytest.mark.parametrize("T", [5, 40])
def test_grouped_moe_kernel_int8_token_matches_references(T: int) -> None:
    """W8A8 INT8 experts (``int8-token``, v6e's int8 MXU): z quantized per token and h per row to INT8 (``amax/127``,
    ties to even), the experts' INT8 codes with one f32 scale per output channel, exact int32 sums scaled after K.
    Against the jnp reference (same codes; only where the scales multiply and the f32 summation order differ: 1e-6)
    and musecore's torch reference ``expert_forward`` with ``act_format="int8-token"`` (the tolerance of moe: an h
    code may differ by one step where the two f32 h values straddle a rounding boundary)."""
    from musecore.testing.check import nmse
    from musecore_quant import dequantize, quantize
    from musecore_tpu.bridge import to_jax, to_torch
    from musecore_tpu.kernels.moe import moe, moe_reference
    gen = torch.Generator().manual_seed(31 + T)
    E, k, h, inter = 8, 2, 256, 256
    z = ref.rms_norm(torch.randn(T, h, generator=gen), None, 1e-5).to(torch.bfloat16)
    z[1, :8] *= 30.0  # an outlier token: its own scale must not touch the others
    ids = torch.stack([torch.randperm(E - 1, generator=gen)[:k] for _ in range(T)])  # expert 7 empty
    wts = torch.softmax(torch.randn(T, k, generator=gen), -1)
    spread = torch.logspace(-1, 1, inter).view(1, inter, 1)  # per-channel scales that differ across a 256-lane tile
    qts = [quantize(torch.randn(s, generator=gen) * s[-1] ** -0.5 * (spread if s[1] == inter else 1.0), "int8")
           for s in ((E, inter, h), (E, inter, h), (E, h, inter))]
    assert qts[0].scale.shape == (E, inter, 1)
    values = [dequantize(q, torch.float32) for q in qts]
    res = [resident(q)[1] for q in qts]
    post_norm = (1 + 0.2 * torch.randn(h, generator=gen)).to(torch.bfloat16)
    args = (to_jax(z), to_jax(wts), to_jax(ids), res[0], res[1], res[2], to_jax(post_norm))
    got = to_torch(moe(*args, fmt="int8", eps=1e-8, act="int8-token", interpret=True))
    jnp_ref = to_torch(moe_reference(*args, fmt="int8", eps=1e-8, act="int8-token"))
    experts = ExpertWeights(gate=values[0], up=values[1], down=values[2], format="int8", num_experts=E,
                            act_format="int8-token")
    want = ref.moe(z, wts, ids, experts, post_norm, 1e-8)
    w16 = ref.moe(z, wts, ids, ExpertWeights(gate=values[0], up=values[1], down=values[2], format="int8",
                                             num_experts=E), post_norm, 1e-8)
    print(f"moe int8-token T={T}: NMSE vs jnp {nmse(jnp_ref, got):.1e}, vs torch int8-token {nmse(want, got):.1e}, "
          f"vs torch W8A16 {nmse(w16, got):.1e}")
    assert_nmse(jnp_ref, got, 1e-6, f"moe int8-token T={T} vs jnp reference")
    assert_nmse(want, got, tolerance("moe"), f"moe int8-token T={T} vs torch reference")
    # not a W8A16 kernel in disguise: the activation quantization is measurably there
    assert nmse(w16, got) > 10 * nmse(want, got), f"int8-token close to W8A16 ({nmse(w16, got):.2e})"


def _positions(case: str) -> tuple[torch.Tensor, torch.Tensor, int, Optional[int]]:
    if case == "prefill-leftpad-sliding":
        q = torch.stack([torch.arange(12), torch.cat([torch.full((3,), -1), torch.arange(9)])])
        return q, q, 0, 8
    slots = torch.full((2, 8), -1)  # decode on a ring of 8 slots, one sequence wrapped, one short
    for b, start in enumerate((4, 29)):
        for pos in range(max(0, start - 8), start):
            slots[b, pos % 8] = pos
    q = torch.tensor([[4], [29]])
    return q, torch.cat([slots, q], 1), 8, 8


@pytest.mark.parametrize("case,kv", [("prefill-leftpad-sliding", "bf16"), ("decode-ring", "fp8")])
def test_attention_kernel_matches_references(case: str, kv: str) -> None:
    from musecore_tpu.bridge import to_jax, to_torch
    from musecore_tpu.kernels.attention import attention, attention_reference
    gen = torch.Generator().manual_seed(3)
    q_pos, k_pos, _cached, window = _positions(case)
    B, T, S, nq, nkv, d = 2, q_pos.shape[1], k_pos.shape[1], 4, 2, 64
    q = torch.randn(B, T, nq, d, generator=gen).to(torch.bfloat16)
    k, v = torch.randn(B, S, nkv, d, generator=gen), torch.randn(B, S, nkv, d, generator=gen)
    ks = vs = None
    if kv == "fp8":
        ks, vs = 0.5, 0.25
        k, v = (k / ks).to(torch.float8_e4m3fn), (v / vs).to(torch.float8_e4m3fn)
    else:
        k, v = k.to(torch.bfloat16), v.to(torch.bfloat16)
    args = (to_jax(q), to_jax(k), to_jax(v), to_jax(q_pos), to_jax(k_pos))
    opts = dict(window=window, scale=d ** -0.5, k_scale=ks or 1.0, v_scale=vs or 1.0)
    got = to_torch(attention(*args, **opts, interpret=True))
    want = ref.attention(q, k, v, q_pos, k_pos, window, d ** -0.5, ks, vs)
    assert_nmse(want, got, tolerance("attention"), f"attention {case} kv {kv} vs torch")
    assert_nmse(to_torch(attention_reference(*args, **opts)), got, tolerance("attention"), f"attention {case} vs jnp")
    if case.startswith("prefill"):
        assert (got[1, :3] == 0).all(), "padding queries (q_pos -1) see no key and must return zeros"


def test_norm_kernels_match_references() -> None:
    from musecore_tpu.bridge import to_jax, to_torch
    from musecore_tpu.kernels.norms import residual_norm, residual_norm_reference, rms_norm, rms_norm_reference
    gen = torch.Generator().manual_seed(5)
    x = (3 * torch.randn(2, 5, 256, generator=gen) + 0.5).to(torch.bfloat16)
    w = (1 + 0.2 * torch.randn(256, generator=gen)).to(torch.bfloat16)
    for weight_, scale_first in ((None, False), (w, False), (w, True)):
        got = to_torch(rms_norm(to_jax(x), to_jax(weight_), eps=1e-5, scale_first=scale_first, interpret=True))
        what = f"rms_norm weight={weight_ is not None} scale_first={scale_first}"
        assert_nmse(ref.rms_norm(x, weight_, 1e-5, scale_first), got, tolerance("rms_norm"), what + " vs torch")
        jr = rms_norm_reference(to_jax(x), to_jax(weight_), eps=1e-5, scale_first=scale_first)
        assert_nmse(to_torch(jr), got, tolerance("rms_norm"), what + " vs jnp")
    out = torch.randn(2, 5, 256, generator=gen).to(torch.bfloat16)
    alpha, beta = ref.residual_gate_coefficients(0.3 * torch.randn(256, generator=gen), 0.3)
    args = (to_jax(x), to_jax(out), to_jax(w), to_jax(alpha), to_jax(beta), to_jax(w))
    got = [to_torch(t) for t in residual_norm(*args, post_eps=1e-8, eps=1e-5, interpret=True)]
    want = ref.residual_norm(x, out, w, alpha, beta, w, 1e-8, 1e-5)
    jr = [to_torch(t) for t in residual_norm_reference(*args, post_eps=1e-8, eps=1e-5)]
    for i, name in enumerate(("residual", "normed")):
        assert_nmse(want[i], got[i], tolerance("residual_norm"), f"residual_norm {name} vs torch")
        assert_nmse(jr[i], got[i], tolerance("residual_norm"), f"residual_norm {name} vs jnp")


@pytest.mark.slow
def test_attention_online_softmax_across_query_and_key_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """Small tiles (8 query rows = 2 queries x 4 heads, 128 keys) so one call crosses query tiles, key tiles,
    padded keys and key tiles that a sliding window masks entirely (the running max must stay finite there)."""
    from musecore_tpu.bridge import to_jax, to_torch
    from musecore_tpu.kernels import tiling
    from musecore_tpu.kernels.attention import attention
    monkeypatch.setattr(tiling, "TILE_Q_ROWS", 8)
    monkeypatch.setattr(tiling, "TILE_KV", 128)
    gen = torch.Generator().manual_seed(11)
    B, T, C, nq, nkv, d = 1, 20, 280, 4, 1, 64  # 280 cached + 20 new = 300 keys: 3 tiles, the last one padded
    k_pos = torch.cat([torch.arange(C), torch.arange(C, C + T)])[None]
    k_pos[0, 5:9] = -1  # empty slots
    q_pos = torch.arange(C, C + T)[None]
    q = torch.randn(B, T, nq, d, generator=gen).to(torch.bfloat16)
    k = torch.randn(B, C + T, nkv, d, generator=gen).to(torch.bfloat16)
    v = torch.randn(B, C + T, nkv, d, generator=gen).to(torch.bfloat16)
    for window in (None, 64):
        got = to_torch(attention(to_jax(q), to_jax(k), to_jax(v), to_jax(q_pos), to_jax(k_pos), window=window,
                                 scale=d ** -0.5, interpret=True))
        want = ref.attention(q, k, v, q_pos, k_pos, window, d ** -0.5)
        assert_nmse(want, got, tolerance("attention"), f"attention tiled window={window} vs torch")


@pytest.mark.parametrize("fmt,act,M,K,N", [("int8", None, 5, 1024, 256), ("int8", "int8-token", 3, 512, 384),
                                           ("fp8", None, 4, 512, 256), ("fp8", "fp8-token", 33, 1024, 128)])
def test_8bit_mxu_matmul_matches_jnp_and_musecore_references(fmt: str, act: Optional[str], M: int, K: int,
                                                             N: int) -> None:
    """INT8 (v6e) and FP8 (v7) weights, with bf16 activations (one bf16 MXU pass: the 8-bit values are exact in
    bf16) or per-token 8-bit activations (int32 / f32 accumulation). Against the jnp reference the only difference
    is summation order; against musecore's reference (``musecore.ops.reference.linear``, fp32 math on the
    dequantized weight; both formats through musecore_quant's codecs and the reference's ``fp8-token`` /
    ``int8-token`` activation rules) the FP8 path also differs by the reference rounding its dequantized activations
    to bf16 (2^-9 relative), hence the looser bound there; ``int8-token`` keeps them f32, as the kernel does."""
    import jax.numpy as jnp
    from musecore_quant import dequantize, quantize
    from musecore_tpu import layouts
    from musecore_tpu.bridge import to_jax, to_torch
    from musecore_tpu.kernels.quantized import matmul_q8, matmul_q8_reference, quantize_tokens
    gen = torch.Generator().manual_seed(21)
    w = torch.randn(N, K, generator=gen) * K ** -0.5
    w[:2, :16] *= 8.0
    x = (torch.randn(M, K, generator=gen) * (1 + 3 * torch.rand(M, 1, generator=gen))).to(torch.bfloat16)
    qt = quantize(w.to(torch.bfloat16), fmt)
    resident, values = layouts.prepare_q8(qt), dequantize(qt, torch.float32)
    # the reference's activation rule in f32 (ref.linear would round y to bf16)
    want = ref.fake_quantize_activation(x, act, None).float() @ values.T if act else x.float() @ values.T
    res = {k: to_jax(v) for k, v in resident.items()}
    got = to_torch(matmul_q8(to_jax(x), res, fmt=fmt, act=act, out_dtype=jnp.float32, interpret=True))
    jnp_ref = to_torch(matmul_q8_reference(to_jax(x), res, fmt=fmt, act=act, out_dtype=jnp.float32))
    assert_nmse(jnp_ref, got, 1e-10, f"matmul {fmt} act {act} vs jnp reference")
    if act:
        # The reference's rule, code for code: the pre-pass divides correctly rounded (XLA's division by a broadcast
        # scale is a multiply by its reciprocal, and bf16 activations often sit exactly on a rounding tie; before
        # that fix 1.3% of fp8-token codes here were one E4M3 step off).
        codes, scale = quantize_tokens(to_jax(x), act)
        mine = to_torch(codes.astype(jnp.float32) * scale)
        theirs = ref.fake_quantize_activation(x, act, None)
        off = float((mine.to(theirs.dtype) != theirs).float().mean())
        print(f"{act} codes differing from the reference's rule: {off:.2%}")
        assert off == 0.0, f"{off:.2%} of {act} codes differ from the reference's"
    # fp8-token: the reference rounds x-hat to bf16 (2^-9 relative); int8-token keeps it f32: only the order differs
    tol = tolerance("linear") if act == "fp8-token" else 1e-10
    assert_nmse(want, got, tol, f"matmul {fmt} act {act} vs musecore reference")
    quant_err = nmse_of(x.float() @ w.T, got)
    print(f"{fmt} act {act}: NMSE vs the unquantized weight {quant_err:.2e} (what the conversion costs)")
    assert quant_err < (5e-3 if act else 1e-3)


def nmse_of(want: torch.Tensor, got: torch.Tensor) -> float:
    from musecore.testing import nmse
    return float(nmse(want, got))


def test_single_pass_bf16_dots() -> None:
    """The measurement behind the kernels' MXU passes (plain jnp on the CPU, whose bf16 dot with f32 accumulation
    has the TPU's numerics: exact products, f32 sums). One bf16 pass equals HIGHEST (6 passes) where both operands
    are bf16 values: bf16 x bf16, bf16 x MXFP4/NVFP4 (decoded without the global scale), bf16 q x fp8 k. It does
    not for INT4 weights (fp16 group scales) or f32 probabilities (p.v), so those keep HIGHEST."""
    import jax.numpy as jnp
    from musecore.testing import nmse
    from musecore_tpu.bridge import to_jax, to_torch
    from musecore_tpu.kernels.matmul import HIGHEST, dequantize_resident, dot_bf16
    gen = torch.Generator().manual_seed(9)
    x = to_jax(torch.randn(8, 1024, generator=gen).to(torch.bfloat16))
    errors = {}
    for fmt in ("bf16", "mxfp4", "nvfp4", "int4"):
        w, _ = weight(fmt, (256, 1024), gen)
        kfmt, res, group = resident(w)
        if kfmt == "nvfp4":  # the kernel's order: E2M1 x E4M3 in bf16, the global scale after the sum
            gs = res["global_scale"]
            wt = dequantize_resident({**res, "global_scale": jnp.float32(1.0)}, kfmt, group, 1024)
        else:
            gs, wt = 1.0, dequantize_resident(res, kfmt, group, 1024)
        highest = jnp.dot(x.astype(jnp.float32), wt, precision=HIGHEST) * gs
        bf16_exact = bool(jnp.all(wt.astype(jnp.bfloat16).astype(jnp.float32) == wt))
        errors[fmt] = (float(nmse(to_torch(highest), to_torch(dot_bf16(x, wt) * gs))), bf16_exact)
    p = torch.softmax(torch.randn(64, 512, generator=gen) * 3, -1)
    v = torch.randn(512, 64, generator=gen).to(torch.bfloat16).float()
    pv_highest = jnp.dot(to_jax(p), to_jax(v), precision=HIGHEST)
    errors["p.v"] = (float(nmse(to_torch(pv_highest), to_torch(dot_bf16(to_jax(p), to_jax(v))))), False)
    print("one bf16 pass vs HIGHEST, NMSE (weights exact in bf16):",
          ", ".join(f"{k} {e:.1e} ({ex})" for k, (e, ex) in errors.items()))
    for fmt in ("bf16", "mxfp4", "nvfp4"):
        assert errors[fmt][1] and errors[fmt][0] < 1e-12, f"{fmt}: one pass should equal HIGHEST: {errors[fmt]}"
    assert not errors["int4"][1] and errors["int4"][0] > 1e-9, "INT4 weights are not bf16 values: keep HIGHEST"
    assert errors["p.v"][0] > 1e-9, "f32 probabilities lose bits in one bf16 pass: keep HIGHEST for p.v"


@pytest.mark.parametrize("fmt,act", [("fp8", "fp8-token"), ("int8", "int8-token")])  # W8A16: test_conformance
def test_backend_8bit_linear_through_its_custom_op(fmt: str, act: Optional[str]) -> None:
    """``TpuBackend.prepare_weight`` keeps a per-tensor FP8 / per-channel INT8 weight as it is and ``linear`` runs the
    8-bit kernel through the registered ``linear_q8`` op, against musecore's reference linear (bf16 output)."""
    from musecore.backends.reference import ReferenceBackend
    from musecore_quant import quantize
    from musecore_tpu import TpuBackend
    gen = torch.Generator().manual_seed(4)
    qt = quantize(torch.randn(256, 512, generator=gen) * 512 ** -0.5, fmt)
    x = torch.randn(2, 3, 512, generator=gen).to(torch.bfloat16)
    backend = TpuBackend("cpu", interpret="jax")
    got = backend.linear(x, backend.prepare_weight(qt, "q_proj", act_format=act))
    reference = ReferenceBackend("cpu")
    want = reference.linear(x, reference.prepare_weight(qt, "q_proj", act_format=act))
    assert got.shape == (2, 3, 256) and got.dtype == torch.bfloat16
    assert_nmse(want, got, tolerance("linear"), f"TpuBackend {fmt} linear act {act} vs reference")
