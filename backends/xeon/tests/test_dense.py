"""BF16 / fp32 dense linear against the reference, on both sides of the BF16 crossover."""

from __future__ import annotations

import pytest
import torch

from musecore.testing import assert_nmse
from musecore.ops import reference as ref
from musecore.ops import tolerance
from musecore_xeon import XeonBackend
from musecore_xeon.kernels.crossover import BF16_CROSSOVER_ENV
from musecore_xeon.kernels.dense import DenseLinear, bf16_crossover, prepare_dense, tile_workspace


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(256, 512), (768, 512), (192, 64)])
def test_dense_linear_matches_reference(xeon: XeonBackend, reference, dtype, shape) -> None:
    w = torch.randn(*shape) * 0.05
    mine, theirs = xeon.prepare_weight(w, "linear", dtype=dtype), reference.prepare_weight(w, "linear", dtype=dtype)
    for m in (1, 5, 64, 130):  # the fixture's crossover is 64: M >= 64 takes fp32 tiles for bf16 weights
        x = torch.randn(m, shape[1], dtype=dtype)
        lin = mine.extra["linear"]
        path = "tiles" if lin.uses_dense_tiles(m) else "direct"
        assert_nmse(ref.linear(x, theirs).float(), xeon.linear(x, mine).float(), tolerance("linear"),
                          f"{dtype} {shape} M={m} ({path})")


def test_bf16_weights_stay_bf16_and_embedding_tables_are_plain_tensors(xeon: XeonBackend) -> None:
    table = xeon.prepare_weight(torch.randn(100, 64), "embedding")
    assert isinstance(table.data, torch.Tensor) and table.data.dtype == torch.bfloat16
    assert table.extra["linear"].calibration is None  # gathered, never multiplied: nothing to measure
    ids = torch.tensor([[3, 7, 99]])
    assert torch.equal(xeon.embedding(ids, table), ref.embedding(ids, table))


def test_bf16_crossover_is_measured_where_bf16_is_emulated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(BF16_CROSSOVER_ENV, raising=False)
    calibration = bf16_crossover(128, 128)
    print(calibration.table())
    assert calibration.source == "measured" and calibration.ms


def test_dense_dtype_must_be_bf16_or_fp32() -> None:
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        prepare_dense(torch.randn(4, 4), torch.float16, native_bf16_dot=False)


def test_tile_workspace_made_under_inference_mode_serves_calls_outside_it() -> None:
    """Generation runs under inference mode; a model loaded afterwards calibrates outside it and
    writes the same cached tile buffer (this raised 'Inplace update to inference tensor')."""
    with torch.inference_mode():
        tile_workspace(1 << 22, torch.float32)  # larger than any buffer cached so far: a new one
    dense = DenseLinear(torch.randn(64, 256, dtype=torch.bfloat16))
    x = torch.randn(4, 256)
    assert_nmse(x @ dense.weight.float().T, dense.run_tiles(x), tolerance("linear"), "tiles after inference mode")
    with torch.inference_mode():
        assert_nmse(x @ dense.weight.float().T, dense.run_tiles(x), tolerance("linear"), "tiles inside it")
