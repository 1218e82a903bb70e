"""Test support for the GPU backends' kernel tests (this package's, musecore-cuda's, musecore-rocm's):
the device to test on and the NMSE checks. Public so that plugin test suites, which run with
``--import-mode=importlib`` where sibling test modules are not importable, share it."""

from __future__ import annotations

import os
import sys

import torch

from musecore.testing import assert_nmse, nmse  # noqa: F401  (re-exported for the tests)

HAS_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_GPU else "cpu")
# The interpreter has no bf16; on a GPU the small tests also cover bf16.
SMALL_DTYPES = [torch.float16, torch.bfloat16] if HAS_GPU else [torch.float16]


def use_interpreter_without_gpu(conftest: str, has_gpu: bool = HAS_GPU) -> None:
    """From a tests folder's ``conftest.py`` (pytest imports every conftest before any test module):
    without a GPU, run the Triton kernels in Triton's interpreter. ``TRITON_INTERPRET=1`` only takes
    effect when it is set before Triton is first imported; past that point this raises, naming
    ``conftest``, instead of letting kernels fail to launch."""
    if has_gpu or os.environ.get("TRITON_INTERPRET") == "1":
        return
    if "triton.language" in sys.modules:
        raise RuntimeError(f"Triton was imported before {conftest} could enable its interpreter; run pytest with "
                           "TRITON_INTERPRET=1 on machines without a GPU")
    os.environ["TRITON_INTERPRET"] = "1"


def skip_gpu_tests(items: list, has_gpu: bool = HAS_GPU, reason: str = "needs a GPU: torch.cuda.is_available() "
                   "is False") -> None:
    """From ``pytest_collection_modifyitems``: skip the tests marked ``gpu`` when there is none, with ``reason``."""
    import pytest

    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip)
