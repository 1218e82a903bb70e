/* Part of kernels.c (one translation unit), after amx.c. The INT4 x BF16 GEMM on AVX512_BF16 (vdpbf16ps): the
   dense path of INT4 weights on CPUs with a BF16 dot product but no AMX (AMD Zen 4/5, Cooper Lake), and where it
   measures faster, on AMX hosts too.

   Why: from M ~ 16 rows a linear layer is compute-bound, and PyTorch's oneDNN BF16 GEMM (vdpbf16ps, 32 products per
   instruction) beat both the int16 GEMV (madd_epi16 on every weight for every row pair) and the dequantized tiles
   (an fp32/BF16 copy of the weight written and read again). Here the weight is read as INT4 once per call and never
   leaves the cache as BF16.

   Scheme (C = X W^T, outer products, 16 output rows per zmm):
   * The activations are converted to bf16 once per call, in pairs: xp[m, P] (uint32) holds the two bf16 values of
     k-pair P, and xs[m, G] the fp32 sum of the bf16-rounded activations of group G. Pair order = the planar order:
     pair P = chunk c, nibble pair j, word q (P = c C/2 + j W + q) holds columns c C + 2jW + q (low half) and
     c C + (2j+1) W + q (high half), exactly the two 16-bit halves of (word >> 4j) of the planar codes. So a group
     is pairs [G g/2, (G+1) g/2) for every supported g (for g = 32, nibble pairs 0-1 are the first group of the chunk).
   * Per panel of BG_NP = 64 output rows and block of at most BG_KB = 256 columns, the codes are transposed 16 rows x
     16 words at a time (so a 32-bit lane holds one row's word) and decoded, per nibble pair j, by one shift and one
     ternary-logic op into bf16 pairs of 16 + q (exponent 2^4, the code in mantissa bits 3..6: exact), into an L1
     panel [pairs][64 rows] (32 KiB). Codes are never decoded to (q - z) * s: the weight stays exact.
   * Micro-kernel: up to BG_MR = 6 activation rows x 4 zmm (64 output rows): per pair, 4 panel loads, 6 broadcasts of
     xp (embedded in vdpbf16ps), 24 vdpbf16ps; fp32 accumulators per group. At the group's end each accumulator is
     flushed into the fp32 output tile: c += s * acc - s (16 + z) xs[m, G], i.e. c += s * sum x (q - z) exactly up
     to fp32 rounding (the offset 16 loses at most ~3 of fp32's 24 bits to cancellation).
   Numerics: the result is the dot product of the bf16-rounded activations (fp32 inputs are rounded to bf16, as
   PyTorch's BF16 GEMM would; vdpbf16ps flushes bf16 denormals, |x| < 2^-126, to zero) with the exact weight
   (q - z) * s, summed in fp32. Threads: panels split over OpenMP (PyTorch's libgomp pool). */
#if defined(HAVE_VNNI512)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16")
#define BG_NP 64    /* output rows per panel: 4 zmm */
#define BG_KB 256   /* columns per block: a multiple of every chunk (64, 128, 256) */
#define BG_MR 6     /* activation rows per micro-kernel call (bg_block's switch) */
/* tuning knobs (-D in lab builds, backends/xeon/lab/scripts/bf16dot_phases.py) */
#ifndef BG_AHEAD
#define BG_AHEAD 4   /* panel blocks of codes prefetched ahead, in the order they are decoded */
#endif
#ifndef BG_PF_HINT
#define BG_PF_HINT _MM_HINT_T0
#endif
#ifndef BG_GROUP
#define BG_GROUP 4   /* panels per task at most (m > BG_GROUP_MIN_M): each activation block is read once per task */
#endif
#ifndef BG_GROUP_MIN_M
#define BG_GROUP_MIN_M 128  /* up to this M one panel per task: the output tiles of 4 panels crowd L1 (lab/NOTES.md) */
#endif
#ifndef BG_MB
#define BG_MB 512   /* activation rows per block (panels decoded once per block): output tiles [BG_GROUP][BG_MB][64] fp32, 512 KiB, in L2 */
#endif

/* r[c] <- column c of the 16 x 16 matrix of dwords whose row i is r[i]. */
static inline __attribute__((always_inline)) void bg_transpose16(__m512i r[16]) {
    __m512i t[16], u[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int b = 0; b < 4; ++b) {
        const __m512i v0 = _mm512_shuffle_i32x4(u[b], u[4 + b], 0x88), v1 = _mm512_shuffle_i32x4(u[b], u[4 + b], 0xDD);
        const __m512i w0 = _mm512_shuffle_i32x4(u[8 + b], u[12 + b], 0x88), w1 = _mm512_shuffle_i32x4(u[8 + b], u[12 + b], 0xDD);
        r[b] = _mm512_shuffle_i32x4(v0, w0, 0x88);
        r[8 + b] = _mm512_shuffle_i32x4(v0, w0, 0xDD);
        r[4 + b] = _mm512_shuffle_i32x4(v1, w1, 0x88);
        r[12 + b] = _mm512_shuffle_i32x4(v1, w1, 0xDD);
    }
}

/* bf16 pairs (16 + code of column 2jW+q, 16 + code of column (2j+1)W+q) of 16 planar words: nibbles j and j + 4. */
static inline __attribute__((always_inline)) __m512i bg_decode(__m512i w, int j) {
    const __m512i s = j == 0 ? _mm512_slli_epi32(w, 3) : _mm512_srli_epi32(w, 4 * j - 3);
    /* (s & 0x00780078) | 0x41804180: bf16 16.0 with the code in mantissa bits 3..6 */
    return _mm512_ternarylogic_epi32(s, _mm512_set1_epi32(0x00780078), _mm512_set1_epi32(0x41804180), 0xEA);
}

/* Prefetch the codes of row blocks [r0, r0 + 16) (rows below n_rows), columns [k0, k0 + kb): per row block one
   contiguous run of ROWS * kb / 2 bytes (its rows interleaved by chunk), starting k0 / 2 words into the block. */
static inline void bg_prefetch(const int4_weight_t *w, int64_t r0, int64_t k0, int64_t kb) {
    const int64_t kw = w->k / 8;
    for (int64_t n = r0; n < r0 + 16 && n < w->n_rows; n += ROWS) {
        const char *p = (const char *)(w->codes + n * kw + k0 / 8 * ROWS);
        for (int64_t b = 0; b < ROWS * kb / 2; b += 64) _mm_prefetch(p + b, BG_PF_HINT);
    }
}

/* Panel of rows [n0, n0 + 64) and columns [k0, k0 + kb) (kb a multiple of the chunk, <= BG_KB): pan[P * 64 + r] =
   the bf16 pair of block pair P for row n0 + r (rows at or past n_rows: zero); sv/cv[G * 64 + r] = s and -s (16 + z)
   of block group G. The codes of the panel block at (next_n0, next_k0) are prefetched on the way: a panel reads 16
   row blocks side by side, more streams than the hardware prefetcher follows. */
static void bg_decode_panel(const int4_weight_t *w, int64_t n0, int64_t k0, int64_t kb, uint32_t *pan, float *sv,
                            float *cv, int64_t next_n0, int64_t next_k0) {
    const int64_t kw = w->k / 8, g = w->g, groups = w->k / g, chunk = chunk_of(g), words = chunk / 8;
    const int64_t chunks = kb / chunk, block_groups = kb / g;
    const int64_t next_kb = w->k - next_k0 < BG_KB ? w->k - next_k0 : BG_KB;
    for (int64_t v = 0; v < BG_NP / 16; ++v) {
        const int64_t r0 = n0 + 16 * v;
        bg_prefetch(w, next_n0 + 16 * v, next_k0, next_kb);
        for (int64_t gi = 0; gi < block_groups; ++gi)
            for (int t = 0; t < 4; ++t) {
                const int64_t n = r0 + ROWS * t;
                __m128 s4 = _mm_setzero_ps(), c4 = _mm_setzero_ps();
                if (n < w->n_rows) {  /* the block's 4 scales, then its 4 zeros */
                    const uint16_t *p = w->sz + ((n / ROWS) * groups + k0 / g + gi) * 2 * ROWS;
                    s4 = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)p));
                    c4 = _mm_mul_ps(_mm_sub_ps(_mm_setzero_ps(), s4),
                                    _mm_add_ps(_mm_set1_ps(16.0f), _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(p + ROWS)))));
                }
                _mm_store_ps(sv + gi * BG_NP + 16 * v + 4 * t, s4);
                _mm_store_ps(cv + gi * BG_NP + 16 * v + 4 * t, c4);
            }
        if (r0 >= w->n_rows) {
            for (int64_t p = 0; p < kb / 2; ++p) _mm512_store_si512((__m512i *)(pan + p * BG_NP + 16 * v), _mm512_setzero_si512());
            continue;
        }
        const int64_t valid = w->n_rows - r0 < 16 ? w->n_rows - r0 : 16;
        const int32_t *block = w->codes + r0 * kw + k0 / 8 * ROWS;  /* row block r0's codes of this column block */
        if (words >= 16) {  /* units: words q0..q0+15 of one chunk */
            for (int64_t c = 0; c < chunks; ++c)
                for (int64_t q0 = 0; q0 < words; q0 += 16) {
                    __m512i r[16];
#pragma GCC unroll 16
                    for (int i = 0; i < 16; ++i)
                        r[i] = i < valid ? _mm512_loadu_si512(block + (i / ROWS) * ROWS * kw + (c * ROWS + i % ROWS) * words + q0)
                                         : _mm512_setzero_si512();
                    bg_transpose16(r);  /* r[l]: word q0 + l of the chunk, rows r0..r0+15 */
                    uint32_t *dst = pan + (c * chunk / 2 + q0) * BG_NP + 16 * v;
#pragma GCC unroll 16
                    for (int l = 0; l < 16; ++l)
#pragma GCC unroll 4
                        for (int j = 0; j < 4; ++j)
                            _mm512_store_si512((__m512i *)(dst + (l + j * words) * BG_NP), bg_decode(r[l], j));
                }
        } else {  /* W = 8: units of words 0..7 of chunks c and c + 1 */
            for (int64_t c = 0; c < chunks; c += 2) {
                const int two = c + 1 < chunks;
                __m512i r[16];
#pragma GCC unroll 16
                for (int i = 0; i < 16; ++i) {
                    if (i >= valid) { r[i] = _mm512_setzero_si512(); continue; }
                    const int32_t *row = block + (i / ROWS) * ROWS * kw + (c * ROWS + i % ROWS) * words;
                    const __m256i lo = _mm256_loadu_si256((const __m256i *)row);
                    const __m256i hi = two ? _mm256_loadu_si256((const __m256i *)(row + ROWS * words)) : _mm256_setzero_si256();
                    r[i] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
                }
                bg_transpose16(r);  /* r[l]: word l % 8 of chunk c + l / 8 */
                uint32_t *dst = pan + (c * chunk / 2) * BG_NP + 16 * v;
#pragma GCC unroll 16
                for (int l = 0; l < 16; ++l) {
                    if (l >= 8 && !two) break;
                    const int64_t base = (l / 8) * chunk / 2 + l % 8;
#pragma GCC unroll 4
                    for (int j = 0; j < 4; ++j)
                        _mm512_store_si512((__m512i *)(dst + (base + j * words) * BG_NP), bg_decode(r[l], j));
                }
            }
        }
    }
}

/* c[i, 0..63] (+)= rows i < mr of one group: x pairs xr[i * xstride + p], p < pairs; panel pan[p * 64 + ...];
   then c += s * acc + cv * xs[i * sstride]. first: c is written, not added to. */
static inline __attribute__((always_inline)) void bg_group(const int mr, const uint32_t *xr, int64_t xstride,
                                                           const uint32_t *pan, int64_t pairs, const float *sv,
                                                           const float *cv, const float *xs, int64_t sstride,
                                                           float *c, int first) {
    __m512 acc[BG_MR][4];
#pragma GCC unroll 6
    for (int i = 0; i < mr; ++i)
#pragma GCC unroll 4
        for (int v = 0; v < 4; ++v) acc[i][v] = _mm512_setzero_ps();
#pragma GCC unroll 2
    for (int64_t p = 0; p < pairs; ++p) {
        const __m512bh b0 = (__m512bh)_mm512_load_si512(pan + p * BG_NP);
        const __m512bh b1 = (__m512bh)_mm512_load_si512(pan + p * BG_NP + 16);
        const __m512bh b2 = (__m512bh)_mm512_load_si512(pan + p * BG_NP + 32);
        const __m512bh b3 = (__m512bh)_mm512_load_si512(pan + p * BG_NP + 48);
#pragma GCC unroll 6
        for (int i = 0; i < mr; ++i) {
            const __m512bh a = (__m512bh)_mm512_set1_epi32((int)xr[i * xstride + p]);
            acc[i][0] = _mm512_dpbf16_ps(acc[i][0], a, b0);
            acc[i][1] = _mm512_dpbf16_ps(acc[i][1], a, b1);
            acc[i][2] = _mm512_dpbf16_ps(acc[i][2], a, b2);
            acc[i][3] = _mm512_dpbf16_ps(acc[i][3], a, b3);
        }
    }
#pragma GCC unroll 6
    for (int i = 0; i < mr; ++i) {
        const __m512 xsum = _mm512_set1_ps(xs[i * sstride]);
#pragma GCC unroll 4
        for (int v = 0; v < 4; ++v) {
            float *cp = c + i * BG_NP + 16 * v;
            const __m512 old = first ? _mm512_setzero_ps() : _mm512_load_ps(cp);
            const __m512 t = _mm512_fmadd_ps(acc[i][v], _mm512_load_ps(sv + 16 * v), old);
            _mm512_store_ps(cp, _mm512_fmadd_ps(xsum, _mm512_load_ps(cv + 16 * v), t));
        }
    }
}

/* One block of columns [k0, k0 + kb) for activation rows [0, mb): xp/xs at the block's first row (row strides
   BG_KB/2 and BG_KB/g). */
static void bg_block(const uint32_t *xp, const float *xs, int64_t g, int64_t kb, int64_t mb, const uint32_t *pan,
                     const float *sv, const float *cv, float *c, int first_block) {
    const int64_t xstride = BG_KB / 2, sstride = BG_KB / g, pairs = g / 2;
    for (int64_t m0 = 0; m0 < mb; m0 += BG_MR) {
        const int64_t mr = mb - m0 < BG_MR ? mb - m0 : BG_MR;
        for (int64_t gi = 0; gi < kb / g; ++gi) {
            const uint32_t *xr = xp + m0 * xstride + gi * pairs;
            const float *xsr = xs + m0 * sstride + gi;
            const uint32_t *pg = pan + gi * pairs * BG_NP;
            const float *svg = sv + gi * BG_NP, *cvg = cv + gi * BG_NP;
            float *cr = c + m0 * BG_NP;
            const int first = first_block && gi == 0;
            switch (mr) {
                case 6: bg_group(6, xr, xstride, pg, pairs, svg, cvg, xsr, sstride, cr, first); break;
                case 5: bg_group(5, xr, xstride, pg, pairs, svg, cvg, xsr, sstride, cr, first); break;
                case 4: bg_group(4, xr, xstride, pg, pairs, svg, cvg, xsr, sstride, cr, first); break;
                case 3: bg_group(3, xr, xstride, pg, pairs, svg, cvg, xsr, sstride, cr, first); break;
                case 2: bg_group(2, xr, xstride, pg, pairs, svg, cvg, xsr, sstride, cr, first); break;
                default: bg_group(1, xr, xstride, pg, pairs, svg, cvg, xsr, sstride, cr, first); break;
            }
        }
    }
}

/* xp and xs of activation row i (see the scheme above), vectorized over the W words of a nibble pair. Both are
   stored by column block, [K / BG_KB][m][BG_KB / 2] and [K / BG_KB][m][BG_KB / g]: the rows of one block are one
   contiguous run, which the micro-kernels read for every panel (row by row, the same rows were m strided streams).
   xp and xs here point at row i of block 0; bstride_p / bstride_s: one block's size (m * BG_KB / 2, m * BG_KB / g). */
static void bg_prepare_row(const void *x, int x_bf16, int64_t k, int64_t g, uint32_t *xp, float *xs, int64_t bstride_p,
                           int64_t bstride_s) {
    const int64_t chunk = chunk_of(g), words = chunk / 8, step = words < 16 ? words : 16;
    const __mmask16 mask = (__mmask16)((1u << step) - 1u);
    for (int64_t c0 = 0; c0 < k; c0 += chunk) {
        __m512 sum = _mm512_setzero_ps();
        for (int j = 0; j < 4; ++j) {
            for (int64_t q0 = 0; q0 < words; q0 += step) {
                const int64_t lo_col = c0 + 2 * j * words + q0, hi_col = lo_col + words;
                __m512i lo, hi;
                if (x_bf16) {
                    lo = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, (const uint16_t *)x + lo_col));
                    hi = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, (const uint16_t *)x + hi_col));
                } else {
                    lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(mask, (const float *)x + lo_col)));
                    hi = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(mask, (const float *)x + hi_col)));
                }
                const __m512i pair = _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
                _mm512_mask_storeu_epi32(xp + (c0 / BG_KB) * bstride_p + (c0 % BG_KB) / 2 + j * words + q0, mask, pair);
                sum = _mm512_add_ps(sum, _mm512_add_ps(_mm512_castsi512_ps(_mm512_slli_epi32(lo, 16)),
                                                       _mm512_castsi512_ps(_mm512_slli_epi32(hi, 16))));
            }
            if (g == 32 && j == 1) {  /* the chunk's first group ends with nibble pair 1 */
                xs[(c0 / BG_KB) * bstride_s + (c0 % BG_KB) / g] = _mm512_reduce_add_ps(sum);
                sum = _mm512_setzero_ps();
            }
        }
        xs[(c0 / BG_KB) * bstride_s + (c0 % BG_KB + chunk) / g - 1] = _mm512_reduce_add_ps(sum);
    }
}

static int bg_supported(void) {
    static int state;  /* 0: not asked yet, 1: this CPU has AVX512_BF16, -1: it has not */
    if (state == 0) {
        __builtin_cpu_init();
        state = __builtin_cpu_supports("avx512bf16") ? 1 : -1;
    }
    return state == 1;
}

/* y[m, n_valid] = x[m, K] @ W.T for a bound INT4 weight (every supported g); x and y bf16 or fp32. Returns 0, -2
   where it cannot run (built without AVX-512, or the CPU lacks AVX512_BF16), 1 when a buffer could not be allocated
   (y then holds no result). One parallel region: the activations are converted by all threads, then each thread
   takes panels of 64 output rows. */
int musecore_int4_bf16_gemm(const int4_weight_t *w, const void *x, int x_bf16, void *y, int y_bf16, int64_t m) {
    if (!bg_supported()) return -2;
    if (m <= 0) return 0;
    const int64_t k = w->k, g = w->g;
#ifdef _OPENMP
    int threads = omp_get_max_threads();
#else
    int threads = 1;
#endif
    /* the calling thread's slot 3 (workers use 1 and 2): xp (m k/2 uint32) then xs (m k/g fp32) */
    const int64_t blocks = (k + BG_KB - 1) / BG_KB, bstride_p = m * (BG_KB / 2), bstride_s = m * (BG_KB / g);
    const size_t xp_bytes = ((size_t)blocks * bstride_p * 4 + 63) & ~(size_t)63;
    uint32_t *xp = (uint32_t *)thread_buffer(3, xp_bytes + (size_t)blocks * bstride_s * 4);
    if (xp == NULL) return 1;
    float *xs = (float *)((char *)xp + xp_bytes);
    /* tasks: one panel, or above BG_GROUP_MIN_M rows groups of up to BG_GROUP panels (fewer where that leaves fewer
       than 2 tasks per thread) */
    const int64_t panels = (w->n_rows + BG_NP - 1) / BG_NP;
    int64_t group = m <= BG_GROUP_MIN_M ? 1 : panels / (2 * (int64_t)threads);
    group = group < 1 ? 1 : group > BG_GROUP ? BG_GROUP : group;
    const int64_t tasks = (panels + group - 1) / group;
    if (threads > tasks) threads = (int)tasks;
    const int64_t mb_max = m < BG_MB ? m : BG_MB;
    int status = 0;
#ifdef _OPENMP
#pragma omp parallel num_threads(threads) if (threads > 1)
#endif
    {
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
        for (int64_t i = 0; i < m; ++i)
            bg_prepare_row((const char *)x + i * k * (x_bf16 ? 2 : 4), x_bf16, k, g, xp + i * (BG_KB / 2),
                           xs + i * (BG_KB / g), bstride_p, bstride_s);
        /* panel (BG_KB/2 pairs x 64 rows x 4 bytes), then s and -s(16+z) per block group (at most BG_KB/32) */
        uint32_t *pan = (uint32_t *)thread_buffer(1, (size_t)BG_KB / 2 * BG_NP * 4 + 2 * (BG_KB / 32) * BG_NP * 4);
        float *c = (float *)thread_buffer(2, (size_t)group * mb_max * BG_NP * 4);  /* [group][mb][64] */
        if (pan == NULL || c == NULL) {
#ifdef _OPENMP
#pragma omp atomic write
#endif
            status = 1;
        }
        float *sv = pan == NULL ? NULL : (float *)(pan + BG_KB / 2 * BG_NP), *cv = sv == NULL ? NULL : sv + (BG_KB / 32) * BG_NP;
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
        for (int64_t task = 0; task < tasks; ++task) {
            if (pan == NULL || c == NULL) continue;  /* every thread still takes part in the loop's barrier */
            const int64_t p0 = task * group, np = panels - p0 < group ? panels - p0 : group;
            for (int64_t m0 = 0; m0 < m; m0 += BG_MB) {
                const int64_t mb = m - m0 < BG_MB ? m - m0 : BG_MB;
                for (int64_t k0 = 0; k0 < k; k0 += BG_KB) {
                    const int64_t kb = k - k0 < BG_KB ? k - k0 : BG_KB;
                    for (int64_t p = 0; p < np; ++p) {
                        /* the panel block BG_AHEAD steps later in this order (p fastest, then k0, then the next task) */
                        const int64_t ahead = (k0 / BG_KB) * np + p + BG_AHEAD, kblk = ahead / np;
                        const int64_t next_n0 = kblk < blocks ? (p0 + ahead % np) * BG_NP : (p0 + np) * BG_NP;
                        const int64_t next_k0 = kblk < blocks ? kblk * BG_KB : 0;
                        bg_decode_panel(w, (p0 + p) * BG_NP, k0, kb, pan, sv, cv, next_n0, next_k0);
                        bg_block(xp + (k0 / BG_KB) * bstride_p + m0 * (BG_KB / 2),
                                 xs + (k0 / BG_KB) * bstride_s + m0 * (BG_KB / g), g, kb, mb, pan, sv, cv,
                                 c + p * mb * BG_NP, k0 == 0);
                    }
                }
                for (int64_t p = 0; p < np; ++p) {
                    const int64_t n0 = (p0 + p) * BG_NP, nv = w->n_valid - n0 < BG_NP ? w->n_valid - n0 : BG_NP;
                    const float *cp = c + p * mb * BG_NP;
                    for (int64_t i = 0; i < mb; ++i)
                        for (int64_t v = 0; v < nv; v += 16) {
                            const __mmask16 mask = nv - v >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (nv - v)) - 1u);
                            const __m512 out = _mm512_load_ps(cp + i * BG_NP + v);
                            const int64_t at = (m0 + i) * w->n_valid + n0 + v;
                            if (y_bf16) _mm256_mask_storeu_epi16((uint16_t *)y + at, mask, (__m256i)_mm512_cvtneps_pbh(out));
                            else _mm512_mask_storeu_ps((float *)y + at, mask, out);
                        }
                }
            }
        }
    }
    return status;
}

int musecore_int4_bf16_ready(void) { return bg_supported(); }
#pragma GCC pop_options
#else
int musecore_int4_bf16_gemm(const int4_weight_t *w, const void *x, int x_bf16, void *y, int y_bf16, int64_t m) {
    (void)w; (void)x; (void)x_bf16; (void)y; (void)y_bf16; (void)m;
    return -2;
}
int musecore_int4_bf16_ready(void) { return 0; }
#endif
