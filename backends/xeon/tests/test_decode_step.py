"""The decode step on the xeon backend is deterministic across thread counts, bit for bit.

Greedy decode on random weights is chaotic (one ulp anywhere moves later tokens), so the decode-path cuts of issue
30 (the in-place softcap, decode attention split over threads from ~22 keys, no-op dtype casts skipped) must keep
every bit. Each op is checked against the reference's bits in ``test_ops.py``; here the whole step: a model's
decode logits through the KV cache are identical at 1 and 2 threads (the threaded paths split work, never sums),
on muse-tiny and on a two-layer muse-small (24 query heads over 3 KV heads: attention runs on both threads from
~22 keys at 2 threads).
"""

from __future__ import annotations

import pytest
import torch

from musecore.api import load_random
from musecore.config import MuseConfig


def small(preset: str) -> MuseConfig:
    config = MuseConfig.from_name(preset)
    if preset == "muse-small":  # two layers, 8 experts: the shapes of every decode op, loaded in seconds
        config.num_hidden_layers, config.num_local_experts = 2, 8
        for name in ("layer_types", "mlp_layer_types", "layer_rope_theta"):  # one entry per layer
            setattr(config, name, getattr(config, name)[:2])
        config.validate()
    return config


def decode_logits(model, prompt: list[int], steps: int, threads: int) -> tuple[torch.Tensor, list[int]]:
    """Greedy steps through the KV cache after a prefill: the logits of every step and the tokens chosen."""
    torch.set_num_threads(threads)
    cache = model.new_cache(1, len(prompt) + steps + 1)
    logits, tokens = [], []
    with torch.inference_mode():
        last = model.forward(torch.tensor([prompt]), cache=cache)[:, -1]
        for s in range(steps):
            tokens.append(int(last.argmax(-1)))
            last = model.forward(torch.tensor([[tokens[-1]]]), positions=torch.tensor([[len(prompt) + s]]),
                                 cache=cache)[:, -1]
            logits.append(last)
    return torch.cat(logits), tokens


@pytest.mark.parametrize("preset", ["muse-tiny", "muse-small"])
def test_greedy_decode_gives_the_same_bits_at_one_and_two_threads(xeon, preset: str) -> None:
    model = load_random(small(preset), "xeon", checkpoint_format="int4", seed=0)
    prompt = torch.randint(3, model.config.vocab_size, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    before = torch.get_num_threads()
    try:
        one, tokens_one = decode_logits(model, prompt, 6, threads=1)
        two, tokens_two = decode_logits(model, prompt, 6, threads=2)
    finally:
        torch.set_num_threads(before)
    assert tokens_one == tokens_two, f"{preset}: greedy tokens at 2 threads {tokens_two} != 1 thread {tokens_one}"
    differ = (one != two).sum().item()
    assert differ == 0, (f"{preset}: {differ} of {one.numel()} decode logits differ between 1 and 2 threads "
                         f"(max {(one - two).abs().max().item():.3g})")
