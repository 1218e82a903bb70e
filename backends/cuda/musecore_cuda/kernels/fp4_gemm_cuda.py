"""Tiled W4A16 GEMM in CUDA C++ for bf16 activations from M = 16 (``backend.GEMM_MIN_M``) up.

``fp4_gemm_mma`` extends the tensor-core decode kernel of :mod:`fp4_gemv_cuda` (same resident FP4
bytes, same exact upcast into bf16x2 pairs feeding ``mma.m16n8k16`` as operand A) to many tokens:

* a block is ``warps`` warps over ``warps * 16 * tile`` weight rows and one tile of ``8 * groups``
  tokens; every upcast weight fragment feeds ``groups`` mmas (one per 8 tokens), so at 64 tokens the
  upcast costs ~2 integer instructions per 8 mmas and the kernel runs at tensor-core speed;
* the weights stream global -> registers as in the decode kernel (a ring of ``prefetch`` chunks per
  thread, L1 bypassed), while the activations stream global -> shared memory by ``cp.async`` in a
  ring of ``stages`` 128-element chunks (token rows padded by 16 bytes, so the 16-byte reads of a
  warp are bank-conflict free), overlapping the copy with the mmas of the chunk before. The decode
  kernel stages a block's whole K range of activations up front instead, which at M = 16 already
  cost as much time as its weights;
* the activations keep their own element order in shared memory; the pairs the FP4 layout needs
  (elements ``e, e + 2`` of a word's half, see ``decode_bf16x2``) are made at use by ``prmt``;
* the ``split`` blocks of a thread-block cluster divide K (any 1..8, so the grid can fill whole
  waves of the GPU: an unfilled last wave cost up to 40% in ncu); their partial sums meet through
  distributed shared memory, each block reducing and storing every ``split``-th accumulator, so the
  output is written once in its dtype (no atomics, no zeroed fp32 buffer, no conversion kernel).

Token tiles are the fastest grid dimension, so the blocks that share a weight tile run together
and all but the first read it from L2.
"""

from __future__ import annotations

import ctypes
import functools
import math
from dataclasses import dataclass
from typing import Optional

import torch

from musecore_cuda.kernels import fp4_gemv_cuda, pdl, sources
from musecore_triton.kernels.fp4_gemm import CHUNK_K, WFMT_NVFP4

SOURCE = sources.read("pdl.cuh", "fp4_gemv.cu", "fp4_gemm.cu")

SMEM_DEFAULT = 48 * 1024          # more needs the kernel's opt-in (set_shared_memory_config)
GEMM_ROW_BYTES = 128 * 2 + 16


@dataclass(frozen=True)
class GemmPlan:
    """How ``fp4_gemm_mma`` cuts an ``[m, k] x [n, k]^T`` product.

    A block is ``warps`` warps, each owning ``tile`` 16-row output tiles for one tile of
    ``8 * groups`` tokens; ``split`` blocks of a cluster divide K; ``prefetch`` weight chunks are in
    flight per thread and ``stages`` activation chunks per block.
    """

    groups: int          # 8-token mma groups per token tile (1..8)
    tile: int = 2        # 16-row tiles per warp
    warps: int = 4
    split: int = 1
    prefetch: int = 1    # (2 was slower in the sweep: more registers, fewer blocks per SM)
    stages: int = 3

    @property
    def tokens(self) -> int:
        return 8 * self.groups

    @property
    def rows_per_block(self) -> int:
        return self.warps * 16 * self.tile

    def grid(self, m: int, n: int) -> tuple[int, int, int]:
        return -(-m // self.tokens), self.split, -(-n // self.rows_per_block)

    @property
    def smem(self) -> int:
        ring = self.stages * self.tokens * GEMM_ROW_BYTES
        partials = self.warps * self.groups * self.tile * 4 * 32 * 4 if self.split > 1 else 0
        return max(ring, partials)


@functools.lru_cache(maxsize=None)
def make_plan(m: int, n: int, k: int, device: torch.device) -> GemmPlan:
    """The cut for ``m`` tokens against an ``[n, k]`` weight.

    Token tile: the next power of two of ``m`` / 8 groups, at most 8 (64 tokens; more would not fit
    the registers). Then the tile per warp (1 or 2) and the split (1..8, >= 4 chunks per block; no split below
    8 chunks of K) that
    minimise the modelled time ``waves * blocks_per_sm * (tile * chunks / split + 4 + reduction)``,
    with the blocks per SM the driver's occupancy for the compiled kernel and the cluster reduction
    ``groups * tile * split / 16`` when split: a partial last wave costs as much as a full one. The
    model was fitted to a sweep of cuts on the H200 (how close it comes: backends/cuda/lab/NOTES.md).
    """
    groups = min(8, 1 << max(0, math.ceil(math.log2(-(-m // 8)))))
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    chunks = k // CHUNK_K
    best = None
    for tile in (1, 2):
        base = GemmPlan(groups=groups, tile=tile)
        per_sm = blocks_per_sm(base)
        for split in range(1, fp4_gemv_cuda.MAX_CLUSTER + 1):
            if split > 1 and chunks // split < 4:  # (a K of fewer than 4 chunks is not split at all)
                break
            plan = GemmPlan(**{**base.__dict__, "split": split})
            tiles_m, _, blocks_n = plan.grid(m, n)
            waves = -(-tiles_m * split * blocks_n // (per_sm * sms))
            reduction = groups * tile * split / 16 if split > 1 else 0.0
            cost = waves * per_sm * (tile * chunks / split + 4 + reduction)
            if best is None or cost < best[0]:
                best = (cost, plan)
    return best[1]


def blocks_per_sm(plan: GemmPlan) -> int:
    """Resident blocks per SM of the plan's kernel (registers and shared memory), from the driver."""
    kern = _kernel(plan, WFMT_NVFP4)
    count = ctypes.c_int(0)
    lib = torch.cuda._utils._get_cuda_library()
    status = lib.cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(count), kern.func, plan.warps * 32,
                                                             ctypes.c_size_t(plan.smem))
    return count.value if status == 0 and count.value > 0 else 1


def kernel_name(plan: GemmPlan, wfmt: int) -> str:
    """The template instantiation of ``csrc/fp4_gemm.cu`` that runs ``plan`` (NVRTC's name expression)."""
    return f"fp4_gemm_mma<{plan.tile}, {plan.groups}, {plan.warps}, {plan.prefetch}, {plan.stages}, {wfmt}, {plan.split}>"


@functools.lru_cache(maxsize=None)
def _kernel(plan: GemmPlan, wfmt: int):
    kern = torch.cuda._compile_kernel(SOURCE, kernel_name(plan, wfmt))
    if plan.smem > SMEM_DEFAULT:
        if not hasattr(kern, "set_shared_memory_config"):
            raise ValueError(f"{plan} needs {plan.smem} bytes of shared memory; this torch cannot opt in")
        kern.set_shared_memory_config(plan.smem)
    return kern


def launch(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, out_scale: torch.Tensor, *, wfmt: int,
           fold_log2: int, n: int, k: int, out: torch.Tensor, plan: Optional[GemmPlan] = None) -> torch.Tensor:
    """``out = x @ W^T`` for bf16 ``x [M, K]`` against one resident FP4 weight (``packed [n, k/2]``)."""
    m = x.shape[0]
    if x.dtype != torch.bfloat16 or x.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError(f"the tiled CUDA GEMM takes row-major bf16 activations; got {x.dtype} strides {x.stride()}")
    plan = plan or make_plan(m, n, k, x.device)
    if k % CHUNK_K or k // CHUNK_K < plan.split:
        raise ValueError(f"K={k} is not a multiple of {CHUNK_K} with at least one chunk per split ({plan.split})")
    words = packed.view(torch.int32)
    pdl.launch(_kernel(plan, wfmt), grid=plan.grid(m, n), block=(plan.warps * 32, 1, 1), shared_mem=plan.smem,
               device=x.device, name="fp4_gemm_mma",
               args=[x, x.stride(0), words, scales, words.stride(-2), scales.stride(-2), out_scale, fold_log2, out,
                     out.stride(0), fp4_gemv_cuda._DTYPE_CODE[out.dtype], m, n, k])
    return out
