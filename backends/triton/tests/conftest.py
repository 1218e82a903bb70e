"""Test setup for the portable Triton kernels: on a machine without a GPU they run in Triton's
interpreter on small fp16/fp32 shapes; tests marked ``gpu`` need a real device and are skipped with a
reason otherwise. Shared helpers live in ``musecore_triton.testing`` (the repository runs pytest with
``--import-mode=importlib``, so sibling test modules are not importable)."""

from __future__ import annotations

import pytest
import torch

from musecore_triton.testing import skip_gpu_tests, use_interpreter_without_gpu

use_interpreter_without_gpu(__file__)


def pytest_collection_modifyitems(config, items):
    skip_gpu_tests(items)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
