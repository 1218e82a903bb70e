"""W4A16 GEMM on Hopper's warpgroup tensor-core instruction (``wgmma``, sm_90a) for bf16 activations.

**Status: correct, measured, and not selected by** ``fp4_linear``: on the H200 it runs 0.35-0.62x
BF16 cuBLAS at M = 64-256, about the mma.sync GEMM and below dequantize + cuBLAS at M = 256
(``lab/scripts/cuda_wgmma_sweep.py``, ``lab/results/cuda_wgmma_sweep*.json``; what was tried
and what the leave-one-stage-out timings showed: ``lab/NOTES.md``, session 6). It stays as
the base of the next step (a warp-specialized version, NOTES.md) with its GPU tests.

This is the design the session-4 notes called for (Machete's, on our resident FP4 bytes): the legacy
``mma.sync`` of :mod:`fp4_gemm_cuda` runs below the tensor cores' ``wgmma`` rate on Hopper, which
capped that kernel near 0.5-0.7x BF16 cuBLAS at M = 64 and kept M >= 128 on dequantize + cuBLAS.

* **Weights: operand A, from registers.** A warpgroup (4 warps) owns 64 weight rows; warp ``w``
  owns rows ``16w .. 16w + 15``, whose A fragment for ``wgmma.m64nNk16`` has the layout of
  ``mma.m16n8k16``'s. So the weights stream global -> registers and are upcast exactly as in the
  decode kernel (``stage_load``, ``half_mults``, ``decode_bf16x2`` of :mod:`fp4_gemv_cuda`: one
  word gives two k16 steps' fragments), never through shared memory. The upcast fragments are
  double-buffered: the next pair of steps is decoded while the tensor cores run the previous one.
  A block holds ``groups`` warpgroups (64 rows each) that share every staged activation chunk.
* **Activations: operand B, from shared memory.** ``wgmma`` reads B through a matrix descriptor in
  the canonical K-major layout (8 tokens x 16 bytes per core matrix, no swizzle), so the hardware
  cannot pair elements the way the FP4 bytes do (``decode_bf16x2`` pairs elements ``e, e + 2`` of a
  word's half). The activations are therefore permuted once per call (:func:`slot_order`, one
  gather kernel ``wgmma_slot_order`` over M x K x 2 bytes) into the order of the A fragments' k
  slots, and then each 128-element chunk streams into a ring of ``stages`` shared-memory slots by
  16-byte ``cp.async`` (made visible to the tensor cores by ``fence.proxy.async``).
* ``split`` blocks of a thread-block cluster divide K and meet through distributed shared memory,
  as in :mod:`fp4_gemm_cuda` (output written once, in its dtype).

Numerics are those of every FP4 kernel here: exact products of the bf16 weight (code times group
scale, exact) and the bf16 activation, fp32 sums, the per-tensor scale on the sums.
"""

from __future__ import annotations

import functools
from pathlib import Path
from dataclasses import dataclass
from typing import Optional

import torch

from musecore_cuda.kernels import fp4_gemm_cuda, fp4_gemv_cuda
from musecore_triton.kernels.fp4_gemm import CHUNK_K

TOKEN_TILES = (16, 32, 64, 128)   # wgmma N per block (accumulators: N / 2 fp32 registers per thread)
ARCH = "90a"                      # wgmma exists on sm_90a only
SMEM_LIMIT = 227 * 1024           # shared memory a block may opt into on Hopper


# The tiled GEMM's source (the decode kernel's upcast and loads, its cp.async helpers), then this kernel
# (csrc/fp4_gemm_wgmma.cu, with the wgmma.m64nNk16 wrappers of every TOKEN_TILES width written out).
SOURCE = fp4_gemm_cuda.SOURCE + (Path(__file__).parent / "csrc" / "fp4_gemm_wgmma.cu").read_text(encoding="utf-8")


def slot_order(k: int) -> torch.Tensor:
    """For each activation slot of the kernel's B operand, the element of K it holds (a permutation).

    Within each 128-element chunk, step ``2 * (2 qp + j) + mm`` (16 slots) feeds the A fragment made
    from word ``q = 4t + 2qp + j`` of thread ``t``: slot ``s`` (``t = s % 8 // 2``) holds element
    ``(s < 8) * 64 + 4q + (1 - mm) + 2 * (s % 2)``, the partner ``decode_bf16x2`` pairs it with.
    """
    if k % CHUNK_K:
        raise ValueError(f"K={k} is not a multiple of {CHUNK_K}")
    order = []
    for qp in range(2):
        for j in range(2):
            for mm in range(2):
                for s in range(16):
                    t, odd, upper = (s % 8) // 2, s % 2, s // 8
                    q = 4 * t + 2 * qp + j
                    order.append((0 if upper else 64) + 4 * q + (1 - mm) + 2 * odd)
    chunk = torch.tensor(order, dtype=torch.long)
    return (torch.arange(k // CHUNK_K).repeat_interleave(CHUNK_K) * CHUNK_K).view(-1, CHUNK_K).add(chunk).view(-1)


def available(device: torch.device) -> bool:
    """wgmma needs an sm_90 device (and NVRTC, as every CUDA C++ kernel here)."""
    return torch.cuda.get_device_capability(device) == (9, 0) and fp4_gemv_cuda.available(device)


def _require(device: torch.device) -> None:
    if not available(device):
        why = "; ".join(fp4_gemv_cuda.UNAVAILABLE) or f"compute capability {torch.cuda.get_device_capability(device)}"
        raise ValueError(f"the wgmma GEMM runs on SM90 (Hopper) GPUs with NVRTC; {device} "
                         f"({torch.cuda.get_device_name(device)}) cannot: {why}")


def to_slot_order(x: torch.Tensor) -> torch.Tensor:
    """``x[:, slot_order(K)]`` for bf16 ``x [M, K]`` on the GPU (one gather kernel)."""
    _require(x.device)
    m, k = x.shape
    if x.dtype != torch.bfloat16 or x.stride(-1) != 1 or k % CHUNK_K:
        raise ValueError(f"slot order takes row-major bf16 [M, K] with K a multiple of {CHUNK_K}; "
                         f"got {x.dtype} {tuple(x.shape)} strides {x.stride()}")
    out = torch.empty(m, k, device=x.device, dtype=x.dtype)
    _order_kernel()(grid=(-(-m * k // 8 // 256), 1, 1), block=(256, 1, 1), args=[x, x.stride(0), out, m, k])
    return out


@functools.lru_cache(maxsize=None)
def _order_kernel():
    return torch.cuda._compile_kernel(SOURCE, "wgmma_slot_order", compute_capability=ARCH)


@dataclass(frozen=True)
class WgmmaPlan:
    """How ``fp4_gemm_wgmma`` cuts an ``[m, k] x [n, k]^T`` product: ``tokens`` per block (wgmma N),
    ``split`` blocks of a cluster over K, ``prefetch`` weight chunks in flight per thread, ``stages``
    activation chunks in the shared-memory ring."""

    tokens: int
    split: int = 1
    prefetch: int = 2
    stages: int = 4
    groups: int = 1      # warpgroups per block (64 rows each), sharing each staged activation chunk
    leave_out: int = 0   # timing experiments only (wrong results): 1 without the wgmmas, 2 without weight loads

    def __post_init__(self) -> None:
        if (self.tokens not in TOKEN_TILES or not 1 <= self.split <= fp4_gemv_cuda.MAX_CLUSTER or self.stages < 3
                or self.groups not in (1, 2, 4) or self.prefetch < 1 or self.leave_out not in (0, 1, 2)
                or self.smem > SMEM_LIMIT):
            raise ValueError(f"{self} cannot be built: tokens in {TOKEN_TILES}, split 1..{fp4_gemv_cuda.MAX_CLUSTER}, "
                             f"stages >= 3, groups 1, 2 or 4, prefetch >= 1, at most {SMEM_LIMIT} bytes of shared "
                             f"memory (this cut needs {self.smem})")

    def grid(self, m: int, n: int) -> tuple[int, int, int]:
        return -(-m // self.tokens), self.split, -(-n // (64 * self.groups))

    @property
    def smem(self) -> int:
        ring = self.stages * self.tokens * CHUNK_K * 2
        partials = self.tokens // 2 * 128 * self.groups * 4 if self.split > 1 else 0
        return max(ring, partials)


# The canonical no-swizzle K-major layout: core matrices of a k16 step 2 * (tokens / 8) * 128 bytes
# apart along K (leading), consecutive 8-token core matrices 128 bytes apart (stride).
def descriptor_offsets(tokens: int) -> tuple[int, int]:
    return tokens // 8 * 128, 128


@functools.lru_cache(maxsize=None)
def make_plan(m: int, n: int, k: int, device: torch.device) -> WgmmaPlan:
    """The best cuts of ``lab/scripts/cuda_wgmma_sweep.py`` on the H200 (q_proj, expert_down, k_proj at
    M = 64-256; ``cuda_wgmma_sweep.json``), as a rule: the smallest token tile of :data:`TOKEN_TILES`
    holding ``m`` (the largest above it); 4 warpgroups per block (2 below 4096 rows, where 4 left too
    few blocks); a cluster split of 8 for one token tile, 4 for more (each block keeping >= 4 chunks).
    Deeper rings (up to 8 / 7 stages) and 1-3 chunks of weights in flight changed nothing there."""
    tokens = next((t for t in TOKEN_TILES if t >= m), TOKEN_TILES[-1])
    split = 8 if m <= tokens else 4
    while split > 1 and k // CHUNK_K // split < 4:
        split //= 2
    return WgmmaPlan(tokens=tokens, split=split, stages=4 if tokens <= 64 else 3, groups=4 if n >= 4096 else 2)


@functools.lru_cache(maxsize=None)
def _kernel(plan: WgmmaPlan, wfmt: int):
    name = (f"fp4_gemm_wgmma<{plan.tokens}, {plan.prefetch}, {plan.stages}, {wfmt}, {plan.split}, "
            f"{plan.groups}, {plan.leave_out}>")
    kern = torch.cuda._compile_kernel(SOURCE, name, compute_capability=ARCH)
    if plan.smem >= 48 * 1024:
        if not hasattr(kern, "set_shared_memory_config"):
            raise ValueError(f"{plan} needs {plan.smem} bytes of shared memory; this torch cannot opt in")
        kern.set_shared_memory_config(plan.smem)
    return kern


def launch(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, out_scale: torch.Tensor, *, wfmt: int,
           fold_log2: int, n: int, k: int, out: torch.Tensor, plan: Optional[WgmmaPlan] = None,
           offsets: Optional[tuple[int, int]] = None, ordered: bool = False) -> torch.Tensor:
    """``out = x @ W^T`` for bf16 ``x [M, K]`` against one resident FP4 weight (``packed [n, k/2]``).

    ``offsets`` overrides the descriptor's (leading, stride) byte offsets; tests use it to show
    that the layout matters (a wrong one gives a wrong product). ``ordered``: ``x`` is already in
    slot order (benchmarks time the GEMM alone so)."""
    m = x.shape[0]
    _require(x.device)
    if x.dtype != torch.bfloat16 or out.stride(-1) != 1:
        raise ValueError(f"the wgmma GEMM takes bf16 activations and a row-major output; got {x.dtype}")
    plan = plan or make_plan(m, n, k, x.device)
    if k % CHUNK_K or k // CHUNK_K < plan.split:
        raise ValueError(f"K={k} is not a multiple of {CHUNK_K} with at least one chunk per split ({plan.split})")
    xs = x if ordered else to_slot_order(x)
    lead, stride = offsets or descriptor_offsets(plan.tokens)
    words = packed.view(torch.int32)
    _kernel(plan, wfmt)(grid=plan.grid(m, n), block=(128 * plan.groups, 1, 1), shared_mem=plan.smem,
                        args=[xs, xs.stride(0), words, scales, words.stride(-2), scales.stride(-2), out_scale,
                              fold_log2, out, out.stride(0), fp4_gemv_cuda._DTYPE_CODE[out.dtype], m, n, k,
                              lead, stride])
    return out
