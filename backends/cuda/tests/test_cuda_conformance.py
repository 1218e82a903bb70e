"""The shared conformance suite (``musecore.testing``) on the CUDA backend.

On a GPU every op x format on the tiny, small and 816b preset shapes runs natively (``-m gpu``);
on a CPU machine the Triton kernels run in the interpreter on the tiny shapes with fp16
activations (the interpreter has no bf16). Unsupported cases (INT4/FP8 weights, W4A4) are
skipped with the backend's reason.
"""

from __future__ import annotations

import pytest
import torch

from musecore.testing import make_conformance_tests
from musecore_cuda import CudaBackend
from musecore_triton.testing import HAS_GPU

if HAS_GPU:
    test_cuda_matches_reference_on_gpu = pytest.mark.gpu(
        make_conformance_tests(lambda: CudaBackend("cuda"), sizes=["tiny", "small", "816b"], device_name="h200"))
else:
    test_cuda_interpreted_matches_reference = make_conformance_tests(
        lambda: CudaBackend("cpu"), dtype=torch.float16, sizes=["tiny"], device_name="h200")
