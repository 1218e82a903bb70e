"""The towers' ops on the CUDA backend: claimed with what runs them (the shared kernels of
``musecore_triton.towers``), native on SM90, emulated on unverified SM100 and in the interpreter, declined
beyond the kernel's head dim. Their numerics are the conformance suite's (``test_cuda_conformance.py``:
tiny shapes in the interpreter, tiny/small/816b on the GPU) and ``backends/triton/tests/test_triton_towers.py``."""

from __future__ import annotations

import pytest
import torch

from musecore.ops import TOWER_OPS, OpSpec
from musecore_cuda import CudaBackend
from musecore_triton.towers import TOWER_REASONS


def spec(op: str, **shape: int) -> OpSpec:
    return OpSpec(op, dtype=torch.bfloat16, shape=tuple(shape.items()), device="h200")


@pytest.mark.parametrize("op", TOWER_OPS)
def test_tower_ops_are_native_on_sm90_with_what_runs_them(op):
    answer = CudaBackend()._supports_on(9, op, spec(op, heads=16, head_dim=96))  # the 816B vision tower
    assert answer.ok and answer.tier.value == "native" and answer.reason == TOWER_REASONS[op], answer
    assert callable(getattr(CudaBackend(), op))


def test_tower_ops_are_emulated_on_unverified_sm100_and_bounded_by_the_kernels_head_dim():
    assert CudaBackend()._supports_on(10, "varlen_attention", spec("varlen_attention", head_dim=96)).tier.value \
        == "emulated"
    wide = CudaBackend()._supports_on(9, "varlen_attention", spec("varlen_attention", head_dim=512))
    assert not wide.ok and "head dims up to 256" in wide.reason, wide
    odd = CudaBackend()._supports_on(9, "rope", spec("rope", head_dim=15))
    assert not odd.ok and "even" in odd.reason, odd
