"""Why one eager (not graph-captured) decode step costs ~40 ms on the H200 (issue 26, session 44).

The targets' e2e row "eager, no graphs" and the serve engine (which decodes eagerly) run muse-small NVFP4 at ~25
tokens/s against ~1140 from the captured graph: ~135 us per kernel, far above a launch. This probe times one eager
``model.forward`` decode step through a dynamic cache (the serve engine's) and through a static one, host and GPU
apart; lists every host-device synchronization one step makes (``torch.cuda.set_sync_debug_mode``, with the line
that made it); and prints a cProfile of a few steps by own time and by cumulative time.

    python backends/cuda/lab/scripts/cuda_eager_probe.py [--preset muse-small] [--batch 1] [--out probe.json]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time
import traceback
import warnings

import torch

from musecore.api import load_random


def step_times(step, n: int) -> tuple[float, float]:
    """(host ms per step, wall ms per step with a synchronize after each)."""
    torch.cuda.synchronize()
    host = 0.0
    t0 = time.perf_counter()
    for _ in range(n):
        t = time.perf_counter()
        step()
        host += time.perf_counter() - t
        torch.cuda.synchronize()
    return host / n * 1e3, (time.perf_counter() - t0) / n * 1e3


def syncs_of(step) -> list[str]:
    """Where one call of ``step`` synchronizes the host with the GPU: the innermost musecore frame of each."""
    seen: list[str] = []

    def record(message, category, filename, lineno, file=None, line=None) -> None:
        frames = [f for f in traceback.extract_stack() if "musecore" in f.filename and "eager_probe" not in f.filename]
        where = f"{frames[-1].filename.split('/')[-1]}:{frames[-1].lineno} {frames[-1].line}" if frames else filename
        seen.append(f"{str(message)[:60]} @ {where}")

    old = warnings.showwarning
    warnings.showwarning = record
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = old
    return seen


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="muse-small")
    p.add_argument("--format", default="nvfp4")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", default="cuda_eager_probe.json")
    args = p.parse_args()
    model = load_random(args.preset, "h200", checkpoint_format=args.format)
    V, B = model.config.vocab_size, args.batch
    row: dict = {"preset": args.preset, "format": args.format, "batch": B, "gpu": torch.cuda.get_device_name()}
    for static in (False, True):
        cache = model.new_cache(B, 512, static=static)
        model.forward(torch.randint(0, V, (B, 32), device="cuda"), cache=cache)
        ids = torch.randint(0, V, (B, 1), device="cuda")
        pos = torch.full((B, 1), 32, dtype=torch.long, device="cuda")
        if static:
            def step() -> torch.Tensor:
                return model.forward(ids, positions=pos, cache=cache)
        else:
            def step() -> torch.Tensor:  # the dynamic cache grows by one position per step, as the engine's does
                out = model.forward(ids, positions=pos, cache=cache)
                pos.add_(1)
                return out
        step()
        key = "static" if static else "dynamic"
        host, wall = step_times(step, args.steps)
        row[f"{key}_host_ms"], row[f"{key}_wall_ms"] = round(host, 2), round(wall, 2)
        syncs = syncs_of(step)
        row[f"{key}_syncs"] = len(syncs)
        row[f"{key}_sync_sites"] = sorted({s: syncs.count(s) for s in syncs}.items(), key=lambda kv: -kv[1])[:20]
        print(f"{key} cache: host {host:.2f} ms, wall {wall:.2f} ms per step, {len(syncs)} syncs", flush=True)
        for site, count in row[f"{key}_sync_sites"]:
            print(f"  {count:4d} x {site}")
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(5):
            step()
        torch.cuda.synchronize()
        prof.disable()
        for order in ("tottime", "cumulative"):
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats(order).print_stats(35)
            text = s.getvalue()
            row[f"{key}_profile_{order}"] = text
            print(f"--- {key} cache, 5 steps, by {order}\n{text}", flush=True)
    with open(args.out, "w") as f:
        json.dump(row, f, indent=1)


if __name__ == "__main__":
    main()
