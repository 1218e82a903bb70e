"""An expert triple whose gate, up and down differ in format is refused by every backend's prepare_experts,
naming the formats (a loader bug or a hand-mixed checkpoint, never run with one format's label on another's data)."""

import pytest
import torch

from musecore.backends.base import expert_format
from musecore.backends.registry import discover


def test_expert_format_is_the_one_format_or_an_error_naming_them():
    assert expert_format(iter(["nvfp4", "nvfp4", "nvfp4"])) == "nvfp4"
    with pytest.raises(ValueError, match=r"gate, up and down must share one format; got \['bf16', 'nvfp4'\]"):
        expert_format(["nvfp4", "bf16", "nvfp4"])


def cpu_backends():
    """Every installed backend that prepares weights on this host's CPU (the GPU ones in Triton's interpreter)."""
    made = []
    for name, record in sorted(discover().items()):
        if record.loaded:
            made.append(pytest.param(record.backend_class, id=name))
    return made


@pytest.mark.parametrize("backend_class", cpu_backends())
def test_prepare_experts_refuses_mixed_formats(backend_class):
    torch.manual_seed(0)
    E, inter, hidden = 2, 64, 64
    gate, up = (torch.randn(E, inter, hidden, dtype=torch.bfloat16) for _ in range(2))
    down = torch.randn(E, hidden, inter, dtype=torch.float32)  # two dense formats: every backend takes each
    backend = backend_class("cpu")
    with pytest.raises(ValueError, match=r"must share one format; got \['bf16', 'fp32'\]"):
        backend.prepare_experts(gate, up, down)
