"""The fused decode MoE through the extension's one-call ``moe`` (csrc/binding.cpp: checks, the fit test, the
allocation and the same C kernel, ``XeonExperts.native_call``) against the same kernel through ctypes
(``native.int4_moe`` / ``bf16_moe``): the same bits, since only the plumbing differs; and where the one call does
not apply it answers None and the Python path runs (and raises the same errors)."""

from __future__ import annotations

import pytest
import torch

import musecore_quant
from musecore_xeon import XeonBackend
from musecore_xeon.kernels import native

E, K_TOP = 8, 3
SHAPES = {"int4": (256, 512), "bf16": (130, 300)}  # (h, I): h = 130 gives the BF16 down projection a partial block


@pytest.fixture(scope="module")
def layers() -> dict:
    xeon = XeonBackend()
    gen = torch.Generator().manual_seed(3)
    out = {}
    for fmt, (h, inter) in SHAPES.items():
        gate, up = torch.randn(E, inter, h, generator=gen) * 0.1, torch.randn(E, inter, h, generator=gen) * 0.1
        down = torch.randn(E, h, inter, generator=gen) * 0.1
        if fmt == "int4":
            gate, up, down = (musecore_quant.quantize(w, "int4", group_size=128) for w in (gate, up, down))
        else:
            gate, up, down = (w.to(torch.bfloat16) for w in (gate, up, down))
        out[fmt] = xeon.prepare_experts(gate, up, down).extra["xeon"]
    if any(r.native_call is None for r in out.values()):
        pytest.skip(f"the extension's moe is not built here (native: {native.UNAVAILABLE})")
    return out


def inputs(fmt: str, tokens: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    h = SHAPES[fmt][0]
    z = torch.randn(tokens, h, generator=gen).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K_TOP] for _ in range(tokens)])
    if tokens > 1:
        ids[1] = ids[0]  # two tokens, the same experts
    ids[0, 1] = ids[0, 0]  # one token routed twice to one expert
    weights = torch.softmax(torch.randn(tokens, K_TOP, generator=gen), -1)
    post_norm = (1 + 0.5 * torch.randn(h, generator=gen)).to(dtype)
    return z, weights, ids, post_norm


def through_ctypes(resident, fmt: str, z, weights, ids, post_norm) -> torch.Tensor:
    if fmt == "bf16":
        return native.bf16_moe(resident.native_pointers, z, ids, weights, post_norm, 1e-6, resident.intermediate)
    gu, dn = resident.gate_up[0], resident.down[0]
    return native.int4_moe(resident.native_pointers, z, ids, weights, post_norm, 1e-6, resident.intermediate,
                           (gu.group_size, dn.group_size), (gu.padded_out_features, dn.padded_out_features))


@pytest.mark.parametrize("fmt", ["int4", "bf16"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens", [1, 5])
@pytest.mark.parametrize("threads", [1, 2])
def test_one_call_moe_gives_the_ctypes_calls_bits(layers, fmt: str, dtype, tokens: int, threads: int) -> None:
    resident = layers[fmt]
    z, weights, ids, post_norm = inputs(fmt, tokens, dtype)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        want = through_ctypes(resident, fmt, z, weights, ids, post_norm)
        got = resident.native_call(resident.native_args_address, z, weights, ids, post_norm, 1e-6, threads)
    finally:
        torch.set_num_threads(before)
    assert got is not None, f"{fmt} {dtype} T={tokens}: the one-call moe did not take decode inputs"
    assert got.dtype == torch.float32 and got.shape == want.shape
    diff = (got - want).abs().max().item()
    assert torch.equal(got, want), \
        f"{fmt} {dtype} T={tokens} {threads} threads: differs from the ctypes call by up to {diff:.3g}"


@pytest.mark.parametrize("fmt", ["int4", "bf16"])
def test_the_backend_moe_is_the_one_call_at_decode(layers, fmt: str, monkeypatch) -> None:
    from musecore_xeon.kernels.moe import moe_forward
    resident = layers[fmt]
    z, weights, ids, post_norm = inputs(fmt, 1, torch.bfloat16)
    want = through_ctypes(resident, fmt, z, weights, ids, post_norm)
    monkeypatch.setattr(native, f"{fmt}_moe", lambda *a, **k: pytest.fail("the ctypes call ran"))
    assert torch.equal(moe_forward(z, weights, ids, resident, post_norm, 1e-6), want)


@pytest.mark.parametrize("fmt", ["int4", "bf16"])
def test_inputs_the_one_call_does_not_take_fall_back_to_the_same_results(layers, fmt: str) -> None:
    from musecore_xeon.kernels.moe import moe_forward
    resident = layers[fmt]
    z, weights, ids, post_norm = inputs(fmt, 5, torch.bfloat16)
    want = through_ctypes(resident, fmt, z, weights, ids, post_norm)
    call = lambda *a: resident.native_call(resident.native_args_address, *a, 1e-6, 1)  # noqa: E731
    wide = torch.zeros(5, 2 * z.shape[1], dtype=z.dtype)
    wide[:, ::2] = z
    same_values = {"strided z": (wide[:, ::2], weights, ids, post_norm),
                   "int32 ids": (z, weights, ids.int(), post_norm)}
    other_values = {"fp16 post_norm": (z, weights, ids, post_norm.half()), "bf16 weights": (z, weights.bfloat16(), ids,
                                                                                         post_norm)}
    for what, (z_, weights_, ids_, post_norm_) in {**same_values, **other_values}.items():
        assert call(z_, weights_, ids_, post_norm_) is None, f"{what}: the one call took inputs it does not handle"
        got = moe_forward(z_, weights_, ids_, resident, post_norm_, 1e-6)  # the Python path converts, then the kernel
        if what in same_values:
            assert torch.equal(got, want), f"{what}: the fallback differs from the fused kernel"


@pytest.mark.parametrize("fmt", ["int4", "bf16"])
def test_errors_still_come_from_the_python_checks(layers, fmt: str) -> None:
    from musecore_xeon.kernels.moe import moe_forward
    resident = layers[fmt]
    z, weights, ids, post_norm = inputs(fmt, 1, torch.bfloat16)
    bad = ids.clone()
    bad[0, 2] = E
    assert resident.native_call(resident.native_args_address, z, weights, bad, post_norm, 1e-6, 1) is None
    with pytest.raises(ValueError, match=rf"expert ids must lie in \[0, {E}\)"):
        moe_forward(z, weights, bad, resident, post_norm, 1e-6)
    with pytest.raises(ValueError, match=r"moe: z has shape"):
        moe_forward(z[:, :-2].contiguous(), weights, ids, resident, post_norm, 1e-6)
    with pytest.raises(ValueError, match=r"post-expert norm weight must be \[h="):
        moe_forward(z, weights, ids, resident, torch.ones(E, z.shape[1], dtype=z.dtype), 1e-6)


@pytest.mark.parametrize("fmt", ["int4", "bf16"])
def test_the_fit_test_counts_rows_per_expert(layers, fmt: str, monkeypatch) -> None:
    """Above max_tokens tokens the one call still runs while every expert has at most max_tokens rows, and answers
    None (the per-expert path) once one expert has more: the rule of XeonExperts.native_fits."""
    resident = layers[fmt]
    monkeypatch.setattr(resident.native_args, "max_tokens", 2)
    z, weights, ids, post_norm = inputs(fmt, 4, torch.float32)
    spread = torch.tensor([[0, 1, 2], [3, 4, 5], [6, 7, 0], [1, 2, 3]])  # at most 2 rows per expert
    got = resident.native_call(resident.native_args_address, z, weights, spread, post_norm, 1e-6, 1)
    assert got is not None and torch.equal(got, through_ctypes(resident, fmt, z, weights, spread, post_norm))
    crowded = spread.clone()
    crowded[3, 0] = 0  # expert 0: 3 rows
    assert resident.native_call(resident.native_args_address, z, weights, crowded, post_norm, 1e-6, 1) is None
