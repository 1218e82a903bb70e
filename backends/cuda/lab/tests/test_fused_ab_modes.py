"""``cuda_fused_ab.py``'s mode language (a named mode, ``rn_/rp_/qkv_RxW`` cuts, ``set:module.NAME=value``, modes
joined by ``+``) and its output check, on the CPU: the A/B itself needs a GPU."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import cuda_fused_ab as ab  # noqa: E402
from cuda_decode_host_probe import output_check  # noqa: E402

MODEL = types.SimpleNamespace(backend=None)


def named(mode: str) -> list[tuple[str, object]]:
    return [(name, value) for _, name, value in ab.patches(MODEL, mode)]


def test_cuts_set_and_joined_modes_patch_what_they_name():
    assert named("rn_8x8") == [("RESIDUAL_NORM_BLOCK_N", 8), ("RESIDUAL_NORM_WARPS", 8)]
    assert named("rp_4x2+qkv_16x16") == [("ROUTER_POOLER_BLOCK_N", 4), ("ROUTER_POOLER_WARPS", 2),
                                         ("QKV_BLOCK_N", 16), ("QKV_WARPS", 16)]
    assert named("set:musecore_triton.kernels.router.ONE_LAUNCH_BLOCK_K=64") == [("ONE_LAUNCH_BLOCK_K", 64)]
    early = dict(named("attn_late+experts_early"))["EARLY_DEFAULT"]
    assert "fp4_gemv_mma_experts" in early and "attention" not in early
    assert "fp4_gemv_mma_experts" not in dict(named("experts_late"))["EARLY_DEFAULT"]
    assert named("fused") == [] and named("rn_8") == [] and named("set:nothing") == []
    with pytest.raises(SystemExit, match="has no NOPE"):
        named("set:musecore_triton.kernels.router.NOPE=1")


def test_output_check_flags_other_tokens_and_logits():
    logits = torch.randn(1, 1, 50)
    first = {"tokens": [[1, 2, 3]], "logits": logits}
    same = output_check({"tokens": [[1, 2, 3]], "logits": logits.clone()}, first)
    assert same == {"tokens_equal_first": True, "logits_nmse_vs_first": 0.0, "first_token_diff": None,
                    "logits_rms": pytest.approx(float(logits.square().mean().sqrt())),
                    "logits_argmax": int(logits.flatten().argmax())}
    other = output_check({"tokens": [[1, 2, 4]], "logits": logits * 1.1}, first)
    assert not other["tokens_equal_first"] and other["logits_nmse_vs_first"] == pytest.approx(0.01, rel=1e-4)
    assert other["first_token_diff"] == 2
    zeros = output_check({"tokens": [[1, 2, 3]], "logits": torch.zeros_like(logits)}, {**first, "logits": logits * 0})
    assert zeros["logits_nmse_vs_first"] == 0.0 and zeros["logits_rms"] == 0.0  # all-zero logits show as such
    nan = output_check({"tokens": [[1, 2, 3]], "logits": logits * float("nan")}, first)
    assert nan["logits_nmse_vs_first"] != nan["logits_nmse_vs_first"]  # NaN stays NaN
