"""Split-K finish's fp32 workspaces that need no memset per launch (``GluonConfig.rezero``).

A split-K ``finish`` launch of the Gluon GEMM adds its splits' partial sums into a zeroed fp32 workspace and counts
them in zeroed per-tile counters; the tile's last split stores the output. Zeroing that workspace per launch is one
more node in a CUDA graph's chain, and it cost 1.26-1.35 us a launch on an H100 (run 91: a second memset of the same
size added to expert_down / pooler M = 16, 10.8 -> 12.2 and 15.3 -> 16.6 us), against launches of 8-25 us. With
``rezero`` the last split stores zeros over the sums it read and over its counter, so the launch leaves the
workspace as it found it and the next launch can use it without a memset: provided no two launches use one
workspace at the same time. Who may share one:

* **Eager launches** share one workspace per (device, stream): a stream runs its kernels one after another (the
  Gluon kernel launches without programmatic dependent launch), so each finds the zeros the one before left.
* **A CUDA graph captured inside** :func:`graph_scope` (the CUDA backend's decode graphs and ``musecore bench``)
  uses the device's graph workspace, allocated and zeroed while the scope's warm-up runs, before the capture;
  graphs captured in the scope share it, so replay them one at a time (as the decode loop does; a replay runs its
  launches in order), never two at once on different streams. When a capture needs more than the warm-up grew, or
  a launch is captured on a second stream of the capture, the launch zeroes a workspace of its own.
* **Any other capture** (outside the scope) zeroes a workspace of its own per launch, the graph owning it: the
  stream's eager workspace is never baked into a graph that could be replayed while eager launches use it.

A graph workspace that a larger one replaced is kept (graphs captured earlier still use it); an eager one is
handed back to the caching allocator, which reuses it in its stream's order.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator, Optional

import torch

_EAGER: dict[tuple[int, int], torch.Tensor] = {}  # (device, stream) -> the stream's zeroed workspace
_GRAPH: dict[int, list[torch.Tensor]] = {}  # device -> its graph workspaces, the current one last
_CAPTURE_STREAM: dict[int, int] = {}  # device -> the stream whose captured launches use the graph workspace
_in_graph_scope: contextvars.ContextVar[bool] = contextvars.ContextVar("musecore_cuda_finish_graph_scope",
                                                                       default=False)


@contextlib.contextmanager
def graph_scope() -> Iterator[None]:
    """Graphs captured in this block (their warm-ups run in it too, before the capture) use the device's graph
    workspace: see the module docstring for who shares it."""
    token = _in_graph_scope.set(True)
    try:
        yield
    finally:
        _in_graph_scope.reset(token)


def workspace(device: torch.device, numel: int) -> Optional[torch.Tensor]:
    """A zeroed fp32 workspace of at least ``numel`` elements that the launch must leave zeroed (``rezero``), or
    None where the launch must zero one of its own (``rezero`` off): a capture outside :func:`graph_scope`, one the
    warm-up did not size, or a second stream of a capture."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = torch.cuda.current_stream(device).cuda_stream
    kept = _GRAPH.get(index)
    if torch.cuda.is_current_stream_capturing():
        if not _in_graph_scope.get() or not kept or kept[-1].numel() < numel:
            return None
        return kept[-1] if _CAPTURE_STREAM.setdefault(index, stream) == stream else None
    if _in_graph_scope.get():  # a warm-up before a capture in the scope: the graph workspace grows here, uncaptured
        _CAPTURE_STREAM.pop(index, None)
        if not kept or kept[-1].numel() < numel:
            _GRAPH.setdefault(index, []).append(_grown(kept[-1] if kept else None, numel, device))
    ws = _EAGER.get((index, stream))
    if ws is None or ws.numel() < numel:
        ws = _EAGER[(index, stream)] = _grown(ws, numel, device)
    return ws


def _grown(old: Optional[torch.Tensor], numel: int, device: torch.device) -> torch.Tensor:
    """A zeroed fp32 workspace to replace ``old``: ``numel`` elements, or twice ``old``'s if that is more (a few
    growing launches reallocate a few times, not once each)."""
    return torch.zeros(max(numel, 2 * old.numel() if old is not None else 0), dtype=torch.float32, device=device)
