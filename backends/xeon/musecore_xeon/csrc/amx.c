/* Part of kernels.c (one translation unit), after int4.c. The INT4 x BF16 GEMM on AMX (Sapphire Rapids and later):
   above a few activation rows the GEMV is compute-bound and the dense tiles write and re-read a BF16 copy of the
   weight; here panels of the INT4 weight are dequantized straight into AMX tiles kept in L2 and multiplied with
   tdpbf16ps, so the weight is read as INT4 once per 256 activation rows. Tile weights are (q - z) * scale rounded to
   bf16, activations bf16, products and sums fp32: only the order of the sums differs from the dense tiles. */
/* ---- INT4 x BF16 GEMM on AMX ---------------------------------------------------------------------------------
   C^T = W X^T: A tiles are the weight (16 output rows x 32 k-slots, 1 KiB, rows in plain order), B tiles the
   activations in VNNI order (16 k-slot pairs x 16 activation rows x 2), C tiles 16 output rows x 16 activation rows
   fp32. A thread takes a panel of nb output rows (a multiple of 32: two A tiles at a time). Per block of at most
   AMX_M_BLOCK activation rows and AMX_K_BLOCK columns, the panel's codes are dequantized into A tiles (tile (t, s):
   rows 16t..16t+15 of the panel, slots 32s..32s+31 of the block), then every pair of A tiles is multiplied by every
   pair of activation tiles, the four C tiles kept in the tile registers over the block's columns and in a per-thread
   fp32 accumulator acc[nb][mb] between blocks; at the end acc is transposed into y. Tiles: C 0-3, A 4-5, B 6-7, all
   16 rows x 64 bytes. A tile pair strip over a block (16 KiB) stays in L1 while the activation tiles stream from L2.

   k-slot order: within a chunk of g columns (W = g/8 planar words), chunk tile tau = j * W/16 + u holds, in slot
   2q + h (q = 0..15, h = 0..1), column (2j + h) * W + 16u + q of the chunk: nibble pair j of the planar words
   16u..16u+15 (positions 2j and 2j+1). The activations are packed in the same order (amx_pack_tile), so every product
   pairs the right column; only the order of the fp32 sums differs from the natural one. */
#if defined(HAVE_VNNI512) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
/* Defaults from the blocking sweep on the GPU machine's 16-core Xeon (backends/xeon/lab/NOTES.md, session 38): 1024
   columns per block cut the C tiles' round trips through acc 4x; 128-row panels split the weight over more tasks. */
#define AMX_M_BLOCK 256  /* activation rows per block: the A tiles are dequantized again for each block */
#define AMX_K_BLOCK 1024 /* columns per block: a multiple of every supported group size (128, 256) */
#define AMX_MAX_PANEL 128
#define AMX_TILE_U16 512 /* uint16 per tile: 16 rows x 32 bf16 */

/* The blocking in use (defaults above) and, for the lab's leave-one-out profile only, a mode that skips one phase
   (1: the dequantization, 2: the tile products, 3: the activations' packing; the result is then garbage), and
   whether the packed activations are written with non-temporal stores (stream: the same bits). Set by
   musecore_int4_amx_tune (backends/xeon/lab/scripts/amx_blocking_sweep.py); the product never changes it. */
typedef struct { int64_t k_block, m_block, max_panel; int mode, stream; } amx_tuning_t;
static amx_tuning_t amx_tuning = {AMX_K_BLOCK, AMX_M_BLOCK, AMX_MAX_PANEL, 0, 0};

typedef struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } amx_config_t;

static int amx_state; /* 0: not asked yet, 1: the kernel may use the tile registers, -1: Linux refused them */

/* Linux hands out the AMX tile state only on request (arch_prctl, once per process, for every thread). */
int musecore_amx_ready(void) {
    if (amx_state == 0) amx_state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
    return amx_state == 1;
}

static void amx_configure(void) {
    amx_config_t cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; ++t) { cfg.colsb[t] = 64; cfg.rows[t] = 16; }
    _tile_loadconfig(&cfg);
}

/* r[c] <- column c of the 16 x 16 matrix of dwords whose row i is r[i] (unpack 32, unpack 64, two block shuffles). */
static inline __attribute__((always_inline)) void amx_transpose16(__m512i r[16]) {
    __m512i t[16], u[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);      /* lane L: r_i[4L], r_i+1[4L], r_i[4L+1], r_i+1[4L+1] */
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);  /* lane L: the same at 4L+2, 4L+3 */
    }
    for (int i = 0; i < 16; i += 4) {  /* u[i + b], lane L: rows i..i+3 at column 4L + b */
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

/* bf16 of (v - z) * s for v = 0..15 in the low 16 lanes: the row's vpermw table (exact fp32, rounded to even). */
static inline __m512i amx_table(float s, float z) {
    const __m512 v = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    return _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(_mm512_fmadd_ps(v, _mm512_set1_ps(s),
                                                                               _mm512_set1_ps(-z * s))));
}

/* The A tiles of rows [n0, n0 + 16) for the chunk (one group, g >= 128) starting at column c0: its g/32 tiles at
   out, out + 512, ... (rows at or past n_rows are zero). Per row and nibble pair j: one shift, one AND and one
   vpermw through the row's table turn 16 planar words into the row's 32 bf16 weights of chunk tile j * W/16 + u. */
static inline void amx_dequant_chunk(const int32_t *codes, const uint16_t *sz, int64_t n0, int64_t n_rows, int64_t kw,
                                     int64_t groups, int64_t g, int64_t c0, uint16_t *out) {
    const int64_t words = g / 8, gi = c0 / g, per_j = words / 16;
    const __m512i low = _mm512_set1_epi32(0x000F000F);
    for (int i = 0; i < 16; ++i) {
        const int64_t n = n0 + i;
        if (n >= n_rows) {
            for (int64_t tau = 0; tau < g / 32; ++tau)
                _mm512_store_si512((__m512i *)(out + tau * AMX_TILE_U16 + 32 * i), _mm512_setzero_si512());
            continue;
        }
        const uint16_t *p = sz + ((n / 4) * groups + gi) * 2 * ROWS + n % 4;
        const __m512i table = amx_table(half_to_float(p[0]), half_to_float(p[ROWS]));
        const int32_t *row = codes + (n - n % 4) * kw + (gi * 4 + n % 4) * words;
        for (int64_t u = 0; u < per_j; ++u) {
            const __m512i wv = _mm512_loadu_si512(row + 16 * u);
#pragma GCC unroll 4
            for (int j = 0; j < 4; ++j)
                _mm512_store_si512((__m512i *)(out + (j * per_j + u) * AMX_TILE_U16 + 32 * i),
                                   _mm512_permutexvar_epi16(_mm512_and_si512(_mm512_srli_epi32(wv, 4 * j), low), table));
        }
    }
}

/* The A tiles of panel rows [n0, n0 + nb) for columns [k0, k0 + kb): tile (t, s) at ap + (t * kb/32 + s) * 512. */
static void amx_dequant_panel(const int4_weight_t *w, int64_t n0, int64_t nb, int64_t k0, int64_t kb, uint16_t *ap) {
    const int64_t kw = w->k / 8, groups = w->k / w->g, steps = kb / 32;
    for (int64_t t = 0; t < nb / 16; ++t)
        for (int64_t c0 = k0; c0 < k0 + kb; c0 += w->g)
            amx_dequant_chunk(w->codes, w->sz, n0 + 16 * t, w->n_rows, kw, groups, w->g, c0,
                              ap + (t * steps + (c0 - k0) / 32) * AMX_TILE_U16);
}

/* acc[nb, mb] (+)= the panel's A tiles times the activation tiles of rows [0, mb) (xp: packed by amx_pack_tile, K/32
   tiles per 16 rows), columns [k0, k0 + kb); mb a multiple of 16. */
static void amx_block(const uint16_t *xp, int64_t k, int64_t k0, int64_t kb, int first, const uint16_t *ap, int64_t nb,
                      float *acc, int64_t mb) {
    const int64_t steps = kb / 32, row_tiles = k / 32, cs = mb * 4;
    for (int64_t t = 0; t < nb / 16; t += 2) {
        const uint16_t *a0 = ap + t * steps * AMX_TILE_U16, *a1 = a0 + steps * AMX_TILE_U16;
        for (int64_t mt = 0; mt < mb; mt += 32) {
            const int two = mt + 16 < mb;  /* a second activation tile (else the block's last 16 rows) */
            const uint16_t *b0 = xp + ((mt / 16) * row_tiles + k0 / 32) * AMX_TILE_U16, *b1 = b0 + row_tiles * AMX_TILE_U16;
            float *c = acc + t * 16 * mb + mt;  /* C (A tile t, B tile mt/16); +16 * mb: A tile t + 1; +16: mt + 16 */
            if (first) {
                _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
            } else {
                _tile_loadd(0, c, cs); _tile_loadd(2, c + 16 * mb, cs);
                if (two) { _tile_loadd(1, c + 16, cs); _tile_loadd(3, c + 16 * mb + 16, cs); }
            }
            if (two)
                for (int64_t s = 0; s < steps; ++s) {
                    _tile_loadd(4, a0 + s * AMX_TILE_U16, 64);
                    _tile_loadd(6, b0 + s * AMX_TILE_U16, 64);
                    _tile_loadd(7, b1 + s * AMX_TILE_U16, 64);
                    _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7);
                    _tile_loadd(5, a1 + s * AMX_TILE_U16, 64);
                    _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
                }
            else
                for (int64_t s = 0; s < steps; ++s) {
                    _tile_loadd(4, a0 + s * AMX_TILE_U16, 64);
                    _tile_loadd(5, a1 + s * AMX_TILE_U16, 64);
                    _tile_loadd(6, b0 + s * AMX_TILE_U16, 64);
                    _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(2, 5, 6);
                }
            _tile_stored(0, c, cs); _tile_stored(2, c + 16 * mb, cs);
            if (two) { _tile_stored(1, c + 16, cs); _tile_stored(3, c + 16 * mb + 16, cs); }
        }
    }
}

/* y[m0 + i, n0 + j] = acc[j, i] for the valid rows and columns, 16 x 16 blocks transposed (bf16: round to even). */
static void amx_store(const float *acc, int64_t mb, int64_t nb, int64_t m0, int64_t m, int64_t n0, int64_t n_valid,
                      void *y, int y_bf16) {
    const int64_t rows = m - m0 < mb ? m - m0 : mb, cols = n_valid - n0 < nb ? n_valid - n0 : nb;
    for (int64_t j0 = 0; j0 < cols; j0 += 16) {
        const __mmask16 mask = (__mmask16)(cols - j0 >= 16 ? 0xFFFFu : (1u << (cols - j0)) - 1u);
        for (int64_t i0 = 0; i0 < rows; i0 += 16) {
            __m512i r[16];
            for (int q = 0; q < 16; ++q) r[q] = _mm512_load_si512((const __m512i *)(acc + (j0 + q) * mb + i0));
            amx_transpose16(r);  /* r[i]: outputs j0..j0+15 of activation row i0 + i */
            for (int64_t i = 0; i < 16 && i0 + i < rows; ++i) {
                const __m512 v = _mm512_castsi512_ps(r[i]);
                const int64_t at = (m0 + i0 + i) * n_valid + n0 + j0;
                if (y_bf16) _mm256_mask_storeu_epi16((uint16_t *)y + at, mask, (__m256i)_mm512_cvtneps_pbh(v));
                else _mm512_mask_storeu_ps((float *)y + at, mask, v);
            }
        }
    }
}

/* Activation tile (a, column tile c) of x (bf16 or fp32) [m, k]: B operand, VNNI order, at xp + (a * k/32 + c) * 512:
   row q holds slot pair q (columns of slots 2q, 2q+1, amx_column_order) of activation rows 16a..16a+15 (rows at or
   past m zero). Per row, the chunk tile's two 16-column runs are loaded and interleaved (vpermw); 16 rows so made are
   transposed. One tile is 1 KiB contiguous. */
static void amx_pack_tile(const void *x, int x_bf16, int64_t m, int64_t k, int64_t g, int64_t a, int64_t c,
                          __m512i interleave, int stream, uint16_t *xp) {
    const int64_t words = g / 8, per_j = words / 16, c0 = c * 32 / g * g, tau = c - c0 / 32;
    const int64_t j = tau / per_j, u = tau % per_j, lo = c0 + 2 * j * words + 16 * u, hi = lo + words;
    __m512i r[16];
    for (int i = 0; i < 16; ++i) {
        const int64_t row = 16 * a + i;
        __m256i l16, h16;
        if (row >= m) {
            l16 = h16 = _mm256_setzero_si256();
        } else if (x_bf16) {
            const uint16_t *src = (const uint16_t *)x + row * k;
            l16 = _mm256_loadu_si256((const __m256i *)(src + lo));
            h16 = _mm256_loadu_si256((const __m256i *)(src + hi));
        } else {
            const float *src = (const float *)x + row * k;
            l16 = (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + lo));
            h16 = (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + hi));
        }
        r[i] = _mm512_permutexvar_epi16(interleave, _mm512_inserti64x4(_mm512_castsi256_si512(l16), h16, 1));
    }
    amx_transpose16(r);
    uint16_t *tile = xp + (a * (k / 32) + c) * AMX_TILE_U16;
    if (stream)
        for (int q = 0; q < 16; ++q) _mm512_stream_si512((__m512i *)(tile + 32 * q), r[q]);
    else
        for (int q = 0; q < 16; ++q) _mm512_store_si512((__m512i *)(tile + 32 * q), r[q]);
}

/* y[m, n_valid] = x[m, K] @ W.T on AMX for a bound INT4 weight with g a multiple of 128; x and y bf16 or fp32.
   Returns 0, -1 for a group size it does not take, -2 without AMX (not built, or Linux refused the tile state),
   1 when a buffer could not be allocated (y then holds no result). One parallel region: the activations are packed
   by all threads, then each thread takes its panels. */
int musecore_int4_amx_linear(const int4_weight_t *w, const void *x, int x_bf16, void *y, int y_bf16, int64_t m) {
    if (amx_state != 1) return -2;
    const int64_t k = w->k, g = w->g;
    if (g % 128 || k % g) return -1;
    if (m <= 0) return 0;
#ifdef _OPENMP
    int threads = omp_get_max_threads();
#else
    int threads = 1;
#endif
    const amx_tuning_t tune = amx_tuning;
    const int64_t k_block = (tune.k_block + g - 1) / g * g;  /* whole groups (only g = 384, 512... change it) */
    const int64_t mp = (m + 15) / 16 * 16, x_tiles = (mp / 16) * (k / 32);
    uint16_t *xp = (uint16_t *)thread_buffer(3, (size_t)mp * k * 2);  /* the calling thread's: not a worker's 1 or 2 */
    if (xp == NULL) return 1;
    __m512i interleave;  /* lane 2q + h <- element 16h + q of [lo 16, hi 16] */
    {
        uint16_t v[32];
        for (int l = 0; l < 32; ++l) v[l] = (uint16_t)(16 * (l % 2) + l / 2);
        interleave = _mm512_loadu_si512(v);
    }
    /* Tasks: panels of nb output rows (a multiple of 32, at most max_panel) times blocks of m_block activation rows.
       nb is the largest panel whose tasks fill the threads' rounds to >= 90% (a 2.5-round split wastes half a round),
       else the best-filled of up to 4x the fewest panels. */
    const int64_t m_block = tune.m_block, m_blocks = (mp + m_block - 1) / m_block;
    const int64_t fewest = (w->n_rows + tune.max_panel - 1) / tune.max_panel;
    int64_t nb = tune.max_panel;
    double best = -1.0;
    for (int64_t panels = fewest; panels <= 4 * fewest + threads && panels * 32 <= w->n_rows + 31; ++panels) {
        int64_t cand = (w->n_rows + panels - 1) / panels;
        cand = cand < 32 ? 32 : (cand + 31) / 32 * 32;
        const int64_t t = (w->n_rows + cand - 1) / cand * m_blocks, rounds = (t + threads - 1) / threads;
        const double fill = (double)t / (double)(rounds * threads);
        if (fill > best + 1e-9) { best = fill; nb = cand; }
        if (fill >= 0.9) break;
    }
    const int64_t n_panels = (w->n_rows + nb - 1) / nb, tasks = n_panels * m_blocks;
    if (threads > tasks) threads = (int)tasks;
    int status = 0;
#ifdef _OPENMP
#pragma omp parallel num_threads(threads)
#endif
    {
        if (tune.mode != 3) {
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
            for (int64_t i = 0; i < x_tiles; ++i)
                amx_pack_tile(x, x_bf16, m, k, g, i / (k / 32), i % (k / 32), interleave, tune.stream, xp);
            if (tune.stream) _mm_sfence();  /* the streamed tiles are visible before the loop's barrier */
        }
        uint16_t *ap = (uint16_t *)thread_buffer(1, (size_t)(nb / 16) * (k_block / 32) * AMX_TILE_U16 * 2);
        float *acc = (float *)thread_buffer(2, (size_t)m_block * nb * 4);
        if (ap == NULL || acc == NULL) {
#ifdef _OPENMP
#pragma omp atomic write
#endif
            status = 1;
        } else {
            amx_configure();
        }
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
        for (int64_t task = 0; task < tasks; ++task) {
            if (ap == NULL || acc == NULL) continue;  /* every thread still takes part in the loop's barrier */
            const int64_t n0 = task / m_blocks * nb, m0 = task % m_blocks * m_block;
            const int64_t mb = mp - m0 < m_block ? mp - m0 : m_block;
            for (int64_t k0 = 0; k0 < k; k0 += k_block) {
                const int64_t kb = k - k0 < k_block ? k - k0 : k_block;
                if (tune.mode != 1) amx_dequant_panel(w, n0, nb, k0, kb, ap);
                if (tune.mode != 2) amx_block(xp + m0 * k, k, k0, kb, k0 == 0, ap, nb, acc, mb);
            }
            amx_store(acc, mb, nb, m0, m, n0, w->n_valid, y, y_bf16);
        }
        if (ap != NULL && acc != NULL) _tile_release();
    }
    return status;
}

/* Lab only: set the blocking (0 keeps a value's default) and the leave-one-out mode; -1 for values the kernel cannot
   take (k_block a multiple of 256 up to 8192, m_block of 16 up to 1024, max_panel of 32 up to 1024, mode 0..3). */
int musecore_int4_amx_tune(int64_t k_block, int64_t m_block, int64_t max_panel, int mode, int stream) {
    amx_tuning_t t = {k_block ? k_block : AMX_K_BLOCK, m_block ? m_block : AMX_M_BLOCK,
                      max_panel ? max_panel : AMX_MAX_PANEL, mode, stream != 0};
    if (t.k_block % 256 || t.k_block > 8192 || t.m_block % 16 || t.m_block > 1024 || t.max_panel % 32 ||
        t.max_panel > 1024 || mode < 0 || mode > 3)
        return -1;
    amx_tuning = t;
    return 0;
}

/* The A tiles of panel rows [n0, n0 + 32) and k-slots [k0, k0 + kb) (kb a multiple of g, at most 256) into
   out (uint16 [2, kb/32, 16 rows, 32 slots], 64-byte aligned): the layout test's view of the dequantizer. */
int musecore_int4_amx_panel(const int4_weight_t *w, int64_t n0, int64_t k0, int64_t kb, uint16_t *out) {
    if (w->g % 128 || n0 % 16 || k0 % w->g || kb % w->g || kb > 256 || k0 + kb > w->k) return -1;
    amx_dequant_panel(w, n0, 32, k0, kb, out);
    return 0;
}
#else
int musecore_amx_ready(void) { return 0; }
int musecore_int4_amx_linear(const int4_weight_t *w, const void *x, int x_bf16, void *y, int y_bf16, int64_t m) {
    (void)w; (void)x; (void)x_bf16; (void)y; (void)y_bf16; (void)m;
    return -2;
}
int musecore_int4_amx_panel(const int4_weight_t *w, int64_t n0, int64_t k0, int64_t kb, uint16_t *out) {
    (void)w; (void)n0; (void)k0; (void)kb; (void)out;
    return -2;
}
int musecore_int4_amx_tune(int64_t k_block, int64_t m_block, int64_t max_panel, int mode, int stream) {
    (void)k_block; (void)m_block; (void)max_panel; (void)mode; (void)stream;
    return -2;
}
#endif
