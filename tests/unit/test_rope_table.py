"""The CPU rotary table (musecore.rope.RotaryTable): the rows a step reads from the table are the bits the step's own
computation (``RotaryTable.compute``, the formula before the table) gives, for every position, shape and rope type."""

import pytest
import torch

from musecore.config import MuseConfig
from musecore.rope import RotaryTable

ROPES = {
    "default": (64, {"rope_type": "default", "rope_theta": 500_000.0}),
    "default_d128_small_theta": (128, {"rope_theta": 10_000.0}),
    "yarn": (128, {"rope_type": "yarn", "rope_theta": 1e6, "factor": 8.0, "original_max_position_embeddings": 4096}),
    "yarn_attention_factor": (64, {"rope_type": "yarn", "rope_theta": 5e5, "factor": 4.0, "beta_fast": 16.0,
                                   "beta_slow": 2.0, "attention_factor": 1.3}),
}


def mismatches(got: torch.Tensor, want: torch.Tensor) -> int:
    return int((got.view(torch.int32) != want.view(torch.int32)).sum())


@pytest.mark.parametrize("name", sorted(ROPES))
def test_decode_rows_from_the_table_are_the_bits_of_the_per_step_formula(name):
    d, params = ROPES[name]
    table = RotaryTable(d, params, 1 << 17)
    positions = list(range(0, 3000)) + [4095, 4096, 65535, 70000, -1]  # crosses the table's first growths
    bad = []
    for p in positions:
        pos = torch.tensor([[p]])
        (cos, sin), (want_cos, want_sin) = table(pos), table.compute(pos)
        assert cos.shape == want_cos.shape == (1, 1, d)
        n = mismatches(cos, want_cos) + mismatches(sin, want_sin)
        if n:
            bad.append((p, n))
    assert not bad, f"{name}: (position, differing values) where the table differs from the formula: {bad[:10]}"


@pytest.mark.parametrize("name", sorted(ROPES))
def test_prefill_and_batch_rows_from_the_table_are_the_bits_of_the_formula(name):
    d, params = ROPES[name]
    table = RotaryTable(d, params, 1 << 17)
    table(torch.tensor([[7]]))  # the table exists (smallest size) before a prefill that grows it
    for pos in (torch.arange(5000)[None], torch.tensor([[-1, -1, 0, 1, 2], [3000, 3001, 3002, 3003, 3004]]),
                torch.arange(6).view(2, 3), torch.zeros(2, 0, dtype=torch.long), torch.tensor([9, 10])):
        (cos, sin), (want_cos, want_sin) = table(pos), table.compute(pos)
        assert cos.shape == want_cos.shape and sin.shape == want_sin.shape
        assert cos.is_contiguous() and sin.is_contiguous()
        n = mismatches(cos, want_cos) + mismatches(sin, want_sin)
        assert n == 0, \
            f"{name}: {n} of {2 * cos.numel()} values differ from the formula for positions {tuple(pos.shape)}"


def test_negative_positions_give_position_zero():
    table = RotaryTable(64, {"rope_theta": 500_000.0}, 4096)
    cos, sin = table(torch.tensor([[-1]]))
    assert torch.equal(cos, torch.ones(1, 1, 64)) and torch.equal(sin, torch.zeros(1, 1, 64))


@pytest.mark.parametrize("preset", ["muse-tiny", "muse-small", "muse-spark-open-816b-a42b"])
def test_presets_rope_rows_are_the_formulas_bits(preset):
    config = MuseConfig.from_name(preset)
    table = RotaryTable(config.head_dim, config.rope_parameters, config.max_position_embeddings)
    pos = torch.arange(2048)[None]
    (cos, sin), (want_cos, want_sin) = table(pos), table.compute(pos)
    assert mismatches(cos, want_cos) + mismatches(sin, want_sin) == 0


def test_a_table_grown_in_inference_mode_serves_calls_outside_it():
    table = RotaryTable(64, {"rope_theta": 500_000.0}, 4096)
    with torch.inference_mode():
        table(torch.tensor([[3]]))
    assert not table.cos_table.is_inference()
    x = torch.randn(1, 1, 64, requires_grad=True)
    cos, sin = table(torch.tensor([[3]]))
    (x * cos + x * sin).sum().backward()  # usable in autograd: not an inference tensor
    assert torch.equal(x.grad, (cos + sin).detach())


def test_accelerator_tables_compute_each_step():
    """A table on another device never reads positions on the host (a captured decode step cannot sync)."""
    table = RotaryTable(64, {"rope_theta": 500_000.0}, 4096, device="meta")
    cos, _ = table(torch.zeros(1, 1, dtype=torch.long, device="meta"))
    assert cos.shape == (1, 1, 64) and table.cos_table is None


def test_a_compiled_step_on_cpu_tensors_computes_its_rows_instead_of_reading_the_table():
    """Inside torch.compile (the TPU backend's decode step runs compiled on CPU tensors) the table would need the
    position on the host, a data-dependent guard; the step computes its rows there (fullgraph: no graph break)."""
    d, params = ROPES["default"]
    table = RotaryTable(d, params, 1 << 17)
    step = torch.compile(lambda pos: table(pos), fullgraph=True, backend="eager")
    for p in (0, 5, 2047):
        pos = torch.tensor([[p]])
        (cos, sin), (want_cos, want_sin) = step(pos), table.compute(pos)
        err = max((cos - want_cos).abs().max().item(), (sin - want_sin).abs().max().item())
        assert err == 0.0, f"position {p}: compiled rows differ from the formula by {err:.3g} (tolerance 0)"
