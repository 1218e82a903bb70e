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

from musecore_triton.kernels import interpreted, sampling


# The greedy step's state through Triton launches: the position update in one (``sampling.greedy_positions``) instead
# of five PyTorch kernels (not, masked_fill's copy and fill, the bool's cast, the add) at the head of every greedy
# replay, and the argmax written straight into the tokens the next replay reads (the backend's ``argmax_into``)
# instead of a device copy after it. On since run 69 (session 55, muse-small NVFP4 greedy decode on the H200, 4 rounds,
# medians): replay 687.2 -> 686.0 us, generate 709.0 -> 701.5 us/token; with EAGER_FIRST_STEP and PREFETCH_POSITIONS
# too 698.7 -> 691.3 (A/B modes greedy_state, all_new53 of backends/cuda/lab/scripts/cuda_fused_ab.py). ROCm's HIP
# graphs take it too: greedy_positions compiles for gfx950 / gfx942 without scratch (test_rocm_compile.py), never run.
FUSED_STATE = True
ArgmaxInto = Callable[[torch.Tensor, torch.Tensor], bool]  # (logits [B,V], tokens [B]) -> whether it wrote them


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


def make_graphed_greedy_step(model: Any, cache: Any, *, scope: Callable[[int], ContextManager] = _no_scope,
                             argmax_into: Optional[ArgmaxInto] = None) -> "GreedyGraphStep":
    """A :class:`GreedyGraphStep` on ``cache``: a decode step that takes its argmax tokens on the device
    (``argmax_into``: see :class:`GreedyGraphStep`)."""
    return GreedyGraphStep(model, cache, scope, argmax_into)


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
    static_ids = torch.zeros(batch, tokens, dtype=torch.long, device=model.device)
    static_positions = torch.full((batch, tokens), -1, dtype=torch.long, device=model.device)
    extra = {"last_only": True} if last_only else {}
    graph, static_logits = _capture(model, cache, scope, lambda: model.forward(
        static_ids, positions=static_positions, cache=cache, **extra))

    def step(ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        static_ids.copy_(ids, non_blocking=True)
        static_positions.copy_(positions, non_blocking=True)
        graph.replay()
        return static_logits

    step.cache = cache  # the graph reads and writes the cache's memory: it must outlive the step (see _capture)
    return step


class GreedyGraphStep:
    """A decode step that also picks its tokens on the device, for greedy ``generate``: one captured graph computes
    the step's positions from the loop's state, runs ``model.forward`` and takes the argmax (``ops.sample`` at
    temperature 0) into the tokens the next replay reads, so nothing but the replay and the tokens' copy to the
    host is launched per token (the position update, the input copies and the sampling ran as ~8 kernels of their
    own, each a dependent launch beside the graph).

    State (static device tensors, ``[B]``): ``tokens`` (the step's input ids, then its output), ``next_position``
    (each row's next position, advanced by one for live rows) and ``live`` (rows still generating; the others run
    at position -1: they read and write nothing). Per replay::

        positions = where(live, next_position, -1); next_position += live
        logits = model.forward(tokens[:, None], positions[:, None], cache); tokens = argmax(logits[:, -1])

    With :data:`FUSED_STATE` on a GPU the position update is one Triton launch, and ``argmax_into(logits, tokens)``
    (a backend's greedy argmax writing into the given buffer; it returns False where it does not take the logits)
    replaces the sampling op and the copy into ``tokens``.

    Example::

        step = GreedyGraphStep(model, cache)          # cache = model.new_cache(B, L, static=True), prefilled
        step.start(first_tokens, next_positions, live)
        for _ in range(n):
            tokens = step()                           # static: copy it out before the next call overwrites it
    """

    def __init__(self, model: Any, cache: Any, scope: Callable[[int], ContextManager] = _no_scope,
                 argmax_into: Optional[ArgmaxInto] = None) -> None:
        batch = cache.next_position.shape[0]
        self.tokens = torch.zeros(batch, dtype=torch.long, device=model.device)
        self.next_position = torch.zeros(batch, dtype=torch.long, device=model.device)
        self.live = torch.zeros(batch, dtype=torch.bool, device=model.device)  # warm-up and capture: padding only

        def body() -> torch.Tensor:
            fused = FUSED_STATE and (self.tokens.is_cuda or interpreted(self.tokens.device))
            if fused:
                positions = sampling.greedy_positions(self.next_position, self.live)
            else:
                positions = self.next_position.masked_fill(~self.live, -1)[:, None]
                self.next_position.add_(self.live.long())
            logits = model.forward(self.tokens[:, None], positions=positions, cache=cache)
            if not (fused and argmax_into is not None and argmax_into(logits[:, -1], self.tokens)):
                self.tokens.copy_(model.ops.sample(logits[:, -1], 0.0, 0, 1.0, None))
            return logits

        self.graph, self.logits = _capture(model, cache, scope, body)
        self.cache = cache  # the graph reads and writes its memory: held as long as the step (see _capture)
        # (the warm-ups ran the body: the state is garbage until start())

    def start(self, tokens: torch.Tensor, next_position: torch.Tensor, live: torch.Tensor) -> None:
        """Queue the loop's state (``[B]`` device tensors: the first tokens to feed, their positions, live rows)."""
        self.tokens.copy_(tokens, non_blocking=True)
        self.next_position.copy_(next_position, non_blocking=True)
        self.live.copy_(live, non_blocking=True)

    def set_live(self, live: torch.Tensor) -> None:
        """Queue new live rows (a row that ended runs at position -1 from the next replay on)."""
        self.live.copy_(live, non_blocking=True)

    def __call__(self) -> torch.Tensor:
        """Replay one step; the new tokens ``[B]`` (static, overwritten by the next call; ``self.logits`` its
        logits ``[B, 1, V]``)."""
        self.graph.replay()
        return self.tokens


def _capture(model: Any, cache: Any, scope: Callable[[int], ContextManager],
             body: Callable[[], torch.Tensor]) -> tuple[Any, torch.Tensor]:
    """``(graph, output)``: ``body`` (a step on the static ``cache`` whose inputs are all at position -1) warmed up
    twice on a side stream, then captured; the cache's next positions are put back as they were. The graph holds
    the cache's memory by address only: whatever replays it must hold ``cache`` too."""
    batch = cache.next_position.shape[0]
    saved_next = cache.next_position.clone()
    side = torch.cuda.Stream(model.device)
    side.wait_stream(torch.cuda.current_stream(model.device))
    with scope(batch):
        with torch.cuda.stream(side):  # warm-up: lets Triton compile and the allocator settle
            for _ in range(2):
                body()
        torch.cuda.current_stream(model.device).wait_stream(side)

        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = body()
    cache.next_position.copy_(saved_next)
    return graph, out
