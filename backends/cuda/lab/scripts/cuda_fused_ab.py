"""A/B of the CUDA backend's fused blocks (``musecore_cuda.fused``) in muse-small's batch-1 decode, in one process:
graph replay per step, kernels per step and ``generate`` per token, with the fused blocks and with every block's
separate ops (session 43, issue 26 item 3). Same random weights, same prompt, alternated ``--rounds`` times.

    python backends/cuda/lab/scripts/cuda_fused_ab.py [--preset muse-small] [--format nvfp4] [--out ab.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json

import torch
from torch.profiler import ProfilerActivity, profile

from cuda_decode_host_probe import gpu_us  # this folder is sys.path[0] when run as a script
from musecore.api import load_random
from musecore.model import separate_ops


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="muse-small")
    p.add_argument("--format", default="nvfp4")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default="cuda_fused_ab.json")
    args = p.parse_args()
    model = load_random(args.preset, "h200", checkpoint_format=args.format)
    blocks = sum(b.fused is not None for layer in model.layers for b in (layer.self_attn, layer.mlp))
    print(f"{blocks} fused blocks of {2 * len(model.layers)}")
    prompt = torch.randint(0, model.config.vocab_size, (1, 32)).tolist()
    rows = []
    for r in range(args.rounds):
        for mode in ("fused", "separate"):
            with contextlib.nullcontext() if mode == "fused" else separate_ops(model):
                model.release_generation_cache()  # a new capture for this mode
                model.generate(prompt, max_new_tokens=8)
                model.generate(prompt, max_new_tokens=64)
                gen_us = 1e6 / model.last_generation_stats.decode_tokens_per_s
                cache = model.new_cache(1, 96, static=True)
                model.forward(torch.tensor(prompt, device="cuda"), cache=cache)
                step = model.decode_step(cache)
                tok = torch.zeros(1, 1, dtype=torch.long, device="cuda")
                pos = torch.full((1, 1), 32, dtype=torch.long, device="cuda")
                rep = gpu_us(lambda: step(tok, pos), warmup=3)
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    step(tok, pos)
                    torch.cuda.synchronize()
                n = sum(1 for e in prof.events() if e.device_type.name == "CUDA")
                row = {"round": r, "mode": mode, "replay_us": round(rep, 1), "generate_us_per_token": round(gen_us, 1),
                       "kernels_per_step": n}
                print(row)
                rows.append(row)
                step = cache = None  # free this mode's graph and cache before the next capture
    for mode in ("fused", "separate"):
        mine = [r for r in rows if r["mode"] == mode]
        print(f"{mode}: replay median {sorted(r['replay_us'] for r in mine)[len(mine) // 2]} us, generate median "
              f"{sorted(r['generate_us_per_token'] for r in mine)[len(mine) // 2]} us/token, "
              f"{mine[0]['kernels_per_step']} kernels")
    with open(args.out, "w") as f:
        json.dump({"preset": args.preset, "format": args.format, "gpu": torch.cuda.get_device_name(), "rows": rows},
                  f, indent=1)


if __name__ == "__main__":
    main()
