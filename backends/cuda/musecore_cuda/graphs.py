"""Decode steps replayed from a captured CUDA graph, so ``generate`` is not bound by kernel launches.

A decode step of the Muse graph is a few hundred small kernels; at batch 1 launching them costs
more than running them. The step is captured once per generation (one batch shape, one static KV
cache) and replayed each token. Capture needs a step free of host syncs: the static KV cache
(``KVCache(static=True)``) writes padding to a trash slot instead of filtering it on the host,
and the MoE kernels sort tokens on the device. Warm-up and capture run with every position at -1,
so they write only to the trash slots and leave the cache as the prefill left it. Up to
``pdl.MAX_BATCH`` sequences, the step is captured with programmatic dependent launch (each kernel
starts under the previous one's tail; ``kernels/pdl.py``).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from musecore_cuda.kernels import pdl


def make_graphed_decode_step(model: Any, cache: Any) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    batch = cache.next_position.shape[0]
    device = model.device
    static_ids = torch.zeros(batch, 1, dtype=torch.long, device=device)
    static_positions = torch.full((batch, 1), -1, dtype=torch.long, device=device)
    saved_next = cache.next_position.clone()

    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with pdl.scope(batch <= pdl.MAX_BATCH):  # programmatic dependent launch (kernels/pdl.py)
        with torch.cuda.stream(side):  # warm-up: lets Triton compile and the allocator settle
            for _ in range(2):
                model.forward(static_ids, positions=static_positions, cache=cache)
        torch.cuda.current_stream(device).wait_stream(side)

        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_logits = model.forward(static_ids, positions=static_positions, cache=cache)
    cache.next_position.copy_(saved_next)

    def step(ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        static_ids.copy_(ids, non_blocking=True)
        static_positions.copy_(positions, non_blocking=True)
        graph.replay()
        return static_logits

    return step
