"""The portable Triton kernels shared by musecore's GPU backends. Without a GPU they run only under
Triton's interpreter (``TRITON_INTERPRET=1`` set before Triton is imported; the tests' conftest does
that), on CPU tensors, without bf16: a test facility, never a fallback the plan could pick."""

from __future__ import annotations

import os

import torch


def interpreted(device: torch.device | str) -> bool:
    """Whether Triton kernels launched on ``device`` run in Triton's CPU interpreter (a CPU device with
    ``TRITON_INTERPRET=1``): the tests' way to run them without a GPU."""
    return torch.device(device).type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
