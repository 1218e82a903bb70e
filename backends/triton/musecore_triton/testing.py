"""Test support for the GPU backends' kernel tests (this package's, musecore-cuda's, musecore-rocm's):
the device to test on and the NMSE checks. Public so that plugin test suites, which run with
``--import-mode=importlib`` where sibling test modules are not importable, share it."""

from __future__ import annotations

import torch

from musecore.testing import assert_nmse, nmse  # noqa: F401  (re-exported for the tests)

HAS_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_GPU else "cpu")
# The interpreter has no bf16; on a GPU the small tests also cover bf16.
SMALL_DTYPES = [torch.float16, torch.bfloat16] if HAS_GPU else [torch.float16]
