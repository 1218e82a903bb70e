"""Profile one CUDA-graph decode step of a random-weight preset: the top kernels by GPU time.

    python benchmarks/cuda_profile_decode.py [--preset muse-small] [--format nvfp4] [--batch 1]
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from musecore.api import load_random


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="muse-small")
    p.add_argument("--format", default="nvfp4")
    p.add_argument("--batch", type=int, default=1)
    args = p.parse_args()
    model = load_random(args.preset, "h200", checkpoint_format=args.format)
    B = args.batch
    cache = model.new_cache(B, 128, static=True)
    ids = torch.randint(0, model.config.vocab_size, (B, 32), device="cuda")
    model.forward(ids, cache=cache)
    step = model.decode_step(cache)
    tok = torch.zeros(B, 1, dtype=torch.long, device="cuda")
    pos = torch.full((B, 1), 32, dtype=torch.long, device="cuda")
    for _ in range(3):
        step(tok, pos)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        step(tok, pos)
    end.record()
    torch.cuda.synchronize()
    print(f"graph replay: {start.elapsed_time(end) / 20 * 1e3:.0f} us per step")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step(tok, pos)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))


if __name__ == "__main__":
    main()
