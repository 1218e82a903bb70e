/* Part of kernels.c (one translation unit), after int4.c. The BF16 weight GEMV: a bf16 is the high half of an fp32,
   so 16 weights in one 256-bit load give two fp32 vectors by a shift and an AND (even and odd columns); the
   activation row is converted once per call in the matching order. The summation order depends on neither M, the
   row block nor the thread count, so every path (AVX2, portable C with fmaf) gives the same bits. */
/* ---- BF16 weight GEMV: y[M, N] = x[M, K] @ W.T, W bf16 [N, K] row-major, x/y bf16 or fp32, fp32 accumulation ---- */
#define BF16_ROWS 4     /* rows per block at M = 1 (8 accumulators: 4 rows x even/odd columns) */
#define BF16_CHUNK 16   /* columns per 256-bit load of weights */

/* x row -> fp32 in the kernel's order: per full chunk of 16 columns the 8 even columns, then the 8 odd ones; the
   K % 16 tail columns in their own order. */
static void bf16_prepare_x(const void *x, int x_bf16, int64_t m_rows, int64_t k, float *xp) {
    const int64_t k16 = k - k % BF16_CHUNK;
    for (int64_t m = 0; m < m_rows; ++m) {
        float *dst = xp + m * k;
        const int64_t off = m * k;
        for (int64_t c = 0; c < k16; c += BF16_CHUNK)
            for (int i = 0; i < 8; ++i) {
                dst[c + i] = load_x(x, x_bf16, off + c + 2 * i);
                dst[c + 8 + i] = load_x(x, x_bf16, off + c + 2 * i + 1);
            }
        for (int64_t c = k16; c < k; ++c) dst[c] = load_x(x, x_bf16, off + c);
    }
}

static inline float bf16_to_float(uint16_t b) { return bits_to_float((uint32_t)b << 16); }

/* The tail columns (k16..k-1) of one row added to the reduced sum, in column order (every path). */
static inline float bf16_tail(const uint16_t *w, const float *xp, int64_t k16, int64_t k, float sum) {
    for (int64_t c = k16; c < k; ++c) sum = fmaf(bf16_to_float(w[c]), xp[c], sum);
    return sum;
}

/* Elements ahead of the current column that the M = 1 rows prefetch: the same columns of the row block(s) that
   follow, whole blocks and at least BF16_PREFETCH_BYTES (a block's 4 rows are 4 short streams that the hardware
   prefetcher picks up too late, as in the INT4 GEMV). */
#ifndef BF16_PREFETCH_BYTES
#define BF16_PREFETCH_BYTES 4096
#endif
static inline int64_t bf16_prefetch_elems(int64_t k) {
    const int64_t block = BF16_ROWS * k * 2;
    return BF16_ROWS * k * ((BF16_PREFETCH_BYTES + block - 1) / block);
}

#ifdef __AVX2__
/* ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)): the portable path's reduce8 in the same order. */
static inline float bf16_hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 0x55)));
}
#define BF16_EVEN(v) _mm256_castsi256_ps(_mm256_slli_epi32(v, 16))
#define BF16_ODD(v) _mm256_castsi256_ps(_mm256_and_si256(v, hi_mask))
#define BF16_LOAD(p) _mm256_loadu_si256((const __m256i *)(p))

#ifndef BF16_PF_HINT
#define BF16_PF_HINT _MM_HINT_T0
#endif
#define BF16_PF(p) _mm_prefetch((const char *)(p), BF16_PF_HINT)

/* 4 rows, one activation row: two chunks (64 bytes of each row) per iteration into the same accumulators, in
   column order (the same sums as one chunk per step), and one prefetch per row. */
static void bf16_rows4_m1(const uint16_t *w, int64_t k, const float *xp, float *out) {
    const __m256i hi_mask = _mm256_set1_epi32((int)0xFFFF0000u);
    const int64_t k16 = k - k % BF16_CHUNK, pf = bf16_prefetch_elems(k);
    const uint16_t *w0 = w, *w1 = w + k, *w2 = w + 2 * k, *w3 = w + 3 * k;
    __m256 e0 = _mm256_setzero_ps(), o0 = e0, e1 = e0, o1 = e0, e2 = e0, o2 = e0, e3 = e0, o3 = e0;
#define BF16_STEP4(C) {                                                                                         \
        const __m256 xe = _mm256_loadu_ps(xp + (C)), xo = _mm256_loadu_ps(xp + (C) + 8);                        \
        const __m256i v0 = BF16_LOAD(w0 + (C)), v1 = BF16_LOAD(w1 + (C)), v2 = BF16_LOAD(w2 + (C)),             \
                      v3 = BF16_LOAD(w3 + (C));                                                                 \
        e0 = _mm256_fmadd_ps(BF16_EVEN(v0), xe, e0); o0 = _mm256_fmadd_ps(BF16_ODD(v0), xo, o0);               \
        e1 = _mm256_fmadd_ps(BF16_EVEN(v1), xe, e1); o1 = _mm256_fmadd_ps(BF16_ODD(v1), xo, o1);               \
        e2 = _mm256_fmadd_ps(BF16_EVEN(v2), xe, e2); o2 = _mm256_fmadd_ps(BF16_ODD(v2), xo, o2);               \
        e3 = _mm256_fmadd_ps(BF16_EVEN(v3), xe, e3); o3 = _mm256_fmadd_ps(BF16_ODD(v3), xo, o3);               \
    }
    int64_t c = 0;
    for (; c + 2 * BF16_CHUNK <= k16; c += 2 * BF16_CHUNK) {
        BF16_PF(w0 + c + pf); BF16_PF(w1 + c + pf); BF16_PF(w2 + c + pf); BF16_PF(w3 + c + pf);
        BF16_STEP4(c)
        BF16_STEP4(c + BF16_CHUNK)
    }
    if (c < k16) {
        BF16_PF(w0 + c + pf); BF16_PF(w1 + c + pf); BF16_PF(w2 + c + pf); BF16_PF(w3 + c + pf);
        BF16_STEP4(c)
    }
#undef BF16_STEP4
    out[0] = bf16_tail(w0, xp, k16, k, bf16_hsum(_mm256_add_ps(e0, o0)));
    out[1] = bf16_tail(w1, xp, k16, k, bf16_hsum(_mm256_add_ps(e1, o1)));
    out[2] = bf16_tail(w2, xp, k16, k, bf16_hsum(_mm256_add_ps(e2, o2)));
    out[3] = bf16_tail(w3, xp, k16, k, bf16_hsum(_mm256_add_ps(e3, o3)));
}

/* 2 rows, two activation rows (each weight load feeds both): out[r * 2 + m]. Two chunks per iteration as in
   bf16_rows4_m1 (the same sums), prefetching the rows of the pair(s) of rows ahead. */
static void bf16_rows2_m2(const uint16_t *w, int64_t k, const float *xp0, const float *xp1, float *out) {
    const __m256i hi_mask = _mm256_set1_epi32((int)0xFFFF0000u);
    const int64_t k16 = k - k % BF16_CHUNK, pf = 2 * k * ((BF16_PREFETCH_BYTES + 4 * k - 1) / (4 * k));
    const uint16_t *w0 = w, *w1 = w + k;
    __m256 e00 = _mm256_setzero_ps(), o00 = e00, e01 = e00, o01 = e00, e10 = e00, o10 = e00, e11 = e00, o11 = e00;
#define BF16_STEP2(C) {                                                                                         \
        const __m256i v0 = BF16_LOAD(w0 + (C)), v1 = BF16_LOAD(w1 + (C));                                       \
        const __m256 a0 = BF16_EVEN(v0), b0 = BF16_ODD(v0), a1 = BF16_EVEN(v1), b1 = BF16_ODD(v1);              \
        const __m256 xe0 = _mm256_loadu_ps(xp0 + (C)), xo0 = _mm256_loadu_ps(xp0 + (C) + 8);                    \
        e00 = _mm256_fmadd_ps(a0, xe0, e00); o00 = _mm256_fmadd_ps(b0, xo0, o00);                               \
        e10 = _mm256_fmadd_ps(a1, xe0, e10); o10 = _mm256_fmadd_ps(b1, xo0, o10);                               \
        const __m256 xe1 = _mm256_loadu_ps(xp1 + (C)), xo1 = _mm256_loadu_ps(xp1 + (C) + 8);                    \
        e01 = _mm256_fmadd_ps(a0, xe1, e01); o01 = _mm256_fmadd_ps(b0, xo1, o01);                               \
        e11 = _mm256_fmadd_ps(a1, xe1, e11); o11 = _mm256_fmadd_ps(b1, xo1, o11);                               \
    }
    int64_t c = 0;
    for (; c + 2 * BF16_CHUNK <= k16; c += 2 * BF16_CHUNK) {
        BF16_PF(w0 + c + pf); BF16_PF(w1 + c + pf);
        BF16_STEP2(c)
        BF16_STEP2(c + BF16_CHUNK)
    }
    if (c < k16) {
        BF16_PF(w0 + c + pf); BF16_PF(w1 + c + pf);
        BF16_STEP2(c)
    }
#undef BF16_STEP2
    out[0] = bf16_tail(w0, xp0, k16, k, bf16_hsum(_mm256_add_ps(e00, o00)));
    out[1] = bf16_tail(w0, xp1, k16, k, bf16_hsum(_mm256_add_ps(e01, o01)));
    out[2] = bf16_tail(w1, xp0, k16, k, bf16_hsum(_mm256_add_ps(e10, o10)));
    out[3] = bf16_tail(w1, xp1, k16, k, bf16_hsum(_mm256_add_ps(e11, o11)));
}

/* 1 row, one activation row (the rows left over by the blocks). */
static float bf16_row_m1(const uint16_t *w, int64_t k, const float *xp) {
    const __m256i hi_mask = _mm256_set1_epi32((int)0xFFFF0000u);
    const int64_t k16 = k - k % BF16_CHUNK;
    __m256 e = _mm256_setzero_ps(), o = e;
    for (int64_t c = 0; c < k16; c += BF16_CHUNK) {
        const __m256i v = BF16_LOAD(w + c);
        e = _mm256_fmadd_ps(BF16_EVEN(v), _mm256_loadu_ps(xp + c), e);
        o = _mm256_fmadd_ps(BF16_ODD(v), _mm256_loadu_ps(xp + c + 8), o);
    }
    return bf16_tail(w, xp, k16, k, bf16_hsum(_mm256_add_ps(e, o)));
}
#else
/* Portable path: the same lanes, fmaf per element, the same reduction order: the same bits as AVX2. */
static float bf16_row_m1(const uint16_t *w, int64_t k, const float *xp) {
    const int64_t k16 = k - k % BF16_CHUNK;
    float e[8] = {0}, o[8] = {0}, s[8];
    for (int64_t c = 0; c < k16; c += BF16_CHUNK)
        for (int i = 0; i < 8; ++i) {
            e[i] = fmaf(bf16_to_float(w[c + 2 * i]), xp[c + i], e[i]);
            o[i] = fmaf(bf16_to_float(w[c + 2 * i + 1]), xp[c + 8 + i], o[i]);
        }
    for (int i = 0; i < 8; ++i) s[i] = e[i] + o[i];
    const float a0 = s[0] + s[4], a1 = s[1] + s[5], a2 = s[2] + s[6], a3 = s[3] + s[7];
    return bf16_tail(w, xp, k16, k, (a0 + a2) + (a1 + a3));
}
static void bf16_rows4_m1(const uint16_t *w, int64_t k, const float *xp, float *out) {
    for (int r = 0; r < 4; ++r) out[r] = bf16_row_m1(w + r * k, k, xp);
}
static void bf16_rows2_m2(const uint16_t *w, int64_t k, const float *xp0, const float *xp1, float *out) {
    for (int r = 0; r < 2; ++r) {
        out[2 * r] = bf16_row_m1(w + r * k, k, xp0);
        out[2 * r + 1] = bf16_row_m1(w + r * k, k, xp1);
    }
}
#endif

/* Rows n0..n1-1 (n0 a multiple of BF16_ROWS) for every activation row. */
static void bf16_row_range(const uint16_t *w, const float *xp, void *y, int y_bf16, int64_t n0, int64_t n1,
                           int64_t n, int64_t k, int64_t m_rows) {
    float out[4];
    int64_t r = n0;
    if (m_rows == 1) {
        for (; r + BF16_ROWS <= n1; r += BF16_ROWS) {
            bf16_rows4_m1(w + r * k, k, xp, out);
            for (int i = 0; i < BF16_ROWS; ++i) store_y(y, y_bf16, r + i, out[i]);
        }
        for (; r < n1; ++r) store_y(y, y_bf16, r, bf16_row_m1(w + r * k, k, xp));
        return;
    }
    for (; r + 2 <= n1; r += 2) {
        int64_t m = 0;
        for (; m + 2 <= m_rows; m += 2) {
            bf16_rows2_m2(w + r * k, k, xp + m * k, xp + (m + 1) * k, out);
            store_y(y, y_bf16, m * n + r, out[0]); store_y(y, y_bf16, (m + 1) * n + r, out[1]);
            store_y(y, y_bf16, m * n + r + 1, out[2]); store_y(y, y_bf16, (m + 1) * n + r + 1, out[3]);
        }
        for (; m < m_rows; ++m) {
            store_y(y, y_bf16, m * n + r, bf16_row_m1(w + r * k, k, xp + m * k));
            store_y(y, y_bf16, m * n + r + 1, bf16_row_m1(w + (r + 1) * k, k, xp + m * k));
        }
    }
    for (; r < n1; ++r)
        for (int64_t m = 0; m < m_rows; ++m) store_y(y, y_bf16, m * n + r, bf16_row_m1(w + r * k, k, xp + m * k));
}

/* y[M, N] = x[M, K] @ W.T for a bf16 weight [N, K]; x, y bf16 or fp32. Blocks of BF16_ROWS rows are split over
   `threads` OpenMP threads (a contiguous range each); below GEMV_PARALLEL_MIN_BYTES of weight bytes times M the
   call runs on the calling thread (the INT4 GEMV's threshold and convention). */
void musecore_bf16_gemv(const uint16_t *w, const void *x, int x_bf16, void *y, int y_bf16, int64_t m_rows,
                        int64_t n, int64_t k, int threads) {
    if (m_rows <= 0 || n <= 0) return;
    float *xp = scratch((size_t)(m_rows * k));
    if (xp == NULL) return;
    bf16_prepare_x(x, x_bf16, m_rows, k, xp);
    const int64_t blocks = (n + BF16_ROWS - 1) / BF16_ROWS;
#ifdef _OPENMP
    if (threads > blocks) threads = (int)blocks;
    if (n * k * 2 * m_rows < GEMV_PARALLEL_MIN_BYTES) threads = 1;
    if (threads > 1) {
#pragma omp parallel num_threads(threads)
        {
            const int t = omp_get_thread_num(), nt = omp_get_num_threads();
            const int64_t b0 = blocks * t / nt, b1 = blocks * (t + 1) / nt;
            const int64_t n0 = b0 * BF16_ROWS, n1 = b1 * BF16_ROWS < n ? b1 * BF16_ROWS : n;
            if (n0 < n1) bf16_row_range(w, xp, y, y_bf16, n0, n1, n, k, m_rows);
        }
        return;
    }
#endif
    (void)threads;
    bf16_row_range(w, xp, y, y_bf16, 0, n, n, k, m_rows);
}

/* One BF16 weight's constant arguments, filled once by Python (Bf16Gemv), passed as one pointer. */
typedef struct { const uint16_t *w; int64_t k, n; } bf16_weight_t;

/* musecore_bf16_gemv on a bound weight with PyTorch's thread count (see musecore_int4_linear). */
void musecore_bf16_linear(const bf16_weight_t *w, const void *x, void *y, int64_t m_rows, int bf16) {
#ifdef _OPENMP
    const int threads = omp_get_max_threads();
#else
    const int threads = 1;
#endif
    musecore_bf16_gemv(w->w, x, bf16, y, bf16, m_rows, w->n, w->k, threads);
}
