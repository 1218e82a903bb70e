"""Microseconds of one decode-step KV-cache update on the CPU (``LayerCache.update`` with one new entry),
for a ring (sliding-window) and a full layer, under ``torch.inference_mode`` as ``generate`` runs it::

    python3 backends/xeon/lab/scripts/cpu_kv_update_probe.py [--threads 2] [--kv-heads 2] [--head-dim 64] [--capacity 512]

The defaults are muse-tiny's KV shape. Best of 5 rounds of 400 updates each. On a CPU a decode step does
this once per layer, so a few microseconds here are a few percent of a small model's token.
"""

from __future__ import annotations

import argparse
import time

import torch

from musecore.kv_cache import LayerCache


def update_us(ring: bool, kv_heads: int, head_dim: int, capacity: int, calls: int = 400, rounds: int = 5) -> float:
    cache = LayerCache(1, capacity, kv_heads, head_dim, ring=ring, kv_format="bf16", dtype=torch.bfloat16,
                       device=torch.device("cpu"))
    k = torch.randn(1, 1, kv_heads, head_dim).to(torch.bfloat16)
    v = torch.randn(1, 1, kv_heads, head_dim).to(torch.bfloat16)
    start_pos = 40
    for p in range(start_pos):
        cache.update(k, v, torch.tensor([[p]]))
    positions = [torch.tensor([[start_pos + i]]) for i in range(calls)]
    best = float("inf")
    for _ in range(rounds):
        cache.used = min(cache.used, start_pos)  # a full layer restarts at the same length every round
        begin = time.perf_counter()
        for pos in positions:
            cache.update(k, v, pos)
        best = min(best, (time.perf_counter() - begin) / calls * 1e6)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--capacity", type=int, default=512)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with torch.inference_mode():
        for ring in (True, False):
            us = update_us(ring, args.kv_heads, args.head_dim, args.capacity)
            print(f"{'ring' if ring else 'full'} layer: {us:.1f} us per decode update "
                  f"([1, {args.capacity}, {args.kv_heads}, {args.head_dim}] bf16, {args.threads} threads)")


if __name__ == "__main__":
    main()
