"""Decode steps replayed from a captured GPU graph, so ``generate`` is not bound by kernel launches.

A decode step of the Muse graph is a few hundred small kernels; at batch 1 launching them costs
more than running them. The step is captured once per generation (one batch shape, one static KV
cache) and replayed each token. ``torch.cuda.CUDAGraph`` is the same public API on NVIDIA (CUDA
graphs) and on ROCm builds of torch (HIP graphs), so this capture is shared by both GPU backends;
what only one vendor adds (NVIDIA's programmatic dependent launch) enters through ``scope``.

Capture needs a step free of host syncs: the static KV cache (``KVCache(static=True)``) writes
padding to a trash slot instead of filtering it on the host, and the MoE kernels sort tokens on
the device. Warm-up and capture run with every position at -1, so they write only to the trash
slots and leave the cache as the prefill left it.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Optional

import torch


def graph_unavailable(device: torch.device) -> Optional[str]:
    """Why a decode step cannot be captured as a graph on ``device``, or None when it can."""
    device = torch.device(device)
    if device.type != "cuda":  # torch's device type for NVIDIA and AMD GPUs alike
        return f"graph capture needs a GPU device; the model runs on {device} (each step launches its kernels)"
    if not hasattr(torch.cuda, "CUDAGraph"):
        return f"this torch {torch.__version__} has no torch.cuda.CUDAGraph"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no GPU (torch.cuda.is_available() is False)"
    return None


def _no_scope(batch: int) -> ContextManager:
    return contextlib.nullcontext()


def make_graphed_decode_step(model: Any, cache: Any, *, scope: Callable[[int], ContextManager] = _no_scope
                             ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``step(ids [B,1], positions [B,1]) -> logits`` replaying one captured ``model.forward`` on ``cache``.

    ``scope(batch)`` wraps warm-up and capture (the CUDA backend passes its PDL scope); the returned
    logits tensor is the graph's static output, overwritten by the next step.

    Example::

        step = make_graphed_decode_step(model, cache)     # cache = model.new_cache(B, L, static=True)
        logits = step(next_ids, next_positions)
    """
    return make_graphed_step(model, cache, tokens=1, scope=scope)


def make_graphed_prefill_step(model: Any, cache: Any, tokens: int
                              ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``step(ids [B,tokens], positions [B,tokens]) -> logits [B,1,V]``: a prefill of left-padded prompts (padding at
    position -1) into the rows of the static ``cache``, replayed from one captured ``model.forward(last_only=True)``.
    The serve engine captures one per (rows, prompt length) bucket on a staging cache (``Engine.prefill_bucket``)."""
    return make_graphed_step(model, cache, tokens=tokens, last_only=True)


def make_graphed_step(model: Any, cache: Any, *, tokens: int = 1, last_only: bool = False,
                      scope: Callable[[int], ContextManager] = _no_scope
                      ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``step(ids [B,tokens], positions [B,tokens]) -> logits`` replaying one captured ``model.forward`` on ``cache``
    (a decode step at ``tokens=1``; a prefill with ``last_only``)."""
    batch = cache.next_position.shape[0]
    device = model.device
    static_ids = torch.zeros(batch, tokens, dtype=torch.long, device=device)
    static_positions = torch.full((batch, tokens), -1, dtype=torch.long, device=device)
    saved_next = cache.next_position.clone()
    extra = {"last_only": True} if last_only else {}

    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with scope(batch):
        with torch.cuda.stream(side):  # warm-up: lets Triton compile and the allocator settle
            for _ in range(2):
                model.forward(static_ids, positions=static_positions, cache=cache, **extra)
        torch.cuda.current_stream(device).wait_stream(side)

        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_logits = model.forward(static_ids, positions=static_positions, cache=cache, **extra)
    cache.next_position.copy_(saved_next)

    def step(ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        static_ids.copy_(ids, non_blocking=True)
        static_positions.copy_(positions, non_blocking=True)
        graph.replay()
        return static_logits

    return step
