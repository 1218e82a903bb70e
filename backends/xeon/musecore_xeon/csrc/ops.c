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
static inline float dot_qk(const float *q, const void *k, int kb, int64_t off, int64_t d) {
    int64_t c = 0;
    float tail = 0.0f;
#ifdef __AVX2__
    __m256 acc = _mm256_setzero_ps();
    for (; c + 8 <= d; c += 8) {
        const __m256 kv = kb ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(
                                   _mm_loadu_si128((const __m128i *)((const uint16_t *)k + off + c))), 16))
                             : _mm256_loadu_ps((const float *)k + off + c);
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + c), kv, acc);
    }
    tail = hsum(acc);
#endif
    for (; c < d; ++c) tail += q[c] * load_x(k, kb, off + c);
    return tail;
}

static inline void axpy_v(float *acc, float p, const void *v, int vb, int64_t off, int64_t d) {
    int64_t c = 0;
#ifdef __AVX2__
    const __m256 pv = _mm256_set1_ps(p);
    for (; c + 8 <= d; c += 8) {
        const __m256 vv = vb ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(
                                   _mm_loadu_si128((const __m128i *)((const uint16_t *)v + off + c))), 16))
                             : _mm256_loadu_ps((const float *)v + off + c);
        _mm256_storeu_ps(acc + c, _mm256_fmadd_ps(pv, vv, _mm256_loadu_ps(acc + c)));
    }
#endif
    for (; c < d; ++c) acc[c] += p * load_x(v, vb, off + c);
}

/* Row off..off+d-1 of a bf16 or fp32 tensor as fp32: dst for bf16 (converted once), the row itself for fp32. */
static inline const float *row_f32(const void *src, int bf16, int64_t off, int64_t d, float *dst) {
    if (!bf16) return (const float *)src + off;
    int64_t c = 0;
#ifdef __AVX2__
    for (; c + 8 <= d; c += 8) _mm256_storeu_ps(dst + c, load8_x(src, 1, off + c));
#endif
    for (; c < d; ++c) dst[c] = load_x(src, 1, off + c);
    return dst;
}

/* An item is hp query heads of one kv head (GQA: heads h .. h+hp-1 read kv head h / (nq / nkv)) at one (batch,
   query): each visible key and value row is converted to fp32 once and used by the hp heads (one conversion per kv
   head instead of one per query head). hp is the whole group unless that leaves fewer items than threads or a
   count the threads cannot share evenly (muse-small at 2 threads: 3 kv heads -> 6 items of 4 heads). Every head's
   arithmetic is the same whatever hp and the thread count (the same bits). Decode goes parallel from ~22 keys of
   muse-small's 24 heads x 64 (1 << 15 multiply-adds per pass): a fork/join costs a few us, one pass over 64 keys
   ~18 us on one core of the 2-core EPYC. */
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
        /* this thread's: scores [hp, S], queries and outputs [hp, d], one converted row [d] */
        float *buf = scratch((size_t)(hp * S + 2 * hp * d + d));
        if (buf == NULL) continue;
        float *sc = buf, *qf = sc + hp * S, *acc = qf + hp * d, *row = acc + hp * d;
        float mx[hp], denom[hp];
        for (int64_t g = 0; g < hp; ++g) {
            for (int64_t c = 0; c < d; ++c) {
                qf[g * d + c] = load_x(q, qb, (bt * nq + h0 + g) * d + c);
                acc[g * d + c] = 0.0f;
            }
            mx[g] = -INFINITY;
            denom[g] = 0.0f;
        }
        int any = 0;
        for (int64_t j = 0; j < S; ++j) {
            const int64_t kp = k_pos[b * S + j];
            if (kp < 0 || kp > qp || (window > 0 && qp - kp >= window)) continue;
            any = 1;
            const float *kr = row_f32(k, kvb, ((b * S + j) * nkv + kvh) * d, d, row);
            for (int64_t g = 0; g < hp; ++g) {
                const float s = dot_qk(qf + g * d, kr, 0, 0, d) * scale;
                sc[g * S + j] = s;
                if (s > mx[g]) mx[g] = s;
            }
        }
        if (any)
            for (int64_t j = 0; j < S; ++j) {
                const int64_t kp = k_pos[b * S + j];
                if (kp < 0 || kp > qp || (window > 0 && qp - kp >= window)) continue;
                const float *vr = row_f32(v, kvb, ((b * S + j) * nkv + kvh) * d, d, row);
                for (int64_t g = 0; g < hp; ++g) {
                    if (mx[g] == -INFINITY) continue;  /* a head whose every score is -inf: zeros, as the reference */
                    const float p = expf(sc[g * S + j] - mx[g]);
                    denom[g] += p;
                    axpy_v(acc + g * d, p, vr, 0, 0, d);
                }
            }
        for (int64_t g = 0; g < hp; ++g) {
            const float inv = denom[g] > 0.0f ? 1.0f / denom[g] : 0.0f;
            for (int64_t c = 0; c < d; ++c) store_y(out, qb, (bt * nq + h0 + g) * d + c, acc[g * d + c] * inv);
        }
    }
}

