"""Device choice and NMSE checks used by the Triton kernels' tests (importable in any pytest import mode)."""

from __future__ import annotations

import torch

from musecore.testing import assert_nmse, nmse  # noqa: F401  (re-exported for the tests)

HAS_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_GPU else "cpu")
# The interpreter has no bf16; on a GPU the small tests also cover bf16.
SMALL_DTYPES = [torch.float16, torch.bfloat16] if HAS_GPU else [torch.float16]
