"""The CPU MoE against the reference: INT4 and BF16 experts, decode and prefill sizes."""

from __future__ import annotations

import pytest
import torch

import musecore_quant
from musecore.testing import assert_nmse
from musecore.ops import reference as ref
from musecore.ops import tolerance
from musecore_xeon import XeonBackend

E, K_TOP, LATENT, INTER = 8, 3, 128, 256


def expert_weights(fmt: str):
    gate, up = torch.randn(E, INTER, LATENT) * 0.1, torch.randn(E, INTER, LATENT) * 0.1
    down = torch.randn(E, LATENT, INTER) * 0.1
    if fmt == "int4":
        return [musecore_quant.quantize(w, "int4", group_size=128, sym=sym)
                for w, sym in ((gate, True), (up, False), (down, True))]  # mixed zero/no-zero fuses too
    return [w.to(torch.bfloat16) for w in (gate, up, down)]


def routing(tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    logits = torch.randn(tokens, E)
    return ref.router_topk(logits, K_TOP, renormalize=True)


@pytest.mark.parametrize("fmt", ["int4", "bf16"])
@pytest.mark.parametrize("tokens", [1, 4, 200])  # 200 tokens x 3 / 8 experts puts experts above crossover 64
def test_moe_matches_reference(xeon: XeonBackend, reference, fmt: str, tokens: int) -> None:
    gate, up, down = expert_weights(fmt)
    mine, theirs = xeon.prepare_experts(gate, up, down), reference.prepare_experts(gate, up, down)
    z = torch.randn(tokens, LATENT, dtype=torch.bfloat16)
    weights, ids = routing(tokens)
    output_norm = 1 + 0.3 * torch.randn(E, LATENT)
    expected = ref.moe(z, weights, ids, theirs, output_norm, 1e-6)
    actual = xeon.moe(z, weights, ids, mine, output_norm, 1e-6)
    assert actual.dtype == torch.float32
    assert_nmse(expected, actual, tolerance("moe"), f"moe {fmt} T={tokens}")


def test_per_expert_norm_is_applied_before_routing_weight(xeon: XeonBackend) -> None:
    """Scaling one expert's down projection must not change the output: its own RMSNorm removes it."""
    gate, up, down = expert_weights("bf16")
    z = torch.randn(6, LATENT, dtype=torch.bfloat16)
    weights, ids = routing(6)
    norm = torch.ones(E, LATENT)
    base = xeon.moe(z, weights, ids, xeon.prepare_experts(gate, up, down), norm, 1e-6)
    scaled_down = down.clone()
    scaled_down[ids[0, 0]] *= 8  # a power of two: exact in bf16
    scaled = xeon.moe(z, weights, ids, xeon.prepare_experts(gate, up, scaled_down), norm, 1e-6)
    assert_nmse(base, scaled, 1e-6, "moe invariant to one expert's output scale")


def test_moe_rejects_experts_it_did_not_prepare(xeon: XeonBackend, reference) -> None:
    gate, up, down = expert_weights("bf16")
    with pytest.raises(TypeError, match="prepare_experts"):
        xeon.moe(torch.randn(1, LATENT), *routing(1), reference.prepare_experts(gate, up, down),
                 torch.ones(E, LATENT), 1e-6)


@pytest.mark.parametrize("fmt", ["int4", "bf16"])
@pytest.mark.parametrize("tokens", [1, 5])
def test_decode_moe_runs_as_one_native_call_and_matches_reference(xeon: XeonBackend, reference, fmt: str,
                                                                  tokens: int, monkeypatch) -> None:
    """INT4 experts through musecore_int4_moe, BF16 experts through musecore_bf16_moe (the same driver with the BF16
    GEMV's rows): fp32 throughout against the reference's fp32 math on the same weights."""
    from musecore_xeon.kernels import native
    if not native.available():
        pytest.skip(f"native kernels unavailable: {native.UNAVAILABLE}")
    gate, up, down = expert_weights(fmt)
    mine = xeon.prepare_experts(gate, up, down)
    resident = mine.extra["xeon"]
    assert resident.native_kind == fmt
    assert resident.native_pointers is not None and resident.native_fits(tokens, torch.zeros(tokens, K_TOP, dtype=torch.int64))
    calls = []
    fused = getattr(native, f"{fmt}_moe")
    monkeypatch.setattr(native, f"{fmt}_moe", lambda *a, **k: calls.append(1) or fused(*a, **k))
    z = torch.randn(tokens, LATENT, dtype=torch.bfloat16)
    weights, ids = routing(tokens)
    ids[0] = ids[0, 0]  # one expert chosen twice by one token: two rows of the same expert in one call
    output_norm = (1 + 0.3 * torch.randn(E, LATENT)).to(torch.bfloat16)
    expected = ref.moe(z, weights, ids, reference.prepare_experts(gate, up, down), output_norm, 1e-6)
    actual = xeon.moe(z, weights, ids, mine, output_norm, 1e-6)
    assert calls == [1], f"{fmt} decode MoE did not take the fused native call"
    assert_nmse(expected, actual, 1e-8 if fmt == "int4" else 1e-6,
                f"fused native {fmt} moe T={tokens} (fp32 throughout; bf16 activations into the BF16 GEMV)")


@pytest.mark.parametrize("fmt", ["int4", "bf16"])
def test_native_moe_rejects_out_of_range_expert_ids(xeon: XeonBackend, fmt: str) -> None:
    from musecore_xeon.kernels import native
    if not native.available():
        pytest.skip(f"native kernels unavailable: {native.UNAVAILABLE}")
    mine = xeon.prepare_experts(*expert_weights(fmt))
    weights, ids = routing(1)
    ids[0, 0] = E
    with pytest.raises(ValueError, match=r"expert ids must lie in \[0, 8\)"):
        xeon.moe(torch.randn(1, LATENT, dtype=torch.bfloat16), weights, ids, mine, torch.ones(E, LATENT), 1e-6)
