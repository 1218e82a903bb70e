"""The one-call attention and MoE blocks (``musecore_xeon.fused``) compute what the blocks' separate xeon ops compute,
bit for bit, take only what they are bound for, and step aside when a weight is replaced or the switch is off."""

from __future__ import annotations

import pytest
import torch

from musecore.api import load_random
from musecore.model import MoE, separate_ops
from musecore.testing import fused_blocks, through_separate_ops
from musecore_xeon.fused import FUSED_ENV, fuse_block


@pytest.fixture(scope="module", params=["int4", "bf16"])
def model(request, xeon):
    return load_random("muse-tiny", "xeon", checkpoint_format=request.param, seed=0)


def max_rows(block: MoE) -> int:
    """The most rows the fused call takes, as the extension checks it: the block's bound (its projections' GEMV
    crossovers) and the experts' fused-call limit (their crossover, measured at load and refreshed since: on a busy
    2-core host it has measured 8 or below)."""
    return min(block.fused.args.max_rows, block.experts.extra["xeon"].native_max_tokens)


@pytest.mark.parametrize("rows", [1, 2, 3, 8])
def test_the_fused_block_gives_the_separate_ops_bits(model, rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    for block in fused_blocks(model, "moe"):
        if rows > max_rows(block):
            continue
        m = torch.randn(1, rows, model.config.hidden_size, generator=gen).to(torch.bfloat16)
        with torch.inference_mode():
            got = block.fused(m)
        want = through_separate_ops(block, m)
        assert got is not None, f"layer {block.layer}: the fused block refused {rows} rows (bound for {max_rows(block)})"
        assert got.shape == want.shape and got.dtype == want.dtype
        differ = (got != want).sum().item()
        assert differ == 0, (f"layer {block.layer}, {rows} rows: {differ} of {got.numel()} outputs differ from the "
                             f"separate ops (max |diff| {(got.float() - want.float()).abs().max().item():.3g})")


def test_inputs_it_is_not_bound_for_fall_back_to_the_separate_ops(model) -> None:
    block = fused_blocks(model, "moe")[0]
    H = model.config.hidden_size
    too_many = torch.randn(1, max_rows(block) + 1, H).to(torch.bfloat16)
    strided = torch.randn(1, 2, 2 * H).to(torch.bfloat16)[..., ::2]
    for m in (too_many, too_many.float(), strided):
        with torch.inference_mode():
            assert block.fused(m) is None, f"the fused block took {tuple(m.shape)} {m.dtype} (contiguous "\
                                           f"{m.is_contiguous()}); it is bound for <= {max_rows(block)} bf16 rows"
            assert torch.equal(block(m), through_separate_ops(block, m))


def test_a_replaced_weight_is_never_read_through_the_old_binding(model) -> None:
    first, other = fused_blocks(model, "moe")[0], fused_blocks(model, "moe")[1]
    m = torch.randn(1, 1, model.config.hidden_size).to(torch.bfloat16)
    saved = first.pre_expert_proj
    first.pre_expert_proj = other.pre_expert_proj
    try:
        with torch.inference_mode():
            assert first.fused(m) is None
            assert torch.equal(first(m), through_separate_ops(first, m))  # computed with the new weight
    finally:
        first.pre_expert_proj = saved


def test_the_switch_turns_fusion_off(model, monkeypatch) -> None:
    monkeypatch.setenv(FUSED_ENV, "0")
    assert fuse_block(fused_blocks(model, "moe")[0]) is None
    assert fuse_block(fused_blocks(model, "attention")[0]) is None


def decode(model, prompt: torch.Tensor, steps: int, kv_format: str = "bf16", batch: int = 1) -> torch.Tensor:
    """Greedy decode logits through a KV cache after a prefill of ``prompt [1, P]`` (repeated ``batch`` times)."""
    P = prompt.shape[1]
    cache = model.new_cache(batch, P + steps + 1, kv_format=kv_format)
    out = []
    with torch.inference_mode():
        last = model.forward(prompt.expand(batch, P), cache=cache)[:, -1]
        for s in range(steps):
            last = model.forward(last.argmax(-1, keepdim=True), positions=torch.full((batch, 1), P + s),
                                 cache=cache)[:, -1]
            out.append(last)
    return torch.cat(out)


@pytest.mark.parametrize("prompt_len,steps", [(12, 5), (60, 12)])  # 60 + 12 > the sliding window (64): ring wrap
def test_greedy_decode_logits_are_the_same_with_and_without_fusion(model, prompt_len: int, steps: int) -> None:
    prompt = torch.randint(3, model.config.vocab_size, (1, prompt_len), generator=torch.Generator().manual_seed(3))
    calls = []
    block = fused_blocks(model, "attention")[0]
    real = block.fused
    block.fused = lambda *a: calls.append(1) or real(*a)
    try:
        fused = decode(model, prompt, steps)
    finally:
        block.fused = real
    assert len(calls) == steps + 1  # the prefill asked too (and was declined: one token at a time only)
    with separate_ops(model):
        plain = decode(model, prompt, steps)
    assert torch.equal(fused, plain), f"max |diff| {(fused - plain).abs().max().item():.3g}"


@pytest.mark.parametrize("kv_format,batch", [("fp8", 1), ("bf16", 2)])
def test_attention_inputs_it_is_not_bound_for_fall_back(model, kv_format: str, batch: int) -> None:
    """An FP8 cache or a batch of two: the fused attention declines, and the logits are the separate ops'."""
    prompt = torch.randint(3, model.config.vocab_size, (1, 10), generator=torch.Generator().manual_seed(4))
    block = fused_blocks(model, "attention")[0]
    real, taken = block.fused, []
    block.fused = lambda *a: taken.append(real(*a)) or taken[-1]
    try:
        fused = decode(model, prompt, 3, kv_format, batch)
    finally:
        block.fused = real
    assert taken and all(t is None for t in taken)
    with separate_ops(model):
        assert torch.equal(fused, decode(model, prompt, 3, kv_format, batch))


def test_a_full_cache_raises_the_separate_paths_error_before_writing(model) -> None:
    full = [i for i, layer in enumerate(model.layers) if layer.self_attn.window is None][0]
    cache = model.new_cache(1, 8)
    a = torch.randn(1, 1, model.config.hidden_size).to(torch.bfloat16)
    before = cache[full].k.clone()
    with torch.inference_mode(), pytest.raises(ValueError, match="exceeds the KV cache capacity"):
        rope = model.rope(torch.tensor([[8]])) if hasattr(model, "rope") else None
        model.layers[full].self_attn.fused(a, torch.tensor([[cache[full].capacity]]), rope, cache)
    assert torch.equal(cache[full].k, before)


def test_a_replaced_attention_weight_is_never_read_through_the_old_binding(model) -> None:
    first, other = fused_blocks(model, "attention")[0], fused_blocks(model, "attention")[2]
    saved = first.o_proj
    first.o_proj = other.o_proj
    try:
        cache = model.new_cache(1, 4)
        a = torch.randn(1, 1, model.config.hidden_size).to(torch.bfloat16)
        with torch.inference_mode():
            assert first.fused(a, torch.tensor([[0]]), (None, None), cache) is None
    finally:
        first.o_proj = saved
