"""The shared conformance suite (``musecore.testing``) on the ROCm backend.

On a ROCm GPU every op x format on the tiny, small and 816b preset shapes (``-m rocm``); on a CPU
machine the Triton kernels run in the interpreter on the tiny shapes with fp16 activations,
standing in for gfx950 (mi355x) and, for the matmuls, gfx942 (mi300x). Unsupported cases (INT4,
NVFP4 W4A4, FP8 off the GPU) are skipped with the backend's reason.
"""

from __future__ import annotations

import pytest
import torch

from musecore.testing import make_conformance_tests
from musecore_rocm import RocmBackend

if torch.version.hip is not None and torch.cuda.is_available():
    test_rocm_matches_reference_on_gpu = pytest.mark.rocm(
        make_conformance_tests(lambda: RocmBackend("cuda"), sizes=["tiny", "small", "816b"]))
elif not torch.cuda.is_available():
    test_rocm_interpreted_gfx950_matches_reference = make_conformance_tests(
        lambda: RocmBackend("cpu", arch="gfx950"), dtype=torch.float16, sizes=["tiny"], device_name="mi355x")
    test_rocm_interpreted_gfx942_matmuls_match_reference = make_conformance_tests(
        lambda: RocmBackend("cpu", arch="gfx942"), dtype=torch.float16, sizes=["tiny"], ops=["linear"],
        formats=["mxfp4"], device_name="mi300x")
