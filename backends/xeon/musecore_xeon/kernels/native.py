"""The INT4 kernels in C: a GEMV / skinny GEMM for small M and the dense-tile dequantizer, compiled at
first use and called through ctypes.

Why: PyTorch's ``_weight_int4pack_mm_for_cpu`` is compute-bound on AVX2 (~6 Gweights/s per core, 15-20%
of the memory bandwidth at M=1 on the 2-core EPYC), so INT4 decode was only 1.15-1.5x BF16. This GEMV
decodes 8 codes with two vector ops (AND or shift, int32 -> fp32) and one FMA, on a layout made for it:

**Nibble-planar layout.** A row of K codes is cut into chunks of C = max(g, 64) columns, each stored as
W = C/8 int32 words; nibble j of word q holds column ``j*W + q`` of the chunk (for g = 128: 16 words,
nibble j = columns 16j..16j+15). ``w & (0xF << 4j)`` converted to fp32 is ``q * 2^(4j)`` exactly, so the
activation is pre-scaled once per call (``x * 2^-4j``, a power of two: exact) and the inner loop is
AND, CVT, FMA per 8 weights (nibble 7 is shifted down instead: bit 31 is the sign). The scales are the
QTensor's own fp16 values with the zero, ``(scale, z)`` fp16 pairs ``[N, K/g, 2]``: 4 bytes per group,
the same as PyTorch's bf16 (scale, zero) pairs, and the weights are exact (``(q - z) * scale`` fits
fp32). Per group and row, ``sum x*(q-z)*s = s*sum(x*q) - z*s*sum_group(x)``: the raw sum is a vector
accumulator, then one FMA with the scale; the zero term uses group sums of x computed once per call.
Only the summation order differs from a dequantize-then-matmul (fp32 accumulation throughout).

The same codes feed the dense-tile path above the crossover M (``musecore_int4_dequant``: fp32 tiles
for SGEMM), so there is one resident copy of the codes (0.53 byte/weight at g = 128).

**Threads.** Row blocks are split with OpenMP over ``torch.get_num_threads()`` threads, linked against
PyTorch's own ``libgomp`` (``torch/lib``): one thread pool for PyTorch and these kernels (a second
OpenMP runtime spins and fights PyTorch's on a 2-core host). Without that library the code is built
without OpenMP (one thread), and :data:`UNAVAILABLE` says so.

Build: the system C compiler (``$CC``, ``cc`` or ``gcc``; no PyTorch headers, ~1 s) the first time; the
shared object is cached under ``$MUSECORE_XEON_CACHE`` (default ``~/.cache/musecore_xeon``) keyed by a
hash of the source and flags. ``-mavx2 -mfma -mf16c`` where the CPU has them; elsewhere the portable C
path (``#ifndef __AVX2__``) is compiled. Without a compiler, or with ``MUSECORE_XEON_NATIVE_DEQUANT=0``,
the backend runs PyTorch's int4pack kernel and PyTorch-op dequantization, announced by a RuntimeWarning.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path
from typing import Optional

import torch

from musecore_xeon.kernels.native_ops_source import OPS_SOURCE

NATIVE_ENV = "MUSECORE_XEON_NATIVE_DEQUANT"
CACHE_ENV = "MUSECORE_XEON_CACHE"
ROWS = 4  # rows per GEMV block (ROWS in the C source): the nibble-planar codes are padded to a multiple

SOURCE = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

/* Nibble-planar INT4 layout (see musecore_xeon/kernels/native.py): a row of K codes is cut into chunks of
   C = max(g, 64) columns, each stored as W = C/8 int32 words; nibble j of word q holds column j*W + q of the
   chunk, so one nibble of W consecutive words is W consecutive columns. */
#define ROWS 4 /* rows per block of the GEMV; codes are padded to a multiple of it */
/* Calls streaming fewer code bytes than these run on the calling thread: an OpenMP fork/join and barriers
   (~5-20 us on 2 cores, more when a sibling thread is descheduled) cost more than a second core saves.
   Measured on the 2-core EPYC: a 512x768 GEMV (196 KiB) still gains from 2 threads (47 vs 65 us); the fused
   MoE of muse-tiny (4 experts, 196 KiB, 3 barriers) loses (INT4/BF16 decode 0.96x with 2 threads, 1.24x with one). */
#define GEMV_PARALLEL_MIN_BYTES (64 * 1024)
#define MOE_PARALLEL_MIN_BYTES (256 * 1024)
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 2048 /* how far ahead (at least) the GEMV prefetches its codes; 2 KiB measured best of 0/2/4/8 KiB */
#endif

static inline int64_t chunk_of(int64_t g) { return g >= 64 ? g : 64; }

static inline float bits_to_float(uint32_t b) { float f; memcpy(&f, &b, 4); return f; }

static inline float half_to_float(uint16_t h) {
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 31u, man = h & 1023u;
    if (e == 0) { float f = (float)man * 5.9604644775390625e-8f; return sign ? -f : f; }
    if (e == 31) return bits_to_float(sign | 0x7F800000u | (man << 13));
    return bits_to_float(sign | ((e + 112u) << 23) | (man << 13));
#endif
}

static inline uint16_t float_to_bf16(float f) { /* round to nearest even; NaN stays NaN */
    uint32_t b; memcpy(&b, &f, 4);
    if ((b & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((b >> 16) | 64);
    return (uint16_t)((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}

static inline float load_x(const void *x, int bf16, int64_t i) {
    return bf16 ? bits_to_float((uint32_t)((const uint16_t *)x)[i] << 16) : ((const float *)x)[i];
}

/* Per-thread scratch, grown as needed (a fresh large malloc per call would be a fresh mmap: page faults). */
static __thread float *scratch_buf;
static __thread size_t scratch_cap;
static float *scratch(size_t n) {
    if (n > scratch_cap) {
        free(scratch_buf);
        scratch_buf = (float *)malloc(n * sizeof(float));
        scratch_cap = scratch_buf ? n : 0;
    }
    return scratch_buf;
}

/* xs[m, c] = x[m, c] * 2^(-4j) where j < 7 is the nibble holding column c (j = 7 is shifted down, factor 1);
   xsum[m, grp] = the sum of x[m, :] over each group. */
static void prepare_x(const void *x, int x_bf16, int64_t m_rows, int64_t k, int64_t g, float *xs, float *xsum) {
    const int64_t chunk = chunk_of(g), words = chunk / 8, groups = k / g;
    for (int64_t m = 0; m < m_rows; ++m) {
        for (int64_t grp = 0; grp < groups; ++grp) xsum[m * groups + grp] = 0.0f;
        for (int64_t c0 = 0; c0 < k; c0 += chunk)
            for (int j = 0; j < 8; ++j) {
                const float factor = j == 7 ? 1.0f : bits_to_float((uint32_t)(127 - 4 * j) << 23);
                const int64_t base = c0 + j * words;
                float sum = 0.0f;
                for (int64_t q = 0; q < words; ++q) {
                    const float v = load_x(x, x_bf16, m * k + base + q);
                    xs[m * k + base + q] = v * factor;
                    sum += v;
                }
                xsum[m * groups + base / g] += sum;
            }
    }
}

static inline void store_y(void *y, int y_bf16, int64_t i, float v) {
    if (y_bf16) ((uint16_t *)y)[i] = float_to_bf16(v);
    else ((float *)y)[i] = v;
}

#ifdef __AVX2__
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* One activation row, ROWS rows of W: the codes are decoded once per 8 columns (AND or shift, int -> float,
   exact) into fp32 FMAs against the pre-scaled activation. Per group: acc = sum xs * (q << 4j), then
   tot += scale * acc; the zero term -z*scale*sum_group(x) is a scalar added once per group. */
static inline __attribute__((always_inline)) void gemv_rows(
        const int32_t *codes, const uint16_t *sz, const float *xs, const float *xsum, float out[ROWS],
        int64_t n, int64_t k, const int64_t g) {
    const int64_t kw = k / 8, groups = k / g, chunk = chunk_of(g), words = chunk / 8, vecs = words / 8;
    /* whole row blocks ahead, at least PREFETCH_BYTES (short rows: K = 512 is 1 KiB per block) */
    const int64_t block_bytes = ROWS * kw * 4, prefetch_words = ROWS * kw * ((PREFETCH_BYTES + block_bytes - 1) / block_bytes);
    __m256 acc[ROWS], tot[ROWS];
    float off[ROWS];
    const int32_t *row[ROWS];
    for (int r = 0; r < ROWS; ++r) {
        acc[r] = tot[r] = _mm256_setzero_ps(); off[r] = 0.0f; row[r] = codes + (n + r) * kw;
    }
#define FLUSH(GRP)                                                                              \
    for (int r = 0; r < ROWS; ++r) {                                                            \
        const uint16_t *p = sz + ((n + r) * groups + (GRP)) * 2;                                \
        const float s = half_to_float(p[0]);                                                    \
        tot[r] = _mm256_fmadd_ps(acc[r], _mm256_set1_ps(s), tot[r]);                            \
        acc[r] = _mm256_setzero_ps();                                                           \
        off[r] -= half_to_float(p[1]) * s * xsum[GRP];                                          \
    }
    for (int64_t c = 0; c < k / chunk; ++c) {
        for (int64_t v = 0; v < vecs; ++v) {
            __m256i w[ROWS];
            for (int r = 0; r < ROWS; ++r) {
                w[r] = _mm256_loadu_si256((const __m256i *)(row[r] + c * words + v * 8));
                /* the same columns of the next row block (ROWS rows further): a block's rows are 4 short
                   streams (1 KiB each at K = 2048) that the hardware prefetcher picks up too late */
                _mm_prefetch((const char *)(row[r] + c * words + v * 8 + prefetch_words), _MM_HINT_T0);
            }
            const float *xc = xs + c * chunk + v * 8;
#pragma GCC unroll 8
            for (int j = 0; j < 8; ++j) {
                const __m256 xv = _mm256_loadu_ps(xc + j * words);
                for (int r = 0; r < ROWS; ++r) {
                    const __m256i bits = j == 7 ? _mm256_srli_epi32(w[r], 28)
                                                : _mm256_and_si256(w[r], _mm256_set1_epi32(15 << (4 * j)));
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(bits), xv, acc[r]);
                }
                if (chunk != g && j == 3) { FLUSH(2 * c) } /* g = 32: nibbles 0-3 are one group, 4-7 the next */
            }
        }
        if (chunk != g) { FLUSH(2 * c + 1) } else { FLUSH(c) }
    }
#undef FLUSH
    for (int r = 0; r < ROWS; ++r) out[r] = hsum(tot[r]) + off[r];
}

/* ROWS rows decoded once per group into an L1 buffer of q << 4j floats, then multiplied into the
   activation rows two at a time (8 accumulators: 4 rows x 2 activations). */
static inline __attribute__((always_inline)) void gemm_rows(
        const int32_t *codes, const uint16_t *sz, const float *xs, const float *xsum, void *y, int y_bf16,
        int64_t n, int64_t n_valid, int64_t m_rows, int64_t k, const int64_t g) {
    const int64_t kw = k / 8, groups = k / g, chunk = chunk_of(g), words = chunk / 8;
    float dq[ROWS][256] __attribute__((aligned(32)));
    float tot[16][ROWS];  /* the caller passes at most 16 activation rows at a time */
    for (int64_t m = 0; m < m_rows; ++m)
        for (int r = 0; r < ROWS; ++r) tot[m][r] = 0.0f;
    for (int64_t c = 0; c < k / chunk; ++c) {
        for (int r = 0; r < ROWS; ++r) {
            const int32_t *src = codes + (n + r) * kw + c * words;
            for (int64_t v = 0; v < words / 8; ++v) {
                const __m256i w = _mm256_loadu_si256((const __m256i *)(src + v * 8));
#pragma GCC unroll 8
                for (int j = 0; j < 8; ++j) {
                    const __m256i bits = j == 7 ? _mm256_srli_epi32(w, 28)
                                                : _mm256_and_si256(w, _mm256_set1_epi32(15 << (4 * j)));
                    _mm256_store_ps(dq[r] + j * words + v * 8, _mm256_cvtepi32_ps(bits));
                }
            }
        }
        for (int64_t h = 0; h < chunk / g; ++h) {  /* the groups of this chunk (2 when g = 32) */
            const int64_t grp = c * (chunk / g) + h;
            float s[ROWS], o[ROWS];
            for (int r = 0; r < ROWS; ++r) {
                const uint16_t *p = sz + ((n + r) * groups + grp) * 2;
                s[r] = half_to_float(p[0]);
                o[r] = -half_to_float(p[1]) * s[r];
            }
            for (int64_t m = 0; m < m_rows; m += 2) {
                const int pair = m + 1 < m_rows;
                const float *x0 = xs + m * k + c * chunk + h * g, *x1 = pair ? x0 + k : x0;
                __m256 acc[ROWS][2];
                for (int r = 0; r < ROWS; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
                for (int64_t e = 0; e < g; e += 8) {
                    const __m256 a = _mm256_loadu_ps(x0 + e), b = _mm256_loadu_ps(x1 + e);
                    for (int r = 0; r < ROWS; ++r) {
                        const __m256 d = _mm256_load_ps(dq[r] + h * g + e);
                        acc[r][0] = _mm256_fmadd_ps(d, a, acc[r][0]);
                        acc[r][1] = _mm256_fmadd_ps(d, b, acc[r][1]);
                    }
                }
                for (int r = 0; r < ROWS; ++r) {
                    tot[m][r] += s[r] * hsum(acc[r][0]) + o[r] * xsum[m * groups + grp];
                    if (pair) tot[m + 1][r] += s[r] * hsum(acc[r][1]) + o[r] * xsum[(m + 1) * groups + grp];
                }
            }
        }
    }
    for (int64_t m = 0; m < m_rows; ++m)
        for (int r = 0; r < ROWS; ++r)
            if (n + r < n_valid) store_y(y, y_bf16, m * n_valid + n + r, tot[m][r]);
}

static inline __attribute__((always_inline)) void row_block_g(
        const int32_t *codes, const uint16_t *sz, const float *xs, const float *xsum, void *y, int y_bf16,
        int64_t n, int64_t n_valid, int64_t m_rows, int64_t k, const int64_t g) {
    if (m_rows == 1) {
        float out[ROWS];
        gemv_rows(codes, sz, xs, xsum, out, n, k, g);
        for (int r = 0; r < ROWS; ++r)
            if (n + r < n_valid) store_y(y, y_bf16, n + r, out[r]);
        return;
    }
    for (int64_t m = 0; m < m_rows; m += 16) {
        const int64_t mb = m_rows - m < 16 ? m_rows - m : 16;
        gemm_rows(codes, sz, xs + m * k, xsum + m * (k / g), (char *)y + m * n_valid * (y_bf16 ? 2 : 4), y_bf16,
                  n, n_valid, mb, k, g);
    }
}

static void row_block(const int32_t *codes, const uint16_t *sz, const float *xs, const float *xsum, void *y,
                      int y_bf16, int64_t n, int64_t n_valid, int64_t m_rows, int64_t k, int64_t g) {
    switch (g) {  /* the group size as a constant: the loops over a group unroll */
    case 32: row_block_g(codes, sz, xs, xsum, y, y_bf16, n, n_valid, m_rows, k, 32); break;
    case 64: row_block_g(codes, sz, xs, xsum, y, y_bf16, n, n_valid, m_rows, k, 64); break;
    case 128: row_block_g(codes, sz, xs, xsum, y, y_bf16, n, n_valid, m_rows, k, 128); break;
    default: row_block_g(codes, sz, xs, xsum, y, y_bf16, n, n_valid, m_rows, k, 256); break;
    }
}
#else
/* Portable C (no AVX2): the same decoding and the same per-group sums, one row and one activation row at a time. */
static void row_block(const int32_t *codes, const uint16_t *sz, const float *xs, const float *xsum, void *y,
                      int y_bf16, int64_t n, int64_t n_valid, int64_t m_rows, int64_t k, int64_t g) {
    const int64_t kw = k / 8, groups = k / g, chunk = chunk_of(g), words = chunk / 8;
    for (int64_t r = n; r < n + ROWS && r < n_valid; ++r)
        for (int64_t m = 0; m < m_rows; ++m) {
            float tot = 0.0f, off = 0.0f;
            for (int64_t grp = 0; grp < groups; ++grp) {
                const uint16_t *p = sz + (r * groups + grp) * 2;
                const float s = half_to_float(p[0]), o = -half_to_float(p[1]) * s;
                float acc = 0.0f;
                for (int64_t col = grp * g; col < (grp + 1) * g; ++col) {
                    const int64_t c0 = col / chunk * chunk, j = (col - c0) / words, q = (col - c0) % words;
                    const uint32_t w = (uint32_t)codes[r * kw + c0 / 8 + q];
                    const float d = j == 7 ? (float)(w >> 28) : (float)(w & (15u << (4 * j)));
                    acc += d * xs[m * k + col];
                }
                tot += s * acc;
                off += o * xsum[m * groups + grp];
            }
            store_y(y, y_bf16, m * n_valid + r, tot + off);
        }
}
#endif

/* y[M, n_valid] = x[M, K] @ W.T with W = (q - z) * scale from nibble-planar codes int32 [n_rows, K/8] and
   fp16 (scale, zero) pairs [n_rows, K/g, 2]; n_rows is a multiple of ROWS (padded rows are never stored).
   x and y are fp32 or bf16. Row blocks are split over `threads` OpenMP threads (PyTorch's own runtime). */
void musecore_int4_gemv(const int32_t *codes, const uint16_t *sz, const void *x, int x_bf16, void *y, int y_bf16,
                        int64_t m_rows, int64_t k, int64_t g, int64_t n_rows, int64_t n_valid, int threads) {
    const int64_t groups = k / g;
    float *xs = scratch((size_t)(m_rows * k + m_rows * groups));
    if (xs == NULL) return;
    float *xsum = xs + m_rows * k;
    prepare_x(x, x_bf16, m_rows, k, g, xs, xsum);
    const int64_t blocks = n_rows / ROWS;
#ifdef _OPENMP
    if (threads > blocks) threads = (int)blocks;
    if (n_rows * k / 2 * m_rows < GEMV_PARALLEL_MIN_BYTES) threads = 1;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
#endif
    for (int64_t blk = 0; blk < blocks; ++blk)
        row_block(codes, sz, xs, xsum, y, y_bf16, blk * ROWS, n_valid, m_rows, k, g);
}

/* silu(g) * u for n values, fp32; AVX2: exp from a degree-5 polynomial on the reduced argument
   (Cephes expf, relative error ~2e-7), so the SwiGLU of a decode call is a few microseconds. */
#ifdef __AVX2__
static inline __m256 exp_ps(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

static void swiglu(const float *gate, const float *up, float *h, int64_t n) {
    int64_t i = 0;
#ifdef __AVX2__
    for (; i + 8 <= n; i += 8) {
        const __m256 g = _mm256_loadu_ps(gate + i);
        const __m256 sig = _mm256_div_ps(_mm256_set1_ps(1.0f), _mm256_add_ps(_mm256_set1_ps(1.0f),
                                                                              exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), g))));
        _mm256_storeu_ps(h + i, _mm256_mul_ps(_mm256_mul_ps(g, sig), _mm256_loadu_ps(up + i)));
    }
#endif
    for (; i < n; ++i) h[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
}

/* The routed experts of one MoE call in ONE native call (decode sizes, below the dense-tile crossover):
     y[t] = sum_j w[t,j] * rms_norm(down_e(silu(gate_e(z_t)) * up_e(z_t))) * out_norm[e],  e = ids[t,j]
   gu_* / dn_* are arrays of E pointers to each expert's nibble-planar codes and fp16 (scale, zero) pairs
   (fused [gate; up] rows 0..2I-1, then down [l, I]). The (t, j) pairs are grouped by expert (counting sort,
   stable), so an expert's bytes are read once per call for all its tokens; the gate/up row blocks of all
   routed experts are one parallel loop, then the SwiGLU, the down row blocks, and the norm + weighted sum,
   all in one OpenMP region (3 barriers instead of a fork/join per expert and projection). fp32 throughout:
   the intermediate h is not rounded to bf16 (the reference does not round it either). */
int musecore_int4_moe(const int64_t *gu_codes, const int64_t *gu_sz, const int64_t *dn_codes, const int64_t *dn_sz,
                       const void *z, int z_bf16, const int64_t *ids, const float *weights, const void *out_norm,
                       int norm_bf16, float eps, float *y, int64_t T, int64_t k_top, int64_t E, int64_t l,
                       int64_t inter, int64_t g_gu, int64_t g_dn, int64_t gu_rows, int64_t dn_rows, int threads) {
    const int64_t P = T * k_top, gu_groups = l / g_gu, dn_groups = inter / g_dn, two_i = 2 * inter;
    const size_t ints = (size_t)(2 * E + 1 + 3 * P),
                 floats = (size_t)(P * (l + gu_groups + two_i + inter + dn_groups + l) + 1) & ~(size_t)1; /* 8-byte aligned ints */
    for (int64_t p = 0; p < P; ++p)
        if (ids[p] < 0 || ids[p] >= E) return -1;
    float *buf = scratch(floats + ints * 2);  /* int64 counters at the end: 2 floats each */
    if (buf == NULL) return -2;
    float *xs_gu = buf, *xsum_gu = xs_gu + P * l, *gu_out = xsum_gu + P * gu_groups, *xs_dn = gu_out + P * two_i,
          *xsum_dn = xs_dn + P * inter, *dn_out = xsum_dn + P * dn_groups;
    int64_t *start = (int64_t *)(dn_out + P * l), *count = start + E + 1, *sorted = count + E, *row_of = sorted + P,
            *expert_list = row_of + P;
    for (int64_t e = 0; e < E; ++e) count[e] = 0;
    for (int64_t p = 0; p < P; ++p) count[ids[p]]++;
    int64_t routed = 0;
    start[0] = 0;
    for (int64_t e = 0; e < E; ++e) {
        start[e + 1] = start[e] + count[e];
        if (count[e]) expert_list[routed++] = e;
        count[e] = 0;
    }
    for (int64_t p = 0; p < P; ++p) {  /* stable: pairs keep their order within an expert */
        const int64_t r = start[ids[p]] + count[ids[p]]++;
        sorted[r] = p; row_of[p] = r;
    }
    const size_t zsize = z_bf16 ? 2 : 4;
    for (int64_t r = 0; r < P; ++r)
        prepare_x((const char *)z + (sorted[r] / k_top) * l * zsize, z_bf16, 1, l, g_gu, xs_gu + r * l,
                  xsum_gu + r * gu_groups);
    const int64_t gu_blocks = gu_rows / ROWS, dn_blocks = dn_rows / ROWS;
    if (routed * (gu_rows * l + dn_rows * inter) / 2 < MOE_PARALLEL_MIN_BYTES) threads = 1;
#ifdef _OPENMP
#pragma omp parallel num_threads(threads) if (threads > 1)
#endif
    {
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
        for (int64_t item = 0; item < routed * gu_blocks; ++item) {
            const int64_t e = expert_list[item / gu_blocks], blk = item % gu_blocks, r0 = start[e];
            row_block((const int32_t *)gu_codes[e], (const uint16_t *)gu_sz[e], xs_gu + r0 * l,
                      xsum_gu + r0 * gu_groups, gu_out + r0 * two_i, 0, blk * ROWS, two_i, start[e + 1] - r0, l, g_gu);
        }
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
        for (int64_t r = 0; r < P; ++r) {
            float *g = gu_out + r * two_i;
            swiglu(g, g + inter, g, inter);  /* h overwrites the gate half */
            prepare_x(g, 0, 1, inter, g_dn, xs_dn + r * inter, xsum_dn + r * dn_groups);
        }
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
        for (int64_t item = 0; item < routed * dn_blocks; ++item) {
            const int64_t e = expert_list[item / dn_blocks], blk = item % dn_blocks, r0 = start[e];
            row_block((const int32_t *)dn_codes[e], (const uint16_t *)dn_sz[e], xs_dn + r0 * inter,
                      xsum_dn + r0 * dn_groups, dn_out + r0 * l, 0, blk * ROWS, l, start[e + 1] - r0, inter, g_dn);
        }
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
        for (int64_t t = 0; t < T; ++t) {  /* per-expert RMSNorm, then the routing weight, then the fp32 sum */
            float *yt = y + t * l;
            for (int64_t c = 0; c < l; ++c) yt[c] = 0.0f;
            for (int64_t j = 0; j < k_top; ++j) {
                const int64_t p = t * k_top + j, e = ids[p];
                const float *o = dn_out + row_of[p] * l;
                float ss = 0.0f;
                for (int64_t c = 0; c < l; ++c) ss += o[c] * o[c];
                const float f = weights[p] / sqrtf(ss / (float)l + eps);
                for (int64_t c = 0; c < l; ++c) {
                    const float nw = norm_bf16 ? bits_to_float((uint32_t)((const uint16_t *)out_norm)[e * l + c] << 16)
                                               : ((const float *)out_norm)[e * l + c];
                    yt[c] += o[c] * f * nw;
                }
            }
        }
    }
    return 0;
}

/* out[r, c] = (q - z) * scale of rows r < rows (fp32 [rows, K]), exact: (q - z) * an fp16 scale fits fp32. */
void musecore_int4_dequant(const int32_t *codes, const uint16_t *sz, float *out, int64_t rows, int64_t k, int64_t g,
                           int threads) {
    const int64_t kw = k / 8, groups = k / g, chunk = chunk_of(g), words = chunk / 8;
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && rows >= 8)
#endif
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t c0 = 0; c0 < k; c0 += chunk) {
            const uint32_t *w = (const uint32_t *)codes + r * kw + c0 / 8;
            for (int j = 0; j < 8; ++j) {
                const uint16_t *p = sz + (r * groups + (c0 + j * words) / g) * 2;
                const float s = half_to_float(p[0]), o = -half_to_float(p[1]) * s;
                float *dst = out + r * k + c0 + j * words;
                for (int64_t q = 0; q < words; ++q) dst[q] = (float)((w[q] >> (4 * j)) & 15u) * s + o;
            }
        }
}

int musecore_int4_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}
""" + OPS_SOURCE


def torch_libgomp() -> Optional[Path]:
    """PyTorch's bundled OpenMP runtime, if it has one (pip wheels on Linux ship ``torch/lib/libgomp.so.1``)."""
    lib = Path(torch.__file__).parent / "lib"
    candidates = sorted(lib.glob("libgomp*.so*"))
    return candidates[0] if candidates else None


def compile_flags() -> list[str]:
    from musecore_xeon.cpu import read_cpu_info
    info = read_cpu_info()
    isa = ["-mavx2", "-mfma"] if info.has("avx2") and info.has("fma") else []
    if isa and info.has("f16c"):
        isa.append("-mf16c")
    gomp = torch_libgomp()
    # -fopenmp links "libgomp.so.1"; -L/-rpath make that PyTorch's copy, already loaded by `import torch`
    omp = ["-fopenmp", f"-L{gomp.parent}", f"-Wl,-rpath,{gomp.parent}"] if gomp is not None else []
    return ["-O3", "-fPIC", "-shared", *isa, *omp]


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "musecore_xeon")


UNAVAILABLE: list[str] = []  # why the native kernels are not used (or run single-threaded), once known


def _unavailable(reason: str) -> None:
    """Not a silent fallback: the slower PyTorch paths are announced once, with the reason."""
    UNAVAILABLE.append(reason)
    warnings.warn(f"musecore-xeon: {reason}; INT4 runs PyTorch's _weight_int4pack_mm_for_cpu at small M and "
                  f"PyTorch-op dequantization for dense tiles (same values, slower). Set {NATIVE_ENV}=0 to "
                  "choose that explicitly.", RuntimeWarning, stacklevel=3)


def disabled() -> bool:
    return os.environ.get(NATIVE_ENV, "").strip().lower() in ("0", "off", "no", "false")


@functools.cache
def load() -> Optional[ctypes.CDLL]:
    """The compiled kernels, or None (disabled, no compiler, or the build failed)."""
    if disabled():
        UNAVAILABLE.append(f"disabled by {NATIVE_ENV}")
        return None
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    try:
        flags = compile_flags()
        digest = hashlib.sha256((SOURCE + " ".join(flags) + " libs: -lm").encode()).hexdigest()[:16]
        target = cache_dir() / f"int4-{digest}.so"
        if not target.exists():
            if compiler is None:
                _unavailable("no C compiler (cc/gcc) to build the native INT4 kernels")
                return None
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                src, obj = Path(tmp) / "int4.c", Path(tmp) / "int4.so"
                src.write_text(SOURCE)
                subprocess.run([compiler, *flags, "-o", str(obj), str(src), "-lm"], check=True, capture_output=True,
                               timeout=120)
                os.replace(obj, target)  # atomic: concurrent processes never load a half-written file
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as err:
        detail = getattr(err, "stderr", b"") or b""
        _unavailable(f"building/loading the native INT4 kernels failed ({type(err).__name__}: {err} "
                     f"{detail.decode(errors='replace')[-500:]})")
        return None
    lib.musecore_int4_gemv.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int, ctypes.c_void_p, ctypes.c_int] \
        + [ctypes.c_int64] * 5 + [ctypes.c_int]
    lib.musecore_int4_gemv.restype = None
    lib.musecore_int4_moe.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int] + [ctypes.c_void_p] * 3 \
        + [ctypes.c_int, ctypes.c_float, ctypes.c_void_p] + [ctypes.c_int64] * 9 + [ctypes.c_int]
    lib.musecore_int4_moe.restype = ctypes.c_int
    vp, i, i64, f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
    lib.musecore_rms_norm.argtypes = [vp, i, vp, i, vp, i, i64, i64, f32]
    lib.musecore_residual_norm.argtypes = [vp, vp, i, vp, i, vp, i, vp, i, vp, vp, i, i64, i64, f32]
    lib.musecore_norm_rope.argtypes = [vp, i, vp, i, vp, vp, vp, i64, i64, i64, f32]
    lib.musecore_head_norm_gate.argtypes = [vp, i, vp, i, vp, i, vp, i64, i64, f32]
    lib.musecore_attention.argtypes = [vp, i, vp, vp, i, vp, vp, i64, f32, vp] + [i64] * 6 + [i]
    for name in ("rms_norm", "residual_norm", "norm_rope", "head_norm_gate", "attention"):
        getattr(lib, f"musecore_{name}").restype = None
    lib.musecore_int4_dequant.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    lib.musecore_int4_dequant.restype = None
    lib.musecore_int4_openmp.restype = ctypes.c_int
    if not lib.musecore_int4_openmp():
        UNAVAILABLE.append("built without OpenMP (PyTorch bundles no libgomp here): the INT4 kernels run on one thread")
    return lib


def available() -> bool:
    return load() is not None


def _check(name: str, t: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> None:
    if t.dtype not in dtypes or not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor of {dtypes}, got {t.dtype} "
                         f"(contiguous={t.is_contiguous()})")


def _check_layout(codes: torch.Tensor, scale_zero: torch.Tensor, k: int, group_size: int) -> None:
    _check("codes", codes, (torch.int32,))
    _check("scale_zero", scale_zero, (torch.float16,))
    rows = codes.shape[0]
    if k % max(group_size, 64) or group_size not in (32, 64, 128, 256) or codes.shape != (rows, k // 8) \
            or scale_zero.shape != (rows, k // group_size, 2):
        raise ValueError(f"nibble-planar INT4: codes {tuple(codes.shape)}, scale_zero {tuple(scale_zero.shape)}, "
                         f"K={k}, group size {group_size} do not match (expected codes [N, K/8], "
                         "scale_zero [N, K/g, 2], g in 32/64/128/256, K a multiple of max(g, 64))")


def int4_gemv(codes: torch.Tensor, scale_zero: torch.Tensor, x: torch.Tensor, group_size: int,
              out_features: int) -> torch.Tensor:
    """``x [M, K] @ W.T -> [M, out_features]`` in ``x``'s dtype (bf16 or fp32; fp32 accumulation) from
    nibble-planar ``codes`` int32 ``[N, K/8]`` (N a multiple of :data:`ROWS`) and fp16 ``scale_zero``
    ``[N, K/g, 2]``.

    Example::

        y = int4_gemv(lin.codes, lin.scale_zero, x_bf16, 128, lin.out_features)
    """
    lib = load()
    if lib is None:
        raise RuntimeError("the native INT4 kernels are not available (see musecore_xeon.kernels.native.UNAVAILABLE)")
    m, k = x.shape
    _check_layout(codes, scale_zero, k, group_size)
    _check("x", x, (torch.bfloat16, torch.float32))
    if codes.shape[0] % ROWS or not 0 < out_features <= codes.shape[0]:
        raise ValueError(f"int4_gemv: {codes.shape[0]} code rows (a multiple of {ROWS}) for {out_features} outputs")
    y = torch.empty(m, out_features, dtype=x.dtype)
    bf16 = int(x.dtype == torch.bfloat16)
    lib.musecore_int4_gemv(codes.data_ptr(), scale_zero.data_ptr(), x.data_ptr(), bf16, y.data_ptr(), bf16,
                           m, k, group_size, codes.shape[0], out_features, torch.get_num_threads())
    return y


class Int4Gemv:
    """:func:`int4_gemv` bound to one weight: the layout is checked and the pointers read once, so a call
    costs the ctypes call, one ``torch.empty`` and a dtype check (~4 us instead of ~10 us per call; decode
    makes ~100 of these per token). The weight tensors must stay alive and unmoved (the owner keeps them).

    Example::

        gemv = Int4Gemv(lin.codes, lin.scale_zero, 128, lin.out_features)
        y = gemv(x_bf16)                      # [M, N]
    """

    def __init__(self, codes: torch.Tensor, scale_zero: torch.Tensor, group_size: int, out_features: int) -> None:
        lib = load()
        if lib is None:
            raise RuntimeError("the native INT4 kernels are not available "
                               "(see musecore_xeon.kernels.native.UNAVAILABLE)")
        self.in_features = codes.shape[1] * 8
        _check_layout(codes, scale_zero, self.in_features, group_size)
        if codes.shape[0] % ROWS or not 0 < out_features <= codes.shape[0]:
            raise ValueError(f"int4_gemv: {codes.shape[0]} code rows (a multiple of {ROWS}) for {out_features} outputs")
        self.codes, self.scale_zero = codes, scale_zero  # kept alive with the pointers
        self.fn, self.out_features = lib.musecore_int4_gemv, out_features
        self.weight_ptrs = (codes.data_ptr(), scale_zero.data_ptr())
        self.shape_args = (self.in_features, group_size, codes.shape[0], out_features)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if (dtype is not torch.bfloat16 and dtype is not torch.float32) or not x.is_contiguous() \
                or x.dim() != 2 or x.shape[1] != self.in_features:
            raise ValueError(f"int4_gemv: x must be a contiguous bf16/fp32 [M, {self.in_features}] tensor; got "
                             f"{dtype} {tuple(x.shape)} (contiguous={x.is_contiguous()})")
        m = x.shape[0]
        y = torch.empty(m, self.out_features, dtype=dtype)
        bf16 = int(dtype is torch.bfloat16)
        k, g, n_rows, n_valid = self.shape_args
        self.fn(*self.weight_ptrs, x.data_ptr(), bf16, y.data_ptr(), bf16, m, k, g, n_rows, n_valid,
                torch.get_num_threads())
        return y


def int4_dequant(codes: torch.Tensor, scale_zero: torch.Tensor, out: torch.Tensor, group_size: int) -> torch.Tensor:
    """``out [rows, K] = (q - z) * scale`` (fp32, exact) from nibble-planar codes; returns ``out``."""
    lib = load()
    if lib is None:
        raise RuntimeError("the native INT4 kernels are not available (see musecore_xeon.kernels.native.UNAVAILABLE)")
    rows, k = out.shape
    _check_layout(codes, scale_zero, k, group_size)
    _check("out", out, (torch.float32,))
    if codes.shape[0] != rows:
        raise ValueError(f"int4_dequant: {codes.shape[0]} code rows for an output of {rows} rows")
    lib.musecore_int4_dequant(codes.data_ptr(), scale_zero.data_ptr(), out.data_ptr(), rows, k, group_size,
                              torch.get_num_threads())
    return out


def int4_moe(pointers: torch.Tensor, z: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
             output_norm: torch.Tensor, eps: float, intermediate: int, group_sizes: tuple[int, int],
             padded_rows: tuple[int, int]) -> torch.Tensor:
    """The routed INT4 experts of one MoE call in one native call -> fp32 ``[T, l]``
    (``musecore_int4_moe``: gate/up GEMV, SwiGLU, down GEMV, per-expert RMSNorm, routing weight, sum).

    ``pointers`` int64 ``[4, E]``: per expert the data pointers of the fused gate/up codes, its scale/zero
    pairs, the down codes and its pairs (the tensors must stay alive: :class:`XeonExperts` holds them).
    ``z`` bf16/fp32 ``[T, l]``, ``ids`` int64 ``[T, k]``, ``weights`` fp32 ``[T, k]``, ``output_norm``
    bf16/fp32 ``[E, l]``, all contiguous. Meant for decode sizes: every expert's rows go through the
    GEMV / skinny-GEMM row blocks (no dense tiles).
    """
    lib = load()
    if lib is None:
        raise RuntimeError("the native INT4 kernels are not available (see musecore_xeon.kernels.native.UNAVAILABLE)")
    (t, l), (_, k_top), e = z.shape, ids.shape, pointers.shape[1]
    if z.dtype not in (torch.bfloat16, torch.float32):
        z = z.to(torch.bfloat16)
    if output_norm.dtype not in (torch.bfloat16, torch.float32):
        output_norm = output_norm.float()
    y = torch.empty(t, l, dtype=torch.float32)
    status = lib.musecore_int4_moe(*(pointers[i].data_ptr() for i in range(4)), z.data_ptr(), int(z.dtype == torch.bfloat16),
                          ids.data_ptr(), weights.data_ptr(), output_norm.data_ptr(),
                          int(output_norm.dtype == torch.bfloat16), eps, y.data_ptr(), t, k_top, e, l, intermediate,
                          group_sizes[0], group_sizes[1], padded_rows[0], padded_rows[1], torch.get_num_threads())
    if status == -1:
        raise ValueError(f"int4_moe: expert ids must lie in [0, {e}); got {ids.min().item()}..{ids.max().item()}")
    if status:
        raise MemoryError(f"int4_moe: no memory for the scratch buffers of {t}x{k_top} routed rows")
    return y
