/* Part of kernels.c (one translation unit), after int4.c. The decode-size non-GEMM ops (norms, RoPE, head gate,
   router selection, few-query attention): at decode they run on a few thousand elements, where PyTorch's per-op
   cost exceeds the work. The math is the reference's, in fp32; uses int4.c's load_x, store_y, hsum, scratch. */
/* The decode-size norms of the graph (musecore/ops: rms_norm, residual_norm, qk_norm_rope, head_norm_gate) and the
   router's selection, fp32 math on bf16 or fp32 tensors (a flag per pointer), with the reference's roundings to the
   activation dtype: at decode PyTorch's per-op cost (dispatch, casts) exceeded the work. */
static inline void store_x(void *p, int bf16, int64_t i, float v) { store_y(p, bf16, i, v); }

#ifdef __AVX2__
/* 8 floats stored as fp32 or as bf16 rounded to nearest even (NaN stays NaN), as float_to_bf16 does one by one */
static inline void store8_x(void *p, int bf16, int64_t i, __m256 v) {
    if (!bf16) { _mm256_storeu_ps((float *)p + i, v); return; }
    const __m256i b = _mm256_castps_si256(v), one = _mm256_set1_epi32(1);
    const __m256i rounded = _mm256_srli_epi32(
        _mm256_add_epi32(b, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), _mm256_and_si256(_mm256_srli_epi32(b, 16), one))), 16);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x7FFFFFFF)), _mm256_set1_epi32(0x7F800000));
    const __m256i h = _mm256_blendv_epi8(rounded, _mm256_or_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(64)), nan);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(h, h), 0xD8);  /* values <= 0xFFFF: exact */
    _mm_storeu_si128((__m128i *)((uint16_t *)p + i), _mm256_castsi256_si128(packed));
}
#endif

/* v rounded to bf16 precision (nearest even, NaN stays NaN) and widened back: what `.to(bfloat16)` keeps */
static inline float round_bf16(float v) { return bits_to_float((uint32_t)float_to_bf16(v) << 16); }
static inline float round_to(int bf16, float v) { return bf16 ? round_bf16(v) : v; }

#ifdef __AVX2__
static inline __m256 round8_bf16(__m256 v) {
    const __m256i b = _mm256_castps_si256(v), one = _mm256_set1_epi32(1);
    const __m256i rounded =
        _mm256_add_epi32(b, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), _mm256_and_si256(_mm256_srli_epi32(b, 16), one)));
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x7FFFFFFF)), _mm256_set1_epi32(0x7F800000));
    const __m256i h = _mm256_blendv_epi8(rounded, _mm256_or_si256(b, _mm256_set1_epi32(0x00400000)), nan);
    return _mm256_castsi256_ps(_mm256_and_si256(h, _mm256_set1_epi32((int)0xFFFF0000u)));
}
static inline __m256 round8_to(int bf16, __m256 v) { return bf16 ? round8_bf16(v) : v; }

/* x[i..i+7] (times w[c..c+7] when w is not NULL, the product rounded to x's dtype: the scale-first norm's input) */
static inline __m256 load8_scaled(const void *x, int xb, int64_t i, const void *w, int wb, int64_t c) {
    const __m256 v = load8_x(x, xb, i);
    return w == NULL ? v : round8_to(xb, _mm256_mul_ps(v, load8_x(w, wb, c)));
}
#endif

static inline float load_scaled(const void *x, int xb, int64_t i, const void *w, int wb, int64_t c) {
    const float v = load_x(x, xb, i);
    return w == NULL ? v : round_to(xb, v * load_x(w, wb, c));
}

/* 1 / rms of n values (each first multiplied by w and rounded to x's dtype when w is not NULL: the scale-first norm):
   the squares summed in 8 fp32 lanes (AVX2) then the tail */
static inline float inv_rms_scaled(const void *x, int xb, int64_t off, const void *w, int wb, int64_t n, float eps) {
    float ss = 0.0f;
    int64_t c = 0;
#ifdef __AVX2__
    __m256 acc = _mm256_setzero_ps();
    for (; c + 8 <= n; c += 8) { const __m256 v = load8_scaled(x, xb, off + c, w, wb, c); acc = _mm256_fmadd_ps(v, v, acc); }
    ss = hsum(acc);
#endif
    for (; c < n; ++c) { const float v = load_scaled(x, xb, off + c, w, wb, c); ss += v * v; }
    return 1.0f / sqrtf(ss / (float)n + eps);
}

static inline float inv_rms(const void *x, int xb, int64_t off, int64_t n, float eps) {
    return inv_rms_scaled(x, xb, off, NULL, 0, n, eps);
}

/* out[c] = x[c] * f * w[c] (x[c] * f when w is NULL) for c < n (offsets ox, oo into x and out) */
static inline void scale_mul(const void *x, int xb, int64_t ox, float f, const void *w, int wb, void *out, int ob,
                             int64_t oo, int64_t n) {
    int64_t c = 0;
#ifdef __AVX2__
    const __m256 fv = _mm256_set1_ps(f);
    for (; c + 8 <= n; c += 8) {
        const __m256 v = _mm256_mul_ps(load8_x(x, xb, ox + c), fv);
        store8_x(out, ob, oo + c, w == NULL ? v : _mm256_mul_ps(v, load8_x(w, wb, c)));
    }
#endif
    for (; c < n; ++c) {
        const float v = load_x(x, xb, ox + c) * f;
        store_x(out, ob, oo + c, w == NULL ? v : v * load_x(w, wb, c));
    }
}

/* out[c] = round(x[c] * w[c]) * f: the scale-first norm's output, given f from inv_rms_scaled */
static inline void scaled_norm_out(const void *x, int xb, int64_t ox, float f, const void *w, int wb, void *out,
                                   int ob, int64_t oo, int64_t n) {
    int64_t c = 0;
#ifdef __AVX2__
    const __m256 fv = _mm256_set1_ps(f);
    for (; c + 8 <= n; c += 8) store8_x(out, ob, oo + c, _mm256_mul_ps(load8_scaled(x, xb, ox + c, w, wb, c), fv));
#endif
    for (; c < n; ++c) store_x(out, ob, oo + c, load_scaled(x, xb, ox + c, w, wb, c) * f);
}

/* rms_norm (musecore/ops): scale_first = 0: rms(x) * w (rms(x) when w is NULL); scale_first = 1: rms(round(x * w)),
   the product rounded to x's dtype (transformers' InputScaledRMSNorm). The output has x's dtype (ob = xb). */
void musecore_rms_norm(const void *x, int xb, const void *w, int wb, void *out, int ob, int64_t rows, int64_t n,
                       float eps, int scale_first) {
    for (int64_t r = 0; r < rows; ++r) {
        if (scale_first && w != NULL)
            scaled_norm_out(x, xb, r * n, inv_rms_scaled(x, xb, r * n, w, wb, n, eps), w, wb, out, ob, r * n, n);
        else
            scale_mul(x, xb, r * n, inv_rms(x, xb, r * n, n, eps), w, wb, out, ob, r * n, n);
    }
}

/* residual_norm (musecore/ops): h = rms(round(out * post_w)) (rms(out) when post_w is NULL) with post_eps, rounded to
   out's dtype; residual' = alpha * residual + beta * h in fp32 (alpha, beta fp32 [n]), rounded to the residual's
   dtype; normed = rms(residual') * next_w (rms(residual') when next_w is NULL) with eps, in the residual's dtype. */
void musecore_residual_norm(const void *res, const void *out, int outb, const void *post_w, int pwb, const float *alpha,
                            const float *beta, const void *next_w, int nwb, void *new_res, void *normed, int rb,
                            int64_t rows, int64_t n, float post_eps, float eps) {
    for (int64_t r = 0; r < rows; ++r) {
        const float f = inv_rms_scaled(out, outb, r * n, post_w, pwb, n, post_eps);
        int64_t c = 0;
#ifdef __AVX2__
        const __m256 fv = _mm256_set1_ps(f);
        for (; c + 8 <= n; c += 8) {
            const __m256 h = round8_to(outb, _mm256_mul_ps(load8_scaled(out, outb, r * n + c, post_w, pwb, c), fv));
            const __m256 sum = _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(alpha + c), load8_x(res, rb, r * n + c)),
                                             _mm256_mul_ps(_mm256_loadu_ps(beta + c), h));
            store8_x(new_res, rb, r * n + c, sum);
        }
#endif
        for (; c < n; ++c) {
            const float h = round_to(outb, load_scaled(out, outb, r * n + c, post_w, pwb, c) * f);
            store_x(new_res, rb, r * n + c, alpha[c] * load_x(res, rb, r * n + c) + beta[c] * h);
        }
        scale_mul(new_res, rb, r * n, inv_rms(new_res, rb, r * n, n, eps), next_w, nwb, normed, rb, r * n, n);
    }
}

/* qk_norm_rope's half (musecore/ops): per head (rows of d) the weightless RMSNorm over d times scale, then, when cos_t
   is not NULL, RoPE with the halves convention (rotate_half = [-x2, x1]); cos/sin fp32 [rows / heads, d]. NULL cos_t:
   a NoPE layer. x's rows may be a view of a wider projection output: row r (token r / heads, head r % heads) starts at
   (r / heads) * tok_stride + (r % heads) * d; out is contiguous [rows, d]. */
void musecore_norm_rope(const void *x, int xb, int64_t tok_stride, float scale, const float *cos_t,
                        const float *sin_t, void *out, int64_t rows, int64_t heads, int64_t d, float eps) {
    const int64_t half = d / 2;
    float buf[1024];
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t off = (r / heads) * tok_stride + (r % heads) * d;
        const float f = inv_rms(x, xb, off, d, eps) * scale;
        if (cos_t == NULL) { scale_mul(x, xb, off, f, NULL, 0, out, xb, r * d, d); continue; }
        const float *cs = cos_t + (r / heads) * d, *sn = sin_t + (r / heads) * d;
        scale_mul(x, xb, off, f, NULL, 0, buf, 0, 0, d);
        int64_t c = 0;
#ifdef __AVX2__
        if (half % 8 == 0) {
            for (; c < half; c += 8) {  /* rotate_half: -x2 in the first half, x1 in the second */
                const __m256 x1 = _mm256_loadu_ps(buf + c), x2 = _mm256_loadu_ps(buf + c + half);
                store8_x(out, xb, r * d + c, _mm256_fnmadd_ps(x2, _mm256_loadu_ps(sn + c), _mm256_mul_ps(x1, _mm256_loadu_ps(cs + c))));
                store8_x(out, xb, r * d + c + half,
                         _mm256_fmadd_ps(x1, _mm256_loadu_ps(sn + c + half), _mm256_mul_ps(x2, _mm256_loadu_ps(cs + c + half))));
            }
            c = d;
        }
#endif
        for (; c < d; ++c) {
            const float rot = c < half ? -buf[c + half] : buf[c - half];
            store_x(out, xb, r * d + c, buf[c] * cs[c] + rot * sn[c]);
        }
    }
}

/* head_norm_gate (musecore/ops): out = rms(o) * sigmoid(gate), element-wise, per head row of d; o and out contiguous
   [rows, d], gate's row r at (r / heads) * gate_tok_stride + (r % heads) * d (a view of the fused projection output). */
void musecore_head_norm_gate(const void *o, int ob, const void *gate, int gb, int64_t gate_tok_stride, void *out,
                             int64_t rows, int64_t heads, int64_t d, float eps) {
    for (int64_t r = 0; r < rows; ++r) {
        const float f = inv_rms(o, ob, r * d, d, eps);
        const int64_t go = (r / heads) * gate_tok_stride + (r % heads) * d;
        int64_t c = 0;
#ifdef __AVX2__
        const __m256 fv = _mm256_set1_ps(f), one = _mm256_set1_ps(1.0f);
        for (; c + 8 <= d; c += 8) {
            const __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, exp_ps(_mm256_sub_ps(_mm256_setzero_ps(),
                                                                                          load8_x(gate, gb, go + c)))));
            store8_x(out, ob, r * d + c, _mm256_mul_ps(_mm256_mul_ps(load8_x(o, ob, r * d + c), fv), sig));
        }
#endif
        for (; c < d; ++c)
            store_x(out, ob, r * d + c, load_x(o, ob, r * d + c) * f / (1.0f + expf(-load_x(gate, gb, go + c))));
    }
}

/* router_topk's selection (musecore/ops), from the fp32 router logits [T, E] (x @ W^T, computed by PyTorch as the
   reference does): s = sigmoid(logit * multiplier); the k experts of largest s + bias in descending order (equal
   values: the lower expert id first; NaN counts as largest, as torch.topk has it); weights = s[ids] / (sum s[ids] +
   1e-15) * scaling. weights fp32 [T, k], ids int64 [T, k]. Returns 0, or -2 when there is no memory for its scratch
   (nothing written). */
int musecore_router_topk(const float *logits, const float *bias, int64_t T, int64_t E, int64_t k, float multiplier,
                         float scaling, float *weights, int64_t *ids) {
    float *s = scratch((size_t)E * 3);
    if (s == NULL) return -2;
    float *key = s + E, *taken = key + E;
    for (int64_t t = 0; t < T; ++t) {
        for (int64_t e = 0; e < E; ++e) {
            s[e] = 1.0f / (1.0f + expf(-(logits[t * E + e] * multiplier)));
            key[e] = s[e] + (bias != NULL ? bias[e] : 0.0f);
            taken[e] = 0.0f;
        }
        float picked = 0.0f;
        for (int64_t j = 0; j < k; ++j) {
            int64_t best = -1;
            for (int64_t e = 0; e < E; ++e)
                if (taken[e] == 0.0f && (best < 0 || key[e] > key[best] || (key[e] != key[e] && key[best] == key[best])))
                    best = e;
            taken[best] = 1.0f;
            weights[t * k + j] = s[best];
            ids[t * k + j] = best;
            picked += s[best];
        }
        const float denom = picked + 1e-15f;
        for (int64_t j = 0; j < k; ++j) weights[t * k + j] = weights[t * k + j] / denom * scaling;
    }
    return 0;
}

/* Decode attention (few queries): per (batch, query, head) the scores over the visible keys (causal, optional
   sliding window, k_pos >= 0), an fp32 softmax, and the weighted sum of the values of its kv head (GQA: head h
   reads kv head h / (nq / nkv)). q, k, v bf16 or fp32 (k and v alike), contiguous [B, T|S, heads, d]; a query
   that sees no key gets zeros. At T = 1 the PyTorch path (mask, casts, SDPA, masked_fill) costs more than the keys
   take to read at short contexts. */
#ifdef __AVX512F__
static inline __m512 load16_x(const void *x, int bf16, int64_t i) {
    if (bf16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)x + i))), 16));
    return _mm512_loadu_ps((const float *)x + i);
}
#endif

/* q . k[off .. off+d-1] for an fp32 row q and a bf16/fp32 row k, in 16 (AVX-512) or 8 (AVX2) fp32 lanes, then the
   lanes' sum and the tail */
static inline float dot_qk(const float *q, const void *k, int kb, int64_t off, int64_t d) {
    int64_t c = 0;
    float s = 0.0f;
#if defined(__AVX512F__)
    __m512 acc = _mm512_setzero_ps();
    for (; c + 16 <= d; c += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + c), load16_x(k, kb, off + c), acc);
    s = _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__)
    __m256 acc = _mm256_setzero_ps();
    for (; c + 8 <= d; c += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + c), load8_x(k, kb, off + c), acc);
    s = hsum(acc);
#endif
    for (; c < d; ++c) s += q[c] * load_x(k, kb, off + c);
    return s;
}

/* out[c] = (sum_j p[j] * v[rows[j] * row_stride + base + c]) * inv for c < d: the sum over j in order, one pass over
   the value rows per 64 (AVX-512; 32 with AVX2) columns, the accumulators in registers */
static inline void weighted_rows(const float *p, const int32_t *rows, int64_t n, const void *v, int vb,
                                 int64_t row_stride, int64_t base, int64_t d, float inv, float *out) {
    int64_t c = 0;
#if defined(__AVX512F__)
    for (; c + 64 <= d; c += 64) {
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t j = 0; j < n; ++j) {
            const int64_t off = rows[j] * row_stride + base + c;
            const __m512 pj = _mm512_set1_ps(p[j]);
            a0 = _mm512_fmadd_ps(pj, load16_x(v, vb, off), a0);
            a1 = _mm512_fmadd_ps(pj, load16_x(v, vb, off + 16), a1);
            a2 = _mm512_fmadd_ps(pj, load16_x(v, vb, off + 32), a2);
            a3 = _mm512_fmadd_ps(pj, load16_x(v, vb, off + 48), a3);
        }
        const __m512 iv = _mm512_set1_ps(inv);
        _mm512_storeu_ps(out + c, _mm512_mul_ps(a0, iv));
        _mm512_storeu_ps(out + c + 16, _mm512_mul_ps(a1, iv));
        _mm512_storeu_ps(out + c + 32, _mm512_mul_ps(a2, iv));
        _mm512_storeu_ps(out + c + 48, _mm512_mul_ps(a3, iv));
    }
#endif
#ifdef __AVX2__
    for (; c + 32 <= d; c += 32) {
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t j = 0; j < n; ++j) {
            const int64_t off = rows[j] * row_stride + base + c;
            const __m256 pj = _mm256_set1_ps(p[j]);
            a0 = _mm256_fmadd_ps(pj, load8_x(v, vb, off), a0);
            a1 = _mm256_fmadd_ps(pj, load8_x(v, vb, off + 8), a1);
            a2 = _mm256_fmadd_ps(pj, load8_x(v, vb, off + 16), a2);
            a3 = _mm256_fmadd_ps(pj, load8_x(v, vb, off + 24), a3);
        }
        const __m256 iv = _mm256_set1_ps(inv);
        _mm256_storeu_ps(out + c, _mm256_mul_ps(a0, iv));
        _mm256_storeu_ps(out + c + 8, _mm256_mul_ps(a1, iv));
        _mm256_storeu_ps(out + c + 16, _mm256_mul_ps(a2, iv));
        _mm256_storeu_ps(out + c + 24, _mm256_mul_ps(a3, iv));
    }
#endif
    for (; c < d; ++c) {
        float a = 0.0f;
        for (int64_t j = 0; j < n; ++j) a += p[j] * load_x(v, vb, rows[j] * row_stride + base + c);
        out[c] = a * inv;
    }
}

/* p[j] = exp(s[j] - mx) for j < n (Cephes expf in 8 lanes where AVX2 is, relative error ~2e-7; expf for the tail),
   returning their sum */
static inline float exp_shifted(float *s, int64_t n, float mx) {
    int64_t j = 0;
    float sum = 0.0f;
#ifdef __AVX2__
    const __m256 m = _mm256_set1_ps(mx);
    __m256 acc = _mm256_setzero_ps();
    for (; j + 8 <= n; j += 8) {
        const __m256 p = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(s + j), m));
        _mm256_storeu_ps(s + j, p);
        acc = _mm256_add_ps(acc, p);
    }
    sum = hsum(acc);
#endif
    for (; j < n; ++j) { s[j] = expf(s[j] - mx); sum += s[j]; }
    return sum;
}

/* An item is hp query heads of one kv head (GQA: heads h .. h+hp-1 read kv head h / (nq / nkv)) at one (batch,
   query): the visible keys are listed once per item, then each head in turn takes its scores (one dot product per
   visible key), their softmax and the weighted sum of the value rows, its accumulators in registers. hp is the whole
   group unless that leaves fewer items than threads or a count the threads cannot share evenly (muse-small at 2
   threads: 3 kv heads -> 6 items of 4 heads). Every head's arithmetic is the same whatever hp and the thread count
   (the same bits). Decode goes parallel from ~22 keys of muse-small's 24 heads x 64 (1 << 15 multiply-adds per
   pass). */
void musecore_attention(const void *q, int qb, const void *k, const void *v, int kvb, const int64_t *q_pos,
                        const int64_t *k_pos, int64_t window, float scale, void *out, int64_t B, int64_t T, int64_t S,
                        int64_t nq, int64_t nkv, int64_t d, int threads) {
    const int64_t group = nq / nkv;
    int64_t hp = group;
    while (hp % 2 == 0 && (B * T * (nq / hp) < threads || (B * T * (nq / hp)) % threads)) hp /= 2;
    const int64_t items = B * T * (nq / hp);
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && B * T * nq * S * d >= (1 << 15))
#endif
    for (int64_t it = 0; it < items; ++it) {
        const int64_t bt = it / (nq / hp), h0 = (it % (nq / hp)) * hp, kvh = h0 / group;
        const int64_t b = bt / T, qp = q_pos[bt];
        /* this thread's: scores [S], the visible key rows [S] (int32), the query and the output row [d] each */
        float *buf = scratch((size_t)(2 * S + 2 * d + 16));
        if (buf == NULL) continue;
        float *sc = buf, *qf = sc + S, *o = qf + d;
        int32_t *rows = (int32_t *)(o + d);
        int64_t n = 0;
        for (int64_t j = 0; j < S; ++j) {
            const int64_t kp = k_pos[b * S + j];
            if (kp < 0 || kp > qp || (window > 0 && qp - kp >= window)) continue;
            rows[n++] = (int32_t)(b * S + j);
        }
        for (int64_t g = 0; g < hp; ++g) {
            const int64_t qo = (bt * nq + h0 + g) * d;
            float mx = -INFINITY, inv = 0.0f;
            for (int64_t c = 0; c < d; ++c) qf[c] = load_x(q, qb, qo + c);
            for (int64_t j = 0; j < n; ++j) {
                sc[j] = dot_qk(qf, k, kvb, (int64_t)rows[j] * nkv * d + kvh * d, d) * scale;
                if (sc[j] > mx) mx = sc[j];
            }
            if (n > 0 && mx != -INFINITY) {  /* none visible, or every score -inf: zeros, as the reference */
                const float denom = exp_shifted(sc, n, mx);
                inv = denom > 0.0f ? 1.0f / denom : 0.0f;
                weighted_rows(sc, rows, n, v, kvb, nkv * d, kvh * d, d, inv, o);
            } else {
                for (int64_t c = 0; c < d; ++c) o[c] = 0.0f;
            }
            for (int64_t c = 0; c < d; ++c) store_y(out, qb, qo + c, o[c]);
        }
    }
}


/* router_topk (musecore/ops) at decode sizes in one call: the logits fp32(x[t]) . W[e] (W fp32 [E, H], x bf16 or
   fp32 [T, H]) as fp32 multiply-adds in 16 (AVX-512) or 8 (AVX2) lanes and then the lanes' sum: not the summation
   order of PyTorch's fp32 matmul, so router_topk's tolerance, not its bits. Then the selection of
   musecore_router_topk. Blocks of 4 experts are shared by `threads` threads from ROUTER_PARALLEL_MIN multiply-adds
   (a logit is the same whatever the thread count). Returns 0, or -2 when there is no memory for its scratch. */
#define ROUTER_PARALLEL_MIN (1 << 16)
#ifndef ROUTER_PREFETCH_BYTES
#define ROUTER_PREFETCH_BYTES 2048 /* how far ahead the router prefetches its weight rows (lab/NOTES.md, session 37) */
#endif
int musecore_router(const void *x, int xb, const float *w, const float *bias, int64_t T, int64_t E, int64_t H,
                    int64_t k, float multiplier, float scaling, float *weights, int64_t *ids, int threads) {
    float *logits = (float *)thread_buffer(1, (size_t)(T * E + T * H + 16) * sizeof(float));
    if (logits == NULL) return -2;
    float *xf = logits + T * E;
    for (int64_t i = 0; i < T * H; ++i) xf[i] = load_x(x, xb, i);
    const int64_t blocks = (E + 3) / 4;
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && T * E * H >= ROUTER_PARALLEL_MIN)
#endif
    for (int64_t blk = 0; blk < blocks; ++blk) {
        const int64_t e0 = blk * 4, ne = E - e0 < 4 ? E - e0 : 4;
        for (int64_t t = 0; t < T; ++t) {
            const float *xt = xf + t * H;
            float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            int64_t c = 0;
            if (ne == 4) {
#if defined(__AVX512F__)
                __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
                for (; c + 16 <= H; c += 16) {
                    if (t == 0)  /* the weight streams once per call: its next lines, ahead of the loads */
                        for (int r = 0; r < 4; ++r)
                            _mm_prefetch((const char *)(w + (e0 + r) * H + c) + ROUTER_PREFETCH_BYTES, _MM_HINT_T0);
                    const __m512 xv = _mm512_loadu_ps(xt + c);
                    a0 = _mm512_fmadd_ps(xv, _mm512_loadu_ps(w + e0 * H + c), a0);
                    a1 = _mm512_fmadd_ps(xv, _mm512_loadu_ps(w + (e0 + 1) * H + c), a1);
                    a2 = _mm512_fmadd_ps(xv, _mm512_loadu_ps(w + (e0 + 2) * H + c), a2);
                    a3 = _mm512_fmadd_ps(xv, _mm512_loadu_ps(w + (e0 + 3) * H + c), a3);
                }
                s[0] = _mm512_reduce_add_ps(a0); s[1] = _mm512_reduce_add_ps(a1);
                s[2] = _mm512_reduce_add_ps(a2); s[3] = _mm512_reduce_add_ps(a3);
#elif defined(__AVX2__)
                __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
                for (; c + 8 <= H; c += 8) {
                    if (t == 0 && c % 16 == 0)
                        for (int r = 0; r < 4; ++r)
                            _mm_prefetch((const char *)(w + (e0 + r) * H + c) + ROUTER_PREFETCH_BYTES, _MM_HINT_T0);
                    const __m256 xv = _mm256_loadu_ps(xt + c);
                    a0 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w + e0 * H + c), a0);
                    a1 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w + (e0 + 1) * H + c), a1);
                    a2 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w + (e0 + 2) * H + c), a2);
                    a3 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w + (e0 + 3) * H + c), a3);
                }
                s[0] = hsum(a0); s[1] = hsum(a1); s[2] = hsum(a2); s[3] = hsum(a3);
#endif
            }
            for (int64_t r = 0; r < ne; ++r) {
                float tail = s[r];
                for (int64_t cc = c; cc < H; ++cc) tail += xt[cc] * w[(e0 + r) * H + cc];
                logits[t * E + e0 + r] = tail;
            }
        }
    }
    return musecore_router_topk(logits, bias, T, E, k, multiplier, scaling, weights, ids);
}

/* logit_softcap (musecore/ops): out = tanh(fp32(x) * multiplier / cap) * cap for n values of x (bf16 or fp32; out
   fp32, never x). The product, quotient and product are the reference's, in its order; tanh is `vml_tanh` called with
   `mode`: MKL VML's vmsTanh (its Fortran entry point VMSTANH_), which torch.tanh runs on an MKL build of PyTorch; the
   Python side finds it and checks it against torch.tanh before passing it, so the result has the reference's bits.
   Per chunk of SOFTCAP_CHUNK values the three passes run while the chunk is in L1 (PyTorch makes five passes over the
   vocabulary); chunks are shared by `threads` threads. */
typedef void (*vml_unary_fn)(const int *, const float *, float *, const int64_t *);
#define SOFTCAP_CHUNK 4096
void musecore_logit_softcap(const void *x, int xb, float *out, int64_t n, float multiplier, float cap,
                            const void *vml_tanh, int64_t mode, int threads) {
    const vml_unary_fn tanh_fn = (vml_unary_fn)vml_tanh;
    const int64_t chunks = (n + SOFTCAP_CHUNK - 1) / SOFTCAP_CHUNK;
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && chunks > 1)
#endif
    for (int64_t ch = 0; ch < chunks; ++ch) {
        const int64_t i0 = ch * SOFTCAP_CHUNK, len = n - i0 < SOFTCAP_CHUNK ? n - i0 : SOFTCAP_CHUNK;
        float *o = out + i0;
        int64_t i = 0;
#ifdef __AVX2__
        const __m256 m = _mm256_set1_ps(multiplier), c = _mm256_set1_ps(cap);
        for (; i + 8 <= len; i += 8) _mm256_storeu_ps(o + i, _mm256_div_ps(_mm256_mul_ps(load8_x(x, xb, i0 + i), m), c));
#endif
        for (; i < len; ++i) o[i] = load_x(x, xb, i0 + i) * multiplier / cap;
        const int count = (int)len;
        tanh_fn(&count, o, o, &mode);
        i = 0;
#ifdef __AVX2__
        for (; i + 8 <= len; i += 8) _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_loadu_ps(o + i), c));
#endif
        for (; i < len; ++i) o[i] = o[i] * cap;
    }
}
