"""Decode steps replayed from a captured CUDA graph, with NVIDIA's programmatic dependent launch.

The capture itself (static inputs, warm-up with every position at -1, capture, replay) is the
portable :func:`musecore_triton.graphs.make_graphed_decode_step` (and its greedy twin, which takes the argmax
tokens in the graph), shared with the ROCm backend's
HIP graphs. What is CUDA's own: up to ``pdl.MAX_BATCH`` sequences, the step is captured with
programmatic dependent launch (each kernel starts under the previous one's tail; ``kernels/pdl.py``), and
split-K finish launches use the device's kept-zero graph workspace instead of a memset each
(``kernels/finish_workspace.py``; the decode graphs replay one at a time).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional

import torch

from musecore_cuda.kernels import finish_workspace, pdl
from musecore_triton import graphs


def make_graphed_decode_step(model: Any, cache: Any) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The shared graphed decode step, captured inside the PDL scope for batches up to ``pdl.MAX_BATCH``."""
    return graphs.make_graphed_decode_step(model, cache, scope=_pdl_scope)


def make_graphed_greedy_step(model: Any, cache: Any, argmax_into: Optional[graphs.ArgmaxInto] = None
                             ) -> graphs.GreedyGraphStep:
    """The shared greedy decode step (its argmax in the graph), captured inside the same PDL scope."""
    return graphs.make_graphed_greedy_step(model, cache, scope=_pdl_scope, argmax_into=argmax_into)


@contextlib.contextmanager
def _pdl_scope(batch: int) -> Iterator[None]:
    with pdl.scope(batch <= pdl.MAX_BATCH), finish_workspace.graph_scope():
        yield
