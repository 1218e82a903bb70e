"""Test setup for the ROCm backend. Without a GPU the Triton kernels run in Triton's interpreter
(``musecore_triton.testing.use_interpreter_without_gpu``: ``TRITON_INTERPRET=1`` before Triton is first
imported) on small fp16 shapes, standing in for gfx950/gfx942; tests marked ``rocm`` need an AMD GPU
and are skipped with a reason otherwise; tests marked ``gpu`` run the portable kernels on whatever GPU
torch sees (on an NVIDIA machine: through Triton's CUDA target, which checks numerics at scale, not AMD
speed). The compile-only tests (gfx950/gfx942 code objects, FlyDSL) need no GPU at all."""

from __future__ import annotations

import pytest
import torch

from musecore_triton.testing import HAS_GPU, skip_gpu_tests, use_interpreter_without_gpu

HAS_ROCM_GPU = torch.version.hip is not None and HAS_GPU
use_interpreter_without_gpu("backends/rocm/tests/conftest.py")


def pytest_collection_modifyitems(config, items):
    skip_gpu_tests(items)
    no_rocm = pytest.mark.skip(reason="needs an AMD GPU with a ROCm build of torch "
                                      f"(torch.version.hip is {torch.version.hip!r}, GPU visible: {HAS_GPU})")
    for item in items:
        if item.get_closest_marker("rocm") and not HAS_ROCM_GPU:  # a marker, not a keyword: the folder is "rocm"
            item.add_marker(no_rocm)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
