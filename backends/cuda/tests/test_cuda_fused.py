"""The fused blocks and sublayers of the CUDA backend (``musecore_cuda.fused``: at one-token decode, MoE 4 launches
instead of 10, attention 3 instead of 7) against the separate ops on the GPU, the inputs they are not bound for, and
their switch; without a GPU, the fused MoE block's glue with its launches in Triton's interpreter."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from musecore.api import load_random
from musecore.model import DeferredNorm, MoE, separate_ops
from musecore.ops import reference as ref
from musecore.testing import fused_blocks, nmse, through_separate_ops
from musecore_triton.kernels import router
from musecore_triton.kernels.moe import moe_decode_dense_rows
from musecore_triton.testing import HAS_GPU, check_decode_embed, count_kernels

from musecore_cuda import fused
from musecore_cuda.fused import FUSED_ENV, fuse_block, fuse_embed

TOLERANCE = 1e-5  # NMSE: the router's fp32 sums and the norm's are grouped differently (musecore_cuda.fused)


@pytest.fixture(scope="module", params=["bf16", "nvfp4"])
def model(request):
    if not HAS_GPU:
        pytest.skip("needs a GPU")
    return load_random("muse-tiny", "h200", checkpoint_format=request.param, seed=0)


@pytest.mark.gpu
@pytest.mark.parametrize("finalize_in_unpooler", [True, False])
def test_the_fused_moe_block_matches_the_separate_ops_in_fewer_launches(model, finalize_in_unpooler, monkeypatch):
    """9 launches -> 4 (the finalize in the unpooler GEMV: every muse-tiny layer's experts, BF16 or NVFP4, take one
    GEMV per assignment at one token), or 5 with ``FINALIZE_IN_UNPOOLER`` off."""
    monkeypatch.setattr(fused, "FINALIZE_IN_UNPOOLER", finalize_in_unpooler)
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.inference_mode():
        for block in fused_blocks(model, "moe"):
            m = torch.randn(1, 1, model.config.hidden_size, device="cuda", generator=gen).to(torch.bfloat16)
            x = m.reshape(1, -1)
            counter = torch.zeros(1, dtype=torch.int32, device="cuda")
            _, ids = router.router_topk_one_launch(x, block.router, block.correction_bias, block.top_k,
                                                   block.multiplier, block.scaling, counter)
            _, want_ids = model.ops.router_topk(x, block.router, block.correction_bias, block.top_k,
                                                block.multiplier, block.scaling)
            assert torch.equal(ids, want_ids), \
                f"layer {block.layer}: ids {ids.tolist()} vs the op's {want_ids.tolist()}"
            for repeat in range(3):  # the counters come back to zero: every launch takes the last-program step
                got, want = block.fused(m), through_separate_ops(block, m)
                assert got is not None and got.shape == want.shape and got.dtype == want.dtype
                err = nmse(want.float(), got.float())
                assert err <= TOLERANCE, f"layer {block.layer}, call {repeat}: NMSE {err:.3g} > {TOLERANCE:g}"
            assert not block.fused.counters.any(), f"layer {block.layer}: counters {block.fused.counters.tolist()}"
            fused_n = count_kernels(lambda: block.fused(m))
            separate_n = count_kernels(lambda: through_separate_ops(block, m))
            fewer = 5 if finalize_in_unpooler else 4
            assert fused_n == separate_n - fewer, \
                f"layer {block.layer} ({block.experts.format}): {fused_n} launches fused, {separate_n} separate"


# Triton's interpreter rounds fp32 to bf16 toward zero where a GPU rounds to nearest (dense_gemv alone, K = 768:
# NMSE 4e-5 against fp64 here, 3e-6 for bf16 rounding): the block's output measured 7e-5 from its separate ops.
INTERPRETER_TOLERANCE = 3e-4


@pytest.mark.parametrize("rows", [True, False])
def test_the_fused_moe_block_glue_in_the_interpreter_matches_the_separate_ops(rows):
    """Without a GPU: ``FusedMoE`` (its guard, the router + pooler launch, the experts, the unpooler GEMV and its
    residual-norm tail) on muse-tiny's first MoE block, its launches in Triton's interpreter, against the block's
    separate ops; the counters back to zero; inputs it is not bound for give None. ``rows``: the experts' rows from
    ``moe_decode_dense_rows`` (its GEMVs in the interpreter) and their finalize in the unpooler GEMV
    (``moe.finalize_gemv``), as ``CUDABackend.moe_rows`` gives them for 16-bit experts; else the backend's ``moe``
    (the reference op) and the plain unpooler GEMV. (On a GPU the tests above run the compiled kernels through the
    CUDA backend.)"""
    if HAS_GPU:
        pytest.skip("a GPU is here: the GPU tests above cover FusedMoE with the compiled kernels")
    model = load_random("muse-tiny", "cpu", seed=0)
    block = next(layer.mlp for layer in model.layers if isinstance(layer.mlp, MoE))

    def moe_rows(z, ids, experts):
        return moe_decode_dense_rows(z, ids, experts.gate, experts.up, experts.down) if rows else None
    backend = SimpleNamespace(moe=model.ops.moe, moe_rows=moe_rows)
    fused_moe = fused.FusedMoE(backend, block, block.pre_expert_proj.data, block.post_expert_proj.data)
    H = model.config.hidden_size
    gen = torch.Generator().manual_seed(0)
    m, residual = (torch.randn(1, 1, H, generator=gen).to(torch.bfloat16) for _ in range(2))
    norm_w = torch.rand(H, generator=gen).add(0.5).to(torch.bfloat16)
    norm = (norm_w, torch.full_like(norm_w, 0.9), torch.full_like(norm_w, 1.1), norm_w.flip(0), 1e-6, 1e-6)
    with torch.inference_mode():
        want = through_separate_ops(block, m)
        want_pair = ref.residual_norm(residual, want, *norm)
        for repeat in range(2):
            got = fused_moe(m)
            err = nmse(want.float(), got.float())
            assert got.shape == want.shape and err <= INTERPRETER_TOLERANCE, \
                f"call {repeat}: NMSE {err:.3g} > {INTERPRETER_TOLERANCE:g}"
            for name, w, g in zip(("residual", "normed"), want_pair, fused_moe.sublayer(residual, norm, m)):
                err = nmse(w.float(), g.float())
                assert g.shape == w.shape and err <= INTERPRETER_TOLERANCE, \
                    f"call {repeat}, sublayer {name}: NMSE {err:.3g} > {INTERPRETER_TOLERANCE:g}"
        assert not fused_moe.counters.any(), f"counters {fused_moe.counters.flatten().tolist()}"
        assert fused_moe(m.float()) is None and fused_moe(torch.cat([m, m], 1)) is None  # fp32; two tokens


def test_the_attention_norm_deferred_into_the_router_pooler_launch_in_the_interpreter(monkeypatch):
    """Without a GPU: ``FusedMoE.sublayer`` on a ``DeferredNorm`` (the residual norm after attention run in the router
    + pooler launch's programs, ``DEFER_RESIDUAL_NORM``) on muse-tiny's first MoE block, its launches in Triton's
    interpreter, against the norm op and then the block's separate ops and its own residual norm, and with ``defer``
    its own norm handed on unrun; declined while the switch is off or for a residual of another dtype."""
    if HAS_GPU:
        pytest.skip("a GPU is here: the GPU test below covers the deferred norm with the compiled kernels")
    model = load_random("muse-tiny", "cpu", seed=0)
    block = next(layer.mlp for layer in model.layers if isinstance(layer.mlp, MoE))
    backend = SimpleNamespace(moe=model.ops.moe, moe_rows=lambda z, ids, experts: None)
    fused_moe = fused.FusedMoE(backend, block, block.pre_expert_proj.data, block.post_expert_proj.data)
    H = model.config.hidden_size
    gen = torch.Generator().manual_seed(1)
    out, residual = (torch.randn(1, 1, H, generator=gen).to(torch.bfloat16) for _ in range(2))
    norm_w = torch.rand(H, generator=gen).add(0.5).to(torch.bfloat16)
    alpha, beta = torch.rand(H, generator=gen).add(0.5), torch.rand(H, generator=gen).sub(0.5)
    attn_norm = (None, alpha, beta, norm_w, 1e-6, 1e-6)  # the model's: a weightless post norm
    moe_norm = (norm_w.flip(0), alpha.flip(0), beta.flip(0), norm_w, 1e-6, 1e-6)
    deferred = DeferredNorm(residual, out, attn_norm)
    monkeypatch.setattr(fused, "DEFER_RESIDUAL_NORM", False)
    assert not fused_moe.takes_deferred and fused_moe.sublayer(deferred, moe_norm, None) is None
    monkeypatch.setattr(fused, "DEFER_RESIDUAL_NORM", True)
    assert fused_moe.takes_deferred
    with torch.inference_mode():
        h, m = ref.residual_norm(residual, out, *attn_norm)
        want = ref.residual_norm(h, through_separate_ops(block, m), *moe_norm)
        for repeat in range(2):
            got = fused_moe.sublayer(deferred, moe_norm, None)
            handed = fused_moe.sublayer(deferred, moe_norm, None, defer=True)
            assert isinstance(handed, DeferredNorm) and handed.norm is moe_norm
            for name, w, g in zip(("residual", "normed", "resolved residual", "resolved normed"), want * 2,
                                  got + handed.resolve(model.ops)):
                err = nmse(w.float(), g.float())
                assert g.shape == w.shape and err <= INTERPRETER_TOLERANCE, \
                    f"call {repeat}, deferred sublayer {name}: NMSE {err:.3g} > {INTERPRETER_TOLERANCE:g}"
        assert not fused_moe.counters.any(), f"counters {fused_moe.counters.flatten().tolist()}"
        assert fused_moe.sublayer(DeferredNorm(residual.float(), out, attn_norm), moe_norm, None) is None


@pytest.mark.gpu
def test_inputs_it_is_not_bound_for_run_the_separate_ops(model):
    block = fused_blocks(model, "moe")[0]
    H = model.config.hidden_size
    with torch.inference_mode():
        assert block.fused(torch.randn(1, 2, H, device="cuda").to(torch.bfloat16)) is None  # two tokens
        assert block.fused(torch.randn(1, 1, H, device="cuda")) is None  # fp32
        saved = block.pre_expert_norm
        block.pre_expert_norm = saved.clone()  # a replaced weight: the fused form steps aside
        try:
            assert block.fused(torch.randn(1, 1, H, device="cuda").to(torch.bfloat16)) is None
        finally:
            block.pre_expert_norm = saved


@pytest.mark.gpu
def test_the_switch_turns_fusion_off(model, monkeypatch):
    monkeypatch.setenv(FUSED_ENV, "0")
    assert fuse_block(model.backend, fused_blocks(model, "moe")[0]) is None


@pytest.mark.gpu
@pytest.mark.parametrize("attend_in_qkv", [False, True])
def test_the_fused_attention_block_matches_the_separate_ops_and_writes_the_same_cache(model, attend_in_qkv,
                                                                                      monkeypatch):
    """Sliding RoPE and full NoPE layers, two positions: the output and the cache's k within TOLERANCE of the separate
    ops (the head norm's and the q/k norms' sums are grouped differently), the cache's v and positions bit for bit,
    three fewer launches (four with attention in the q/k/v/gate GEMV's launch, ``fused.ATTENTION_IN_QKV``)."""
    monkeypatch.setattr(fused, "ATTENTION_IN_QKV", attend_in_qkv)
    prompt = torch.randint(0, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))
    caches = [model.new_cache(1, 64, static=True) for _ in range(2)]
    gen = torch.Generator(device="cuda").manual_seed(2)
    with torch.inference_mode():
        for cache in caches:
            model.forward(prompt, cache=cache)
        for position in (12, 13):
            positions = torch.tensor([[position]], device="cuda")
            rope = model.rope(positions)
            for block in fused_blocks(model, "attention"):
                a = torch.randn(1, 1, model.config.hidden_size, device="cuda", generator=gen).to(torch.bfloat16)
                got = block.fused(a, positions, rope, caches[0])
                want = through_separate_ops(block, a, positions, rope, caches[1])
                assert got is not None and got.shape == want.shape and got.dtype == want.dtype
                err = nmse(want.float(), got.float())
                assert err <= TOLERANCE, f"layer {block.layer} at {position}: NMSE {err:.3g} > {TOLERANCE:g}"
                mine, theirs = caches[0][block.layer], caches[1][block.layer]
                err = nmse(theirs.k.float(), mine.k.float())
                assert err <= TOLERANCE, f"layer {block.layer} at {position}: cache k NMSE {err:.3g} > {TOLERANCE:g}"
                for name in ("v", "positions"):
                    assert torch.equal(getattr(mine, name), getattr(theirs, name)), \
                        f"layer {block.layer} at {position}: the caches' {name} differ"
        block = fused_blocks(model, "attention")[0]
        positions = torch.tensor([[20]], device="cuda")
        rope = model.rope(positions)
        fused_n = count_kernels(lambda: block.fused(a, positions, rope, caches[0]))
        separate_n = count_kernels(lambda: through_separate_ops(block, a, positions, rope, caches[1]))
        assert fused_n == separate_n - 3 - attend_in_qkv, f"{fused_n} launches fused, {separate_n} separate"
        assert not block.fused.counters.any(), f"counters {block.fused.counters.tolist()}"
        assert block.fused(torch.cat([a, a], 1), positions.repeat(1, 2), model.rope(positions.repeat(1, 2)),
                           caches[0]) is None  # two tokens: the separate ops
        assert block.fused(a, positions, rope, model.new_cache(1, 64)) is None  # a dynamic cache


@pytest.mark.gpu
def test_fused_sublayers_match_the_separate_ops_in_fewer_launches(model):
    """``MuseModel.attention_sublayer`` / ``feedforward_sublayer`` through the fused blocks' ``sublayer`` (the residual
    norm in the last GEMV's last program): the pair (residual', normed) within TOLERANCE of the separate ops, the
    caches' v bit for bit and k within TOLERANCE, and 3 launches for 7 (attention), 4 for 10 (MoE)."""
    gen = torch.Generator(device="cuda").manual_seed(4)
    H = model.config.hidden_size
    with torch.inference_mode():
        caches, positions, rope = prefilled_pair(model, 3)
        for i, layer in enumerate(model.layers):
            x, a = (torch.randn(1, 1, H, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(2))
            got = model.attention_sublayer(i, x, a, positions, rope, caches[0])
            with separate_ops(model):
                want = model.attention_sublayer(i, x, a, positions, rope, caches[1])
            for name, w, g in zip(("h", "m"), want, got):
                err = nmse(w.float(), g.float())
                assert g.shape == w.shape and g.dtype == w.dtype and err <= TOLERANCE, \
                    f"layer {i} attention sublayer {name}: NMSE {err:.3g} > {TOLERANCE:g}"
            err = nmse(caches[1][i].k.float(), caches[0][i].k.float())
            assert err <= TOLERANCE and torch.equal(caches[0][i].v, caches[1][i].v), \
                f"layer {i}: cache k NMSE {err:.3g} (> {TOLERANCE:g}?) or cache v differs"
            if not isinstance(layer.mlp, MoE):
                continue
            got = model.feedforward_sublayer(i, x, a)
            with separate_ops(model):
                want = model.feedforward_sublayer(i, x, a)
            for name, w, g in zip(("x", "a"), want, got):
                err = nmse(w.float(), g.float())
                assert g.shape == w.shape and g.dtype == w.dtype and err <= TOLERANCE, \
                    f"layer {i} MoE sublayer {name}: NMSE {err:.3g} > {TOLERANCE:g}"
            fused_n = count_kernels(lambda: model.feedforward_sublayer(i, x, a))
            with separate_ops(model):
                separate_n = count_kernels(lambda: model.feedforward_sublayer(i, x, a))
            assert (fused_n, separate_n) == (4, 10), f"layer {i} MoE sublayer: {fused_n} launches fused, {separate_n}"
        fused_n = count_kernels(lambda: model.attention_sublayer(0, x, a, positions, rope, caches[0]))
        with separate_ops(model):
            separate_n = count_kernels(lambda: model.attention_sublayer(0, x, a, positions, rope, caches[1]))
        assert (fused_n, separate_n) == (3, 7), f"attention sublayer: {fused_n} launches fused, {separate_n}"
        moe = fused_blocks(model, "moe")[0]
        assert moe.fused.sublayer(torch.zeros(1, 1, H, device="cuda"), (None,) * 6, x) is None  # fp32 residual


@pytest.mark.gpu
@pytest.mark.parametrize("after_attention,after_moe", [(True, False), (False, True), (True, True)])
def test_residual_norms_deferred_to_the_next_block_match_the_separate_ops(model, after_attention, after_moe,
                                                                           monkeypatch):
    """``DEFER_RESIDUAL_NORM`` (the norm after attention run in the MoE block's router + pooler launch) and
    ``DEFER_MOE_NORM`` (the norm after the MoE block run in the next layer's q/k/v/gate launch): each sublayer pair
    with the norm handed on (``defer=True``, then a ``DeferredNorm`` as the next sublayer's residual) within TOLERANCE
    of the separate ops', the launch counts of the undeferred blocks (3 for attention, 4 for the MoE block), and a
    decode step's logits within TOLERANCE of the separate ops'."""
    monkeypatch.setattr(fused, "DEFER_RESIDUAL_NORM", after_attention)
    monkeypatch.setattr(fused, "DEFER_MOE_NORM", after_moe)
    gen = torch.Generator(device="cuda").manual_seed(6)
    H = model.config.hidden_size
    with torch.inference_mode():
        caches, positions, rope = prefilled_pair(model, 5)
        pairs = 0
        for i, layer in enumerate(model.layers[:-1]):
            if not isinstance(layer.mlp, MoE):
                continue
            x, a = (torch.randn(1, 1, H, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(2))
            if after_attention:  # attention (i) -> MoE (i)
                deferred, none = model.attention_sublayer(i, x, a, positions, rope, caches[0], defer=True)
                assert isinstance(deferred, DeferredNorm) and none is None, f"layer {i}: {type(deferred).__name__}"
                got = model.feedforward_sublayer(i, deferred, None)
                with separate_ops(model):
                    want = model.feedforward_sublayer(i, *model.attention_sublayer(i, x, a, positions, rope,
                                                                                    caches[1]))
                check_pair(want, got, f"layer {i} MoE sublayer after the deferred attention norm")
                assert count_kernels(lambda: model.feedforward_sublayer(i, deferred, None)) == 4
                assert count_kernels(lambda: model.attention_sublayer(i, x, a, positions, rope, caches[0],
                                                                       defer=True)) == 3
                pairs += 1
            if after_moe:  # MoE (i) -> attention (i + 1)
                deferred, none = model.feedforward_sublayer(i, x, a, defer=True)
                assert isinstance(deferred, DeferredNorm) and none is None, f"layer {i}: {type(deferred).__name__}"
                got = model.attention_sublayer(i + 1, deferred, None, positions, rope, caches[0])
                with separate_ops(model):
                    want = model.attention_sublayer(i + 1, *model.feedforward_sublayer(i, x, a), positions, rope,
                                                    caches[1])
                check_pair(want, got, f"layer {i + 1} attention sublayer after the deferred MoE norm")
                err = nmse(caches[1][i + 1].k.float(), caches[0][i + 1].k.float())
                assert err <= TOLERANCE, f"layer {i + 1}: cache k NMSE {err:.3g} > {TOLERANCE:g}"
                assert count_kernels(lambda: model.attention_sublayer(i + 1, deferred, None, positions, rope,
                                                                       caches[0])) == 3
                assert count_kernels(lambda: model.feedforward_sublayer(i, x, a, defer=True)) == 4
                pairs += 1
        assert pairs, "muse-tiny has no MoE layer before its last"
        step = torch.tensor([[7]], device="cuda")
        got = model.forward(step, positions, cache=caches[0])
        with separate_ops(model):
            want = model.forward(step, positions, cache=caches[1])
        err = nmse(want, got)
        assert err <= TOLERANCE, f"decode step logits with the deferred norms: NMSE {err:.3g} > {TOLERANCE:g}"


def prefilled_pair(model, seed: int) -> tuple[list, torch.Tensor, Any]:
    """Two static caches (one for the fused blocks, one for the separate ops) filled by the same random 12-token
    prompt, the next position ``[[12]]`` and its rotary rows."""
    prompt = torch.randint(0, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(seed))
    caches = [model.new_cache(1, 64, static=True) for _ in range(2)]
    for cache in caches:
        model.forward(prompt, cache=cache)
    positions = torch.tensor([[12]], device="cuda")
    return caches, positions, model.rope(positions)


def check_pair(want: tuple, got: tuple, what: str) -> None:
    for name, w, g in zip(("residual", "normed"), want, got):
        err = nmse(w.float(), g.float())
        assert g.shape == w.shape and g.dtype == w.dtype and err <= TOLERANCE, \
            f"{what}, {name}: NMSE {err:.3g} > {TOLERANCE:g}"


@pytest.mark.gpu
def test_the_fused_embed_gives_the_ops_embed_in_one_launch(model):
    """``MuseModel.embed`` at decode (3 rows: a token, an image placeholder on a padding row, a token) through
    ``decode_embed`` against its ops: the residual stream and the first norm within the norm op's tolerance (the
    same helper, so bit-equal where the reduction tree matches), the rotary rows within 2e-6, the cache's next
    positions equal; one launch instead of the ops' many."""
    assert model.fused_embed is not None
    cache = model.new_cache(3, 64, static=True)
    ids = torch.tensor([[5], [model.config.image_token_id], [9]], device="cuda")
    positions = torch.tensor([[4], [-1], [7]], device="cuda")
    start = torch.tensor([3, 0, 2], device="cuda")
    with torch.inference_mode():
        cache.next_position.copy_(start)
        got = model.embed(ids, positions, cache)
        got_next = cache.next_position.clone()
        cache.next_position.copy_(start)
        with separate_ops(model):
            want = model.embed(ids, positions, cache)
        check_decode_embed(got, want, got_next, cache.next_position)
        fused_n = count_kernels(lambda: model.embed(ids, positions, cache))
        with separate_ops(model):
            separate_n = count_kernels(lambda: model.embed(ids, positions, cache))
    assert fused_n == 1 and separate_n >= 8, f"{fused_n} launches fused, {separate_n} through the ops"


@pytest.mark.gpu
def test_the_fused_embed_steps_aside_for_a_prefill_and_a_replaced_embedding(model, monkeypatch):
    cache = model.new_cache(1, 64, static=True)
    with torch.inference_mode():
        assert model.fused_embed(torch.tensor([[1, 2]], device="cuda"), torch.tensor([[0, 1]], device="cuda"),
                                 cache) is None
        assert model.fused_embed(torch.tensor([[1]], device="cuda"), None, cache) is None
        saved = model.layers[0].input_layernorm
        model.layers[0].input_layernorm = saved.clone()
        try:
            assert model.fused_embed(torch.tensor([[1]], device="cuda"), torch.tensor([[0]], device="cuda"),
                                     cache) is None
        finally:
            model.layers[0].input_layernorm = saved
    monkeypatch.setenv(FUSED_ENV, "0")
    assert fuse_embed(model) is None
