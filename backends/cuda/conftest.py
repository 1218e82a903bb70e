"""Test setup for the CUDA backend's tests and its lab's (``tests/``, ``lab/tests/``): on a machine
without a GPU the Triton kernels run in Triton's interpreter on small fp16/fp32 shapes; tests marked ``gpu`` need a real NVIDIA device and
are skipped with a reason otherwise. Shared helpers (device choice, NMSE checks) come from
``musecore_triton.testing``, the GPU backends' test support (the repository runs pytest with
``--import-mode=importlib``, so sibling test modules are not importable). On a ROCm build of torch
every test here is skipped: they test NVIDIA kernels."""

from __future__ import annotations

import pytest
import torch

from musecore_triton.testing import skip_gpu_tests, use_interpreter_without_gpu

ROCM = torch.version.hip is not None
HAS_GPU = torch.cuda.is_available() and not ROCM
use_interpreter_without_gpu(__file__)  # any GPU, AMD's included, runs the Triton kernels natively


ROCM_SKIP = pytest.mark.skip(reason="the CUDA backend's tests need an NVIDIA GPU or none (interpreter); "
                                    "this torch is a ROCm build")


def pytest_collection_modifyitems(config, items):
    if ROCM:
        here = str(config.rootpath / "backends" / "cuda")
        for item in items:
            if str(item.path).startswith(here):
                item.add_marker(ROCM_SKIP)
    skip_gpu_tests(items, HAS_GPU, "needs a CUDA GPU: torch.cuda.is_available() is False")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
