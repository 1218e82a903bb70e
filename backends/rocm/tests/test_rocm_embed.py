"""The ROCm backend's decode embed (``RocmBackend.fuse_embed``: the shared
``musecore_triton.kernels.embed.model_decode_embed``, one launch for the decode step's embedding stage). Off a GPU
it declines and the ops run; on a GPU (``-m gpu``; on an NVIDIA machine this checks the shared code, not HIP) it
gives the ops' embed. Its kernel compiles for gfx950/gfx942 in ``test_rocm_compile.py``; it has never run on AMD."""

from __future__ import annotations

import pytest
import torch

from musecore.api import load_random
from musecore.model import separate_ops
from musecore_rocm import RocmBackend
from musecore_triton.kernels.embed import model_decode_embed
from musecore_triton.testing import HAS_GPU, check_decode_embed


def test_off_a_gpu_the_embed_is_not_fused_and_says_why():
    model = load_random("muse-tiny", "cpu", allow_reference=True)
    assert RocmBackend("cpu").fuse_embed(model) is None
    embed, why = model_decode_embed(model)
    assert embed is None and "GPU" in why, why


@pytest.mark.gpu
def test_on_a_gpu_the_backend_gives_the_ops_embed():
    if not HAS_GPU:
        pytest.skip("needs a GPU")
    model = load_random("muse-tiny", "auto", seed=0)  # weights on the GPU (any backend); the embed through this one
    embed = RocmBackend("cuda").fuse_embed(model)
    assert embed is not None
    cache = model.new_cache(2, 32, static=True)
    ids, positions = torch.tensor([[5], [9]], device="cuda"), torch.tensor([[4], [-1]], device="cuda")
    start = torch.tensor([3, 0], device="cuda")
    with torch.inference_mode():
        cache.next_position.copy_(start)
        got = embed(ids, positions, cache)
        got_next = cache.next_position.clone()
        cache.next_position.copy_(start)
        with separate_ops(model):
            want = model.embed(ids, positions, cache)
    check_decode_embed(got, want, got_next, cache.next_position)
