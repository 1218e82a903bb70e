"""The fused MoE block of the CUDA backend (``musecore_cuda.fused``: six launches instead of nine at one-token decode)
against the block's separate ops on the GPU, the inputs it is not bound for, and its switch."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from musecore.api import load_random
from musecore.model import MoE
from musecore.testing import nmse
from musecore_triton.kernels import router
from musecore_triton.testing import HAS_GPU

from musecore_cuda.fused import FUSED_ENV, fuse_block

TOLERANCE = 1e-5  # NMSE: the router's fp32 sums and the norm's are grouped differently (musecore_cuda.fused)


@pytest.fixture(scope="module", params=["bf16", "nvfp4"])
def model(request):
    if not HAS_GPU:
        pytest.skip("needs a GPU")
    return load_random("muse-tiny", "h200", checkpoint_format=request.param, seed=0)


def moe_blocks(model) -> list[MoE]:
    found = [layer.mlp for layer in model.layers if isinstance(layer.mlp, MoE)]
    assert found and all(b.fused is not None for b in found), \
        f"load_random fused {sum(b.fused is not None for b in found)} of {len(found)} MoE blocks; expected all"
    return found


def separate(block: MoE, m: torch.Tensor) -> torch.Tensor:
    fused, block.fused = block.fused, None
    try:
        return block(m)
    finally:
        block.fused = fused


def kernels(fn) -> int:
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type.name == "CUDA" and not e.name.startswith("Memcpy"))


@pytest.mark.gpu
def test_the_fused_moe_block_matches_the_separate_ops_in_three_fewer_launches(model):
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.inference_mode():
        for block in moe_blocks(model):
            m = torch.randn(1, 1, model.config.hidden_size, device="cuda", generator=gen).to(torch.bfloat16)
            x = m.reshape(1, -1)
            counter = torch.zeros(1, dtype=torch.int32, device="cuda")
            _, ids = router.router_topk_one_launch(x, block.router, block.correction_bias, block.top_k,
                                                   block.multiplier, block.scaling, counter)
            _, want_ids = model.ops.router_topk(x, block.router, block.correction_bias, block.top_k,
                                                block.multiplier, block.scaling)
            assert torch.equal(ids, want_ids), f"layer {block.layer}: ids {ids.tolist()} vs the op's {want_ids.tolist()}"
            for repeat in range(3):  # the counters come back to zero: every launch takes the last-program step
                got, want = block.fused(m), separate(block, m)
                assert got is not None and got.shape == want.shape and got.dtype == want.dtype
                err = nmse(want.float(), got.float())
                assert err <= TOLERANCE, f"layer {block.layer}, call {repeat}: NMSE {err:.3g} > {TOLERANCE:g}"
            assert not block.fused.counters.any(), f"layer {block.layer}: counters {block.fused.counters.tolist()}"
            fused_n, separate_n = kernels(lambda: block.fused(m)), kernels(lambda: separate(block, m))
            assert fused_n == separate_n - 3, f"layer {block.layer}: {fused_n} launches fused, {separate_n} separate"


@pytest.mark.gpu
def test_inputs_it_is_not_bound_for_run_the_separate_ops(model):
    block = moe_blocks(model)[0]
    H = model.config.hidden_size
    with torch.inference_mode():
        assert block.fused(torch.randn(1, 2, H, device="cuda").to(torch.bfloat16)) is None  # two tokens
        assert block.fused(torch.randn(1, 1, H, device="cuda")) is None  # fp32
        saved = block.pre_expert_norm
        block.pre_expert_norm = saved.clone()  # a replaced weight: the fused form steps aside
        try:
            assert block.fused(torch.randn(1, 1, H, device="cuda").to(torch.bfloat16)) is None
        finally:
            block.pre_expert_norm = saved


@pytest.mark.gpu
def test_the_switch_turns_fusion_off(model, monkeypatch):
    monkeypatch.setenv(FUSED_ENV, "0")
    assert fuse_block(model.backend, moe_blocks(model)[0]) is None
