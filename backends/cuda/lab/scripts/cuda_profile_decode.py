"""Profile one CUDA-graph decode step of a random-weight preset: the top kernels by GPU time.

    python backends/cuda/lab/scripts/cuda_profile_decode.py [--preset muse-small] [--format nvfp4] [--batch 1]
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
    p.add_argument("--rows", type=int, default=60, help="kernels listed")
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
    replay_us = start.elapsed_time(end) / 20 * 1e3
    print(f"graph replay: {replay_us:.0f} us per step")
    steps = 5
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step(tok, pos)
        torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = sum(e.count for e in events if e.device_type.name == "CUDA") / steps
    busy = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA") / steps
    print(f"kernels per step: {kernels:.0f}; GPU busy {busy:.0f} us of the {replay_us:.0f} us replay "
          f"({replay_us - busy:.0f} us between kernels)")
    print(events.table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=70))
    prompt = torch.randint(0, model.config.vocab_size, (B, 32)).tolist()
    model.generate(prompt, max_new_tokens=8)
    model.generate(prompt, max_new_tokens=64)
    per_token = 1e6 / model.last_generation_stats.decode_tokens_per_s * B
    print(f"generate: {per_token:.0f} us per decode step = replay {replay_us:.0f} us + {per_token - replay_us:.0f} us "
          "of host work (sampling, the token's trip to the host, stop checks, input copies)")


if __name__ == "__main__":
    main()
