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


def grouped_moe_cases() -> list:
    """The suite's MoE prefill cases (small: 8 experts top-4, 816b: 3 of 256 experts top-2) at enough tokens to pass
    the decode GEMVs' 1024 assignments, so that they reach the grouped GEMMs (Triton's, and Gluon's when opted in)."""
    import dataclasses

    from musecore.testing.cases import moe_cases
    tokens = {"small": 300, "816b": 600}
    return [dataclasses.replace(c, variant="prefill-grouped",
                                dims=tuple((k, tokens[size] if k == "tokens" else v) for k, v in c.dims))
            for size in tokens for c in moe_cases(size)
            if c.variant == "prefill" and c.weight_format in ("nvfp4", "mxfp4") and c.act_format is None]


@pytest.mark.gpu
@pytest.mark.parametrize("gluon", ["0", "1"], ids=["triton", "gluon"])
@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in grouped_moe_cases()])
def test_cuda_grouped_moe_matches_reference_on_gpu(case, gluon, monkeypatch):
    """The grouped paths through the suite's checker: the Triton grouped GEMM, and with MUSECORE_CUDA_GLUON_MOE=1
    the grouped Gluon GEMM for NVFP4 (MXFP4 keeps Triton's; the case says which ran in its message)."""
    from musecore.testing.check import check_op
    if not HAS_GPU:
        pytest.skip("needs a CUDA GPU")
    monkeypatch.setenv("MUSECORE_CUDA_GLUON_MOE", gluon)
    result = check_op(CudaBackend("cuda"), case, device_name="h200")
    assert result.passed, result.message()
