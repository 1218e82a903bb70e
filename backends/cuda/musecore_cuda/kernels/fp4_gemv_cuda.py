"""FP4 decode kernels in CUDA C++ (NVRTC through ``torch.cuda._compile_kernel``): M <= 8 on GPUs.

Both kernels read the resident FP4 bytes of :mod:`musecore_cuda.layouts` (no second copy) as int32
words; nibble ``n`` of word ``q`` of a 128-element chunk is element ``(n % 2) * 64 + 4q + n / 2``.

* ``fp4_gemv_mma`` (bf16 activations, M <= 8, the default): ``mma.m16n8k16`` with the weights as
  operand A, upcast in registers (shift/LOP3 into bf16x2 pairs holding ``code * 2**-126`` exactly,
  then ``mul.bf16x2`` by ``scale * 2**(126 - fold)``, also exact: about 3 instructions per weight)
  and the activations as operand B, staged once per block in shared memory in the same pair order,
  so B is one 16-byte load per word. Split-K runs as a thread-block cluster whose partial sums meet
  in block 0 through distributed shared memory: the output is written once, in its own dtype.
* ``fp4_gemv`` (bf16 or fp16, M <= 2; fp16 activations use it): fp32 FMA. Each lane reads 16
  bytes of each of ``R`` rows per step (next step's loads issued first); activations are staged as
  fp32 times 2**64; the upcast gives the fp32 bits of ``code * 2**-126``; sums per group, one FMA
  per group with ``scale * 2**(62 - fold)``; split-K through fp32 atomics.

Numerics: products are exact (2-bit code times a 16-bit activation) and sums are fp32, as in the
Triton GEMM; no ``--use_fast_math``, so the subnormal ``0.5 * 2**-126`` is kept (tested for every
code at every nibble position). The per-tensor ``out_scale`` (NVFP4 global scale times
``2**fold``) is applied to the sums.

Why not Triton: a Triton FMA GEMV with the same upcast (commit 10aaac7, removed) was correct, but
Triton converted the activations and the decoded weights between register layouts through shared
memory inside the K loop (45 ``BAR.SYNC`` in its SASS) and streamed at ~25% of HBM bandwidth.
Measurements and the ncu profile: ``backends/cuda/NOTES.md``.

Availability: needs ``torch.cuda._compile_kernel`` (PyTorch >= 2.8) and NVRTC. When either is
missing or compilation fails, :func:`available` is False with the reason in :data:`UNAVAILABLE`
and the backend uses the Triton GEMM (announced once as a RuntimeWarning).
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
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

// Expert mode: program z is assignment a, expert ids[a], activation row a / a_div, output row a.
__device__ __forceinline__ void assignment(const long long *ids, int a_div, long long &e, long long &x_row,
                                           long long &y_row) {
    const int a = blockIdx.z;
    e = ids[a];
    x_row = a / a_div;
    y_row = a;
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
    if (EXPERTS) assignment(ids, a_div, e, x_row, y_row);
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

// ---------------------------------------------------------------------------------------------
// Tensor-core decode GEMM for bf16 activations, M <= 8: out^T[16 rows, 8 tokens] per mma.m16n8k16,
// weights as operand A (upcast in registers, never through shared memory), activations as B.
// Thread (g = lane / 4, t = lane % 4) of a warp loads 16 bytes (words 4t..4t+3 of a chunk) of rows
// g and g + 8 of each 16-row tile; word i of those feeds mmas 2i and 2i + 1: pairs 2j and 2j + 1 of
// the word (bf16x2 of two nibbles, see decode_bf16x2) are the A registers for logical k {2t, 2t+1}
// and {2t+8, 2t+9} of mma 2i + j. The activations are staged in shared memory in that same pair
// order ([token][chunk][word][pair] as bf16x2), so B is one 16-byte load per word.

__device__ __forceinline__ u32 bmul2(u32 a, u32 b) {
    u32 d; asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b)); return d;
}

// Scale byte -> (scale * 2**(126 - fold)) as bf16x2, exact (at most 4 significant bits).
template <int WFMT>
__device__ __forceinline__ u32 group_mult_bf16x2(u32 s, int fold) {
    float v;
    if (WFMT == 1) {
        u32 e = (s >> 3) & 15u, m = s & 7u;
        v = e ? (float)(8u + m) * __uint_as_float((e + 117u) << 23) : (float)m * __uint_as_float(118u << 23);
        v *= __uint_as_float((u32)(127 + 126 - fold) << 23);
        if (s & 128u) v = -v;
    } else {
        int e = (int)s - 127 + 126 - fold;
        e = e < -126 ? -126 : (e > 127 ? 127 : e);
        v = __uint_as_float((u32)(e + 127) << 23);
    }
    u32 b = __float_as_uint(v) >> 16;
    return b | (b << 16);
}

// Word -> 4 bf16x2 pairs (low half, high half) = nibbles (3,7), (2,6), (1,5), (0,4), each exactly
// code * 2**-126 times its half's multiplier (nibbles 7,3,5,1 are the chunk's high half).
__device__ __forceinline__ void decode_bf16x2(u32 w, u32 ml, u32 mh, u32 (&a)[4]) {
    a[0] = bmul2(((w >> 6) & 0x01C001C0u) | (w & 0x80008000u), mh);
    a[1] = bmul2(((w >> 2) & 0x01C001C0u) | ((w << 4) & 0x80008000u), ml);
    a[2] = bmul2(((w << 2) & 0x01C001C0u) | ((w << 8) & 0x80008000u), mh);
    a[3] = bmul2(((w << 6) & 0x01C001C0u) | ((w << 12) & 0x80008000u), ml);
}

__device__ __forceinline__ void mma16816(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

template <int RT, int WFMT>
__device__ __forceinline__ void mma_load(const u32 *const (&wrow)[RT][2], const u8 *const (&srow)[RT][2], int c,
                                         int t, uint4 (&wv)[RT][2], u32 (&sl)[RT][2], u32 (&sh)[RT][2]) {
    const int gpc = WFMT == 1 ? 8 : 4;
    const int sg = WFMT == 1 ? c * gpc + t : c * gpc + (t >> 1);
#pragma unroll
    for (int rt = 0; rt < RT; ++rt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            wv[rt][h] = __ldg(reinterpret_cast<const uint4 *>(wrow[rt][h] + c * 16 + t * 4));
            sl[rt][h] = __ldg(srow[rt][h] + sg);
            sh[rt][h] = __ldg(srow[rt][h] + sg + gpc / 2);
        }
}

template <int RT, int WFMT>
__device__ __forceinline__ void mma_rows(const u32 *__restrict__ wbase, const u8 *__restrict__ sbase, int wstride,
                                         int sstride, int n0, int N, const u32 *__restrict__ xp, bool has_token,
                                         int c_begin, int c_end, int fold, float (&acc)[RT][4]) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    float acc2[RT][4];  // a second accumulator per tile: two independent mma chains
    const u32 *wrow[RT][2];
    const u8 *srow[RT][2];
#pragma unroll
    for (int rt = 0; rt < RT; ++rt) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            int n = n0 + rt * 16 + h * 8 + g;
            n = n < N ? n : N - 1;  // rows past N compute a copy of the last row, never stored
            wrow[rt][h] = wbase + (long long)n * wstride;
            srow[rt][h] = sbase + (long long)n * sstride;
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[rt][i] = acc2[rt][i] = 0.f;
    }
    uint4 wv[RT][2];
    u32 sl[RT][2], sh[RT][2];
    mma_load<RT, WFMT>(wrow, srow, c_begin, t, wv, sl, sh);
    for (int c = c_begin; c < c_end; ++c) {
        uint4 wn[RT][2];
        u32 sln[RT][2], shn[RT][2];
        mma_load<RT, WFMT>(wrow, srow, c + 1 < c_end ? c + 1 : c, t, wn, sln, shn);
        uint4 b[4];
#pragma unroll
        for (int i = 0; i < 4; ++i)
            b[i] = has_token ? *reinterpret_cast<const uint4 *>(xp + ((c - c_begin) * 16 + 4 * t + i) * 4)
                             : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
        for (int rt = 0; rt < RT; ++rt) {
            const u32 ml0 = group_mult_bf16x2<WFMT>(sl[rt][0], fold), mh0 = group_mult_bf16x2<WFMT>(sh[rt][0], fold);
            const u32 ml1 = group_mult_bf16x2<WFMT>(sl[rt][1], fold), mh1 = group_mult_bf16x2<WFMT>(sh[rt][1], fold);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const u32 w0 = i == 0 ? wv[rt][0].x : i == 1 ? wv[rt][0].y : i == 2 ? wv[rt][0].z : wv[rt][0].w;
                const u32 w1 = i == 0 ? wv[rt][1].x : i == 1 ? wv[rt][1].y : i == 2 ? wv[rt][1].z : wv[rt][1].w;
                u32 a0[4], a1[4];
                decode_bf16x2(w0, ml0, mh0, a0);
                decode_bf16x2(w1, ml1, mh1, a1);
                mma16816(acc[rt], a0[0], a1[0], a0[1], a1[1], b[i].x, b[i].y);
                mma16816(acc2[rt], a0[2], a1[2], a0[3], a1[3], b[i].z, b[i].w);
            }
        }
#pragma unroll
        for (int rt = 0; rt < RT; ++rt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                wv[rt][h] = wn[rt][h];
                sl[rt][h] = sln[rt][h];
                sh[rt][h] = shn[rt][h];
            }
    }
#pragma unroll
    for (int rt = 0; rt < RT; ++rt)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[rt][i] += acc2[rt][i];
}

__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
    u32 d; asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel)); return d;
}

__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// Float at shared-memory address `p` of block `rank` of this cluster.
__device__ __forceinline__ float cluster_load(const float *p, u32 rank) {
    u32 local = (u32)__cvta_generic_to_shared(p), remote;
    float v;
    asm("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
    asm("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote));  // ordered by the cluster barriers
    return v;
}

// Same contract as fp4_gemv, for bf16 activations and M <= 8; rows per block = WARPS * 16 * RT.
// Split-K runs as a thread-block cluster of SPLIT blocks along y: each block sums its K range, the
// partial sums meet in block 0's registers through distributed shared memory, and block 0 writes the
// output once in its final dtype (no zero-filled fp32 buffer, no atomics, no conversion kernel).
template <int RT, int WARPS, int WFMT, bool EXPERTS, bool SWIGLU, int SPLIT>
__global__ void __cluster_dims__(1, SPLIT, 1) __launch_bounds__(WARPS * 32, 8) fp4_gemv_mma(
        const u16 *__restrict__ x, int x_stride, const long long *__restrict__ ids, int a_div,
        const u32 *__restrict__ w, const u8 *__restrict__ s, const u32 *__restrict__ w2, const u8 *__restrict__ s2,
        int w_e, int w_n, int s_e, int s_n,
        const float *__restrict__ out_scale, const float *__restrict__ out_scale2, int fold,
        void *__restrict__ y, int y_stride, int ot, int m_rows, int N, int K, int split) {
    extern __shared__ u32 xp[];  // [m_rows][chunks][16 words][4 pairs] bf16x2; later the partial sums
    const int chunks = K / 128 / SPLIT;
    const int c_begin = blockIdx.y * chunks, c_end = c_begin + chunks;
    const int pairs = chunks * 64;  // per token
    long long e = 0, x_row = 0, y_row = 0;
    if (EXPERTS) assignment(ids, a_div, e, x_row, y_row);
    // Stage: 16 bytes (8 activations: words q0 = 2v', q1 = q0 + 1 of one half chunk) per load, stored as
    // pairs (e0,e2) (e1,e3) (e4,e6) (e5,e7) = pairs 3,1 (low half) or 2,0 (high half) of q0 and q1.
    for (int i = threadIdx.x; i < m_rows * chunks * 16; i += WARPS * 32) {
        const int m = i / (chunks * 16), r = i - m * (chunks * 16), c = r >> 4, v = r & 15;
        const uint4 raw = __ldg(reinterpret_cast<const uint4 *>(
            x + (x_row + m) * (long long)x_stride + (c_begin + c) * 128 + v * 8));
        const int hi = v >> 3, q0 = 2 * (v & 7);
        const int pe = hi ? 2 : 3, po = hi ? 0 : 1;
        u32 *dst = xp + m * pairs + c * 64;
        dst[q0 * 4 + pe] = prmt(raw.x, raw.y, 0x5410u);
        dst[q0 * 4 + po] = prmt(raw.x, raw.y, 0x7632u);
        dst[q0 * 4 + 4 + pe] = prmt(raw.z, raw.w, 0x5410u);
        dst[q0 * 4 + 4 + po] = prmt(raw.z, raw.w, 0x7632u);
    }
    __syncthreads();
    const int lane = threadIdx.x & 31;
    const int n0 = (blockIdx.x * WARPS + (threadIdx.x >> 5)) * 16 * RT;
    const int g = lane >> 2, t = lane & 3;
    const bool has_token = g < m_rows;
    const u32 *xt = xp + (has_token ? g : 0) * pairs;
    float acc[RT][4];
    if (n0 < N) {  // (no early return: every block takes part in the cluster barriers below)
        mma_rows<RT, WFMT>(w + e * (long long)w_e, s + e * (long long)s_e, w_n, s_n, n0, N, xt, has_token,
                           c_begin, c_end, fold, acc);
        if (SWIGLU) {
            float acc2[RT][4];
            mma_rows<RT, WFMT>(w2 + e * (long long)w_e, s2 + e * (long long)s_e, w_n, s_n, n0, N, xt, has_token,
                               c_begin, c_end, fold, acc2);
            const float os = out_scale[e], os2 = out_scale2[e];
#pragma unroll
            for (int rt = 0; rt < RT; ++rt)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const float gt = acc[rt][i] * os, u = acc2[rt][i] * os2;
                    acc[rt][i] = gt / (1.f + __expf(-gt)) * u;
                }
        }
    }
    if (SPLIT > 1) {
        float *red = reinterpret_cast<float *>(xp);
        __syncthreads();  // every warp is done with the staged activations
#pragma unroll
        for (int rt = 0; rt < RT; ++rt)
#pragma unroll
            for (int i = 0; i < 4; ++i) red[(rt * 4 + i) * WARPS * 32 + threadIdx.x] = n0 < N ? acc[rt][i] : 0.f;
        cluster_sync();
        if (blockIdx.y == 0 && n0 < N) {
#pragma unroll
            for (int rt = 0; rt < RT; ++rt)
#pragma unroll
                for (int i = 0; i < 4; ++i)
#pragma unroll
                    for (int r = 1; r < SPLIT; ++r)
                        acc[rt][i] += cluster_load(red + (rt * 4 + i) * WARPS * 32 + threadIdx.x, (u32)r);
        }
        cluster_sync();  // the other blocks' shared memory stays alive until block 0 has read it
        if (blockIdx.y != 0) return;
    }
    if (n0 >= N) return;
    if (!SWIGLU) {
        const float os = out_scale[e];
#pragma unroll
        for (int rt = 0; rt < RT; ++rt)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[rt][i] *= os;
    }
    // c0, c1: row g, tokens 2t, 2t+1; c2, c3: row g + 8, same tokens.
#pragma unroll
    for (int rt = 0; rt < RT; ++rt)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int row = n0 + rt * 16 + g + (i >= 2 ? 8 : 0), token = 2 * t + (i & 1);
            if (row >= N || token >= m_rows) continue;
            store_out(y, (y_row + token) * (long long)y_stride + row, acc[rt][i], ot);
        }
}
"""

FMA_WARPS, MMA_WARPS = 8, 4
FMA_MAX_M = 2  # fp32 FMA kernel (bf16 or fp16 activations); its FMA count grows with M
MAX_M = 8      # tensor-core kernel (bf16 activations): one mma n8 covers up to 8 tokens
SMEM_LIMIT = 48 * 1024  # staged activations per block without the opt-in
MAX_CLUSTER = 8  # portable thread-block cluster size: the MMA kernel's largest split-K
UNAVAILABLE: list[str] = []
_DTYPE_CODE = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}


@dataclass(frozen=True)
class GemvPlan:
    """Which decode kernel runs a weight at ``m`` rows, and how it is cut into blocks."""

    kind: str            # "mma" (tensor cores, bf16) or "fma" (fp32 FMA, bf16/fp16)
    m: int
    tile: int            # FMA: rows per warp; MMA: 16-row tiles per warp
    rows_per_block: int
    split_k: int

    @property
    def atomic(self) -> bool:
        """Split-K through fp32 atomics into a zeroed fp32 output (FMA kernel); the MMA kernel reduces
        its splits inside a thread-block cluster and writes the final dtype."""
        return self.kind == "fma" and self.split_k > 1

    def smem(self, k: int) -> int:
        if self.kind == "mma":  # bf16 pairs; then the cluster reduction's partial sums
            return max(self.m * (k // self.split_k) * 2, self.tile * 4 * MMA_WARPS * 32 * 4 if self.split_k > 1 else 0)
        return self.m * (k // self.split_k) * 4


def kind_for(m: int, dtype: torch.dtype) -> Optional[str]:
    if dtype == torch.bfloat16 and m <= MAX_M:
        return "mma"
    if dtype in (torch.bfloat16, torch.float16) and m <= FMA_MAX_M:
        return "fma"
    return None


def make_plan(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device, *, allow_split: bool = True,
              kind: Optional[str] = None) -> GemvPlan:
    """Tile and split-K for ``m`` activation rows against an ``[n, k]`` weight (``kind`` forces a kernel)."""
    kind = kind or kind_for(m, dtype)
    if kind is None:
        raise ValueError(f"no CUDA decode kernel for M={m} with {dtype} activations (see kind_for)")
    if kind == "mma":
        tile = 1
        rows = MMA_WARPS * 16 * tile
    else:
        tile = 8 if m == 1 else 4
        rows = FMA_WARPS * tile
    blocks = -(-n // rows)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    chunks, split = k // CHUNK_K, 1
    max_split = MAX_CLUSTER if kind == "mma" else 16
    plan = GemvPlan(kind, m, tile, rows, split)
    while split < max_split and chunks % (split * 2) == 0 and chunks // (split * 2) >= 4 and (
            (allow_split and blocks * split < (4 if kind == "mma" else 2) * sms) or plan.smem(k) >= SMEM_LIMIT):
        split *= 2
        plan = GemvPlan(kind, m, tile, rows, split)
    if plan.smem(k) >= SMEM_LIMIT:
        raise ValueError(f"the CUDA decode kernel cannot stage {m} x {k} activations in shared memory")
    return plan


@functools.lru_cache(maxsize=None)
def _kernel(kind: str, tile: int, m: int, wfmt: int, experts: bool, swiglu: bool, split: int = 1):
    flags = f"{wfmt}, {str(experts).lower()}, {str(swiglu).lower()}"
    name = (f"fp4_gemv_mma<{tile}, {MMA_WARPS}, {flags}, {split}>" if kind == "mma"
            else f"fp4_gemv<{tile}, {m}, {FMA_WARPS}, {flags}>")
    return torch.cuda._compile_kernel(SOURCE, name)


def available(device: torch.device) -> bool:
    """True when the CUDA C++ decode kernels compile here (checked once per process, reason kept)."""
    return device.type == "cuda" and _probe()


@functools.lru_cache(maxsize=1)
def _probe() -> bool:
    if not hasattr(torch.cuda, "_compile_kernel"):
        reason = f"torch {torch.__version__} has no torch.cuda._compile_kernel (NVRTC; PyTorch >= 2.8)"
    else:
        try:
            _kernel("mma", 1, 1, WFMT_NVFP4, False, False)
            _kernel("fma", 8, 1, WFMT_NVFP4, False, False)
            return True
        except Exception as exc:  # NVRTC missing or a compile error: say why, use the Triton GEMM
            reason = f"compiling the CUDA C++ decode kernels with NVRTC failed ({type(exc).__name__}: {str(exc)[:300]})"
    UNAVAILABLE.append(reason)
    warnings.warn(f"musecore-cuda: {reason}; decode linears use the slower Triton tensor-core GEMM",
                  RuntimeWarning, stacklevel=3)
    return False


def launch(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, out_scale: torch.Tensor, *,
           wfmt: int, fold_log2: int, n: int, k: int, out: torch.Tensor, plan: GemvPlan,
           ids: Optional[torch.Tensor] = None, a_div: int = 1, packed2: Optional[torch.Tensor] = None,
           scales2: Optional[torch.Tensor] = None, out_scale2: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``out (+)= x @ W^T`` for ``x [M, K]`` (``plan.m == M``), or one row per assignment when ``ids``
    (int64 ``[A]``) is given (expert ``ids[a]``, activation row ``a // a_div``, output row ``a``)."""
    m = x.shape[0] if ids is None else 1
    if m != plan.m:
        raise ValueError(f"plan for M={plan.m} used with M={m}")
    if kind_for(m, x.dtype) is None or (plan.kind == "mma" and x.dtype != torch.bfloat16) or x.stride(-1) != 1:
        raise ValueError(f"the {plan.kind} decode kernel cannot take M={m} contiguous={x.stride(-1) == 1} {x.dtype}")
    if plan.atomic and (ids is not None or packed2 is not None or out.dtype != torch.float32):
        raise ValueError("FMA split-K accumulates with fp32 atomics: linear only, into a zeroed fp32 output")
    if ids is not None and ids.dtype != torch.int64:
        ids = ids.to(torch.int64)
    smem = plan.smem(k)
    if smem >= SMEM_LIMIT:
        raise ValueError(f"{smem} bytes of staged activations exceed {SMEM_LIMIT}; raise split_k")
    words = packed.view(torch.int32)
    w2 = packed2.view(torch.int32) if packed2 is not None else words
    kern = _kernel(plan.kind, plan.tile, m, wfmt, ids is not None, packed2 is not None,
                   plan.split_k if plan.kind == "mma" else 1)
    head = [x, x.stride(0)] + ([] if plan.kind == "mma" else [_DTYPE_CODE[x.dtype]])
    kern(grid=(-(-n // plan.rows_per_block), plan.split_k, 1 if ids is None else ids.numel()),
         block=((MMA_WARPS if plan.kind == "mma" else FMA_WARPS) * 32, 1, 1), shared_mem=smem,
         args=[*head, ids if ids is not None else out_scale, a_div,
               words, scales, w2, scales2 if scales2 is not None else scales,
               words.stride(0), words.stride(1), scales.stride(0), scales.stride(1),
               out_scale, out_scale2 if out_scale2 is not None else out_scale, fold_log2,
               out, out.stride(0), _DTYPE_CODE[out.dtype], m, n, k, plan.split_k])
    return out
