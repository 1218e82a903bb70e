// Tiled FP4 GEMM; compiled after pdl.cuh and fp4_gemv.cu, whose helpers it uses (kernels/sources.py).
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
