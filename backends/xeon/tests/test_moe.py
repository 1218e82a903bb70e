"""The CPU MoE against the reference: INT4 and BF16 experts, decode (one fused native call) and prefill sizes
(per-expert calls), with the shared post-expert norm applied scale first before the routing weight."""

from __future__ import annotations

import pytest
import torch

import musecore_quant
from musecore.testing import assert_nmse
from musecore.ops import reference as ref
from musecore.ops import tolerance
from musecore_xeon import XeonBackend

E, K_TOP, HIDDEN, INTER = 8, 3, 128, 256


def expert_weights(fmt: str):
    gate, up = torch.randn(E, INTER, HIDDEN) * 0.1, torch.randn(E, INTER, HIDDEN) * 0.1
    down = torch.randn(E, HIDDEN, INTER) * 0.1
    if fmt == "int4":
        return [musecore_quant.quantize(w, "int4", group_size=128, sym=sym)
                for w, sym in ((gate, True), (up, False), (down, True))]  # mixed zero/no-zero fuses too
    return [w.to(torch.bfloat16) for w in (gate, up, down)]


def routing(tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, weight, bias = torch.randn(tokens, 64), torch.randn(E, 64) * 0.5, torch.randn(E) * 0.05
    return ref.router_topk(x, weight, bias, K_TOP, 0.5, 1.0)


def post_norm_weight(dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return (1 + 0.5 * torch.randn(HIDDEN)).to(dtype)  # one weight [h], shared by all experts (1 + w folded)


def scale_after_moe(z, weights, ids, experts, post_norm, post_eps) -> torch.Tensor:
    """The OLD contract's order (norm, then the weight multiplied after): what the backend must no longer compute."""
    y = torch.zeros(z.shape[0], z.shape[-1])
    for e in ids.unique().tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        out = ref.rms_norm(ref.expert_forward(z[tok], experts, e).to(z.dtype), post_norm, post_eps)
        y.index_add_(0, tok, weights[tok, slot, None].float() * out.float())
    return y


@pytest.mark.parametrize("fmt", ["int4", "bf16"])
@pytest.mark.parametrize("tokens", [1, 4, 200])  # 200 tokens x 3 / 8 experts puts experts above crossover 64
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_moe_matches_reference(xeon: XeonBackend, reference, fmt: str, tokens: int, dtype) -> None:
    gate, up, down = expert_weights(fmt)
    mine, theirs = xeon.prepare_experts(gate, up, down), reference.prepare_experts(gate, up, down)
    z = torch.randn(tokens, HIDDEN, dtype=dtype)
    weights, ids = routing(tokens)
    post_norm = post_norm_weight()
    expected = ref.moe(z, weights, ids, theirs, post_norm, 1e-8)
    actual = xeon.moe(z, weights, ids, mine, post_norm, 1e-8)
    assert actual.dtype == torch.float32 and actual.shape == (tokens, HIDDEN)
    assert_nmse(expected, actual, tolerance("moe"), f"moe {fmt} T={tokens} z {dtype}")


@pytest.mark.parametrize("tokens", [2, 200])  # the fused native call and the per-expert path
def test_post_expert_norm_is_scale_first_and_before_the_routing_weight(xeon: XeonBackend, reference,
                                                                       tokens: int) -> None:
    """With a non-uniform shared weight, scale-first (rms(round(e * w))) and scale-after (rms(e) * w) differ by far more
    than the tolerance; the backend must be the former."""
    gate, up, down = expert_weights("bf16")
    z = torch.randn(tokens, HIDDEN, dtype=torch.bfloat16)
    weights, ids = routing(tokens)
    post_norm = post_norm_weight()
    actual = xeon.moe(z, weights, ids, xeon.prepare_experts(gate, up, down), post_norm, 1e-8)
    theirs = reference.prepare_experts(gate, up, down)
    assert_nmse(ref.moe(z, weights, ids, theirs, post_norm, 1e-8), actual, tolerance("moe"), "scale-first moe")
    old = scale_after_moe(z, weights, ids, theirs, post_norm, 1e-8)
    err = ((actual - old).pow(2).mean() / old.pow(2).mean()).item()
    assert err > 10 * tolerance("moe"), f"scale-after is indistinguishable here (NMSE {err:.3g}): the test is blind"


def test_post_expert_norm_is_applied_to_each_expert_before_routing_weight(xeon: XeonBackend) -> None:
    """Scaling one expert's down projection by a power of two must not change the output: the norm of that expert's own
    output (not of the sum) removes it."""
    gate, up, down = expert_weights("bf16")
    z = torch.randn(6, HIDDEN, dtype=torch.bfloat16)
    weights, ids = routing(6)
    post_norm = post_norm_weight()
    base = xeon.moe(z, weights, ids, xeon.prepare_experts(gate, up, down), post_norm, 1e-8)
    scaled_down = down.clone()
    scaled_down[ids[0, 0]] *= 8  # a power of two: exact in bf16
    scaled = xeon.moe(z, weights, ids, xeon.prepare_experts(gate, up, scaled_down), post_norm, 1e-8)
    assert_nmse(base, scaled, 1e-6, "moe invariant to one expert's output scale")


def test_moe_rejects_experts_it_did_not_prepare(xeon: XeonBackend, reference) -> None:
    gate, up, down = expert_weights("bf16")
    with pytest.raises(TypeError, match="prepare_experts"):
        xeon.moe(torch.randn(1, HIDDEN), *routing(1), reference.prepare_experts(gate, up, down), post_norm_weight(),
                 1e-8)


def test_moe_rejects_a_per_expert_norm_weight(xeon: XeonBackend) -> None:
    """The old contract's per-expert ``[E, h]`` norm is an error naming the expected ``[h]``, not silently indexed."""
    mine = xeon.prepare_experts(*expert_weights("bf16"))
    with pytest.raises(ValueError, match=r"must be \[h=128\]"):
        xeon.moe(torch.randn(1, HIDDEN, dtype=torch.bfloat16), *routing(1), mine, torch.ones(E, HIDDEN), 1e-8)


@pytest.mark.parametrize("fmt", ["int4", "bf16"])
@pytest.mark.parametrize("tokens", [1, 5])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decode_moe_runs_as_one_native_call_and_matches_reference(xeon: XeonBackend, reference, fmt: str,
                                                                  tokens: int, dtype, monkeypatch) -> None:
    """INT4 experts through musecore_int4_moe, BF16 experts through musecore_bf16_moe (the same driver with the BF16
    GEMV's rows): fp32 math with the reference's roundings to z's dtype (expert output, scaled product, norm output)."""
    from musecore_xeon.kernels import native
    if not native.available():
        pytest.skip(f"native kernels unavailable: {native.UNAVAILABLE}")
    gate, up, down = expert_weights(fmt)
    mine = xeon.prepare_experts(gate, up, down)
    resident = mine.extra["xeon"]
    assert resident.native_kind == fmt
    assert resident.native_pointers is not None and resident.native_fits(tokens, torch.zeros(tokens, K_TOP, dtype=torch.int64))
    calls = []  # fused calls that ran: through the extension's one-call moe when it is built, else through ctypes
    if resident.native_call is not None:
        one_call = resident.native_call
        def counted(*args):
            y = one_call(*args)
            calls.append(int(y is not None))
            return y
        monkeypatch.setattr(resident, "native_call", counted)
        monkeypatch.setattr(native, f"{fmt}_moe", lambda *a, **k: pytest.fail("the ctypes call ran too"))
    else:
        fused = getattr(native, f"{fmt}_moe")
        monkeypatch.setattr(native, f"{fmt}_moe", lambda *a, **k: calls.append(1) or fused(*a, **k))
    z = torch.randn(tokens, HIDDEN, dtype=dtype)
    weights, ids = routing(tokens)
    ids[0] = ids[0, 0]  # one expert chosen twice by one token: two rows of the same expert in one call
    post_norm = post_norm_weight(dtype)
    expected = ref.moe(z, weights, ids, reference.prepare_experts(gate, up, down), post_norm, 1e-8)
    actual = xeon.moe(z, weights, ids, mine, post_norm, 1e-8)
    assert calls == [1], f"{fmt} decode MoE did not take the fused native call"
    # bf16: a last-bit difference of the expert output moves a rounding of the norm's input or output (2^-9 relative);
    # fp32: only the GEMVs' activation rounding (int16 per group for INT4, bf16 into the BF16 GEMV) differs
    tol = 1e-5 if dtype == torch.bfloat16 else (1e-8 if fmt == "int4" else 1e-5)
    assert_nmse(expected, actual, tol, f"fused native {fmt} moe T={tokens} z {dtype}")


@pytest.mark.parametrize("fmt", ["int4", "bf16"])
def test_native_moe_rejects_out_of_range_expert_ids(xeon: XeonBackend, fmt: str) -> None:
    from musecore_xeon.kernels import native
    if not native.available():
        pytest.skip(f"native kernels unavailable: {native.UNAVAILABLE}")
    mine = xeon.prepare_experts(*expert_weights(fmt))
    weights, ids = routing(1)
    ids[0, 0] = E
    with pytest.raises(ValueError, match=r"expert ids must lie in \[0, 8\)"):
        xeon.moe(torch.randn(1, HIDDEN, dtype=torch.bfloat16), weights, ids, mine, post_norm_weight(), 1e-8)
