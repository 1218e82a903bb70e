"""The one-call MoE block (``musecore_xeon.fused``) computes what the block's separate xeon ops compute, bit for bit,
takes only what it is bound for, and steps aside when a weight is replaced or the switch is off."""

from __future__ import annotations

import pytest
import torch

from musecore.api import load_random
from musecore.model import MoE
from musecore_xeon import fused as fused_module
from musecore_xeon.fused import FUSED_MOE_ENV, fuse_moe_block


@pytest.fixture(scope="module", params=["int4", "bf16"])
def model(request, xeon):
    return load_random("muse-tiny", "xeon", checkpoint_format=request.param, seed=0)


def blocks(model) -> list[MoE]:
    found = [layer.mlp for layer in model.layers if isinstance(layer.mlp, MoE)]
    assert found and all(b.fused is not None for b in found), \
        f"load_random fused {sum(b.fused is not None for b in found)} of {len(found)} MoE blocks; expected all"
    return found


def separate(block: MoE, m: torch.Tensor) -> torch.Tensor:
    """The block through its separate ops."""
    fused, block.fused = block.fused, None
    try:
        with torch.inference_mode():
            return block(m)
    finally:
        block.fused = fused


def max_rows(block: MoE) -> int:
    return block.fused.keep[0].max_rows


@pytest.mark.parametrize("rows", [1, 2, 3, 8])
def test_the_fused_block_gives_the_separate_ops_bits(model, rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    for block in blocks(model):
        if rows > max_rows(block):
            continue
        m = torch.randn(1, rows, model.config.hidden_size, generator=gen).to(torch.bfloat16)
        with torch.inference_mode():
            got = block.fused(m)
        want = separate(block, m)
        assert got is not None, f"layer {block.layer}: the fused block refused {rows} rows (bound for {max_rows(block)})"
        assert got.shape == want.shape and got.dtype == want.dtype
        differ = (got != want).sum().item()
        assert differ == 0, (f"layer {block.layer}, {rows} rows: {differ} of {got.numel()} outputs differ from the "
                             f"separate ops (max |diff| {(got.float() - want.float()).abs().max().item():.3g})")


def test_inputs_it_is_not_bound_for_fall_back_to_the_separate_ops(model) -> None:
    block = blocks(model)[0]
    H = model.config.hidden_size
    too_many = torch.randn(1, max_rows(block) + 1, H).to(torch.bfloat16)
    strided = torch.randn(1, 2, 2 * H).to(torch.bfloat16)[..., ::2]
    for m in (too_many, too_many.float(), strided):
        with torch.inference_mode():
            assert block.fused(m) is None, f"the fused block took {tuple(m.shape)} {m.dtype} (contiguous "\
                                           f"{m.is_contiguous()}); it is bound for <= {max_rows(block)} bf16 rows"
            assert torch.equal(block(m), separate(block, m))


def test_a_replaced_weight_is_never_read_through_the_old_binding(model) -> None:
    first, other = blocks(model)[0], blocks(model)[1]
    m = torch.randn(1, 1, model.config.hidden_size).to(torch.bfloat16)
    saved = first.pre_expert_proj
    first.pre_expert_proj = other.pre_expert_proj
    try:
        with torch.inference_mode():
            assert first.fused(m) is None
            assert torch.equal(first(m), separate(first, m))  # computed with the new weight
    finally:
        first.pre_expert_proj = saved


def test_the_switch_turns_fusion_off(model, monkeypatch) -> None:
    monkeypatch.setenv(FUSED_MOE_ENV, "0")
    assert fuse_moe_block(blocks(model)[0]) is None
    _, why = fused_module._fuse(blocks(model)[0])
    assert FUSED_MOE_ENV in why


def test_greedy_decode_logits_are_the_same_with_and_without_fusion(model) -> None:
    prompt = torch.randint(3, model.config.vocab_size, (12,), generator=torch.Generator().manual_seed(3))[None]

    def decode(steps: int = 5) -> torch.Tensor:
        cache = model.new_cache(1, 12 + steps + 1)
        out = []
        with torch.inference_mode():
            last = model.forward(prompt, cache=cache)[:, -1]
            for s in range(steps):
                last = model.forward(last.argmax(-1, keepdim=True), positions=torch.tensor([[12 + s]]),
                                     cache=cache)[:, -1]
                out.append(last)
        return torch.cat(out)

    fused = decode()
    saved = [(b, b.fused) for b in blocks(model)]
    for b, _ in saved:
        b.fused = None
    try:
        plain = decode()
    finally:
        for b, f in saved:
            b.fused = f
    assert torch.equal(fused, plain), f"max |diff| {(fused - plain).abs().max().item():.3g}"
