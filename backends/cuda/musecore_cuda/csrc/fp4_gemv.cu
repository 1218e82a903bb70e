// FP4 decode GEMVs and dequantize; compiled after pdl.cuh (musecore_cuda/kernels/sources.py joins them).
// MUSECORE_GEMV_PLAIN 1: every decode GEMV without the lean path (session 55's code; the lab A/B's baseline).
#ifndef MUSECORE_GEMV_PLAIN
#define MUSECORE_GEMV_PLAIN 0
#endif
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

// An expert id or a permutation entry: through L2 only (`cg`) in a kernel that reads them while the kernels before
// it may still run (the hand-off's consumer, below), else through the read-only path.
__device__ __forceinline__ long long ld_index(const long long *p, bool cg) { return cg ? __ldcg(p) : *p; }

// Expert mode: program z is assignment a, expert ids[a], activation row a / a_div, output row a.
__device__ __forceinline__ void assignment(const long long *ids, int a_div, long long &e, long long &x_row,
                                           long long &y_row, bool cg = false) {
    const int a = blockIdx.z;
    e = ld_index(ids + a, cg);
    x_row = a / a_div;
    y_row = a;
}

// Runs (the MMA kernel's expert mode with ``perm``): ids are sorted by expert and perm[p] is the assignment at
// sorted position p. Program z = p heads a run chunk when p starts its expert's run or lies a multiple of `cap`
// positions into it; the chunk's up to `cap` assignments (one expert) share each weight chunk the block streams,
// so an expert chosen by several tokens is read once per chunk instead of once per assignment. Returns the
// chunk's length, 0 when program z is not a head (its assignments belong to an earlier program).
__device__ __forceinline__ int run_chunk(const long long *ids, int p, int n, int cap, bool cg) {
    const long long e = ld_index(ids + p, cg);
    int start = p;
    while (start > 0 && ld_index(ids + start - 1, cg) == e) --start;
    if ((p - start) % cap) return 0;
    int len = 1;
    while (len < cap && p + len < n && ld_index(ids + p + len, cg) == e) ++len;
    return len;
}

// Row of token m of this program: the run's assignment perm[p + m] / div, or base + m without runs.
__device__ __forceinline__ long long token_row(const long long *perm, int p, int m, long long base, int div,
                                               bool cg = false) {
    return perm ? ld_index(perm + p + m, cg) / div : base + m;
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
template <int R, int M, int WARPS, int WFMT, bool EXPERTS, bool SWIGLU, bool EARLY>
__global__ void __launch_bounds__(WARPS * 32) fp4_gemv(
        const u16 *__restrict__ x, int x_stride, int xt, const long long *__restrict__ ids, int a_div,
        const u32 *__restrict__ w, const u8 *__restrict__ s, const u32 *__restrict__ w2, const u8 *__restrict__ s2,
        int w_e, int w_n, int s_e, int s_n,
        const float *__restrict__ out_scale, const float *__restrict__ out_scale2, int fold,
        void *__restrict__ y, int y_stride, int ot, int m_rows, int N, int K, int split) {
    extern __shared__ float xs[];
    if (EARLY) pdl_trigger();  // (kernels/pdl.py: only the decode GEMVs signal the next kernel early)
    pdl_wait();  // the activations (and with EXPERTS the ids) are the previous kernels' outputs
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
// Tensor-core decode GEMM for bf16 activations, M <= 16: out^T[16 rows, 8 tokens] per mma.m16n8k16,
// weights as operand A (upcast in registers, never through shared memory), activations as B.
// Thread (g = lane / 4, t = lane % 4) of a warp loads 16 bytes (words 4t..4t+3 of a chunk) of rows
// g and g + 8 of each 16-row tile; word i of those feeds mmas 2i and 2i + 1: pairs 2j and 2j + 1 of
// the word (bf16x2 of two nibbles, see decode_bf16x2) are the A registers for logical k {2t, 2t+1}
// and {2t+8, 2t+9} of mma 2i + j. The activations are staged in shared memory in that same pair
// order ([token][chunk][word][pair] as bf16x2), so B is one 16-byte load per word.

__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
    u32 d; asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel)); return d;
}

__device__ __forceinline__ u32 bmul2(u32 a, u32 b) {
    u32 d; asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b)); return d;
}

// Scale byte -> (scale * 2**(126 - fold)) as bf16x2, exact (at most 4 significant bits).
template <int WFMT>
__device__ __forceinline__ u32 group_mult_bf16x2(u32 s, int fold) {
    float v;
    if (WFMT == 1) {  // e4m3 -> f16 in hardware (sm_89+; exact, subnormals included), then f32
        u32 h2;
        asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"((u16)s));
        asm("cvt.f32.f16 %0, %1;" : "=f"(v) : "h"((u16)h2));
        v *= __uint_as_float((u32)(127 + 126 - fold) << 23);
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

// One pipeline stage: chunk c of every weight tile a thread reads (16 bytes of rows g and g + 8
// each) and the scale bytes of those two rows for the chunk (8 bytes NVFP4, 4 bytes MXFP4).
template <int NT>
struct Stage {
    uint4 w[NT][2];
    u32 s[NT][2][2];  // scale bytes 0-3 and 4-7 of the row's chunk (MXFP4: 0-3 only)
};

// 16 weight bytes, streamed once: no L1 allocation; L2 fetches the 256-byte block around them
// (the next chunks of the same row) so each row is read from HBM in long bursts.
__device__ __forceinline__ uint4 ld_stream(const u32 *p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

template <int NT, int WFMT>
__device__ __forceinline__ void stage_load(const u32 *const (&wrow)[NT][2], const u8 *const (&srow)[NT][2], int c,
                                           int t, Stage<NT> &st) {
#pragma unroll
    for (int i = 0; i < NT; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            st.w[i][h] = ld_stream(wrow[i][h] + c * 16 + t * 4);
            if (WFMT == 1) {
                const uint2 s = __ldg(reinterpret_cast<const uint2 *>(srow[i][h] + c * 8));
                st.s[i][h][0] = s.x;
                st.s[i][h][1] = s.y;
            } else {
                st.s[i][h][0] = __ldg(reinterpret_cast<const u32 *>(srow[i][h] + c * 4));
            }
        }
}

// The rows a thread streams: tile i reads weight words w[i] + wo[i][h] and scale bytes s[i] + so[i][h] for its rows g
// and g + 8 (h), the offsets (32-bit: one weight's words, which launch() checks fit) pointing at the next chunk to load. Offsets instead of 64-bit
// row pointers save the ~28 instructions per chunk that recomputing four row addresses from the row index costs (the
// lean kernel's; see gemv_mma_body).
template <int NT>
struct Rows {
    const u32 *w[NT];
    const u8 *s[NT];
    u32 wo[NT][2], so[NT][2];
};

template <int NT, int WFMT>
__device__ __forceinline__ void stage_load(Rows<NT> &rows, Stage<NT> &st) {
#pragma unroll
    for (int i = 0; i < NT; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            st.w[i][h] = ld_stream(rows.w[i] + rows.wo[i][h]);
            if (WFMT == 1) {
                const uint2 s = __ldg(reinterpret_cast<const uint2 *>(rows.s[i] + rows.so[i][h]));
                st.s[i][h][0] = s.x;
                st.s[i][h][1] = s.y;
            } else {
                st.s[i][h][0] = __ldg(reinterpret_cast<const u32 *>(rows.s[i] + rows.so[i][h]));
            }
            rows.wo[i][h] += 16;  // the next chunk of the row
            rows.so[i][h] += WFMT == 1 ? 8 : 4;
        }
}

// Rows<NT> of tiles of 16 rows from row n0 (tile i: rows n0 + (i % rt) * 16 + {g, g + 8}, clamped to N - 1: rows past N
// compute a copy of the last row, never stored), from chunk c0 on; tiles rt.. read the second weight (SwiGLU's up).
template <int NT, int WFMT>
__device__ __forceinline__ Rows<NT> make_rows(const u32 *w, const u8 *s, const u32 *w2, const u8 *s2, int rt, int n0,
                                             int N, int w_n, int s_n, int c0, int g, int t) {
    Rows<NT> rows;
#pragma unroll
    for (int i = 0; i < NT; ++i) {
        rows.w[i] = i < rt ? w : w2;
        rows.s[i] = i < rt ? s : s2;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const u32 n = (u32)min(n0 + (i % rt) * 16 + h * 8 + g, N - 1);
            rows.wo[i][h] = n * (u32)w_n + 16u * (u32)c0 + 4u * (u32)t;
            rows.so[i][h] = n * (u32)s_n + (WFMT == 1 ? 8u : 4u) * (u32)c0;
        }
    }
    return rows;
}

// The chunk's low/high-half group multipliers of a thread: NVFP4 groups t and t + 4 (16 elements
// each), MXFP4 groups t / 2 and t / 2 + 2 (32 elements each).
template <int WFMT, bool PAIRED = false>
__device__ __forceinline__ void half_mults(const u32 (&s)[2], int t, int fold, u32 &ml, u32 &mh) {
    if (WFMT == 1 && PAIRED) {  // group_mult_bf16x2 of both bytes at once: one byte select, one e4m3x2 -> f16x2 convert
        const u32 two = prmt(s[0], s[1], (u32)t | ((u32)(t + 4) << 4));  // byte t of s[0], byte t of s[1]
        u32 h2;
        float lo, hi;
        asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"((u16)two));
        asm("cvt.f32.f16 %0, %1;" : "=f"(lo) : "h"((u16)h2));
        asm("cvt.f32.f16 %0, %1;" : "=f"(hi) : "h"((u16)(h2 >> 16)));
        const float f = __uint_as_float((u32)(127 + 126 - fold) << 23);
        lo *= f;
        hi *= f;
        ml = prmt(__float_as_uint(lo), 0u, 0x3232u);  // the bf16 (top half) in both halves: exact, at most 4 bits
        mh = prmt(__float_as_uint(hi), 0u, 0x3232u);
    } else if (WFMT == 1) {
        ml = group_mult_bf16x2<WFMT>((s[0] >> (8 * t)) & 255u, fold);
        mh = group_mult_bf16x2<WFMT>((s[1] >> (8 * t)) & 255u, fold);
    } else {
        ml = group_mult_bf16x2<WFMT>((s[0] >> (8 * (t >> 1))) & 255u, fold);
        mh = group_mult_bf16x2<WFMT>((s[0] >> (8 * (t >> 1) + 16)) & 255u, fold);
    }
}

// Four independent accumulator chains per tile (word parity x mma of the word), so consecutive
// mmas of a warp do not wait on each other.
template <int NG, int NT, int WFMT, bool LEAN>
__device__ __forceinline__ void stage_mma(const Stage<NT> &st, const uint4 (&b)[NG][4], int t, int fold,
                                          float (&acc)[4][NG][NT][4]) {
#pragma unroll
    for (int i = 0; i < NT; ++i) {
        u32 ml0, mh0, ml1, mh1;
        half_mults<WFMT, LEAN>(st.s[i][0], t, fold, ml0, mh0);
        half_mults<WFMT, LEAN>(st.s[i][1], t, fold, ml1, mh1);
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            const uint4 &v0 = st.w[i][0], &v1 = st.w[i][1];
            const u32 w0 = q == 0 ? v0.x : q == 1 ? v0.y : q == 2 ? v0.z : v0.w;
            const u32 w1 = q == 0 ? v1.x : q == 1 ? v1.y : q == 2 ? v1.z : v1.w;
            u32 a0[4], a1[4];
            decode_bf16x2(w0, ml0, mh0, a0);
            decode_bf16x2(w1, ml1, mh1, a1);
#pragma unroll
            for (int ng = 0; ng < NG; ++ng) {  // one upcast feeds every group of 8 tokens
                mma16816(acc[2 * (q & 1)][ng][i], a0[0], a1[0], a0[1], a1[1], b[ng][q].x, b[ng][q].y);
                mma16816(acc[2 * (q & 1) + 1][ng][i], a0[2], a1[2], a0[3], a1[3], b[ng][q].z, b[ng][q].w);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Dequantization for large M (the caller then runs the BF16 GEMM): W[e, n, :] as bf16 times
// out_scale[e], rows [n_begin, n_begin + rows). One thread per int32 word: its 8 weights are
// elements 4q..4q+3 (low half) and 64+4q..64+4q+3 (high half) of the word's 128-element chunk.
__device__ __forceinline__ u32 bf16x2_scaled(u32 lo, u32 hi, float os) {  // two bf16 * os, each rounded once
    u32 d;
    const float a = __uint_as_float(lo << 16) * os, b = __uint_as_float(hi << 16) * os;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(b), "f"(a));
    return d;
}

template <int WFMT>
__global__ void __launch_bounds__(256) fp4_dequant(const u32 *__restrict__ w, const u8 *__restrict__ s, int w_n,
                                                   int s_n, const float *__restrict__ out_scale, int fold,
                                                   u16 *__restrict__ out, int out_stride, int rows, int K) {
    pdl_wait();  // the output buffer may still be read by the previous kernel
    const long long i = blockIdx.x * 256ll + threadIdx.x;  // word index within the rows
    const int words = K / 8;
    if (i >= (long long)rows * words) return;
    const int n = (int)(i / words), wi = (int)(i - (long long)n * words), c = wi >> 4, q = wi & 15;
    const u32 word = __ldg(w + (long long)n * w_n + wi);
    const u8 *srow = s + (long long)n * s_n;
    const int lo_group = WFMT == 1 ? c * 8 + (q >> 2) : c * 4 + (q >> 3);
    const int hi_group = lo_group + (WFMT == 1 ? 4 : 2);
    u32 a[4];
    decode_bf16x2(word, group_mult_bf16x2<WFMT>(srow[lo_group], fold), group_mult_bf16x2<WFMT>(srow[hi_group], fold),
                  a);
    const float os = out_scale[0];
    // a[0] = nibbles (3, 7), a[1] = (2, 6), a[2] = (1, 5), a[3] = (0, 4); nibble p is element
    // (p % 2) * 64 + 4q + p / 2: low half = nibbles 0, 2, 4, 6; high half = nibbles 1, 3, 5, 7.
    u16 *row = out + (long long)n * out_stride + c * 128 + 4 * q;
    *reinterpret_cast<uint2 *>(row) = make_uint2(bf16x2_scaled(a[3] & 0xFFFFu, a[1] & 0xFFFFu, os),
                                                 bf16x2_scaled(a[3] >> 16, a[1] >> 16, os));
    *reinterpret_cast<uint2 *>(row + 64) = make_uint2(bf16x2_scaled(a[2] & 0xFFFFu, a[0] & 0xFFFFu, os),
                                                      bf16x2_scaled(a[2] >> 16, a[0] >> 16, os));
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

// Same contract as fp4_gemv, for bf16 activations and M <= 8 * NG (NG groups of 8 tokens share
// each upcast weight fragment: mma n8 per group).
// Block: 4 warps = (4 / KW) row groups x KW slices of the block's K range; a warp owns RT 16-row
// output tiles (with SWIGLU: RT gate tiles and the same RT up tiles), so rows per block =
// 4 / KW * 16 * RT. Each thread keeps PF chunks of its tiles in flight (loads issued PF chunks
// ahead), and the first PF are issued before the activations are staged, so that staging hides
// under them. Split-K: KW warps of a block meet in shared memory, and the SPLIT blocks of a
// thread-block cluster along y through distributed shared memory; block 0's first K slice applies
// SwiGLU / the output scale and writes the output once in its final dtype (no atomics, no zeroed
// fp32 buffer, no conversion kernel).
// Expert mode with runs != 0 (``perm_in`` read, see run_chunk): m_rows is the chunk capacity (the staged rows
// allocated), and each program computes its run chunk's tokens, or nothing.
template <int RT, int KW, int PF, int NG, int WFMT, bool EXPERTS, bool SWIGLU, int SPLIT, bool EARLY,
          bool LEAN_PATH>
__device__ __forceinline__ void gemv_mma_body(
        const u16 *__restrict__ x, int x_stride, const long long *__restrict__ ids,
        const long long *__restrict__ perm_in, int runs, int a_div,
        const u32 *__restrict__ w, const u8 *__restrict__ s, const u32 *__restrict__ w2, const u8 *__restrict__ s2,
        int w_e, int w_n, int s_e, int s_n,
        const float *__restrict__ out_scale, const float *__restrict__ out_scale2, int fold,
        void *__restrict__ y, int y_stride, int ot, int m_rows, int N, int K, int split, bool handed) {
    constexpr int WARPS = 4, NT = SWIGLU ? 2 * RT : RT;
    extern __shared__ u32 smem[];  // staged activations [m_rows][chunks][16 words][4 pairs] bf16x2 (+pad);
                                   // then the partial sums [WARPS][NG * NT * 4][32] fp32
    const int chunks = K / 128 / SPLIT;
    const int c_begin = blockIdx.y * chunks;
    const int pairs = chunks * 64 + 16;  // per token, padded by 64 bytes: token rows g = 0..7 read by one
                                         // load instruction fall in alternate halves of the banks
    long long e = 0, x_row = 0, y_row = 0;
    int rows = m_rows;  // tokens of this program
    // LEAN_PATH (the plan's choice, fp4_gemv_cuda.lean_path): the lean kernel spends ~18% fewer instructions per
    // chunk: row offsets stepped per chunk (Rows), B read from token 0's row for absent token columns instead of
    // zeroed (mma columns are independent and those are never stored), the two NVFP4 scale bytes through one
    // convert, staging without a division per item. It also takes more registers (the split-8 cut of linears at
    // M = 2..8: 80 -> 95), which made those multi-wave grids 2-9% slower on the H200. The plain path is session 55's
    // code (the same SASS).
    constexpr bool LEAN = LEAN_PATH && !MUSECORE_GEMV_PLAIN;
    const long long *perm = runs && (EXPERTS || !LEAN) ? perm_in : nullptr;  // (lean: a constant nullptr in a linear)
    if (EARLY) pdl_trigger();  // (kernels/pdl.py: only the decode GEMVs signal the next kernel early)
    if (EXPERTS) {  // the expert id is an input: wait before it picks the weights
        if (!handed) pdl_wait();  // (handed: the producer's hand-off for this program has been acquired instead)
        if (perm) {
            rows = run_chunk(ids, blockIdx.z, gridDim.z, m_rows, handed);
            if (rows == 0) return;  // the whole block (and cluster: same z) leaves before any barrier
            e = ld_index(ids + blockIdx.z, handed);
        } else {
            assignment(ids, a_div, e, x_row, y_row, handed);
        }
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int kw = warp % KW;
    const int n0 = (blockIdx.x * (WARPS / KW) + warp / KW) * 16 * RT;
    const int per_warp = chunks / KW;
    const int cw_begin = c_begin + kw * per_warp, cw_end = cw_begin + per_warp;
    const bool rows_valid = n0 < N;

    const u32 *wrow[NT][2];
    const u8 *srow[NT][2];
    Rows<NT> wrows;
    if constexpr (LEAN)
        wrows = make_rows<NT, WFMT>(w + e * (long long)w_e, s + e * (long long)s_e, w2 + e * (long long)w_e,
                                    s2 + e * (long long)s_e, RT, n0, N, w_n, s_n, cw_begin, g, t);
    else
#pragma unroll
    for (int i = 0; i < NT; ++i) {
        const bool second = SWIGLU && i >= RT;
        const u32 *wb = (second ? w2 : w) + e * (long long)w_e;
        const u8 *sb = (second ? s2 : s) + e * (long long)s_e;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            int n = n0 + (i % RT) * 16 + h * 8 + g;
            n = n < N ? n : N - 1;  // rows past N compute a copy of the last row, never stored
            wrow[i][h] = wb + (long long)n * w_n;
            srow[i][h] = sb + (long long)n * s_n;
        }
    }
    constexpr int SLOTS = PF + 1;  // ring: chunk x lives in slot (x - cw_begin) % SLOTS
    Stage<NT> st[SLOTS];
    if (rows_valid) {
#pragma unroll
        for (int p = 0; p < PF; ++p) {
            if constexpr (LEAN) {
                if (cw_begin + p < cw_end) stage_load<NT, WFMT>(wrows, st[p]);
            } else {
                stage_load<NT, WFMT>(wrow, srow, min(cw_begin + p, cw_end - 1), t, st[p]);
            }
        }
    }
    if (!EXPERTS) pdl_wait();  // the first weight chunks are in flight under the previous kernel's tail

    // Stage: 16 bytes (8 activations: words q0 = 2v', q1 = q0 + 1 of one half chunk) per load, stored as
    // pairs (e0,e2) (e1,e3) (e4,e6) (e5,e7) = pairs 3,1 (low half) or 2,0 (high half) of q0 and q1.
    auto stage = [&](int m, int r) {  // item r (16 bytes) of token m's row
        const int c = r >> 4, v = r & 15;
        const long long row = token_row(perm, blockIdx.z, m, x_row, a_div, handed);
        const uint4 *src = reinterpret_cast<const uint4 *>(x + row * (long long)x_stride + (c_begin + c) * 128 + v * 8);
        const uint4 raw = handed ? __ldcg(src) : __ldg(src);  // handed: written while this kernel runs (no nc path)
        const int hi = v >> 3, q0 = 2 * (v & 7);
        const int pe = hi ? 2 : 3, po = hi ? 0 : 1;
        u32 *dst = smem + m * pairs + c * 64;
        dst[q0 * 4 + pe] = prmt(raw.x, raw.y, 0x5410u);
        dst[q0 * 4 + po] = prmt(raw.x, raw.y, 0x7632u);
        dst[q0 * 4 + 4 + pe] = prmt(raw.z, raw.w, 0x5410u);
        dst[q0 * 4 + 4 + po] = prmt(raw.z, raw.w, 0x7632u);
    };
    const int per_row = chunks * 16;
    if constexpr (LEAN) {  // (m, r) stepped by the block size: no division per item
        for (int m = threadIdx.x / per_row, r = threadIdx.x % per_row; m < rows;) {
            stage(m, r);
            for (r += WARPS * 32; r >= per_row; r -= per_row) ++m;
        }
    } else {
        for (int i = threadIdx.x; i < rows * per_row; i += WARPS * 32) {
            const int m = i / per_row;
            stage(m, i - m * per_row);
        }
    }
    __syncthreads();

    bool has_token[NG];
    const u32 *xt[NG];
#pragma unroll
    for (int ng = 0; ng < NG; ++ng) {
        has_token[ng] = ng * 8 + g < rows;
        xt[ng] = smem + (has_token[ng] ? ng * 8 + g : 0) * pairs;
    }
    float acc[4][NG][NT][4];
    float *sums = &acc[0][0][0][0];  // chain 0, then the final sums
    constexpr int PER = NG * NT * 4;  // accumulators per chain and thread
#pragma unroll
    for (int i = 0; i < 4 * PER; ++i) sums[i] = 0.f;
    if (rows_valid) {
        for (int c0 = cw_begin; c0 < cw_end; c0 += SLOTS) {
#pragma unroll
            for (int p = 0; p < SLOTS; ++p) {  // unrolled: slot indices are static, no register copies
                const int c = c0 + p;
                if (c >= cw_end) break;
                if (c + PF < cw_end) {
                    if constexpr (LEAN) stage_load<NT, WFMT>(wrows, st[(p + PF) % SLOTS]);
                    else stage_load<NT, WFMT>(wrow, srow, c + PF, t, st[(p + PF) % SLOTS]);
                }
                uint4 b[NG][4];
#pragma unroll
                for (int ng = 0; ng < NG; ++ng)
#pragma unroll
                    for (int q = 0; q < 4; ++q)
                        b[ng][q] = LEAN || has_token[ng]
                            ? *reinterpret_cast<const uint4 *>(xt[ng] + ((c - c_begin) * 16 + 4 * t + q) * 4)
                            : make_uint4(0u, 0u, 0u, 0u);
                stage_mma<NG, NT, WFMT, LEAN>(st[p], b, t, fold, acc);
            }
        }
    }
#pragma unroll
    for (int i = 0; i < PER; ++i) sums[i] += sums[PER + i] + sums[2 * PER + i] + sums[3 * PER + i];

    if (KW > 1 || SPLIT > 1) {
        float *red = reinterpret_cast<float *>(smem) + m_rows * pairs;
#pragma unroll
        for (int i = 0; i < PER; ++i) red[(warp * PER + i) * 32 + lane] = sums[i];
        if (SPLIT > 1) cluster_sync(); else __syncthreads();
        if (blockIdx.y == 0 && kw == 0) {
#pragma unroll
            for (int i = 0; i < PER; ++i) {
                float v = sums[i];
#pragma unroll
                for (int r = 0; r < SPLIT; ++r)
#pragma unroll
                    for (int k2 = 0; k2 < KW; ++k2) {
                        if (r == 0 && k2 == 0) continue;
                        const float *p = red + ((warp + k2) * PER + i) * 32 + lane;
                        v += r == 0 ? *p : cluster_load(p, (u32)r);
                    }
                sums[i] = v;
            }
        }
        if (SPLIT > 1) cluster_sync();  // the other blocks' shared memory stays alive until block 0 has read it
        if (blockIdx.y != 0 || kw != 0) return;
    }
    if (!rows_valid) return;
    const float os = out_scale[e];
    // c0, c1: row g, tokens 2t, 2t+1 of the group; c2, c3: row g + 8, same tokens.
#pragma unroll
    for (int ng = 0; ng < NG; ++ng)
#pragma unroll
        for (int i = 0; i < RT; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                float out;
                if (SWIGLU) {
                    const float gt = acc[0][ng][i][j] * os, u = acc[0][ng][RT + i][j] * out_scale2[e];
                    out = gt / (1.f + __expf(-gt)) * u;
                } else {
                    out = acc[0][ng][i][j] * os;
                }
                const int row = n0 + i * 16 + g + (j >= 2 ? 8 : 0), token = ng * 8 + 2 * t + (j & 1);
                if (row >= N || token >= rows) continue;
                store_out(y, token_row(perm, blockIdx.z, token, y_row, 1, handed) * (long long)y_stride + row, out, ot);
            }
}

// Producer/consumer hand-off between the decode MoE's two expert GEMVs (gate+up+SwiGLU, then down), so that the down
// GEMV's blocks start in the gate/up GEMV's last wave instead of after it (moe_decode.py). `sync` holds two int32
// counters per program z, 128 bytes apart from the next program's (every spinning block polls its own L2 line, not
// one line for all): done[z] (the producer's warps of program z that have finished, stores included) and used[z]
// (the consumer's blocks of program z that have seen it complete). role 1 (producer, launched EARLY): every
// warp publishes its end with a release add on done[z]. role 2 (consumer, launched with the PDL attribute, so its
// blocks may start once every producer block has started): each block waits for done[z] == need (the producer's
// warps per program) with an acquire load instead of griddepcontrol.wait, and the last block of z to see it resets
// both counters for the next launch. The polls back off from 256 ns to 2 us; the wait gives up after 5 s with a trap
// (a CUDA error, never a silent hang).
constexpr int HANDOFF_STRIDE = 32;  // ints between two programs' counters: one 128-byte line each

__device__ __forceinline__ void handoff_wait(int *sync, int need) {
    const int z = blockIdx.z;
    if (threadIdx.x == 0) {
        int *done = sync + HANDOFF_STRIDE * z, *used = done + 1;
        unsigned long long start, now;
        unsigned sleep = 256;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
        for (;;) {
            int v;
            asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(done) : "memory");
            if (v >= need) break;
            __nanosleep(sleep);
            sleep = sleep < 2048 ? 2 * sleep : sleep;
            asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
            if (now - start > 5000000000ull) __trap();  // the producer never finished: a bug, made loud
        }
        if (atomicAdd(used, 1) == (int)(gridDim.x * gridDim.y) - 1) {  // every block of z has passed: reset
            *done = 0;
            *used = 0;
        }
    }
    __syncthreads();
}

__device__ __forceinline__ void handoff_publish(int *sync) {
    __threadfence();
    __syncwarp();
    if ((threadIdx.x & 31) == 0)
        asm volatile("red.release.gpu.global.add.s32 [%0], 1;" :: "l"(sync + HANDOFF_STRIDE * blockIdx.z) : "memory");
}

// MIN_BLOCKS: __launch_bounds__'s minimum blocks per SM (the plan's min_blocks): it caps the registers (4: 128,
// 8: 64), so that more blocks of a grid fit in one wave (fp4_gemv_cuda.GemvPlan).
template <int RT, int KW, int PF, int NG, int WFMT, bool EXPERTS, bool SWIGLU, int SPLIT, bool EARLY,
          bool LEAN_PATH, int MIN_BLOCKS>
__global__ void __cluster_dims__(1, SPLIT, 1) __launch_bounds__(128, MIN_BLOCKS) fp4_gemv_mma(
        const u16 *__restrict__ x, int x_stride, const long long *__restrict__ ids,
        const long long *__restrict__ perm_in, int runs, int a_div,
        const u32 *__restrict__ w, const u8 *__restrict__ s, const u32 *__restrict__ w2, const u8 *__restrict__ s2,
        int w_e, int w_n, int s_e, int s_n,
        const float *__restrict__ out_scale, const float *__restrict__ out_scale2, int fold,
        void *__restrict__ y, int y_stride, int ot, int m_rows, int N, int K, int split,
        int *sync, int role, int need) {
    if (EXPERTS && role == 2) handoff_wait(sync, need);
    gemv_mma_body<RT, KW, PF, NG, WFMT, EXPERTS, SWIGLU, SPLIT, EARLY, LEAN_PATH>(
        x, x_stride, ids, perm_in, runs, a_div, w, s, w2, s2, w_e, w_n, s_e, s_n, out_scale, out_scale2, fold, y,
        y_stride, ot, m_rows, N, K, split, EXPERTS && role == 2);
    if (EXPERTS && role == 1) handoff_publish(sync);
}
