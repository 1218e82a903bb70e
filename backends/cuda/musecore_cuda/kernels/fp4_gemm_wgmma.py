"""W4A16 GEMM on Hopper's warpgroup tensor-core instruction (``wgmma``, sm_90a) for bf16 activations.

**Status: correct, measured, and not selected by** ``fp4_linear``: on the H200 it runs 0.35-0.62x
BF16 cuBLAS at M = 64-256, about the mma.sync GEMM and below dequantize + cuBLAS at M = 256
(``benchmarks/cuda_wgmma_sweep.py``, ``benchmarks/results/cuda_wgmma_sweep*.json``; what was tried
and what the leave-one-stage-out timings showed: ``backends/cuda/NOTES.md``, session 6). It stays as
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
from dataclasses import dataclass
from typing import Optional

import torch

from musecore_cuda.kernels import fp4_gemm_cuda, fp4_gemv_cuda
from musecore_cuda.kernels.fp4_gemm import CHUNK_K

TOKEN_TILES = (16, 32, 64, 128)   # wgmma N per block (accumulators: N / 2 fp32 registers per thread)
ARCH = "90a"                      # wgmma exists on sm_90a only
SMEM_LIMIT = 227 * 1024           # shared memory a block may opt into on Hopper


def _wgmma_source(n: int) -> str:
    """``wgmma.m64n{n}k16`` with A from registers and B from a shared-memory descriptor, accumulating."""
    regs = n // 2
    outs = ", ".join(f"%{i}" for i in range(regs))
    a = ", ".join(f"%{regs + i}" for i in range(4))
    binds = ", ".join(f'"+f"(d[{i}])' for i in range(regs))
    return (
        f"__device__ __forceinline__ void wgmma_n{n}(float (&d)[{regs}], u32 a0, u32 a1, u32 a2, u32 a3,\n"
        f"                                          unsigned long long desc) {{\n"
        f'    asm volatile("wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16 "\n'
        f'                 "{{{outs}}}, {{{a}}}, %{regs + 4}, 1, 1, 1, 0;"\n'
        f'                 : {binds}\n'
        f'                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc));\n'
        f"}}\n"
        f"template <> struct Wgmma<{n}> {{\n"
        f"    static __device__ __forceinline__ void run(float (&d)[{regs}], const u32 (&a)[4],\n"
        f"                                               unsigned long long desc) {{\n"
        f"        wgmma_n{n}(d, a[0], a[1], a[2], a[3], desc);\n"
        f"    }}\n"
        f"}};\n")


# On the tiled GEMM's source: the decode kernel's upcast and loads, and its cp.async helpers.
SOURCE = fp4_gemm_cuda.SOURCE + r"""
// ---------------------------------------------------------------------------------------------
// W4A16 GEMM on wgmma (sm_90a): see the docstring of fp4_gemm_wgmma.py.

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory"); }
// Writes by the generic proxy (cp.async, plain stores) made visible to the tensor cores' reads.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// Keeps the compiler from moving accesses of the accumulators across the asynchronous wgmmas.
template <int R>
__device__ __forceinline__ void fence_operands(float (&d)[R]) {
#pragma unroll
    for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// Shared-memory matrix descriptor, no swizzle: start address, the byte distance between the two
// core matrices of a k16 step (leading, K) and between consecutive 8-token core matrices (stride, N).
__device__ __forceinline__ unsigned long long smem_desc(u32 addr, u32 lead, u32 stride) {
    return (unsigned long long)((addr & 0x3FFFFu) >> 4) | ((unsigned long long)(lead >> 4) << 16) |
           ((unsigned long long)(stride >> 4) << 32);
}

template <int N> struct Wgmma;

""" + "".join(_wgmma_source(n) for n in TOKEN_TILES) + r"""

// x (bf16 [M, K], row stride x_stride) -> out [M, K] in the kernel's slot order (slot_order() in
// Python): one thread per 8 slots (16 bytes), gathered from one 128-element chunk of x.
__global__ void __launch_bounds__(256) wgmma_slot_order(const u16 *__restrict__ x, int x_stride,
                                                        u16 *__restrict__ out, int m_rows, int K) {
    const long long i = blockIdx.x * 256ll + threadIdx.x;
    const int pieces = K / 8;
    if (i >= (long long)m_rows * pieces) return;
    const int m = (int)(i / pieces), pc = (int)(i - (long long)m * pieces), c = pc >> 4, piece = pc & 15;
    const int st = piece >> 1, kh = piece & 1, qp = st >> 2, j = (st >> 1) & 1, mm = st & 1;
    // slot 2t + odd (+8 for kh) of step (qp, j, mm) = element (kh ? 0 : 64) + 4(4t + 2qp + j) + (1 - mm) + 2 odd
    const u16 *src = x + (long long)m * x_stride + c * 128 + (kh ? 0 : 64) + 8 * qp + 4 * j + (1 - mm);
    u32 v[4];
#pragma unroll
    for (int t = 0; t < 4; ++t) v[t] = (u32)__ldg(src + 16 * t) | ((u32)__ldg(src + 16 * t + 2) << 16);
    *reinterpret_cast<uint4 *>(out + (long long)m * K + pc * 8) = make_uint4(v[0], v[1], v[2], v[3]);
}

// y[m, n] = x[m, :] @ W[n, :]^T * out_scale for bf16 x given in slot order (slot_order()): each
// 128-element chunk holds 8 k16 steps (q pair qp, word parity j, mma half mm) of 16 slots.
// Grid (token tiles, SPLIT, row blocks of 64 * WG), block 128 * WG: WG warpgroups of 64 rows each share
// every activation chunk staged in shared memory. LEAVE_OUT (timing only, wrong results): 1 skips the
// wgmmas, 2 the weight loads after the first PF chunks (the ring's words are reused).
// Shared memory per stage: [step 8][k half 2][token group TOK/8][token 8][8 slots] bf16.
template <int TOK, int PF, int STAGES, int WFMT, int SPLIT, int WG, int LEAVE_OUT>
__global__ void __cluster_dims__(1, SPLIT, 1) __launch_bounds__(128 * WG) fp4_gemm_wgmma(
        const u16 *__restrict__ x, int x_stride, const u32 *__restrict__ w, const u8 *__restrict__ s, int w_n,
        int s_n, const float *__restrict__ out_scale, int fold, void *__restrict__ y, int y_stride, int ot,
        int m_rows, int N, int K, int lead, int stride) {
    constexpr int NB = TOK / 8, STEP_BYTES = 2 * NB * 128, STAGE_BYTES = 8 * STEP_BYTES, SLOTS = PF + 1;
    constexpr int ACC = TOK / 2;
    // the ring holds the chunk in use, the one the previous wgmmas may still read, and at least one ahead
    static_assert(STAGES >= 3, "STAGES >= 3");
    extern __shared__ __align__(128) unsigned char gsm[];  // activation ring; after the loop, partial sums
    constexpr int THREADS = 128 * WG;
    const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3, g = lane >> 2, t = lane & 3;
    const int m0 = blockIdx.x * TOK, n0 = (blockIdx.z * WG + (threadIdx.x >> 7)) * 64 + warp * 16;
    const int c_begin = blockIdx.y * (K / 128) / SPLIT, chunks = (blockIdx.y + 1) * (K / 128) / SPLIT - c_begin;
    const int tokens = min(TOK, m_rows - m0);

    // Every warp takes part in every wgmma: rows past N read a copy of the last row, never stored.
    const u32 *wrow[1][2];
    const u8 *srow[1][2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int n = min(n0 + h * 8 + g, N - 1);
        wrow[0][h] = w + (long long)n * w_n;
        srow[0][h] = s + (long long)n * s_n;
    }
    Stage<1> st[SLOTS];  // chunk c_begin + x lives in slot x % SLOTS
#pragma unroll
    for (int p = 0; p < PF; ++p) stage_load<1, WFMT>(wrow, srow, c_begin + min(p, chunks - 1), t, st[p]);

    const u32 ring = (u32)__cvta_generic_to_shared(gsm);
    // Token rows past M are zero in every slot and never copied (no branch on the token count below).
    for (int i = tokens * 16 + threadIdx.x; i < TOK * 16; i += THREADS) {
        const int tok = i >> 4, piece = i & 15;
#pragma unroll
        for (int slot = 0; slot < STAGES; ++slot)
            *reinterpret_cast<uint4 *>(gsm + slot * STAGE_BYTES + (piece * NB + (tok >> 3)) * 128 + (tok & 7) * 16) =
                make_uint4(0u, 0u, 0u, 0u);
    }
    auto stage_x = [&](int ci) {  // activations of chunk c_begin + ci -> slot ci % STAGES
        const u32 base = ring + (ci % STAGES) * STAGE_BYTES;
        for (int i = threadIdx.x; i < tokens * 16; i += THREADS) {
            const int tok = i >> 4, piece = i & 15;  // piece = step * 2 + k half: 8 slots, 16 bytes
            cp_async16(base + (piece * NB + (tok >> 3)) * 128 + (tok & 7) * 16,
                       x + (long long)(m0 + tok) * x_stride + (long long)(c_begin + ci) * 128 + piece * 8);
        }
    };
    // Chunk ci's slot is refilled (with chunk ci + STAGES) only after chunk ci's wgmmas completed.
#pragma unroll
    for (int p = 0; p < STAGES - 2; ++p) {
        if (p < chunks) stage_x(p);
        cp_async_commit();
    }

    float acc[ACC];
#pragma unroll
    for (int i = 0; i < ACC; ++i) acc[i] = 0.f;
    u32 frag[2][2][4];  // [buffer][mma half][A registers]: one decoded word pair = two k16 steps

    for (int c0 = 0; c0 < chunks; c0 += SLOTS) {
#pragma unroll
        for (int p = 0; p < SLOTS; ++p) {  // unrolled: static register slots
            const int ci = c0 + p;
            if (ci >= chunks) break;
            cp_async_wait<STAGES - 3>();
            fence_proxy_async();
            __syncthreads();  // chunk ci visible to all; chunk ci - 2's wgmmas are complete (waited below)
            if (ci + STAGES - 2 < chunks) stage_x(ci + STAGES - 2);
            cp_async_commit();
            if (LEAVE_OUT != 2 && ci + PF < chunks)
                stage_load<1, WFMT>(wrow, srow, c_begin + ci + PF, t, st[(p + PF) % SLOTS]);
            const u32 base = ring + (ci % STAGES) * STAGE_BYTES;
            u32 ml[2], mh[2];
#pragma unroll
            for (int h = 0; h < 2; ++h) half_mults<WFMT>(st[p].s[0][h], t, fold, ml[h], mh[h]);
#pragma unroll
            for (int qj = 0; qj < 4; ++qj) {  // words 4t + qj of rows g and g + 8: steps 2qj, 2qj + 1
                const int b = qj & 1;
                wgmma_wait<1>();  // the steps that last read frag[b] (two word pairs ago) are done
                fence_operands(acc);
                u32 a0[4], a1[4];
                const uint4 &v0 = st[p].w[0][0], &v1 = st[p].w[0][1];
                decode_bf16x2(qj == 0 ? v0.x : qj == 1 ? v0.y : qj == 2 ? v0.z : v0.w, ml[0], mh[0], a0);
                decode_bf16x2(qj == 0 ? v1.x : qj == 1 ? v1.y : qj == 2 ? v1.z : v1.w, ml[1], mh[1], a1);
                frag[b][0][0] = a0[0]; frag[b][0][1] = a1[0]; frag[b][0][2] = a0[1]; frag[b][0][3] = a1[1];
                frag[b][1][0] = a0[2]; frag[b][1][1] = a1[2]; frag[b][1][2] = a0[3]; frag[b][1][3] = a1[3];
                wgmma_fence();
#pragma unroll
                for (int mm = 0; mm < 2; ++mm) {
                    if (LEAVE_OUT == 1) acc[mm] += __uint_as_float(frag[b][mm][0] ^ frag[b][mm][3]);
                    else Wgmma<TOK>::run(acc, frag[b][mm], smem_desc(base + (2 * qj + mm) * STEP_BYTES, lead, stride));
                }
                wgmma_commit();
                fence_operands(acc);
            }
        }
    }
    wgmma_wait<0>();
    fence_operands(acc);

    const int rank = SPLIT > 1 ? (int)blockIdx.y : 0;
    if (SPLIT > 1) {  // partial sums meet through distributed shared memory
        cp_async_wait<0>();
        __syncthreads();  // every warp is done with the ring: reuse it
        float *red = reinterpret_cast<float *>(gsm);
#pragma unroll
        for (int i = 0; i < ACC; ++i) red[i * THREADS + threadIdx.x] = acc[i];
        cluster_sync();
#pragma unroll
        for (int i = 0; i < ACC; ++i) {
            if (i % SPLIT != rank) continue;
            float v = 0.f;
#pragma unroll
            for (int r = 0; r < SPLIT; ++r) v += cluster_load(red + i * THREADS + threadIdx.x, (u32)r);
            acc[i] = v;
        }
        cluster_sync();  // the other blocks' shared memory stays alive until all have read it
    }
    const float os = out_scale[0];
    // acc[4 nb + j]: row n0 + g (+8 for j >= 2), token m0 + 8 nb + 2t + (j & 1)
#pragma unroll
    for (int i = 0; i < ACC; ++i) {
        if (i % SPLIT != rank) continue;
        const int j = i & 3, row = n0 + g + (j >= 2 ? 8 : 0), token = (i >> 2) * 8 + 2 * t + (j & 1);
        if (row >= N || token >= tokens) continue;
        store_out(y, (m0 + token) * (long long)y_stride + row, acc[i] * os, ot);
    }
}
"""


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
    """The best cuts of ``benchmarks/cuda_wgmma_sweep.py`` on the H200 (q_proj, expert_down, k_proj at
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
