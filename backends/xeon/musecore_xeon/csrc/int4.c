/* Part of kernels.c (one translation unit). The INT4 kernels: nibble-planar GEMV / skinny GEMM, the dense-tile
   dequantizer, and the helpers (activation loads and stores, per-thread scratch) the other parts use.
   musecore_xeon/kernels/native.py explains the layout and the numerics. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <float.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

/* Nibble-planar INT4 layout (see musecore_xeon/kernels/native.py): a row of K codes is cut into chunks of
   C = max(g, 64) columns, each stored as W = C/8 int32 words. Position p = 0..7 of word q holds column p*W + q of
   the chunk, in nibble nib(p) = p/2 + 4*(p%2): positions 2j and 2j+1 are nibbles j and j+4, the two 16-bit halves
   of the word at the same offset, so (w >> 4j) & 0x000F000F puts the codes of columns 2jW+q and (2j+1)W+q side by
   side as two int16 lanes: one operand of _mm256_madd_epi16. For g = 32 (C = 64, two groups per chunk) positions
   0-3 are the first group and 4-7 the second: no int16 pair straddles a group.
   Row blocks are interleaved by chunk: word q of chunk c of row r (0..ROWS-1) of the block starting at row n is at
   codes[n * K/8 + (c * ROWS + r) * W + q], so a block is one sequential stream for the hardware prefetcher.
   Scales and zeros: fp16 [N/ROWS, K/g, 2, ROWS], per row block and group the ROWS scales then the ROWS zeros (the
   QTensor's fp16 scale; the zero an integer 0..15), read by one 16-byte load. */
#define ROWS 4 /* rows per block of the GEMV; codes are padded to a multiple of it */
/* Calls streaming fewer code bytes than these run on the calling thread: an OpenMP fork/join and barriers
   cost more than a second core saves on so little work (measurements: lab/NOTES.md, "thread thresholds"). */
#ifndef GEMV_PARALLEL_MIN_BYTES
#define GEMV_PARALLEL_MIN_BYTES (32 * 1024)
#endif
/* ... and each thread gets at least this many code bytes: on a many-core host every thread adds to the fork/join
   (16 KiB per thread keeps the 2-core rule above: 2 threads from 32 KiB). */
#define GEMV_MIN_BYTES_PER_THREAD (16 * 1024)
#define MOE_PARALLEL_MIN_BYTES (256 * 1024)
/* Activation rows per pass over the weight: each row block of the weight reads the int16 activations of every row
   of the pass; short passes keep them close (L1/L2) at the cost of reading the codes once per pass (measured:
   lab/NOTES.md, "Session 37: linear"). */
#ifndef GEMV_MB
#define GEMV_MB 16
#endif
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 2048 /* how far ahead (at least) the GEMV prefetches its codes (lab/NOTES.md) */
#endif
/* Activations are int16 per group: xq = round(x / sx), sx = max|x_group| / XQ_MAX. The error is at most sx/2 =
   max|x_group| * 2^-16 per element: no more than the bf16 rounding (2^-9 relative) of every element within 2^7 of
   the group's largest, i.e. of the elements that carry the dot product. The integer sums are exact:
   |sum_group xq (q - z)| <= 2 * g * 15 * XQ_MAX = 251,652,096 for g = 256, below INT32_MAX (every partial sum of
   the accumulator lanes is bounded by the same sum of absolute values). */
#define XQ_MAX 32767
#define MAX_GROUP 256
_Static_assert((int64_t)2 * MAX_GROUP * 15 * XQ_MAX <= INT32_MAX, "int32 group sums of xq * (q - z) must not overflow");
#define TINY_GROUP_MAX 0x1p-100f /* a group whose max |x| is below this is taken as zero (32767 / max would overflow) */

static inline int64_t chunk_of(int64_t g) { return g >= 64 ? g : 64; }
static inline int nibble_of(int p) { return (p >> 1) + 4 * (p & 1); }

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

static inline void store_y(void *y, int y_bf16, int64_t i, float v) {
    if (y_bf16) ((uint16_t *)y)[i] = float_to_bf16(v);
    else ((float *)y)[i] = v;
}

/* Per-thread buffers, 64-byte aligned, grown as needed and kept (a fresh large malloc per call would be a fresh
   mmap: page faults). Slot 0 is scratch(); the AMX GEMM uses 1-3. */
#define THREAD_BUFFERS 4
static __thread void *thread_bufs[THREAD_BUFFERS];
static __thread size_t thread_caps[THREAD_BUFFERS];
static void *thread_buffer(int which, size_t bytes) {
    if (bytes > thread_caps[which]) {
        free(thread_bufs[which]);
        thread_bufs[which] = aligned_alloc(64, (bytes + 63) & ~(size_t)63);
        thread_caps[which] = thread_bufs[which] ? bytes : 0;
    }
    return thread_bufs[which];
}
static float *scratch(size_t n) { return (float *)thread_buffer(0, n * sizeof(float)); }

/* The quantized activations of m_rows rows: int16 [m, K] in the GEMV's order, fp32 sx and int32 sum(xq) [m, K/g]. */
typedef struct { int16_t *xq; float *sx; int32_t *xqsum; } qx_t;

/* Floats of scratch for a qx_t of m rows (each part 32-byte aligned). */
static inline size_t qx_floats(int64_t m, int64_t k, int64_t g) {
    return (size_t)(((m * k / 2 + 7) & ~7) + 2 * ((m * (k / g) + 7) & ~7));
}
static inline qx_t qx_at(float *buf, int64_t m, int64_t k, int64_t g) {
    qx_t q;
    q.xq = (int16_t *)buf;
    q.sx = buf + ((m * k / 2 + 7) & ~7);
    q.xqsum = (int32_t *)(q.sx + ((m * (k / g) + 7) & ~7));
    return q;
}
static inline qx_t qx_row(qx_t q, int64_t r, int64_t k, int64_t g) {
    q.xq += r * k; q.sx += r * (k / g); q.xqsum += r * (k / g);
    return q;
}

static inline void group_scale(float amax, int bad, float *sx, float *inv) {
    if (bad) { *sx = NAN; *inv = 0.0f; }            /* inf/NaN in the group: NaN out, as the float math would give */
    else if (amax < TINY_GROUP_MAX) { *sx = 0.0f; *inv = 0.0f; }
    else { *sx = amax / (float)XQ_MAX; *inv = (float)XQ_MAX / amax; }
}

#ifdef __AVX2__
static inline __m256 load8_x(const void *x, int bf16, int64_t i) {
    if (bf16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)x + i))), 16));
    return _mm256_loadu_ps((const float *)x + i);
}

static inline int32_t hsum_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}
#endif

/* AVX-512 VNNI (Ice Lake / Sapphire Rapids / Xeon 6, Zen 4): for groups of 128 or more the GEMVs read 16 words
   (128 weights of a row) per 512-bit load and accumulate with vpdpwssd (madd and add in one instruction): a third
   of the AVX2 loop's instructions per weight. The integer sums are the same exact int32 values, reduced to the
   AVX2 accumulators before the flush, so both builds give the same bits (tested). g = 32 and 64 keep the AVX2
   loop (a chunk row is one 256-bit vector there). */
#if defined(__AVX2__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define HAVE_VNNI512 1
/* The 512-bit activation operand of code pair J for words 16V..16V+15: the AVX2 order keeps words 16V..16V+7
   and 16V+8..16V+15 in two 64-int16 runs (xc = the run of the first). */
static inline __m512i load_x512(const int16_t *xc, int j) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(xc + 16 * j))),
                              _mm256_loadu_si256((const __m256i *)(xc + 64 + 16 * j)), 1);
}
/* Exact int32 lane sums of one 512-bit accumulator folded into one 256-bit vector (for the AVX2 flush). */
static inline __m256i fold1_512(__m512i s) {
    return _mm256_add_epi32(_mm512_castsi512_si256(s), _mm512_extracti64x4_epi64(s, 1));
}
/* ... and of two accumulators. */
static inline __m256i fold512(__m512i a, __m512i b) { return fold1_512(_mm512_add_epi32(a, b)); }
/* 16 accumulators -> one vector whose lane i is the (exact int32) sum of a[i]'s 16 lanes: unpack/add within
   128-bit lanes twice, then two rounds of 128-bit block shuffles and adds. */
static inline __attribute__((always_inline)) __m512i pair_sum32(__m512i a, __m512i b) {
    return _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
}
static inline __attribute__((always_inline)) __m512i pair_sum64(__m512i a, __m512i b) {
    return _mm512_add_epi32(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b));
}
static inline __attribute__((always_inline)) __m512i block_sum(__m512i a, __m512i b) {
    return _mm512_add_epi32(_mm512_shuffle_i32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                            _mm512_shuffle_i32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
}
static inline __attribute__((always_inline)) __m512i reduce16(const __m512i a[16]) {
    __m512i q[4];
    for (int j = 0; j < 4; ++j)  /* q[j], 128-bit lane l: the sums over lane l of a[4j] .. a[4j+3] */
        q[j] = pair_sum64(pair_sum32(a[4 * j], a[4 * j + 1]), pair_sum32(a[4 * j + 2], a[4 * j + 3]));
    return block_sum(block_sum(q[0], q[1]), block_sum(q[2], q[3]));  /* block j: the totals of a[4j] .. a[4j+3] */
}
#define NIB_PAIR512(W, J) ((J) == 0 ? _mm512_and_si512((W), low4x) :                                  \
                           (J) == 3 ? _mm512_srli_epi16((W), 12) :                                    \
                                      _mm512_and_si512(_mm512_srli_epi16((W), 4 * (J)), low4x))
#endif

/* One activation row, one chunk: the group maxima, then xq in the GEMV's order: for vector v (words 8v..8v+7) and
   pair j (0..3), 16 int16 at xq[(4v + j) * 16 + 2q + h] = the column at position 2j + h of word 8v + q. The AVX2
   and scalar versions give the same bits (max is exact, x * inv one rounding, round-to-nearest-even to int). */
static void prepare_chunk(const void *x, int x_bf16, int64_t base, int64_t chunk, int64_t g, int16_t *xq, float *sx,
                          int32_t *xqsum) {
    const int64_t words = chunk / 8, per = chunk / g;
    float inv[2];
    for (int64_t h = 0; h < per; ++h) {
        float amax = 0.0f;
        int bad = 0;
        int64_t i = 0;
#ifdef __AVX2__
        __m256 mx = _mm256_setzero_ps(), nonfinite = _mm256_setzero_ps();
        const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF)), big = _mm256_set1_ps(FLT_MAX);
        for (; i + 8 <= g; i += 8) {
            const __m256 a = _mm256_and_ps(load8_x(x, x_bf16, base + h * g + i), abs_mask);
            nonfinite = _mm256_or_ps(nonfinite, _mm256_cmp_ps(a, big, _CMP_NLE_UQ));
            mx = _mm256_max_ps(mx, a);
        }
        bad = _mm256_movemask_ps(nonfinite) != 0;
        float lanes[8];
        _mm256_storeu_ps(lanes, mx);
        for (int l = 0; l < 8; ++l) amax = lanes[l] > amax ? lanes[l] : amax;
#endif
        for (; i < g; ++i) {
            const float a = fabsf(load_x(x, x_bf16, base + h * g + i));
            if (!(a <= FLT_MAX)) bad = 1;
            else if (a > amax) amax = a;
        }
        group_scale(amax, bad, sx + h, inv + h);
    }
    for (int64_t h = 0; h < per; ++h) xqsum[h] = 0;
    for (int64_t v = 0; v < words / 8; ++v)
        for (int j = 0; j < 4; ++j) {
            const int64_t h = (2 * j * words) / g, col = base + 2 * j * words + 8 * v;  /* h: the group in the chunk */
            int16_t *dst = xq + (4 * v + j) * 16;
#ifdef __AVX2__
            const __m256 iv = _mm256_set1_ps(inv[h]);
            const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(load8_x(x, x_bf16, col), iv)),
                          b = _mm256_cvtps_epi32(_mm256_mul_ps(load8_x(x, x_bf16, col + words), iv));
            _mm256_storeu_si256((__m256i *)dst, _mm256_or_si256(_mm256_and_si256(a, _mm256_set1_epi32(0xFFFF)),
                                                                _mm256_slli_epi32(b, 16)));
            xqsum[h] += hsum_epi32(_mm256_add_epi32(a, b));
#else
            for (int q = 0; q < 8; ++q)
                for (int hh = 0; hh < 2; ++hh) {
                    const int32_t v16 = (int32_t)lrintf(load_x(x, x_bf16, col + hh * words + q) * inv[h]);
                    dst[2 * q + hh] = (int16_t)v16;
                    xqsum[h] += v16;
                }
#endif
        }
}

static void prepare_x(const void *x, int x_bf16, int64_t m_rows, int64_t k, int64_t g, qx_t out) {
    const int64_t chunk = chunk_of(g), groups = k / g;
    for (int64_t m = 0; m < m_rows; ++m)
        for (int64_t c0 = 0; c0 < k; c0 += chunk)
            prepare_chunk(x, x_bf16, m * k + c0, chunk, g, out.xq + m * k + c0, out.sx + m * groups + c0 / g,
                          out.xqsum + m * groups + c0 / g);
}

#ifdef __AVX2__
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* The two codes of pair J of each 16-bit half as int16 lanes: nibbles J and J+4 of every word. */
#define NIB_PAIR(W, J) ((J) == 0 ? _mm256_and_si256((W), low4) :                                      \
                        (J) == 3 ? _mm256_srli_epi16((W), 12) :                                        \
                                   _mm256_and_si256(_mm256_srli_epi16((W), 4 * (J)), low4))

/* The scales (s0..s3) and integer zeros (z0..z3) of a row block for one group: 8 fp16 at sz, one 16-byte load
   (gathering them from 4 rows cost ~13% of the GEMV). */
static inline __attribute__((always_inline)) void load_sz4(const uint16_t *sz, __m128 *s, __m128i *z) {
#ifdef __F16C__
    const __m256 f = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)sz));
    *s = _mm256_castps256_ps128(f);
    *z = _mm_cvtps_epi32(_mm256_extractf128_ps(f, 1));
#else
    *s = _mm_setr_ps(half_to_float(sz[0]), half_to_float(sz[1]), half_to_float(sz[2]), half_to_float(sz[3]));
    *z = _mm_cvtps_epi32(_mm_setr_ps(half_to_float(sz[4]), half_to_float(sz[5]), half_to_float(sz[6]), half_to_float(sz[7])));
#endif
}

/* One group of ROWS rows: the exact int32 sums of xq * q (one accumulator vector per row) reduced to 4 integers,
   minus z * sum(xq) (exact), then tot += float(dot) * (s * sx): the scalar path does the same operations per row.
   Used by the skinny GEMM and for the last group of an odd group count in the GEMV. */
static inline __attribute__((always_inline)) __m128 flush4(__m256i a0, __m256i a1, __m256i a2, __m256i a3, __m128 s,
                                                          __m128i z, float sx, int32_t xqsum, __m128 tot) {
    const __m256i s01 = _mm256_hadd_epi32(a0, a1), s23 = _mm256_hadd_epi32(a2, a3);
    const __m256i both = _mm256_hadd_epi32(s01, s23);  /* [r0 r1 r2 r3] low half + the same of the high half */
    __m128i dot = _mm_add_epi32(_mm256_castsi256_si128(both), _mm256_extracti128_si256(both, 1));
    dot = _mm_sub_epi32(dot, _mm_mullo_epi32(z, _mm_set1_epi32(xqsum)));
    return _mm_fmadd_ps(_mm_cvtepi32_ps(dot), _mm_mul_ps(s, _mm_set1_ps(sx)), tot);
}

/* The ROWS accumulators of one group transposed into [r0 r1 r2 r3 | r0 r1 r2 r3] (each row's lanes 0-3 summed in
   the low half, 4-7 in the high half; exact int32) by unpack and add: no horizontal add, and one vector per group. */
static inline __attribute__((always_inline)) __m256i transpose_sum4(__m256i a0, __m256i a1, __m256i a2, __m256i a3) {
    const __m256i t01 = _mm256_add_epi32(_mm256_unpacklo_epi32(a0, a1), _mm256_unpackhi_epi32(a0, a1));
    const __m256i t23 = _mm256_add_epi32(_mm256_unpacklo_epi32(a2, a3), _mm256_unpackhi_epi32(a2, a3));
    return _mm256_add_epi32(_mm256_unpacklo_epi64(t01, t23), _mm256_unpackhi_epi64(t01, t23));
}

/* Two consecutive groups (even group G, G + 1) of ROWS rows flushed by one 8-lane vector of each kind: the halves
   of the transposed sums combined into [dot_G r0..r3 | dot_G+1 r0..r3] (exact, the same integers as flush4), minus
   z * sum(xq), converted once and FMA'd with s * sx into tot = [even groups' total | odd groups' total] (the two
   are added once per row block). sz: the scales and zeros of both groups (32 contiguous bytes). */
static inline __attribute__((always_inline)) __m256 flush_pair(__m256i da, __m256i db, const uint16_t *sz,
                                                              const float *sx, const int32_t *xqsum, __m256 tot) {
    const __m256i dot = _mm256_add_epi32(_mm256_permute2x128_si256(da, db, 0x20), _mm256_permute2x128_si256(da, db, 0x31));
    const __m256i pair_index = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    const __m256 sx2 = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_castsi128_ps(_mm_loadl_epi64((const __m128i *)sx))), pair_index);
    const __m256i xs2 = _mm256_permutevar8x32_epi32(_mm256_castsi128_si256(_mm_loadl_epi64((const __m128i *)xqsum)), pair_index);
#ifdef __F16C__
    /* 64-bit quarters [s_G z_G s_G+1 z_G+1] -> [s_G s_G+1 z_G z_G+1] */
    const __m256i h = _mm256_permute4x64_epi64(_mm256_loadu_si256((const __m256i *)sz), 0xD8);
    const __m256 s = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
    const __m256i z = _mm256_cvtps_epi32(_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)));
#else
    __m128 s0, s1; __m128i z0, z1;
    load_sz4(sz, &s0, &z0); load_sz4(sz + 2 * ROWS, &s1, &z1);
    const __m256 s = _mm256_setr_m128(s0, s1);
    const __m256i z = _mm256_setr_m128i(z0, z1);
#endif
    const __m256i d = _mm256_sub_epi32(dot, _mm256_mullo_epi32(z, xs2));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_mul_ps(s, sx2), tot);
}

/* One activation row, ROWS rows of W: per 8 words (64 weights) and row, 4 x (shift/AND, madd_epi16, add_epi32)
   against the int16 activation, int32 accumulators per group, flushed two groups at a time (flush_pair). */
static inline __attribute__((always_inline)) void gemv_rows(
        const int32_t *codes, const uint16_t *sz, qx_t x, float out[ROWS], int64_t n, int64_t k, const int64_t g) {
    const int64_t kw = k / 8, groups = k / g, chunk = chunk_of(g), words = chunk / 8, vecs = words / 8;
    /* whole row blocks ahead, at least PREFETCH_BYTES (short rows: K = 512 is 1 KiB per block) */
    const int64_t block_bytes = ROWS * kw * 4, prefetch_words = ROWS * kw * ((PREFETCH_BYTES + block_bytes - 1) / block_bytes);
    const __m256i low4 = _mm256_set1_epi32(0x000F000F);
    const uint16_t *szr = sz + (n / ROWS) * groups * 2 * ROWS;
    /* one int32 accumulator per row as a named variable (acc2*: the second group of a chunk when g = 32): with
       arrays indexed in the row loop, gcc kept them on the stack and each update was a load, add and store */
    __m256i acc0 = _mm256_setzero_si256(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
    __m256i acc20 = acc0, acc21 = acc0, acc22 = acc0, acc23 = acc0;
    __m256i held = acc0;                 /* the transposed sums of an even group, flushed with the next one */
    __m256 tot = _mm256_setzero_ps();    /* [even groups | odd groups], 4 rows each */
    const int32_t *block = codes + n * kw;
#define ROW_STEP(R, ACC, ACC2) {                                                                             \
        const int32_t *src = block + (c * ROWS + (R)) * words + v * 8;                                         \
        const __m256i w = _mm256_loadu_si256((const __m256i *)src);                                            \
        /* the same columns of the next row block(s): a block's rows are short streams that the hardware      \
           prefetcher picks up too late */                                                                     \
        _mm_prefetch((const char *)(src + prefetch_words), _MM_HINT_T0);                                       \
        if (chunk != g) {  /* g = 32: pairs 0-1 are one group, 2-3 the next */                                 \
            ACC = _mm256_add_epi32(ACC, _mm256_add_epi32(_mm256_madd_epi16(NIB_PAIR(w, 0), x0),                \
                                                         _mm256_madd_epi16(NIB_PAIR(w, 1), x1)));              \
            ACC2 = _mm256_add_epi32(ACC2, _mm256_add_epi32(_mm256_madd_epi16(NIB_PAIR(w, 2), x2),              \
                                                           _mm256_madd_epi16(NIB_PAIR(w, 3), x3)));            \
            __asm__("" : "+x"(ACC2));                                                                          \
        } else {                                                                                               \
            ACC = _mm256_add_epi32(ACC, _mm256_add_epi32(                                                      \
                _mm256_add_epi32(_mm256_madd_epi16(NIB_PAIR(w, 0), x0), _mm256_madd_epi16(NIB_PAIR(w, 1), x1)), \
                _mm256_add_epi32(_mm256_madd_epi16(NIB_PAIR(w, 2), x2), _mm256_madd_epi16(NIB_PAIR(w, 3), x3)))); \
        }                                                                                                      \
        /* an empty asm pins each update here: otherwise gcc reassociates a group's integer sum into all its    \
           madds first and the adds last, spilling the madd results to the stack (~25% slower) */              \
        __asm__("" : "+x"(ACC));                                                                               \
    }
#define FLUSH_PAIR(DA, DB, GRP) \
        tot = flush_pair((DA), (DB), szr + (GRP) * 2 * ROWS, x.sx + (GRP), x.xqsum + (GRP), tot);
#ifdef HAVE_VNNI512
    const __m512i low4x = _mm512_set1_epi32(0x000F000F);
    /* per row, pairs 0-1 and 2-3 in two accumulators: two short dependency chains instead of one long one */
#define ROW_STEP512(R, A, B) {                                                                               \
        const int32_t *src = block + (c * ROWS + (R)) * words + vv * 16;                                      \
        const __m512i w = _mm512_loadu_si512((const void *)src);                                              \
        _mm_prefetch((const char *)(src + prefetch_words), _MM_HINT_T0);                                      \
        A = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(A, NIB_PAIR512(w, 0), x0), NIB_PAIR512(w, 1), x1);        \
        B = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(B, NIB_PAIR512(w, 2), x2), NIB_PAIR512(w, 3), x3);        \
    }
#endif
    for (int64_t c = 0; c < k / chunk; ++c) {
#ifdef HAVE_VNNI512
        if (chunk == g && g >= 128) {
            __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
#pragma GCC unroll 1
            for (int64_t vv = 0; vv < words / 16; ++vv) {
                const int16_t *xc = x.xq + c * chunk + vv * 128;
                const __m512i x0 = load_x512(xc, 0), x1 = load_x512(xc, 1), x2 = load_x512(xc, 2), x3 = load_x512(xc, 3);
                ROW_STEP512(0, a0, b0)
                ROW_STEP512(1, a1, b1)
                ROW_STEP512(2, a2, b2)
                ROW_STEP512(3, a3, b3)
            }
            acc0 = fold512(a0, b0); acc1 = fold512(a1, b1); acc2 = fold512(a2, b2); acc3 = fold512(a3, b3);
        } else
#endif
#pragma GCC unroll 1
        for (int64_t v = 0; v < vecs; ++v) {
            const int16_t *xc = x.xq + c * chunk + v * 64;
            /* the 4 activation pairs stay in registers; each row's word is loaded and used at once (with the
               4 words loaded first, gcc spilled to the stack) */
            const __m256i x0 = _mm256_loadu_si256((const __m256i *)xc), x1 = _mm256_loadu_si256((const __m256i *)(xc + 16)),
                          x2 = _mm256_loadu_si256((const __m256i *)(xc + 32)), x3 = _mm256_loadu_si256((const __m256i *)(xc + 48));
            ROW_STEP(0, acc0, acc20)
            ROW_STEP(1, acc1, acc21)
            ROW_STEP(2, acc2, acc22)
            ROW_STEP(3, acc3, acc23)
        }
        if (chunk != g) {  /* g = 32: groups 2c and 2c + 1 */
            FLUSH_PAIR(transpose_sum4(acc0, acc1, acc2, acc3), transpose_sum4(acc20, acc21, acc22, acc23), 2 * c)
            acc20 = acc21 = acc22 = acc23 = _mm256_setzero_si256();
        } else if (c % 2 == 0) {
            held = transpose_sum4(acc0, acc1, acc2, acc3);
        } else {
            FLUSH_PAIR(held, transpose_sum4(acc0, acc1, acc2, acc3), c - 1)
        }
        acc0 = acc1 = acc2 = acc3 = _mm256_setzero_si256();
    }
#undef ROW_STEP
#ifdef HAVE_VNNI512
#undef ROW_STEP512
#endif
    __m128 sum = _mm256_extractf128_ps(tot, 1);  /* the odd groups */
    if (chunk == g && (k / chunk) % 2) {  /* an odd group count: the last (even) group alone */
        const int64_t last = k / chunk - 1;
        __m128 s_; __m128i z_;
        load_sz4(szr + last * 2 * ROWS, &s_, &z_);
        const __m128i dot = _mm_sub_epi32(_mm_add_epi32(_mm256_castsi256_si128(held), _mm256_extracti128_si256(held, 1)),
                                          _mm_mullo_epi32(z_, _mm_set1_epi32(x.xqsum[last])));
        tot = _mm256_castps128_ps256(_mm_fmadd_ps(_mm_cvtepi32_ps(dot), _mm_mul_ps(s_, _mm_set1_ps(x.sx[last])),
                                                  _mm256_castps256_ps128(tot)));
    }
#undef FLUSH_PAIR
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(tot), sum));
}

/* Two activation rows (M = 2), g >= 64: the GEMV with each word's 4 code pairs decoded once and multiplied into
   both activation rows (8 accumulators: 4 rows x 2 activations, named variables), flushed in pairs of groups like
   the GEMV. The same integer sums and float operations as gemm_rows (the same bits); M = 2 used to cost ~2x M = 1
   through the L1 decode buffer. */
static inline __attribute__((always_inline)) void gemv2_rows(
        const int32_t *codes, const uint16_t *sz, qx_t x, float out0[ROWS], float out1[ROWS], int64_t n, int64_t k,
        const int64_t g) {
    const int64_t kw = k / 8, groups = k / g, words = g / 8, vecs = words / 8;
    const int64_t block_bytes = ROWS * kw * 4, prefetch_words = ROWS * kw * ((PREFETCH_BYTES + block_bytes - 1) / block_bytes);
    const __m256i low4 = _mm256_set1_epi32(0x000F000F);
    const uint16_t *szr = sz + (n / ROWS) * groups * 2 * ROWS;
    const qx_t x1q = qx_row(x, 1, k, g);
    __m256i a00 = _mm256_setzero_si256(), a01 = a00, a02 = a00, a03 = a00;  /* activation row 0, rows 0..3 of W */
    __m256i a10 = a00, a11 = a00, a12 = a00, a13 = a00;                     /* activation row 1 */
    __m256i held0 = a00, held1 = a00;
    __m256 tot0 = _mm256_setzero_ps(), tot1 = tot0;
    const int32_t *block = codes + n * kw;
#define PAIR_STEP(J, S0, S1) {                                                                                 \
        const __m256i p_ = NIB_PAIR(w, J);                                                                     \
        S0 = _mm256_add_epi32(S0, _mm256_madd_epi16(p_, _mm256_loadu_si256((const __m256i *)(xa + 16 * (J))))); \
        S1 = _mm256_add_epi32(S1, _mm256_madd_epi16(p_, _mm256_loadu_si256((const __m256i *)(xb + 16 * (J))))); \
    }
#define ROW2_STEP(R, ACC0, ACC1) {                                                                             \
        const int32_t *src = block + (c * ROWS + (R)) * words + v * 8;                                         \
        const __m256i w = _mm256_loadu_si256((const __m256i *)src);                                            \
        _mm_prefetch((const char *)(src + prefetch_words), _MM_HINT_T0);                                       \
        __m256i s0 = _mm256_madd_epi16(NIB_PAIR(w, 0), _mm256_loadu_si256((const __m256i *)xa)),              \
                s1 = _mm256_madd_epi16(NIB_PAIR(w, 0), _mm256_loadu_si256((const __m256i *)xb));              \
        PAIR_STEP(1, s0, s1) PAIR_STEP(2, s0, s1) PAIR_STEP(3, s0, s1)                                         \
        ACC0 = _mm256_add_epi32(ACC0, s0);                                                                     \
        ACC1 = _mm256_add_epi32(ACC1, s1);                                                                     \
        __asm__("" : "+x"(ACC0), "+x"(ACC1));                                                                  \
    }
#ifdef HAVE_VNNI512
    const __m512i low4x = _mm512_set1_epi32(0x000F000F);
#define ROW2_STEP512(R, A0, A1) {                                                                            \
        const int32_t *src = block + (c * ROWS + (R)) * words + vv * 16;                                      \
        const __m512i w = _mm512_loadu_si512((const void *)src);                                              \
        _mm_prefetch((const char *)(src + prefetch_words), _MM_HINT_T0);                                      \
        const __m512i p0 = NIB_PAIR512(w, 0), p1 = NIB_PAIR512(w, 1), p2 = NIB_PAIR512(w, 2), p3 = NIB_PAIR512(w, 3); \
        A0 = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(A0, p0, xa0), p1, xa1);                                  \
        A0 = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(A0, p2, xa2), p3, xa3);                                  \
        A1 = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(A1, p0, xb0), p1, xb1);                                  \
        A1 = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(A1, p2, xb2), p3, xb3);                                  \
    }
#endif
    for (int64_t c = 0; c < groups; ++c) {
#ifdef HAVE_VNNI512
        if (g >= 128) {
            __m512i c00 = _mm512_setzero_si512(), c01 = c00, c02 = c00, c03 = c00, c10 = c00, c11 = c00, c12 = c00,
                    c13 = c00;
#pragma GCC unroll 1
            for (int64_t vv = 0; vv < words / 16; ++vv) {
                const int16_t *xa = x.xq + c * g + vv * 128, *xb = x1q.xq + c * g + vv * 128;
                const __m512i xa0 = load_x512(xa, 0), xa1 = load_x512(xa, 1), xa2 = load_x512(xa, 2), xa3 = load_x512(xa, 3),
                              xb0 = load_x512(xb, 0), xb1 = load_x512(xb, 1), xb2 = load_x512(xb, 2), xb3 = load_x512(xb, 3);
                ROW2_STEP512(0, c00, c10)
                ROW2_STEP512(1, c01, c11)
                ROW2_STEP512(2, c02, c12)
                ROW2_STEP512(3, c03, c13)
            }
            a00 = fold1_512(c00); a01 = fold1_512(c01); a02 = fold1_512(c02); a03 = fold1_512(c03);
            a10 = fold1_512(c10); a11 = fold1_512(c11); a12 = fold1_512(c12); a13 = fold1_512(c13);
        } else
#endif
#pragma GCC unroll 1
        for (int64_t v = 0; v < vecs; ++v) {
            const int16_t *xa = x.xq + c * g + v * 64, *xb = x1q.xq + c * g + v * 64;
            ROW2_STEP(0, a00, a10)
            ROW2_STEP(1, a01, a11)
            ROW2_STEP(2, a02, a12)
            ROW2_STEP(3, a03, a13)
        }
        if (c % 2 == 0) {
            held0 = transpose_sum4(a00, a01, a02, a03);
            held1 = transpose_sum4(a10, a11, a12, a13);
        } else {
            tot0 = flush_pair(held0, transpose_sum4(a00, a01, a02, a03), szr + (c - 1) * 2 * ROWS, x.sx + c - 1,
                              x.xqsum + c - 1, tot0);
            tot1 = flush_pair(held1, transpose_sum4(a10, a11, a12, a13), szr + (c - 1) * 2 * ROWS, x1q.sx + c - 1,
                              x1q.xqsum + c - 1, tot1);
        }
        a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = _mm256_setzero_si256();
    }
#undef ROW2_STEP
#undef PAIR_STEP
#ifdef HAVE_VNNI512
#undef ROW2_STEP512
#endif
    __m128 sum0 = _mm256_extractf128_ps(tot0, 1), sum1 = _mm256_extractf128_ps(tot1, 1);
    __m128 even0 = _mm256_castps256_ps128(tot0), even1 = _mm256_castps256_ps128(tot1);
    if (groups % 2) {  /* an odd group count: the last (even) group alone, as flush4 */
        const int64_t last = groups - 1;
        __m128 s_; __m128i z_;
        load_sz4(szr + last * 2 * ROWS, &s_, &z_);
        const __m128i d0 = _mm_sub_epi32(_mm_add_epi32(_mm256_castsi256_si128(held0), _mm256_extracti128_si256(held0, 1)),
                                         _mm_mullo_epi32(z_, _mm_set1_epi32(x.xqsum[last]))),
                      d1 = _mm_sub_epi32(_mm_add_epi32(_mm256_castsi256_si128(held1), _mm256_extracti128_si256(held1, 1)),
                                         _mm_mullo_epi32(z_, _mm_set1_epi32(x1q.xqsum[last])));
        even0 = _mm_fmadd_ps(_mm_cvtepi32_ps(d0), _mm_mul_ps(s_, _mm_set1_ps(x.sx[last])), even0);
        even1 = _mm_fmadd_ps(_mm_cvtepi32_ps(d1), _mm_mul_ps(s_, _mm_set1_ps(x1q.sx[last])), even1);
    }
    _mm_storeu_ps(out0, _mm_add_ps(even0, sum0));
    _mm_storeu_ps(out1, _mm_add_ps(even1, sum1));
}

/* ROWS rows decoded once per chunk into an L1 buffer of int16 code pairs, then multiplied into the activation rows
   two at a time (8 accumulators: 4 rows x 2 activations), flushed per group like the GEMV. */
static inline __attribute__((always_inline)) void gemm_rows(
        const int32_t *codes, const uint16_t *sz, qx_t x, void *y, int y_bf16,
        int64_t n, int64_t n_valid, int64_t m_rows, int64_t k, const int64_t g) {
    const int64_t kw = k / 8, groups = k / g, chunk = chunk_of(g), words = chunk / 8;
    const __m256i low4 = _mm256_set1_epi32(0x000F000F);
    const uint16_t *szr = sz + (n / ROWS) * groups * 2 * ROWS;
    int16_t dq[ROWS][MAX_GROUP] __attribute__((aligned(64)));
    __m128 tot[2][16];  /* even and odd groups (as in the GEMV); the caller passes at most 16 activation rows */
    for (int64_t m = 0; m < m_rows; ++m) tot[0][m] = tot[1][m] = _mm_setzero_ps();
    for (int64_t c = 0; c < k / chunk; ++c) {
        for (int r = 0; r < ROWS; ++r) {
            const int32_t *src = codes + n * kw + (c * ROWS + r) * words;
            for (int64_t v = 0; v < words / 8; ++v) {
                const __m256i w = _mm256_loadu_si256((const __m256i *)(src + v * 8));
                __m256i *d = (__m256i *)(dq[r] + v * 64);
                _mm256_store_si256(d, NIB_PAIR(w, 0));
                _mm256_store_si256(d + 1, NIB_PAIR(w, 1));
                _mm256_store_si256(d + 2, NIB_PAIR(w, 2));
                _mm256_store_si256(d + 3, NIB_PAIR(w, 3));
            }
        }
        for (int64_t h = 0; h < chunk / g; ++h) {  /* the groups of this chunk (2 when g = 32) */
            const int64_t grp = c * (chunk / g) + h;
            __m128 s;
            __m128i z;
            load_sz4(szr + grp * 2 * ROWS, &s, &z);
            int64_t m_start = 0;
#ifdef HAVE_VNNI512
            /* four activation rows at a time: 16 accumulators (acc[4 i + r]: activation row m + i, weight row r)
               reduced by one tree into 16 exact sums, then flush4's operations lane by lane (the same bits):
               half the flush work per vpdpwssd of the pair loop below, which folds and flushes 8 accumulators */
            for (; m_start + 4 <= m_rows; m_start += 4) {
                const int64_t m = m_start;
                const int16_t *xr = x.xq + m * k + c * chunk + h * g;
                __m512i acc[16];
                for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_si512();
                for (int64_t e = 0; e < g; e += 32) {
                    const __m512i v0 = _mm512_loadu_si512((const void *)(xr + e)),
                                  v1 = _mm512_loadu_si512((const void *)(xr + k + e)),
                                  v2 = _mm512_loadu_si512((const void *)(xr + 2 * k + e)),
                                  v3 = _mm512_loadu_si512((const void *)(xr + 3 * k + e));
                    for (int r = 0; r < ROWS; ++r) {
                        const __m512i d = _mm512_load_si512((const void *)(dq[r] + h * g + e));
                        acc[r] = _mm512_dpwssd_epi32(acc[r], d, v0);
                        acc[4 + r] = _mm512_dpwssd_epi32(acc[4 + r], d, v1);
                        acc[8 + r] = _mm512_dpwssd_epi32(acc[8 + r], d, v2);
                        acc[12 + r] = _mm512_dpwssd_epi32(acc[12 + r], d, v3);
                    }
                }
                int32_t xs4[4];
                float sx4[4];
                for (int i = 0; i < 4; ++i) {
                    xs4[i] = x.xqsum[(m + i) * groups + grp];
                    sx4[i] = x.sx[(m + i) * groups + grp];
                }
                const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
                const __m512i xs = _mm512_permutexvar_epi32(spread, _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)xs4)));
                const __m512 sxv = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_loadu_ps(sx4)));
                const __m512i dot = _mm512_sub_epi32(reduce16(acc), _mm512_mullo_epi32(_mm512_broadcast_i32x4(z), xs));
                float *tp = (float *)&tot[grp & 1][m];  /* tot[.][m .. m+3]: 16 contiguous floats, lane 4 i + r */
                _mm512_storeu_ps(tp, _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(_mm512_broadcast_f32x4(s), sxv),
                                                     _mm512_loadu_ps(tp)));
            }
#endif
            for (int64_t m = m_start; m < m_rows; m += 2) {
                const int pair = m + 1 < m_rows;
                const int16_t *x0 = x.xq + m * k + c * chunk + h * g, *x1 = pair ? x0 + k : x0;
                /* named accumulators (arrays indexed in the row loop stayed on the stack) */
                __m256i c00 = _mm256_setzero_si256(), c01 = c00, c02 = c00, c03 = c00, c10 = c00, c11 = c00, c12 = c00,
                        c13 = c00;
#ifdef HAVE_VNNI512
                /* the decoded pairs and the activations share one order: 32 int16 per vpdpwssd */
                __m512i d00 = _mm512_setzero_si512(), d01 = d00, d02 = d00, d03 = d00, d10 = d00, d11 = d00, d12 = d00,
                        d13 = d00;
                for (int64_t e = 0; e < g; e += 32) {
                    const __m512i a = _mm512_loadu_si512((const void *)(x0 + e)), b = _mm512_loadu_si512((const void *)(x1 + e));
#define DQ_STEP512(R, C0, C1) {                                                                \
                        const __m512i d = _mm512_load_si512((const void *)(dq[R] + h * g + e)); \
                        C0 = _mm512_dpwssd_epi32(C0, d, a);                                    \
                        C1 = _mm512_dpwssd_epi32(C1, d, b);                                    \
                    }
                    DQ_STEP512(0, d00, d10) DQ_STEP512(1, d01, d11) DQ_STEP512(2, d02, d12) DQ_STEP512(3, d03, d13)
#undef DQ_STEP512
                }
                c00 = fold1_512(d00); c01 = fold1_512(d01); c02 = fold1_512(d02); c03 = fold1_512(d03);
                c10 = fold1_512(d10); c11 = fold1_512(d11); c12 = fold1_512(d12); c13 = fold1_512(d13);
#else
                for (int64_t e = 0; e < g; e += 16) {
                    const __m256i a = _mm256_loadu_si256((const __m256i *)(x0 + e)),
                                  b = _mm256_loadu_si256((const __m256i *)(x1 + e));
#define DQ_STEP(R, C0, C1) {                                                                   \
                        const __m256i d = _mm256_load_si256((const __m256i *)(dq[R] + h * g + e)); \
                        C0 = _mm256_add_epi32(C0, _mm256_madd_epi16(d, a));                   \
                        C1 = _mm256_add_epi32(C1, _mm256_madd_epi16(d, b));                   \
                    }
                    DQ_STEP(0, c00, c10) DQ_STEP(1, c01, c11) DQ_STEP(2, c02, c12) DQ_STEP(3, c03, c13)
#undef DQ_STEP
                }
#endif
                const __m256i acc0[ROWS] = {c00, c01, c02, c03}, acc1[ROWS] = {c10, c11, c12, c13};
                __m128 *t = tot[grp & 1];
                t[m] = flush4(acc0[0], acc0[1], acc0[2], acc0[3], s, z, x.sx[m * groups + grp], x.xqsum[m * groups + grp], t[m]);
                if (pair)
                    t[m + 1] = flush4(acc1[0], acc1[1], acc1[2], acc1[3], s, z, x.sx[(m + 1) * groups + grp],
                                      x.xqsum[(m + 1) * groups + grp], t[m + 1]);
            }
        }
    }
    for (int64_t m = 0; m < m_rows; ++m) {
        float t[ROWS];
        _mm_storeu_ps(t, _mm_add_ps(tot[0][m], tot[1][m]));
        for (int r = 0; r < ROWS; ++r)
            if (n + r < n_valid) store_y(y, y_bf16, m * n_valid + n + r, t[r]);
    }
}
#undef NIB_PAIR

static inline __attribute__((always_inline)) void row_block_g(
        const int32_t *codes, const uint16_t *sz, qx_t x, void *y, int y_bf16,
        int64_t n, int64_t n_valid, int64_t m_rows, int64_t k, const int64_t g) {
    if (m_rows == 1) {
        float out[ROWS];
        gemv_rows(codes, sz, x, out, n, k, g);
        for (int r = 0; r < ROWS; ++r)
            if (n + r < n_valid) store_y(y, y_bf16, n + r, out[r]);
        return;
    }
    if (m_rows == 2 && g >= 64) {
        float out[2][ROWS];
        gemv2_rows(codes, sz, x, out[0], out[1], n, k, g);
        for (int m = 0; m < 2; ++m)
            for (int r = 0; r < ROWS; ++r)
                if (n + r < n_valid) store_y(y, y_bf16, m * n_valid + n + r, out[m][r]);
        return;
    }
    for (int64_t m = 0; m < m_rows; m += 16) {
        const int64_t mb = m_rows - m < 16 ? m_rows - m : 16;
        gemm_rows(codes, sz, qx_row(x, m, k, g), (char *)y + m * n_valid * (y_bf16 ? 2 : 4), y_bf16,
                  n, n_valid, mb, k, g);
    }
}

static void row_block(const int32_t *codes, const uint16_t *sz, qx_t x, void *y,
                      int y_bf16, int64_t n, int64_t n_valid, int64_t m_rows, int64_t k, int64_t g) {
    switch (g) {  /* the group size as a constant: the loops over a group unroll */
    case 32: row_block_g(codes, sz, x, y, y_bf16, n, n_valid, m_rows, k, 32); break;
    case 64: row_block_g(codes, sz, x, y, y_bf16, n, n_valid, m_rows, k, 64); break;
    case 128: row_block_g(codes, sz, x, y, y_bf16, n, n_valid, m_rows, k, 128); break;
    default: row_block_g(codes, sz, x, y, y_bf16, n, n_valid, m_rows, k, 256); break;
    }
}
#else
/* Portable C (no AVX2): the same integer group sums and the same float operations in the same order as flush_pair /
   flush4 (even and odd groups summed apart, added at the end), one row and one activation row at a time, so both
   paths give the same bits. */
static void row_block(const int32_t *codes, const uint16_t *sz, qx_t x, void *y,
                      int y_bf16, int64_t n, int64_t n_valid, int64_t m_rows, int64_t k, int64_t g) {
    const int64_t kw = k / 8, groups = k / g, chunk = chunk_of(g), words = chunk / 8;
    for (int64_t r = n; r < n + ROWS && r < n_valid; ++r)
        for (int64_t m = 0; m < m_rows; ++m) {
            float tot[2] = {0.0f, 0.0f};  /* even and odd groups */
            for (int64_t grp = 0; grp < groups; ++grp) {
                const int64_t c = grp * g / chunk, e0 = grp * g - c * chunk;  /* e0: the group's start in the chunk */
                int32_t isum = 0;
                for (int64_t e = e0; e < e0 + g; ++e) {  /* xq order: e = 64 v + 16 j + 2 q + h */
                    const int64_t v = e / 64, j = (e / 16) % 4, q = (e % 16) / 2, h = e % 2;
                    const uint32_t w = (uint32_t)codes[(r - r % ROWS) * kw + (c * ROWS + r % ROWS) * words + v * 8 + q];
                    isum += (int32_t)x.xq[m * k + c * chunk + e] * (int32_t)((w >> (4 * (j + 4 * h))) & 15u);
                }
                const uint16_t *p = sz + ((r / ROWS) * groups + grp) * 2 * ROWS;
                const int32_t dot = isum - (int32_t)half_to_float(p[ROWS + r % ROWS]) * x.xqsum[m * groups + grp];
                tot[grp & 1] = fmaf((float)dot, half_to_float(p[r % ROWS]) * x.sx[m * groups + grp], tot[grp & 1]);
            }
            store_y(y, y_bf16, m * n_valid + r, tot[0] + tot[1]);
        }
}
#endif

/* y[M, n_valid] = x[M, K] @ W.T with W = (q - z) * scale from nibble-planar codes int32 [n_rows, K/8] and
   fp16 scales and zeros [n_rows/ROWS, K/g, 2, ROWS] (zero an integer 0..15); n_rows is a multiple of ROWS (padded rows are
   never stored). x and y are fp32 or bf16. Row blocks are split over `threads` OpenMP threads (PyTorch's runtime). */
void musecore_int4_gemv(const int32_t *codes, const uint16_t *sz, const void *x, int x_bf16, void *y, int y_bf16,
                        int64_t m_rows, int64_t k, int64_t g, int64_t n_rows, int64_t n_valid, int threads) {
    float *buf = scratch(qx_floats(m_rows, k, g));
    if (buf == NULL) return;
    const qx_t xq = qx_at(buf, m_rows, k, g);
    prepare_x(x, x_bf16, m_rows, k, g, xq);
    const int64_t blocks = n_rows / ROWS;
#ifdef _OPENMP
    if (threads > blocks) threads = (int)blocks;
    const int64_t code_bytes = n_rows * k / 2 * m_rows;
    if (code_bytes < GEMV_PARALLEL_MIN_BYTES) threads = 1;
    else if (threads > code_bytes / GEMV_MIN_BYTES_PER_THREAD) threads = (int)(code_bytes / GEMV_MIN_BYTES_PER_THREAD);
#pragma omp parallel num_threads(threads) if (threads > 1)
#endif
    /* passes of at most GEMV_MB activation rows over the weight (a remainder below 16 rows joins the last pass) */
    for (int64_t m0 = 0; m0 < m_rows; m0 += GEMV_MB) {
        const int64_t mb = m_rows - m0 < GEMV_MB + 16 ? m_rows - m0 : GEMV_MB;
        void *ym = (char *)y + m0 * n_valid * (y_bf16 ? 2 : 4);
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
        for (int64_t blk = 0; blk < blocks; ++blk)
            row_block(codes, sz, qx_row(xq, m0, k, g), ym, y_bf16, blk * ROWS, n_valid, mb, k, g);
        if (mb > GEMV_MB) break;
    }
}

/* One INT4 weight's constant arguments, filled once by Python (Int4Gemv): a bound call passes 5 arguments through
   ctypes instead of 12 (decode makes ~100 such calls per token). */
typedef struct { const int32_t *codes; const uint16_t *sz; int64_t k, g, n_rows, n_valid; } int4_weight_t;

/* musecore_int4_gemv on a bound weight, with PyTorch's thread count: this library runs on PyTorch's libgomp, whose
   omp_get_max_threads() is what torch.get_num_threads() returns (ATen's OpenMP build reads the same ICV). */
void musecore_int4_linear(const int4_weight_t *w, const void *x, void *y, int64_t m_rows, int bf16) {
#ifdef _OPENMP
    const int threads = omp_get_max_threads();
#else
    const int threads = 1;
#endif
    musecore_int4_gemv(w->codes, w->sz, x, bf16, y, bf16, m_rows, w->k, w->g, w->n_rows, w->n_valid, threads);
}

int musecore_max_threads(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
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

/* out[r, c] = (q - z) * scale of rows r < rows (fp32 [rows, K]; rows a multiple of ROWS), exact: (q - z) * an
   fp16 scale fits fp32. */
void musecore_int4_dequant(const int32_t *codes, const uint16_t *sz, float *out, int64_t rows, int64_t k, int64_t g,
                           int threads) {
    const int64_t kw = k / 8, groups = k / g, chunk = chunk_of(g), words = chunk / 8;
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && rows >= 8)
#endif
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t c0 = 0; c0 < k; c0 += chunk) {
            const uint32_t *w = (const uint32_t *)codes + (r - r % ROWS) * kw + ((c0 / chunk) * ROWS + r % ROWS) * words;
#ifdef __AVX2__
            if (chunk == g) {  /* one group per chunk: one scale; 8 words loaded once for all 8 positions */
                const uint16_t *pz = sz + ((r / ROWS) * groups + c0 / g) * 2 * ROWS + r % ROWS;
                const float s = half_to_float(pz[0]), o = -half_to_float(pz[ROWS]) * s;
                const __m256 sv = _mm256_set1_ps(s), ov = _mm256_set1_ps(o);
                const __m256i low = _mm256_set1_epi32(15);
                for (int64_t q = 0; q < words; q += 8) {  /* words = g / 8: a multiple of 8 */
                    const __m256i wv = _mm256_loadu_si256((const __m256i *)(w + q));
                    for (int p = 0; p < 8; ++p) {  /* the same exact values as the loop below: (q - z) * s fits fp32 */
                        const __m256i code = _mm256_and_si256(_mm256_srl_epi32(wv, _mm_cvtsi32_si128(4 * nibble_of(p))), low);
                        _mm256_storeu_ps(out + r * k + c0 + p * words + q, _mm256_fmadd_ps(_mm256_cvtepi32_ps(code), sv, ov));
                    }
                }
                continue;
            }
#endif
            for (int p = 0; p < 8; ++p) {  /* position p: columns p*W .. p*W + W-1 of the chunk, nibble nib(p) */
                const int shift = 4 * nibble_of(p);
                const uint16_t *pz = sz + ((r / ROWS) * groups + (c0 + p * words) / g) * 2 * ROWS + r % ROWS;
                const float s = half_to_float(pz[0]), o = -half_to_float(pz[ROWS]) * s;
                float *dst = out + r * k + c0 + p * words;
                /* int32 before float: AVX2 converts signed ints in one instruction (an unsigned source kept gcc
                   from vectorizing this loop: 2.5x slower than the BF16 upcast of the same tile) */
                for (int64_t q = 0; q < words; ++q) dst[q] = (float)(int32_t)((w[q] >> shift) & 15u) * s + o;
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
