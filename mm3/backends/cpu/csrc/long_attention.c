/* Bidirectional attention over a long sequence in bfloat16, with the processor's bfloat16 dot
   products (AVX512-BF16), for mm3.backends.cpu.attention (built into the same library as
   integer_product.c). torch's CPU flash attention multiplies its blocks through a library call each
   where the processor has no AMX; here the keys and values are laid out once as pairs of bfloat16
   values (what one dot-product instruction takes) and every query row reads them from the cache.

   The arithmetic is the flash kernel's: scores as float32 sums of exact bfloat16 products, scaled,
   a float32 softmax whose unnormalized weights are rounded to bfloat16 for the product with the
   values, float32 sums divided by the weights' float32 sum, rounded to bfloat16 (to nearest even).
   Only the order of the float32 additions differs. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>

#define KEYS 16  /* keys a score vector holds: one float32 lane each */
#ifndef ROWS
#define ROWS 4   /* query rows that share each load of the keys and values */
#endif
#ifndef BLOCKS
#define BLOCKS 4 /* key blocks a broadcast query pair meets */
#endif
#define MAX_VECTORS 16 /* head_dim / 16 at most: a row's output in float32 vectors */

/* e^x for x <= 0 to about a float32 ulp: Cody-Waite reduction by ln 2, Cephes' polynomial,
   2^n by scalef; 0 far below (as expf underflows). */
static inline __m512 exp_vector(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-104.f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-0.693359375f), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

/* One head's keys as [s_pad / 16][d / 2][16 keys][2] and values as [s_pad / 2][d][2] bfloat16
   (padding zeros): a key block's pair of dimensions, and a pair of positions' values, are one
   vector each. */
static void pack_head(const uint16_t *k, const uint16_t *v, int64_t stride, int64_t s, int64_t s_pad, int64_t d,
                      uint16_t *keys, uint16_t *values) {
    memset(keys, 0, sizeof(uint16_t) * s_pad * d);
    memset(values, 0, sizeof(uint16_t) * s_pad * d);
    for (int64_t j = 0; j < s; j++) {
        const uint16_t *kj = k + j * stride, *vj = v + j * stride;
        uint16_t *kb = keys + (j / KEYS) * KEYS * d + (j % KEYS) * 2, *vb = values + (j / 2) * 2 * d + (j % 2);
        for (int64_t i = 0; i < d; i += 2) {
            kb[i * KEYS] = kj[i];
            kb[i * KEYS + 1] = kj[i + 1];
        }
        for (int64_t i = 0; i < d; i++) vb[2 * i] = vj[i];
    }
}

/* Scores of `rows` (<= ROWS) query rows over every key block: scores[r][s_pad], scaled. BLOCKS
   key blocks at a time share each broadcast of a query pair. */
static void score_rows(const uint16_t *q, int64_t stride, int rows, const uint16_t *keys, int64_t s_pad, int64_t d,
                       float scale, float *scores) {
    int32_t pairs[ROWS][MAX_VECTORS * 8] = {{0}};
    for (int r = 0; r < rows; r++) memcpy(pairs[r], q + r * stride, sizeof(uint16_t) * d);  /* any alignment */
    const __m512 scaled = _mm512_set1_ps(scale);
    const int64_t blocks = s_pad / KEYS;
    int64_t block = 0;
    for (; block + BLOCKS <= blocks; block += BLOCKS) {
        const uint16_t *kb = keys + block * KEYS * d;
        __m512 acc[ROWS][BLOCKS];
        for (int r = 0; r < ROWS; r++)
            for (int c = 0; c < BLOCKS; c++) acc[r][c] = _mm512_setzero_ps();
        for (int64_t i = 0; i < d / 2; i++) {
            __m512bh key[BLOCKS];
            for (int c = 0; c < BLOCKS; c++) key[c] = (__m512bh)_mm512_loadu_si512(kb + c * KEYS * d + i * 2 * KEYS);
            for (int r = 0; r < ROWS; r++) {
                const __m512bh pair = (__m512bh)_mm512_set1_epi32(pairs[r][i]);
                for (int c = 0; c < BLOCKS; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], pair, key[c]);
            }
        }
        for (int r = 0; r < rows; r++)
            for (int c = 0; c < BLOCKS; c++)
                _mm512_storeu_ps(scores + r * s_pad + (block + c) * KEYS, _mm512_mul_ps(acc[r][c], scaled));
    }
    for (; block < blocks; block++) {
        const uint16_t *kb = keys + block * KEYS * d;
        __m512 acc[ROWS];
        for (int r = 0; r < ROWS; r++) acc[r] = _mm512_setzero_ps();
        for (int64_t i = 0; i < d / 2; i++) {
            const __m512bh key = (__m512bh)_mm512_loadu_si512(kb + i * 2 * KEYS);
            for (int r = 0; r < ROWS; r++)
                acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32(pairs[r][i]), key);
        }
        for (int r = 0; r < rows; r++) _mm512_storeu_ps(scores + r * s_pad + block * KEYS, _mm512_mul_ps(acc[r], scaled));
    }
}

/* A score row's softmax weights, unnormalized (e^(x - max)) and rounded to bfloat16 into weights
   [s_pad] (zeros past s); returns their float32 sum. */
static float weigh_row(const float *scores, int64_t s, int64_t s_pad, uint16_t *weights) {
    __m512 top = _mm512_set1_ps(-__builtin_inff());
    int64_t j = 0;
    for (; j + KEYS <= s; j += KEYS) top = _mm512_max_ps(top, _mm512_loadu_ps(scores + j));
    const __mmask16 tail = (__mmask16)((1u << (s - j)) - 1u);
    if (j < s) top = _mm512_mask_max_ps(top, tail, top, _mm512_maskz_loadu_ps(tail, scores + j));
    const __m512 most = _mm512_set1_ps(_mm512_reduce_max_ps(top));
    __m512 sum = _mm512_setzero_ps();
    for (j = 0; j < s_pad; j += KEYS) {
        const __mmask16 live = j + KEYS <= s ? (__mmask16)0xFFFF : j < s ? tail : 0;
        const __m512 e = _mm512_maskz_mov_ps(live, exp_vector(_mm512_sub_ps(_mm512_loadu_ps(scores + j), most)));
        sum = _mm512_add_ps(sum, e);
        _mm256_storeu_si256((__m256i *)(weights + j), (__m256i)_mm512_cvtneps_pbh(e));
    }
    return _mm512_reduce_add_ps(sum);
}

/* out rows = weights @ values / sums, rounded to bfloat16, for `vectors` = d / 16 (a constant
   where inlined, so the sums stay in registers). */
static inline __attribute__((always_inline)) void weigh_values_of(
    const uint16_t *weights, int64_t s_pad, int rows, const uint16_t *values, const int vectors, const float *sums,
    uint16_t *out, int64_t out_stride) {
    __m512 acc[ROWS][MAX_VECTORS];
    for (int r = 0; r < ROWS; r++)
        for (int i = 0; i < vectors; i++) acc[r][i] = _mm512_setzero_ps();
    for (int64_t pair = 0; pair < s_pad / 2; pair++) {
        const uint16_t *vp = values + pair * 2 * (int64_t)vectors * 16;
        __m512bh value[MAX_VECTORS];
        for (int i = 0; i < vectors; i++) value[i] = (__m512bh)_mm512_loadu_si512(vp + i * 32);
        for (int r = 0; r < ROWS; r++) {
            const __m512bh weight = (__m512bh)_mm512_set1_epi32(((const int32_t *)(weights + r * s_pad))[pair]);
            for (int i = 0; i < vectors; i++) acc[r][i] = _mm512_dpbf16_ps(acc[r][i], weight, value[i]);
        }
    }
    for (int r = 0; r < rows; r++) {
        const __m512 inverse = _mm512_set1_ps(1.f / sums[r]);
        for (int i = 0; i < vectors; i++)
            _mm256_storeu_si256((__m256i *)(out + r * out_stride + i * 16),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[r][i], inverse)));
    }
}

static void weigh_values(const uint16_t *weights, int64_t s_pad, int rows, const uint16_t *values, int64_t d,
                         const float *sums, uint16_t *out, int64_t out_stride) {
    switch (d / 16) {
        case 2: weigh_values_of(weights, s_pad, rows, values, 2, sums, out, out_stride); break;
        case 4: weigh_values_of(weights, s_pad, rows, values, 4, sums, out, out_stride); break;
        case 8: weigh_values_of(weights, s_pad, rows, values, 8, sums, out, out_stride); break;
        default: weigh_values_of(weights, s_pad, rows, values, (int)(d / 16), sums, out, out_stride);
    }
}
#endif

/* out = softmax(q k^T scale) v for every batch row and head: q, k, v, out [b][s][heads][d]
   bfloat16 (a position's heads side by side, positions `stride` values apart, batch rows
   `batch_stride` apart; out contiguous). Returns 0; 1 where this build has no bfloat16 dot
   products; -1 for a head size it does not take (not a multiple of 32 or over 256) or memory it
   cannot allocate. */
int mm3_long_attention(const uint16_t *q, const uint16_t *k, const uint16_t *v, int64_t b, int64_t s, int64_t heads,
                       int64_t d, int64_t stride, int64_t batch_stride, float scale, uint16_t *out, int threads) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    if (d % 32 || d > 16 * MAX_VECTORS || s < 1) return -1;
    const int64_t s_pad = (s + KEYS - 1) / KEYS * KEYS, heads_all = b * heads, row_blocks = (s + ROWS - 1) / ROWS;
    uint16_t *packed = malloc(sizeof(uint16_t) * 2 * heads_all * s_pad * d);
    if (!packed) return -1;
    int status = 0;
#pragma omp parallel num_threads(threads > 0 ? threads : 1) reduction(min : status)
    {
#pragma omp for schedule(static)
        for (int64_t bh = 0; bh < heads_all; bh++) {
            const int64_t at = (bh / heads) * batch_stride + (bh % heads) * d;
            pack_head(k + at, v + at, stride, s, s_pad, d, packed + 2 * bh * s_pad * d,
                      packed + (2 * bh + 1) * s_pad * d);
        }
        float *scores = malloc(sizeof(float) * ROWS * s_pad);
        uint16_t *weights = malloc(sizeof(uint16_t) * ROWS * s_pad);
        if (!scores || !weights) status = -1;
#pragma omp for schedule(static) collapse(2)
        for (int64_t bh = 0; bh < heads_all; bh++)
            for (int64_t block = 0; block < row_blocks; block++) {
                if (!scores || !weights) continue;
                const int64_t first = block * ROWS, at = (bh / heads) * batch_stride + (bh % heads) * d;
                const int rows = (int)(s - first < ROWS ? s - first : ROWS);
                float sums[ROWS];
                score_rows(q + at + first * stride, stride, rows, packed + 2 * bh * s_pad * d, s_pad, d, scale,
                           scores);
                for (int r = 0; r < ROWS; r++)
                    if (r < rows) sums[r] = weigh_row(scores + r * s_pad, s, s_pad, weights + r * s_pad);
                    else memset(weights + r * s_pad, 0, sizeof(uint16_t) * s_pad);
                weigh_values(weights, s_pad, rows, packed + (2 * bh + 1) * s_pad * d, d, sums,
                             out + ((bh / heads) * s + first) * heads * d + (bh % heads) * d, heads * d);
            }
        free(scores);
        free(weights);
    }
    free(packed);
    return status;
#else
    (void)q, (void)k, (void)v, (void)b, (void)s, (void)heads, (void)d, (void)stride, (void)batch_stride, (void)scale,
        (void)out, (void)threads;
    return 1;
#endif
}
