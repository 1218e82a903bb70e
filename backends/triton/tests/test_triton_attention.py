"""Attention against ``musecore.ops.reference.attention``: the position mask contract (empty slots,
causal, window, queries that see nothing), GQA, FP8 K/V, and split-S decode."""

from __future__ import annotations

import pytest
import torch

from musecore.ops import reference as ref
from musecore.ops import tolerance

from musecore_triton.testing import DEVICE, SMALL_DTYPES, assert_nmse

from musecore_triton.kernels import attention as attention_module
from musecore_triton.kernels.attention import attention


def case(B, T, S, nq, nkv, d, dtype, device=DEVICE):
    q = torch.randn(B, T, nq, d, device=device).to(dtype)
    k = torch.randn(B, S, nkv, d, device=device).to(dtype)
    v = torch.randn(B, S, nkv, d, device=device).to(dtype)
    return q, k, v


def prefill_positions(B, T, S, device=DEVICE):
    """Batch 0: keys 0..S-1 with the last 3 slots empty; batch 1: a ring buffer (rotated positions)."""
    k_pos = torch.arange(S, device=device).repeat(B, 1)
    k_pos[0, -3:] = -1
    k_pos[1] = torch.roll(k_pos[1], 5)
    q_pos = torch.arange(S - T, S, device=device).repeat(B, 1)
    q_pos[0, 0] = -1  # a padding query: sees nothing, must return zeros
    return q_pos, k_pos


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("dtype", SMALL_DTYPES)
def test_prefill_attention_follows_the_mask_contract(window, dtype):
    B, T, S, nq, nkv, d = 2, 9, 40, 4, 2, 32
    q, k, v = case(B, T, S, nq, nkv, d, dtype)
    q_pos, k_pos = prefill_positions(B, T, S)
    out = attention(q, k, v, q_pos, k_pos, window, d ** -0.5)
    expected = ref.attention(q, k, v, q_pos, k_pos, window, d ** -0.5)
    assert out.dtype == dtype
    assert torch.equal(out[0, 0].float(), torch.zeros_like(out[0, 0].float()))
    assert_nmse(expected, out, tolerance("attention"), f"prefill window={window}")


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("B,T", [(1, 1), (2, 3)])
@pytest.mark.parametrize("eager", [False, True])
def test_decode_attention_splits_long_contexts(monkeypatch, fp8, B, T, eager):
    """Keys split over programs and merged by the merge kernel; with two rows, the second a padding row (position
    -1: sees nothing, gives zeros) and three queries each (the merge's rows map to tokens and heads). ``eager``: one
    token's first step loads its k and v (fp8 too) with the positions, later steps' positions prefetched (session 53;
    several queries per row keep the lazy loads)."""
    monkeypatch.setattr(attention_module, "EAGER_FIRST_STEP", eager)
    monkeypatch.setattr(attention_module, "PREFETCH_POSITIONS", eager)
    S, nq, nkv, d = 600, 8, 2, 64  # S long enough for several splits
    q, k, v = case(B, T, S, nq, nkv, d, torch.float16)
    k_pos = torch.arange(S, device=DEVICE).repeat(B, 1)
    k_pos[:, 550:] = -1
    q_pos = torch.arange(550 - T, 550, device=DEVICE).repeat(B, 1)
    if B > 1:
        q_pos[1] = -1
    k_scale = v_scale = None
    if fp8:
        k_scale, v_scale = 0.05, 0.02
        k = (k.float() / k_scale).clamp(-448, 448).to(torch.float8_e4m3fn)
        v = (v.float() / v_scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    out = attention(q, k, v, q_pos, k_pos, 128, d ** -0.5, k_scale, v_scale)
    expected = ref.attention(q, k, v, q_pos, k_pos, 128, d ** -0.5, k_scale, v_scale)
    assert_nmse(expected, out, tolerance("attention"), f"decode fp8={fp8} B={B} T={T} eager={eager}")
    if B > 1:
        assert torch.equal(out[1].float(), torch.zeros_like(out[1].float())), "a padding row saw keys"


@pytest.mark.gpu
@pytest.mark.parametrize("T,S,window", [(1, 4096, None), (1, 32768, 2048), (512, 512, None), (300, 4096, 2048)])
@pytest.mark.parametrize("fp8", [False, True])
def test_attention_at_model_heads_on_gpu(T, S, window, fp8):
    B, nq, nkv, d = 2, 128, 16, 64  # the 816B preset's heads
    q, k, v = case(B, T, S, nq, nkv, d, torch.bfloat16, device="cuda")
    k_pos = torch.arange(S, device="cuda").repeat(B, 1)
    k_pos[1, S // 2:] = -1
    q_pos = torch.arange(S - T, S, device="cuda").repeat(B, 1)
    ks = vs = None
    if fp8:
        ks, vs = 0.01, 0.01
        k, v = ((t.float() / ks).clamp(-448, 448).to(torch.float8_e4m3fn) for t in (k, v))  # unclamped casts make NaN
    out = attention(q, k, v, q_pos, k_pos, window, d ** -0.5, ks, vs)
    expected = ref.attention(q, k, v, q_pos, k_pos, window, d ** -0.5, ks, vs)
    assert_nmse(expected, out, tolerance("attention"), f"T={T} S={S} window={window} fp8={fp8}")


@pytest.mark.parametrize("S,window", [(40, None), (600, 128)])  # one program per KV head; keys split (merge)
def test_attention_with_the_head_norm_gate_equals_the_two_ops(S, window):
    """``attention(gate=)``: the head norm and gate in the kernel's epilogue (or after the merge of split keys) give
    what head_norm_gate gives on the attention output; the gate logits may be a fused projection's slice."""
    B, T, nq, nkv, d = 1, 1, 8, 2, 64
    q, k, v = case(B, T, S, nq, nkv, d, torch.float16)
    gate = torch.randn(B, T, 2 * nq, d, device=DEVICE).half()[:, :, nq:]  # a slice: heads contiguous per token
    k_pos = torch.arange(S, device=DEVICE)[None]
    q_pos = torch.tensor([[S - 5]], device=DEVICE)
    want = ref.head_norm_gate(attention(q, k, v, q_pos, k_pos, window, d ** -0.5), gate, 1e-6)
    got = attention(q, k, v, q_pos, k_pos, window, d ** -0.5, gate=(gate, 1e-6))
    assert got.shape == want.shape and got.dtype == want.dtype
    assert_nmse(want, got, tolerance("head_norm_gate"), f"attention + head norm gate, S={S}")
    with pytest.raises(ValueError, match="gate logits must be"):
        attention(q, k, v, q_pos, k_pos, window, d ** -0.5, gate=(gate[..., :32], 1e-6))


@pytest.mark.parametrize("prefetch,eager", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("dtype", SMALL_DTYPES)
@pytest.mark.parametrize("block_n", [32, 64, 128, 256])
@pytest.mark.parametrize("S,window,layout", [(100, None, "static"), (300, 37, "static"), (600, None, "static"),
                                             (300, None, "half"), (300, 90, "ring")])
def test_decode_attention_keys_per_step(monkeypatch, block_n, S, window, layout, dtype, prefetch, eager):
    """One-token attention with ``DECODE_BLOCK_N`` keys per loop step (session 51: 128, was 64), with each step's key
    positions loaded during the step before or not (``PREFETCH_POSITIONS``, session 52), and the first step's k and v
    loaded with its positions or not (``EAGER_FIRST_STEP``, session 53): the reference's values for
    caches shorter than one step, several steps and split keys; a cache whose second half is empty (``half``: the
    later steps see no key, as a 256-slot generation cache's second block); a ring whose slots hold positions out of
    order (``ring``: a step's visible keys are found by the positions it loaded, not by slot)."""
    monkeypatch.setattr(attention_module, "DECODE_BLOCK_N", block_n)
    monkeypatch.setattr(attention_module, "PREFETCH_POSITIONS", prefetch)
    monkeypatch.setattr(attention_module, "EAGER_FIRST_STEP", eager)
    B, T, nq, nkv, d = 1, 1, 8, 2, 64
    q, k, v = case(B, T, S, nq, nkv, d, dtype)
    k_pos = torch.arange(S, device=DEVICE)[None].clone()
    if layout == "static":
        k_pos[0, S - 7:] = -1  # empty slots at the end of a static cache
        q_pos = torch.tensor([[S - 8]], device=DEVICE)
    elif layout == "half":
        k_pos[0, S // 2:] = -1
        q_pos = torch.tensor([[S // 2 - 1]], device=DEVICE)
    else:  # positions 1000 .. 1000 + S - 1 written round a ring of S slots, the newest at slot 123
        k_pos = (1000 + (torch.arange(S, device=DEVICE) - 124) % S)[None]
        q_pos = torch.tensor([[1000 + S - 1]], device=DEVICE)
    want = ref.attention(q, k, v, q_pos, k_pos, window, d ** -0.5)
    got = attention(q, k, v, q_pos, k_pos, window, d ** -0.5)
    assert_nmse(want, got, tolerance("attention"),
                f"decode attention, {block_n} keys per step, S={S}, {layout}, prefetch={prefetch}, eager={eager}")


@pytest.mark.parametrize("S", [0, 1, 100, 255, 256, 300, 600, 4096, 131072])
@pytest.mark.parametrize("programs", [1, 3, 16, 264])
def test_key_splits_do_not_depend_on_the_step(S, programs):
    """The split count comes from ``SPLIT_UNIT``-key units whatever the step (64 or 128 keys: the same splits for
    every S and grid here), each split covers whole steps, and together they cover every key."""
    for block_n in (64, 128):
        splits, per = attention_module.key_splits(S, programs, block_n, sms=132)
        assert per % block_n == 0 and splits * per >= S and (splits - 1) * per < max(S, 1), (S, programs, block_n)
    assert attention_module.key_splits(S, programs, 64, 132)[0] == attention_module.key_splits(S, programs, 128, 132)[0]
