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

from musecore_cuda.kernels import fp4_gemv_cuda, pdl
from musecore_cuda.kernels.fp4_gemm import CHUNK_K, WFMT_NVFP4

SOURCE = fp4_gemv_cuda.SOURCE + r"""
// ---------------------------------------------------------------------------------------------
// Tiled GEMM (M > 16): see the module docstring of fp4_gemm_cuda.py.

constexpr int GEMM_ROW_BYTES = 128 * 2 + 16;  // one token's 128 activations of a chunk, padded

__device__ __forceinline__ void cp_async16(u32 dst, const void *src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

// y[m, n] = x[m, :] @ W[n, :]^T * out_scale, bf16 activations. Grid (token tiles, SPLIT, row blocks),
// block WARPS * 32; warp w owns rows n0 .. n0 + 16 * RT of its block and all 8 * NG tokens of the tile.
template <int RT, int NG, int WARPS, int PF, int STAGES, int WFMT, int SPLIT>
__global__ void __cluster_dims__(1, SPLIT, 1) __launch_bounds__(WARPS * 32) fp4_gemm_mma(
        const u16 *__restrict__ x, int x_stride, const u32 *__restrict__ w, const u8 *__restrict__ s, int w_n,
        int s_n, const float *__restrict__ out_scale, int fold, void *__restrict__ y, int y_stride, int ot,
        int m_rows, int N, int K) {
    constexpr int TOK = 8 * NG, STAGE_BYTES = TOK * GEMM_ROW_BYTES, SLOTS = PF + 1, PER = NG * RT * 4;
    extern __shared__ __align__(16) unsigned char gsm[];  // activation ring; after the loop, the partial sums
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int m0 = blockIdx.x * TOK, n0 = (blockIdx.z * WARPS + warp) * 16 * RT;
    const int c_begin = blockIdx.y * (K / 128) / SPLIT, chunks = (blockIdx.y + 1) * (K / 128) / SPLIT - c_begin;
    const int tokens = min(TOK, m_rows - m0);
    const bool rows_valid = n0 < N;

    const u32 *wrow[RT][2];
    const u8 *srow[RT][2];
#pragma unroll
    for (int i = 0; i < RT; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int n = min(n0 + i * 16 + h * 8 + g, N - 1);  // rows past N: a copy of the last, never stored
            wrow[i][h] = w + (long long)n * w_n;
            srow[i][h] = s + (long long)n * s_n;
        }
    Stage<RT> st[SLOTS];  // chunk c_begin + x lives in slot x % SLOTS
    if (rows_valid) {
#pragma unroll
        for (int p = 0; p < PF; ++p) stage_load<RT, WFMT>(wrow, srow, c_begin + min(p, chunks - 1), t, st[p]);
    }
    pdl_wait();  // the activations are the previous kernel's output (the weights above are not)
    const u32 ring = (u32)__cvta_generic_to_shared(gsm);
    // Token rows past M (a partial last tile) are zero in every slot and never copied, so the mma
    // loop has no branch on the token count (straight-line code that ptxas can schedule freely).
    for (int i = tokens * 16 + threadIdx.x; i < TOK * 16; i += WARPS * 32)
#pragma unroll
        for (int slot = 0; slot < STAGES; ++slot)
            *reinterpret_cast<uint4 *>(gsm + slot * STAGE_BYTES + (i >> 4) * GEMM_ROW_BYTES + (i & 15) * 16) =
                make_uint4(0u, 0u, 0u, 0u);
    auto stage_x = [&](int ci) {  // activations of chunk c_begin + ci -> slot ci % STAGES
        const u32 base = ring + (ci % STAGES) * STAGE_BYTES;
        for (int i = threadIdx.x; i < tokens * 16; i += WARPS * 32)
            cp_async16(base + (i >> 4) * GEMM_ROW_BYTES + (i & 15) * 16,
                       x + (long long)(m0 + (i >> 4)) * x_stride + (long long)(c_begin + ci) * 128 + (i & 15) * 8);
    };
#pragma unroll
    for (int p = 0; p < STAGES - 1; ++p) {
        if (p < chunks) stage_x(p);
        cp_async_commit();
    }

    float acc[NG][RT][4];
#pragma unroll
    for (int ng = 0; ng < NG; ++ng)
#pragma unroll
        for (int i = 0; i < RT; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j) acc[ng][i][j] = 0.f;

    for (int c0 = 0; c0 < chunks; c0 += SLOTS) {
#pragma unroll
        for (int p = 0; p < SLOTS; ++p) {  // unrolled: static register slots
            const int ci = c0 + p;
            if (ci >= chunks) break;
            cp_async_wait<STAGES - 2>();
            __syncthreads();  // chunk ci visible to all; the slot of chunk ci - 1 is free
            if (ci + STAGES - 1 < chunks) stage_x(ci + STAGES - 1);
            cp_async_commit();
            if (!rows_valid) continue;
            if (ci + PF < chunks) stage_load<RT, WFMT>(wrow, srow, c_begin + ci + PF, t, st[(p + PF) % SLOTS]);
            const unsigned char *xs = gsm + (ci % STAGES) * STAGE_BYTES + g * GEMM_ROW_BYTES + 32 * t;
            u32 ml[RT][2], mh[RT][2];
#pragma unroll
            for (int i = 0; i < RT; ++i)
#pragma unroll
                for (int h = 0; h < 2; ++h) half_mults<WFMT>(st[p].s[i][h], t, fold, ml[i][h], mh[i][h]);
#pragma unroll
            for (int qp = 0; qp < 2; ++qp) {  // words 4t + 2qp and 4t + 2qp + 1 of the chunk
                u32 a[RT][2][2][4];  // [tile][word][row g / g + 8][pair]
#pragma unroll
                for (int i = 0; i < RT; ++i)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const uint4 &v = st[p].w[i][h];
                        decode_bf16x2(qp ? v.z : v.x, ml[i][h], mh[i][h], a[i][0][h]);
                        decode_bf16x2(qp ? v.w : v.y, ml[i][h], mh[i][h], a[i][1][h]);
                    }
#pragma unroll
                for (int ng = 0; ng < NG; ++ng) {
                    // x[4q .. 4q + 3] and x[64 + 4q ..] of both words: 16 bytes each
                    const uint4 lo = *reinterpret_cast<const uint4 *>(xs + ng * 8 * GEMM_ROW_BYTES + 16 * qp);
                    const uint4 hi = *reinterpret_cast<const uint4 *>(xs + ng * 8 * GEMM_ROW_BYTES + 128 + 16 * qp);
#pragma unroll
                    for (int j = 0; j < 2; ++j) {
                        const u32 l0 = j ? lo.z : lo.x, l1 = j ? lo.w : lo.y, h0 = j ? hi.z : hi.x,
                                  h1 = j ? hi.w : hi.y;
                        // B pairs in decode_bf16x2's order: (3,7) (2,6) | (1,5) (0,4)
                        const u32 b0 = prmt(h0, h1, 0x7632u), b1 = prmt(l0, l1, 0x7632u);
                        const u32 b2 = prmt(h0, h1, 0x5410u), b3 = prmt(l0, l1, 0x5410u);
#pragma unroll
                        for (int i = 0; i < RT; ++i) {
                            mma16816(acc[ng][i], a[i][j][0][0], a[i][j][1][0], a[i][j][0][1], a[i][j][1][1], b0, b1);
                            mma16816(acc[ng][i], a[i][j][0][2], a[i][j][1][2], a[i][j][0][3], a[i][j][1][3], b2, b3);
                        }
                    }
                }
            }
        }
    }

    float *flat = &acc[0][0][0];
    const int rank = SPLIT > 1 ? (int)blockIdx.y : 0;
    if (SPLIT > 1) {  // partial sums meet through distributed shared memory
        cp_async_wait<0>();
        __syncthreads();  // every warp is done with the ring: reuse it
        float *red = reinterpret_cast<float *>(gsm);
#pragma unroll
        for (int i = 0; i < PER; ++i) red[(warp * PER + i) * 32 + lane] = flat[i];
        cluster_sync();
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            if (i % SPLIT != rank) continue;
            float v = 0.f;
#pragma unroll
            for (int r = 0; r < SPLIT; ++r) v += cluster_load(red + (warp * PER + i) * 32 + lane, (u32)r);
            flat[i] = v;
        }
        cluster_sync();  // the other blocks' shared memory stays alive until all have read it
    }
    if (!rows_valid) return;
    const float os = out_scale[0];
    // acc[ng][i][j]: row n0 + 16i + g (+8 for j >= 2), token m0 + 8ng + 2t + (j & 1)
#pragma unroll
    for (int ng = 0; ng < NG; ++ng)
#pragma unroll
        for (int i = 0; i < RT; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                if (((ng * RT + i) * 4 + j) % SPLIT != rank) continue;
                const int row = n0 + i * 16 + g + (j >= 2 ? 8 : 0), token = ng * 8 + 2 * t + (j & 1);
                if (row >= N || token >= tokens) continue;
                store_out(y, (m0 + token) * (long long)y_stride + row, acc[ng][i][j] * os, ot);
            }
}
"""

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
    the registers). Then the tile per warp (1 or 2) and the split (1..8, >= 4 chunks per block) that
    minimise the modelled time ``waves * blocks_per_sm * (tile * chunks / split + 4 + reduction)``,
    with the blocks per SM the driver's occupancy for the compiled kernel and the cluster reduction
    ``groups * tile * split / 16`` when split: a partial last wave costs as much as a full one. The
    model was fitted to ``benchmarks/cuda_gemm_sweep.py`` on the H200; in the committed sweep
    (``cuda_gemm_sweep.json``, 20 shape x M points) its choice is 13% slower than the best cut on
    average (geometric mean), within 5% on 6 points, 1.49x at worst (expert_up, M=64).
    """
    groups = min(8, 1 << max(0, math.ceil(math.log2(-(-m // 8)))))
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    chunks = k // CHUNK_K
    best = None
    for tile in (1, 2):
        base = GemmPlan(groups=groups, tile=tile)
        per_sm = blocks_per_sm(base)
        for split in range(1, fp4_gemv_cuda.MAX_CLUSTER + 1):
            if chunks // split < 4:
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


@functools.lru_cache(maxsize=None)
def _kernel(plan: GemmPlan, wfmt: int):
    name = (f"fp4_gemm_mma<{plan.tile}, {plan.groups}, {plan.warps}, {plan.prefetch}, {plan.stages}, {wfmt}, "
            f"{plan.split}>")
    kern = torch.cuda._compile_kernel(SOURCE, name)
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
