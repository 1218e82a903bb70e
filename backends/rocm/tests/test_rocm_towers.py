"""The towers' ops on the ROCm backend: the shared kernels of ``musecore_triton.towers``, claimed with what
runs them and emulated (never run on AMD hardware) like every kernel here. Their numerics are the
conformance suite's (``test_rocm_conformance.py``: tiny shapes in the interpreter standing in for gfx950)."""

from __future__ import annotations

import pytest
import torch

from musecore.ops import TOWER_OPS, OpSpec
from musecore_rocm import RocmBackend
from musecore_triton.towers import TOWER_REASONS


@pytest.mark.parametrize("op", TOWER_OPS)
@pytest.mark.parametrize("arch", ["gfx950", "gfx942"])
def test_tower_ops_are_claimed_as_the_shared_kernels_not_yet_run_on_amd(op, arch):
    answer = RocmBackend("cpu", arch=arch)._supports_on(arch, op, OpSpec(op, dtype=torch.bfloat16,
                                                                         shape=(("head_dim", 96),)))
    assert answer.ok and answer.tier.value == "emulated", answer
    assert answer.reason == f"{TOWER_REASONS[op]}; not yet run on {arch} hardware", answer
