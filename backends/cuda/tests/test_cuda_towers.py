"""The towers' ops on the CUDA backend: claimed with what runs them (the shared kernels of
``musecore_triton.towers``), native on SM90, emulated on unverified SM100 and in the interpreter, declined
beyond the kernel's head dim; muse-tiny's towers through them equal the reference ops. Their numerics are the conformance suite's (``test_cuda_conformance.py``:
tiny shapes in the interpreter, tiny/small/816b on the GPU) and ``backends/triton/tests/test_triton_towers.py``."""

from __future__ import annotations

import pytest
import torch

from musecore.ops import TOWER_OPS, OpSpec
from musecore.testing import assert_nmse, nmse
from musecore_cuda import CudaBackend
from musecore_triton.towers import TOWER_REASONS


def spec(op: str, **shape: int) -> OpSpec:
    return OpSpec(op, dtype=torch.bfloat16, shape=tuple(shape.items()), device="h200")


@pytest.mark.parametrize("op", TOWER_OPS)
def test_tower_ops_are_native_on_sm90_with_what_runs_them(op):
    answer = CudaBackend()._supports_on(9, op, spec(op, heads=16, head_dim=96))  # the 816B vision tower
    assert answer.ok and answer.tier.value == "native" and answer.reason == TOWER_REASONS[op], answer
    assert callable(getattr(CudaBackend(), op))


def test_tower_ops_are_emulated_on_unverified_sm100_and_bounded_by_the_kernels_head_dim():
    assert CudaBackend()._supports_on(10, "varlen_attention", spec("varlen_attention", head_dim=96)).tier.value \
        == "emulated"
    wide = CudaBackend()._supports_on(9, "varlen_attention", spec("varlen_attention", head_dim=512))
    assert not wide.ok and "head dims up to 256" in wide.reason, wide
    odd = CudaBackend()._supports_on(9, "rope", spec("rope", head_dim=15))
    assert not odd.ok and "even" in odd.reason, odd


def media(grid_rows):
    gen = torch.Generator().manual_seed(0)
    grid = torch.tensor(grid_rows)
    pixels = torch.randn(int(grid.prod(-1).sum()), 1176, generator=gen)
    audio = 0.3 * torch.randn(2, 1920 * 3, generator=gen)
    mask = torch.ones_like(audio, dtype=torch.bool)
    mask[1, 1920 + 17:] = False
    return pixels, grid, audio, mask


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter run; on a GPU the gpu test below runs instead")
def test_muse_tiny_towers_through_the_shared_kernels_in_the_interpreter():
    """muse-tiny's (random) towers in fp16 (the interpreter has no bf16) with their ops swapped for the shared
    Triton ones encode an image, a 2-frame video and masked audio as the reference ops do (measured NMSE ~6e-8
    and 0)."""
    import musecore
    from musecore_triton.ops import TritonOps

    model = musecore.load("muse-tiny", device="cpu", dtype=torch.float16)
    pixels, grid, audio, mask = media([[1, 6, 10], [2, 4, 4]])
    want = torch.cat(model.encode_images(pixels, grid)), torch.cat(model.encode_audio(audio, mask))
    for op in TOWER_OPS:
        setattr(model.ops, op, getattr(TritonOps, op))
    got = torch.cat(model.encode_images(pixels, grid)), torch.cat(model.encode_audio(audio, mask))
    for what, w, g in zip(("images", "audio"), want, got):
        assert_nmse(w.float(), g.float(), 1e-4, f"muse-tiny {what} through musecore_triton's tower ops")


@pytest.mark.gpu
def test_muse_tiny_towers_on_the_gpu_are_as_close_to_fp32_as_the_references_bf16():
    """On the GPU (plan device cuda, bf16), muse-tiny's towers against the reference backend in fp32: the error
    may be at most twice the reference's own bf16 error plus 1e-5 (both round to bf16 at the same points, in
    different arithmetic)."""
    import musecore

    pixels, grid, audio, mask = media([[1, 6, 10], [2, 4, 4], [1, 40, 36]])  # the last: several 32x32 windows
    gpu = musecore.load("muse-tiny", device="cuda")
    assert {gpu.ops.sources[op] for op in TOWER_OPS} == {f"cuda.{op}" for op in TOWER_OPS}
    exact = musecore.load("muse-tiny", device="cpu", dtype=torch.float32)
    bf16 = musecore.load("muse-tiny", device="cpu", dtype=torch.bfloat16)
    for what, encode in (("images", lambda m: m.encode_images(pixels, grid)),
                         ("audio", lambda m: m.encode_audio(audio, mask))):
        truth = torch.cat(encode(exact)).float()
        own = nmse(truth, torch.cat(encode(bf16)).float())
        assert_nmse(truth, torch.cat(encode(gpu)).float().cpu(), 2 * own + 1e-5,
                    f"muse-tiny {what} on the GPU vs fp32 (reference bf16: {own:.3e})")
