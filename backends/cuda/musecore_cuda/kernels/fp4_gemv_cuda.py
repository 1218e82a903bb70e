"""FP4 decode GEMV in CUDA C++ (NVRTC through ``torch.cuda._compile_kernel``): the fast path on GPUs.

Why not Triton: a Triton FMA GEMV with the same upcast (commit 10aaac7, removed) was correct, but Triton
puts the activation vector and the decoded weights in different register layouts and converts
between them through shared memory with barriers inside the K loop (45 ``BAR.SYNC`` in its SASS):
it streams the weights at ~25% of HBM bandwidth whatever the tile shape. Here the layout is ours:

* a warp owns ``R`` weight rows; lane ``L`` reads 16 bytes of each row per step (the 4 words of
  quarter ``L % 4`` of chunk ``L / 4``), so a warp step is 512 contiguous bytes per row, and the
  next step's ``R`` loads are issued before the current step is computed;
* the activations of the block's K range are staged once in shared memory as fp32 times 2**64
  (exact), and each lane reads the 32 values its 16 bytes meet as eight 16-byte loads shared by
  all ``R`` rows;
* the upcast is the bit trick of the Triton kernel (E2M1 -> fp32 bits of ``code * 2**-126``, about
  2.75 integer instructions per weight, no conversions), one FMA per weight and activation row
  into a per-group sum (a lane's 16 low-half and 16 high-half weights are exactly one NVFP4 group
  each, half of an MXFP4 group), then one FMA per group with ``scale * 2**(62 - fold)``;
  the per-tensor ``out_scale`` (global scale times ``2**fold``) is applied to the warp's sum.

Products are exact in fp32 (2-bit code times 8-bit activation) and sums are fp32: the numerics
are the Triton kernel's (tested against the same reference). Only ``mul``/``fma`` without
``--use_fast_math``, so the subnormal ``0.5 * 2**-126`` is kept.

Availability: needs ``torch.cuda._compile_kernel`` (PyTorch >= 2.8) and NVRTC. When either is
missing or compilation fails, :func:`available` is False with the reason in :data:`UNAVAILABLE`
and the backend uses the Triton GEMV (announced once as a RuntimeWarning).
"""

from __future__ import annotations

import functools
import warnings
from typing import Optional

import torch

from musecore_cuda.kernels.fp4_gemm import CHUNK_K, WFMT_NVFP4

SOURCE = r"""
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;

__device__ __forceinline__ float load_act(const u16 *p, int xt) {
    u16 b = *p;
    if (xt == 0) return __uint_as_float(((u32)b) << 16);          // bf16
    float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(b)); return f;  // fp16
}

__device__ __forceinline__ void store_out(void *out, long long i, float v, int ot) {
    if (ot == 2) { ((float *)out)[i] = v; return; }
    u16 b;
    if (ot == 0) {  // bf16, round to nearest even (NaN kept quiet)
        u32 u = __float_as_uint(v);
        if ((u & 0x7f800000u) == 0x7f800000u) b = (u16)((u >> 16) | ((u & 0xffffu) ? 0x40u : 0u));
        else b = (u16)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    } else {
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(b) : "f"(v));
    }
    ((u16 *)out)[i] = b;
}

// Scale byte -> scale * 2**(62 - fold) as fp32 (e4m3 for NVFP4, e8m0 for MXFP4).
template <int WFMT>
__device__ __forceinline__ float group_mult(u32 s, int fold) {
    if (WFMT == 1) {
        u32 e = (s >> 3) & 15u, m = s & 7u;
        float v = e ? (float)(8u + m) * __uint_as_float((e + 117u) << 23)   // (8+m) * 2**(e-10)
                    : (float)m * __uint_as_float(118u << 23);                    // m * 2**-9
        v *= __uint_as_float((u32)(127 + 62 - fold) << 23);
        return (s & 128u) ? -v : v;
    }
    int e = (int)s - 127 + 62 - fold;
    e = e < -126 ? -126 : (e > 127 ? 127 : e);
    return __uint_as_float((u32)(e + 127) << 23);
}

// One int32 word of the resident layout -> its 8 weights as fp32 bits of code * 2**-126.
// Nibble n is element (n % 2) * 64 + 4q + n / 2 of its 128-element chunk.
__device__ __forceinline__ void decode(u32 w, float f[8]) {
    u32 p;
    p = ((w >> 6) & 0x01C001C0u) | (w & 0x80008000u);
    f[7] = __uint_as_float(p & 0xFFFF0000u); f[3] = __uint_as_float(p << 16);
    p = ((w >> 2) & 0x01C001C0u) | ((w << 4) & 0x80008000u);
    f[6] = __uint_as_float(p & 0xFFFF0000u); f[2] = __uint_as_float(p << 16);
    p = ((w << 2) & 0x01C001C0u) | ((w << 8) & 0x80008000u);
    f[5] = __uint_as_float(p & 0xFFFF0000u); f[1] = __uint_as_float(p << 16);
    p = ((w << 6) & 0x01C001C0u) | ((w << 12) & 0x80008000u);
    f[4] = __uint_as_float(p & 0xFFFF0000u); f[0] = __uint_as_float(p << 16);
}

// acc[r] += sum over one lane step of row r (weights already loaded in wv).
template <int R, int M>
__device__ __forceinline__ void step(const uint4 (&wv)[R], const float (&ml)[R], const float (&mh)[R],
                                     const float *__restrict__ xs, int ks, int xoff, float (&acc)[R][M]) {
    float lo[R][M], hi[R][M];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int m = 0; m < M; ++m) lo[r][m] = hi[r][m] = 0.f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        float xl[M][4], xh[M][4];
#pragma unroll
        for (int m = 0; m < M; ++m) {
            float4 a = *reinterpret_cast<const float4 *>(xs + m * ks + xoff + 4 * j);
            float4 b = *reinterpret_cast<const float4 *>(xs + m * ks + xoff + 64 + 4 * j);
            xl[m][0] = a.x; xl[m][1] = a.y; xl[m][2] = a.z; xl[m][3] = a.w;
            xh[m][0] = b.x; xh[m][1] = b.y; xh[m][2] = b.z; xh[m][3] = b.w;
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
            u32 w = j == 0 ? wv[r].x : j == 1 ? wv[r].y : j == 2 ? wv[r].z : wv[r].w;
            float f[8];
            decode(w, f);
#pragma unroll
            for (int m = 0; m < M; ++m) {
#pragma unroll
                for (int b = 0; b < 4; ++b) {
                    lo[r][m] = fmaf(f[2 * b], xl[m][b], lo[r][m]);
                    hi[r][m] = fmaf(f[2 * b + 1], xh[m][b], hi[r][m]);
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int m = 0; m < M; ++m) acc[r][m] = fmaf(lo[r][m], ml[r], fmaf(hi[r][m], mh[r], acc[r][m]));
}

template <int R, int WFMT>
__device__ __forceinline__ void load_step(const u32 *const (&wrow)[R], const u8 *const (&srow)[R], int c, int v,
                                          uint4 (&wv)[R], u32 (&sl)[R], u32 (&sh)[R]) {
    const int gpc = WFMT == 1 ? 8 : 4;  // scale groups per chunk
    const int sg_lo = WFMT == 1 ? c * gpc + v : c * gpc + (v >> 1);
#pragma unroll
    for (int r = 0; r < R; ++r) {
        wv[r] = __ldg(reinterpret_cast<const uint4 *>(wrow[r] + c * 16 + v * 4));
        sl[r] = __ldg(srow[r] + sg_lo);
        sh[r] = __ldg(srow[r] + sg_lo + gpc / 2);
    }
}

// Rows n0..n0+R-1 of one weight: each lane streams its 16-byte slices, one step ahead (the next
// step's loads are issued before the current step is computed), then the warp sums its lanes.
template <int R, int M, int WFMT>
__device__ __forceinline__ void gemv_rows(const u32 *__restrict__ wbase, const u8 *__restrict__ sbase,
                                          int wstride, int sstride, int n0, int N,
                                          const float *__restrict__ xs, int ks, int c_begin, int c_end,
                                          int fold, float (&acc)[R][M]) {
    const int lane = threadIdx.x & 31, v = lane & 3;
    const u32 *wrow[R];
    const u8 *srow[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        int n = n0 + r < N ? n0 + r : N - 1;  // rows past N compute a copy of the last row, never stored
        wrow[r] = wbase + (long long)n * wstride;
        srow[r] = sbase + (long long)n * sstride;
#pragma unroll
        for (int m = 0; m < M; ++m) acc[r][m] = 0.f;
    }
    int c = c_begin + (lane >> 2);
    if (c >= c_end) c = c_end;  // (lanes past the end skip the loop below)
    uint4 wv[R];
    u32 sl[R], sh[R];
    if (c < c_end) load_step<R, WFMT>(wrow, srow, c, v, wv, sl, sh);
    for (; c < c_end; c += 8) {
        uint4 wn[R];
        u32 sln[R], shn[R];
        const int cn = c + 8 < c_end ? c + 8 : c;  // the last step reloads itself (cached, never used)
        load_step<R, WFMT>(wrow, srow, cn, v, wn, sln, shn);
        float ml[R], mh[R];
#pragma unroll
        for (int r = 0; r < R; ++r) {
            ml[r] = group_mult<WFMT>(sl[r], fold);
            mh[r] = group_mult<WFMT>(sh[r], fold);
        }
        step<R, M>(wv, ml, mh, xs, ks, (c - c_begin) * 128 + v * 16, acc);
#pragma unroll
        for (int r = 0; r < R; ++r) {
            wv[r] = wn[r];
            sl[r] = sln[r];
            sh[r] = shn[r];
        }
    }
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int m = 0; m < M; ++m)
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) acc[r][m] += __shfl_xor_sync(0xffffffffu, acc[r][m], o);
}

// y[m, n] (+)= x[m, :] @ W[e, n, :]^T.  Grid (row blocks, split, assignments); block WARPS * 32.
// experts: program z is assignment a, expert ids[a], activation row a / a_div, output row a.
template <int R, int M, int WARPS, int WFMT, bool EXPERTS, bool SWIGLU>
__global__ void __launch_bounds__(WARPS * 32) fp4_gemv(
        const u16 *__restrict__ x, int x_stride, int xt, const long long *__restrict__ ids, int a_div,
        const u32 *__restrict__ w, const u8 *__restrict__ s, const u32 *__restrict__ w2, const u8 *__restrict__ s2,
        int w_e, int w_n, int s_e, int s_n,
        const float *__restrict__ out_scale, const float *__restrict__ out_scale2, int fold,
        void *__restrict__ y, int y_stride, int ot, int m_rows, int N, int K, int split) {
    extern __shared__ float xs[];
    const int chunks = K / 128 / split;
    const int c_begin = blockIdx.y * chunks, c_end = c_begin + chunks;
    const int ks = chunks * 128;  // staged activations per row
    long long e = 0, x_row = 0, y_row = 0;
    if (EXPERTS) {
        const int a = blockIdx.z;
        e = ids[a];
        x_row = a / a_div;
        y_row = a;
    }
    const float two64 = 18446744073709551616.f;
    for (int i = threadIdx.x * 8; i < M * ks; i += WARPS * 32 * 8) {  // 8 activations (16 bytes) per load
        const int m = i / ks, k = i - m * ks;
        float f[8];
        if (m < m_rows) {
            const uint4 raw = __ldg(reinterpret_cast<const uint4 *>(x + (x_row + m) * (long long)x_stride
                                                                     + c_begin * 128 + k));
            const u32 h[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                f[2 * j] = load_act(reinterpret_cast<const u16 *>(&h[j]), xt) * two64;
                f[2 * j + 1] = load_act(reinterpret_cast<const u16 *>(&h[j]) + 1, xt) * two64;
            }
        } else {
#pragma unroll
            for (int j = 0; j < 8; ++j) f[j] = 0.f;
        }
        *reinterpret_cast<float4 *>(xs + i) = make_float4(f[0], f[1], f[2], f[3]);
        *reinterpret_cast<float4 *>(xs + i + 4) = make_float4(f[4], f[5], f[6], f[7]);
    }
    __syncthreads();
    const int n0 = (blockIdx.x * WARPS + (threadIdx.x >> 5)) * R;
    if (n0 >= N) return;
    float acc[R][M];
    gemv_rows<R, M, WFMT>(w + e * (long long)w_e, s + e * (long long)s_e, w_n, s_n, n0, N, xs, ks, c_begin, c_end,
                          fold, acc);
    const float os = out_scale[e];
    if (SWIGLU) {
        float acc2[R][M];
        gemv_rows<R, M, WFMT>(w2 + e * (long long)w_e, s2 + e * (long long)s_e, w_n, s_n, n0, N, xs, ks, c_begin,
                              c_end, fold, acc2);
        const float os2 = out_scale2[e];
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
            for (int m = 0; m < M; ++m) {
                float g = acc[r][m] * os, u = acc2[r][m] * os2;
                acc[r][m] = g / (1.f + __expf(-g)) * u;
            }
    } else {
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
            for (int m = 0; m < M; ++m) acc[r][m] *= os;
    }
    if ((threadIdx.x & 31) != 0) return;
#pragma unroll
    for (int r = 0; r < R; ++r) {
        if (n0 + r >= N) break;
#pragma unroll
        for (int m = 0; m < M; ++m) {
            if (m >= m_rows) break;
            const long long i = (y_row + m) * (long long)y_stride + n0 + r;
            if (split > 1) atomicAdd((float *)y + i, acc[r][m]);
            else store_out(y, i, acc[r][m], ot);
        }
    }
}
"""

WARPS = 8
MAX_M = 2  # measured: M = 3-4 (shared-memory activation reads per row step) lose to the tensor-core GEMM
SMEM_LIMIT = 48 * 1024  # staged activations per block without the opt-in
UNAVAILABLE: list[str] = []
_DTYPE_CODE = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}


def rows_per_warp(m: int) -> int:
    return 8 if m == 1 else 4


@functools.lru_cache(maxsize=None)
def _kernel(r: int, m: int, wfmt: int, experts: bool, swiglu: bool):
    name = f"fp4_gemv<{r}, {m}, {WARPS}, {wfmt}, {str(experts).lower()}, {str(swiglu).lower()}>"
    return torch.cuda._compile_kernel(SOURCE, name)


def available(device: torch.device) -> bool:
    """True when the CUDA C++ GEMV compiles here (checked once per process, reason kept)."""
    return device.type == "cuda" and _probe()


@functools.lru_cache(maxsize=1)
def _probe() -> bool:
    if not hasattr(torch.cuda, "_compile_kernel"):
        reason = f"torch {torch.__version__} has no torch.cuda._compile_kernel (NVRTC; PyTorch >= 2.8)"
    else:
        try:
            _kernel(rows_per_warp(1), 1, WFMT_NVFP4, False, False)
            return True
        except Exception as exc:  # NVRTC missing or a compile error: say why, use the Triton GEMV
            reason = f"compiling the CUDA C++ GEMV with NVRTC failed ({type(exc).__name__}: {str(exc)[:300]})"
    UNAVAILABLE.append(reason)
    warnings.warn(f"musecore-cuda: {reason}; decode linears use the slower Triton GEMV", RuntimeWarning,
                  stacklevel=3)
    return False


def split_for(blocks: int, k: int, m: int, device: torch.device) -> int:
    """Split K until there are ~2 blocks per SM and the staged activations fit in shared memory."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    chunks, split = k // CHUNK_K, 1
    while chunks % (split * 2) == 0 and chunks // (split * 2) >= 8 and (
            blocks * split < 2 * sms or m * (k // split) * 4 >= SMEM_LIMIT):
        split *= 2
    if m * (k // split) * 4 >= SMEM_LIMIT:
        raise ValueError(f"the CUDA GEMV cannot stage {m} x {k} activations in shared memory")
    return split


def launch(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, out_scale: torch.Tensor, *,
           wfmt: int, fold_log2: int, n: int, k: int, out: torch.Tensor, split_k: int = 1,
           ids: Optional[torch.Tensor] = None, a_div: int = 1, packed2: Optional[torch.Tensor] = None,
           scales2: Optional[torch.Tensor] = None, out_scale2: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``out (+)= x @ W^T`` for ``x [M<=4, K]``, or per assignment when ``ids`` (int64 ``[A]``) is given."""
    m = x.shape[0] if ids is None else 1
    if m > MAX_M:
        raise ValueError(f"the CUDA GEMV takes at most {MAX_M} rows; got {m}")
    if x.dtype not in (torch.bfloat16, torch.float16) or x.stride(-1) != 1:
        raise ValueError(f"the CUDA GEMV takes contiguous bf16/fp16 activations; got {x.dtype}")
    if split_k > 1 and (ids is not None or packed2 is not None or out.dtype != torch.float32):
        raise ValueError("split-K accumulates with fp32 atomics: linear only, into an fp32 output")
    if ids is not None and ids.dtype != torch.int64:
        ids = ids.to(torch.int64)
    r = rows_per_warp(m)
    words = packed.view(torch.int32)
    blocks = -(-n // (WARPS * r))
    smem = m * (k // split_k) * 4
    kern = _kernel(r, m, wfmt, ids is not None, packed2 is not None)
    if smem >= SMEM_LIMIT:
        raise ValueError(f"{smem} bytes of staged activations exceed {SMEM_LIMIT}; raise split_k")
    w2 = packed2.view(torch.int32) if packed2 is not None else words
    kern(grid=(blocks, split_k, 1 if ids is None else ids.numel()), block=(WARPS * 32, 1, 1), shared_mem=smem,
         args=[x, x.stride(0), _DTYPE_CODE[x.dtype], ids if ids is not None else out_scale, a_div,
               words, scales, w2, scales2 if scales2 is not None else scales,
               words.stride(0), words.stride(1), scales.stride(0), scales.stride(1),
               out_scale, out_scale2 if out_scale2 is not None else out_scale, fold_log2,
               out, out.stride(0), _DTYPE_CODE[out.dtype], m, n, k, split_k])
    return out
