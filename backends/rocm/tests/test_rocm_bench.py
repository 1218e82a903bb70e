"""``musecore bench --backend rocm`` offers its cases and, without an AMD GPU, each stops with the reason."""

from __future__ import annotations

import pytest
import torch

from musecore_rocm.bench import Skip, benchmarks


@pytest.mark.skipif(torch.version.hip is not None and torch.cuda.is_available(), reason="an AMD GPU is here")
@pytest.mark.parametrize("case", ["linear", "moe"])
def test_bench_cases_skip_with_the_reason_without_a_rocm_gpu(case):
    table = benchmarks()
    assert set(table) == {"linear", "moe"}
    with pytest.raises(Skip, match="needs an AMD GPU"):
        table[case]()
