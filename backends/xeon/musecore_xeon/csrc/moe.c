/* Part of kernels.c (one translation unit), after int4.c, ops.c and bf16.c, whose row kernels it calls. The fused
   decode MoE, one native call per layer for INT4 and BF16 experts: one driver, since grouping, phases and barriers
   are the same; only the activation preparation and the row kernel differ per format. */
/* The routed experts of one MoE call in ONE native call (decode sizes, below the dense-tile crossover):
     y[t] = sum_j w[t,j] * rms(round(round(down_e(silu(gate_e(z_t)) * up_e(z_t))) * post_norm)),  e = ids[t,j]
   (musecore/ops moe: the expert's output rounded to z's dtype, then the post-expert norm with ONE weight [l] shared by
   all experts, scale first and rounded, its output rounded too, then the routing weight and the fp32 sum)
   gu_w / dn_w are arrays of E pointers to each expert's weights (fused [gate; up] rows 0..2I-1, then down [l, I]):
   INT4 nibble-planar codes with gu_sz / dn_sz their fp16 (scale, zero) pairs, or BF16 [N, K] row-major (sz unused).
   The (t, j) pairs are grouped by expert (counting sort, stable), so an expert's bytes are read once per call for
   all its tokens; the gate/up row blocks of all routed experts are split into one contiguous range per thread, then
   the SwiGLU, the down row blocks (split the same way), and the norm + weighted sum, all in one OpenMP region. Where
   the routed experts divide evenly over the threads, each thread's ranges are the same whole experts in both
   projections and it runs on from its gate/up rows to its down rows without a barrier (one barrier, before the norm;
   else three). Each thread prefetches the first blocks of its next weight (the next expert's, or its first down
   block) while it finishes the current one, where the row kernel's own prefetch runs past the weight's end.
   fp32 throughout: the intermediate h is not rounded to bf16 (the reference does not round it either); the GEMV
   inputs z and h are prepared per row as each format's GEMV prepares them (z once per token, copied to its other
   rows). Each output row is computed by one thread in one order: the bits depend on neither the thread count nor
   the other tokens of the call. */
enum { MOE_INT4 = 0, MOE_BF16 = 1 };

typedef struct { int kind; int64_t rows, k, g; float *buf; } moe_act_t;  /* the prepared input rows of one projection */

static size_t moe_act_floats(int kind, int64_t rows, int64_t k, int64_t g) {
    return kind == MOE_INT4 ? qx_floats(rows, k, g) : (size_t)((rows * k + 7) & ~7);
}

static void moe_prepare(const moe_act_t *a, const void *src, int src_bf16, int64_t r) {
    if (a->kind == MOE_INT4)
        prepare_x(src, src_bf16, 1, a->k, a->g, qx_row(qx_at(a->buf, a->rows, a->k, a->g), r, a->k, a->g));
    else
        bf16_prepare_x(src, src_bf16, 1, a->k, a->buf + r * a->k);
}

/* Prepared row dst := prepared row src (the same input row). */
static void moe_copy_prepared(const moe_act_t *a, int64_t src, int64_t dst) {
    if (a->kind == MOE_INT4) {
        const qx_t q = qx_at(a->buf, a->rows, a->k, a->g), s = qx_row(q, src, a->k, a->g), d = qx_row(q, dst, a->k, a->g);
        const int64_t groups = a->k / a->g;
        memcpy(d.xq, s.xq, (size_t)a->k * sizeof(int16_t));
        memcpy(d.sx, s.sx, (size_t)groups * sizeof(float));
        memcpy(d.xqsum, s.xqsum, (size_t)groups * sizeof(int32_t));
    } else {
        memcpy(a->buf + dst * a->k, a->buf + src * a->k, (size_t)a->k * sizeof(float));
    }
}

/* Output rows [blk * block, +block) of weight w for the `count` prepared rows from r0, into out[(r0 + m) * n + row]. */
static void moe_rows(const moe_act_t *a, const void *w, const void *sz, int64_t r0, int64_t count, float *out,
                     int64_t blk, int64_t n) {
    if (a->kind == MOE_INT4) {
        row_block((const int32_t *)w, (const uint16_t *)sz, qx_row(qx_at(a->buf, a->rows, a->k, a->g), r0, a->k, a->g),
                  out + r0 * n, 0, blk * ROWS, n, count, a->k, a->g);
    } else {
        const int64_t n0 = blk * BF16_ROWS, n1 = n0 + BF16_ROWS < n ? n0 + BF16_ROWS : n;
        bf16_row_range((const uint16_t *)w, a->buf + r0 * a->k, out + r0 * n, 0, n0, n1, n, a->k, count);
    }
}

/* Row blocks ahead that the row kernel prefetches within one weight (the INT4 GEMV's PREFETCH_BYTES, the BF16
   GEMV's BF16_PREFETCH_BYTES, in whole blocks): where the block that far ahead lies in another weight (the next
   routed expert, or the thread's first block of the next projection), the driver prefetches it instead. */
static int64_t moe_prefetch_blocks(const moe_act_t *a) {
    const int64_t block = a->kind == MOE_INT4 ? ROWS * a->k / 2 : BF16_ROWS * a->k * 2,
                  ahead = a->kind == MOE_INT4 ? PREFETCH_BYTES : BF16_PREFETCH_BYTES;
    return (ahead + block - 1) / block;
}

/* Prefetch (into L1) row block blk of weight w [n, k] (and its INT4 scales/zeros). */
static void moe_prefetch(const moe_act_t *a, const void *w, const void *sz, int64_t blk, int64_t n) {
#ifdef __AVX2__
    const char *p, *q = NULL;
    int64_t bytes, qbytes = 0;
    if (a->kind == MOE_INT4) {
        p = (const char *)w + blk * ROWS * a->k / 2;
        bytes = ROWS * a->k / 2;
        q = (const char *)sz + blk * (a->k / a->g) * 2 * ROWS * 2;
        qbytes = (a->k / a->g) * 2 * ROWS * 2;
    } else {
        const int64_t rows = n - blk * BF16_ROWS < BF16_ROWS ? n - blk * BF16_ROWS : BF16_ROWS;
        p = (const char *)w + blk * BF16_ROWS * a->k * 2;
        bytes = rows * a->k * 2;
    }
    for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(p + off, _MM_HINT_T0);
    for (int64_t off = 0; off < qbytes; off += 64) _mm_prefetch(q + off, _MM_HINT_T0);
#else
    (void)a; (void)w; (void)sz; (void)blk; (void)n;
#endif
}

/* One projection's row blocks for all routed experts, as items idx * blocks + blk (idx into expert_list). */
typedef struct {
    const moe_act_t *act;
    const int64_t *w, *sz;  /* per expert (E pointers) */
    int64_t blocks, n;      /* row blocks per expert, output rows */
    float *out;
} moe_phase_t;

static void moe_phase_prefetch(const moe_phase_t *ph, const int64_t *expert_list, int64_t item) {
    const int64_t e = expert_list[item / ph->blocks];
    moe_prefetch(ph->act, (const void *)ph->w[e], ph->sz ? (const void *)ph->sz[e] : NULL, item % ph->blocks, ph->n);
}

/* Items [i0, i1) of phase ph on this thread; next / j0, j1: this thread's items of the phase that follows (next NULL
   for none), whose first blocks are prefetched while the last ones of this phase run. */
static void moe_run_items(const moe_phase_t *ph, const moe_phase_t *next, int64_t i0, int64_t i1, int64_t j0,
                          int64_t j1, const int64_t *expert_list, const int64_t *start) {
    const int64_t ahead = moe_prefetch_blocks(ph->act);
    for (int64_t item = i0; item < i1; ++item) {
        const int64_t idx = item / ph->blocks, e = expert_list[idx], r0 = start[e], target = item + ahead;
        if (target < i1) {
            if (target / ph->blocks != idx) moe_phase_prefetch(ph, expert_list, target);
        } else if (next != NULL && j0 + (target - i1) < j1) {
            moe_phase_prefetch(next, expert_list, j0 + (target - i1));
        }
        moe_rows(ph->act, (const void *)ph->w[e], ph->sz ? (const void *)ph->sz[e] : NULL, r0, start[e + 1] - r0,
                 ph->out, item % ph->blocks, ph->n);
    }
}

/* h = silu(gate) * up of gate/up output row r (h overwrites the gate half), prepared as the down projection's input. */
static void moe_swiglu_row(const moe_act_t *x_dn, float *gu_out, int64_t r, int64_t inter) {
    float *g = gu_out + r * 2 * inter;
    swiglu(g, g + inter, g, inter);
    moe_prepare(x_dn, g, 0, r);
}

/* The post-expert norm of one expert output row o (fp32, l values), as the reference rounds it: the expert's output
   rounded to z's dtype, times the shared weight and rounded again (scale first), in place; returns 1 / rms of those. */
static float post_expert_scale(float *o, int z_bf16, const void *post_norm, int norm_bf16, int64_t l, float eps) {
    float ss = 0.0f;
    int64_t c = 0;
#ifdef __AVX2__
    __m256 acc = _mm256_setzero_ps();
    for (; c + 8 <= l; c += 8) {
        const __m256 v = round8_to(z_bf16, _mm256_mul_ps(round8_to(z_bf16, _mm256_loadu_ps(o + c)),
                                                         load8_x(post_norm, norm_bf16, c)));
        _mm256_storeu_ps(o + c, v);
        acc = _mm256_fmadd_ps(v, v, acc);
    }
    ss = hsum(acc);
#endif
    for (; c < l; ++c) {
        const float v = round_to(z_bf16, round_to(z_bf16, o[c]) * load_x(post_norm, norm_bf16, c));
        o[c] = v;
        ss += v * v;
    }
    return 1.0f / sqrtf(ss / (float)l + eps);
}

/* yt += w * round(o * f): the normed row (rounded to z's dtype, as the norm's output) times its routing weight */
static void post_expert_add(const float *o, int z_bf16, float f, float w, float *yt, int64_t l) {
    int64_t c = 0;
#ifdef __AVX2__
    const __m256 fv = _mm256_set1_ps(f), wv = _mm256_set1_ps(w);
    for (; c + 8 <= l; c += 8)
        _mm256_storeu_ps(yt + c, _mm256_fmadd_ps(wv, round8_to(z_bf16, _mm256_mul_ps(_mm256_loadu_ps(o + c), fv)),
                                                 _mm256_loadu_ps(yt + c)));
#endif
    for (; c < l; ++c) yt[c] += w * round_to(z_bf16, o[c] * f);
}

static int moe_decode(int kind, const int64_t *gu_w, const int64_t *gu_sz, const int64_t *dn_w, const int64_t *dn_sz,
                      const void *z, int z_bf16, const int64_t *ids, const float *weights, const void *post_norm,
                      int norm_bf16, float post_eps, float *y, int64_t T, int64_t k_top, int64_t E, int64_t l, int64_t inter,
                      int64_t g_gu, int64_t g_dn, int64_t gu_blocks, int64_t dn_blocks, int64_t weight_bytes,
                      int threads) {
    const int64_t P = T * k_top, two_i = 2 * inter;
    const size_t qgu = moe_act_floats(kind, P, l, g_gu), qdn = moe_act_floats(kind, P, inter, g_dn),
                 outs = (size_t)((P * two_i + P * l + 7) & ~7), ints = (size_t)(2 * E + 1 + 3 * P + T);
    for (int64_t p = 0; p < P; ++p)
        if (ids[p] < 0 || ids[p] >= E) return -1;
    float *buf = scratch(qgu + qdn + outs + ints * 2);  /* int64 counters at the end: 2 floats each */
    if (buf == NULL) return -2;
    const moe_act_t x_gu = {kind, P, l, g_gu, buf}, x_dn = {kind, P, inter, g_dn, buf + qgu};
    float *gu_out = buf + qgu + qdn, *dn_out = gu_out + P * two_i;
    int64_t *start = (int64_t *)(buf + qgu + qdn + outs), *count = start + E + 1, *sorted = count + E,
            *row_of = sorted + P, *expert_list = row_of + P;
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
    const moe_phase_t gu = {&x_gu, gu_w, gu_sz, gu_blocks, two_i, gu_out},
                      dn = {&x_dn, dn_w, dn_sz, dn_blocks, l, dn_out};
    if (threads > routed * gu_blocks) threads = (int)(routed * gu_blocks);
    if (routed * weight_bytes < MOE_PARALLEL_MIN_BYTES) threads = 1;
    for (int64_t i = 0; i < moe_prefetch_blocks(&x_gu) && i < routed * gu_blocks / threads; ++i)
        moe_phase_prefetch(&gu, expert_list, i);  /* the first thread's first blocks, while z is prepared */
    /* z once per token: a token's later rows copy its first row's prepared values (decode: 1 of k_top prepared) */
    const size_t zsize = z_bf16 ? 2 : 4;
    int64_t *first = expert_list + P;  /* [T] */
    for (int64_t t = 0; t < T; ++t) first[t] = -1;
    for (int64_t r = 0; r < P; ++r) {
        const int64_t t = sorted[r] / k_top;
        if (first[t] < 0) {
            moe_prepare(&x_gu, (const char *)z + t * l * zsize, z_bf16, r);
            first[t] = r;
        } else {
            moe_copy_prepared(&x_gu, first[t], r);
        }
    }
#ifdef _OPENMP
#pragma omp parallel num_threads(threads) if (threads > 1)
#endif
    {
#ifdef _OPENMP
        const int th = omp_get_thread_num(), nt = omp_get_num_threads();
#else
        const int th = 0, nt = 1;
#endif
        /* contiguous item ranges per thread (each output row is computed by one thread in one order: the bits do
           not depend on the thread count) */
        const int64_t G = routed * gu_blocks, D = routed * dn_blocks;
        const int64_t g0 = G * th / nt, g1 = G * (th + 1) / nt, d0 = D * th / nt, d1 = D * (th + 1) / nt;
        moe_run_items(&gu, &dn, g0, g1, d0, d1, expert_list, start);
        if (routed % nt == 0) {
            /* the ranges are whole experts, the same ones in both projections: this thread's down rows need only
               its own gate/up rows (no barrier between the projections) */
            const int64_t r0 = start[expert_list[routed * th / nt]],
                          r1 = start[expert_list[routed * (th + 1) / nt - 1] + 1];
            for (int64_t r = r0; r < r1; ++r) moe_swiglu_row(&x_dn, gu_out, r, inter);
        } else {
#ifdef _OPENMP
#pragma omp barrier
#pragma omp for schedule(static)
#endif
            for (int64_t r = 0; r < P; ++r) moe_swiglu_row(&x_dn, gu_out, r, inter);
        }
        moe_run_items(&dn, NULL, d0, d1, 0, 0, expert_list, start);
#ifdef _OPENMP
#pragma omp barrier
#pragma omp for schedule(static)
#endif
        for (int64_t t = 0; t < T; ++t) {  /* the shared post-expert norm (scale first), then the routing weight, then the fp32 sum */
            float *yt = y + t * l;
            for (int64_t c = 0; c < l; ++c) yt[c] = 0.0f;
            for (int64_t j = 0; j < k_top; ++j) {
                const int64_t p = t * k_top + j;
                float *o = dn_out + row_of[p] * l;  /* this pair's own row: overwritten with the scaled values */
                const float f = post_expert_scale(o, z_bf16, post_norm, norm_bf16, l, post_eps);
                post_expert_add(o, z_bf16, f, weights[p], yt, l);
            }
        }
    }
    return 0;
}

/* INT4 experts: gu_rows / dn_rows the padded code rows (multiples of ROWS), g_gu / g_dn the group sizes. */
int musecore_int4_moe(const int64_t *gu_codes, const int64_t *gu_sz, const int64_t *dn_codes, const int64_t *dn_sz,
                      const void *z, int z_bf16, const int64_t *ids, const float *weights, const void *post_norm,
                      int norm_bf16, float post_eps, float *y, int64_t T, int64_t k_top, int64_t E, int64_t l,
                      int64_t inter, int64_t g_gu, int64_t g_dn, int64_t gu_rows, int64_t dn_rows, int threads) {
    return moe_decode(MOE_INT4, gu_codes, gu_sz, dn_codes, dn_sz, z, z_bf16, ids, weights, post_norm, norm_bf16, post_eps, y,
                      T, k_top, E, l, inter, g_gu, g_dn, gu_rows / ROWS, dn_rows / ROWS,
                      (gu_rows * l + dn_rows * inter) / 2, threads);
}

/* BF16 experts: gate/up [2I, l] and down [l, I], each contiguous row-major bf16. */
int musecore_bf16_moe(const int64_t *gu_w, const int64_t *dn_w, const void *z, int z_bf16, const int64_t *ids,
                      const float *weights, const void *post_norm, int norm_bf16, float post_eps, float *y, int64_t T,
                      int64_t k_top, int64_t E, int64_t l, int64_t inter, int threads) {
    return moe_decode(MOE_BF16, gu_w, NULL, dn_w, NULL, z, z_bf16, ids, weights, post_norm, norm_bf16, post_eps, y, T, k_top,
                      E, l, inter, 0, 0, (2 * inter + BF16_ROWS - 1) / BF16_ROWS, (l + BF16_ROWS - 1) / BF16_ROWS,
                      (3 * inter * l) * 2, threads);
}
