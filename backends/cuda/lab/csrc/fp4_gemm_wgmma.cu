// wgmma FP4 GEMM (lab); compiled after pdl.cuh, fp4_gemv.cu and fp4_gemm.cu of musecore_cuda/csrc.
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

__device__ __forceinline__ void wgmma_n16(float (&d)[8], u32 a0, u32 a1, u32 a2, u32 a3,
                                          unsigned long long desc) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, 1, 1, 1, 0;"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc));
}
template <> struct Wgmma<16> {
    static __device__ __forceinline__ void run(float (&d)[8], const u32 (&a)[4],
                                               unsigned long long desc) {
        wgmma_n16(d, a[0], a[1], a[2], a[3], desc);
    }
};
__device__ __forceinline__ void wgmma_n32(float (&d)[16], u32 a0, u32 a1, u32 a2, u32 a3,
                                          unsigned long long desc) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, {%16, %17, %18, %19}, %20, 1, 1, 1, 0;"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc));
}
template <> struct Wgmma<32> {
    static __device__ __forceinline__ void run(float (&d)[16], const u32 (&a)[4],
                                               unsigned long long desc) {
        wgmma_n32(d, a[0], a[1], a[2], a[3], desc);
    }
};
__device__ __forceinline__ void wgmma_n64(float (&d)[32], u32 a0, u32 a1, u32 a2, u32 a3,
                                          unsigned long long desc) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, 1, 1, 1, 0;"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc));
}
template <> struct Wgmma<64> {
    static __device__ __forceinline__ void run(float (&d)[32], const u32 (&a)[4],
                                               unsigned long long desc) {
        wgmma_n64(d, a[0], a[1], a[2], a[3], desc);
    }
};
__device__ __forceinline__ void wgmma_n128(float (&d)[64], u32 a0, u32 a1, u32 a2, u32 a3,
                                          unsigned long long desc) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, 1, 1, 1, 0;"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc));
}
template <> struct Wgmma<128> {
    static __device__ __forceinline__ void run(float (&d)[64], const u32 (&a)[4],
                                               unsigned long long desc) {
        wgmma_n128(d, a[0], a[1], a[2], a[3], desc);
    }
};


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
