"""Does the host wait in ``graph.replay()`` while the previous replay of the same graph still runs? Times the
decode step of muse-small (NVFP4, batch 1, CUDA graph) called back to back: host seconds per call (until
``replay()`` returns) against wall seconds per call (until the GPU is done), for one captured graph and for
two captures of the same step used alternately::

    python backends/cuda/lab/scripts/cuda_graph_launch_probe.py
"""

from __future__ import annotations

import time

import torch

from musecore.api import load_random
from musecore_cuda.graphs import make_graphed_decode_step


def per_call_us(fn, calls: int = 50) -> tuple[float, float]:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(calls):
        fn(i)
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    return host / calls * 1e6, wall / calls * 1e6


def main() -> None:
    model = load_random("muse-small", "h200", checkpoint_format="nvfp4")
    cache = model.new_cache(1, 256, static=True)
    model.forward(torch.randint(0, model.config.vocab_size, (1, 32), device="cuda"), cache=cache)
    steps = [make_graphed_decode_step(model, cache), make_graphed_decode_step(model, cache)]
    tok = torch.zeros(1, 1, dtype=torch.long, device="cuda")
    pos = torch.full((1, 1), 32, dtype=torch.long, device="cuda")
    for fn in steps:
        for _ in range(3):
            fn(tok, pos)
    idle = []
    for _ in range(10):
        torch.cuda.synchronize()
        start = time.perf_counter()
        steps[0](tok, pos)
        idle.append((time.perf_counter() - start) * 1e6)
    print(f"one call with the GPU idle: host {min(idle):.0f} us (min of 10)")
    for name, fn in (("one graph", lambda i: steps[0](tok, pos)),
                     ("two graphs alternating", lambda i: steps[i % 2](tok, pos))):
        host, wall = per_call_us(fn)
        print(f"{name:24s}: host {host:6.0f} us per call, wall {wall:6.0f} us per call")


if __name__ == "__main__":
    main()
