/* Few-row products with 8-bit weights on the CPU, for mm3.gguf.cpu_native.

   y[i, n] = sum_k x[i, k] w[n, k], w[n, k] = s[n, k / G] q[n, k] (q int8, s float32, G = 16 or 32
   columns a scale: Q8_0, Q5_0 and Q6_K values as they are).

   Weights come in tiles of 16 rows: per tile the int8 values as [K / 2][16][2] (row r's columns
   2p and 2p + 1 side by side), then the scales as float32 [K / G][16]. Each input row is rounded
   per G columns to int16 with a float32 scale (the largest value maps to 32767: a relative error
   of about 1e-5, far below bfloat16's), so a group's dot products are exact integer sums (at most
   32 * 32767 * 128 < 2^31) and each group adds its sum times both scales to a float32 total.
   The integer multiply-adds take 16 rows at a time (AVX-512; AVX2 in two halves; fused where the
   processor has VNNI); elsewhere the same arithmetic in plain C. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#if defined(__AVX512BW__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define TILE 16
#define FLIGHT 4 /* tiles multiplied together: independent chains of multiply-adds */

static int64_t tile_bytes(int64_t k, int group) { return TILE * k + TILE * (k / group) * 4; }

/* A block holding a NaN or an infinity gets a NaN scale: its rows' outputs are NaN, as a float
   product's would be, so a diverging run is caught downstream. */
static void round_rows(const float *x, int64_t m, int64_t k, int group, int16_t *xq, float *dx) {
    for (int64_t b = 0; b < m * (k / group); b++) {
        const float *v = x + b * group;
        float top = 0.f;
        int finite = 1;
        for (int j = 0; j < group; j++) {
            finite &= isfinite(v[j]) != 0;
            top = fmaxf(top, fabsf(v[j]));
        }
        if (!finite) {
            dx[b] = NAN;
            for (int j = 0; j < group; j++) xq[b * group + j] = 0;
            continue;
        }
        float inv = top > 0.f ? 32767.f / top : 0.f;
        dx[b] = top / 32767.f;
        for (int j = 0; j < group; j++) xq[b * group + j] = (int16_t)lrintf(v[j] * inv);
    }
}

/* Rows i0 and i1 of the input (the same row twice when one is left) times tiles t0 .. t0 + nt - 1. */
static void tiles(const int8_t *w, const int16_t *xq, const float *dx, float *y, int64_t n, int64_t k, int group,
                  int64_t t0, int nt, int64_t i0, int64_t i1) {
    const int64_t groups = k / group, bytes = tile_bytes(k, group);
    const int pairs = group / 2;
    const int32_t *x0 = (const int32_t *)(xq + i0 * k), *x1 = (const int32_t *)(xq + i1 * k);
#if defined(__AVX512BW__)
    __m512 acc0[FLIGHT], acc1[FLIGHT];
    for (int t = 0; t < FLIGHT; t++) acc0[t] = acc1[t] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m512i s0[FLIGHT], s1[FLIGHT];
        for (int t = 0; t < FLIGHT; t++) s0[t] = s1[t] = _mm512_setzero_si512();
        for (int p = 0; p < pairs; p++) {
            __m512i a = _mm512_set1_epi32(x0[g * pairs + p]), b = _mm512_set1_epi32(x1[g * pairs + p]);
            for (int t = 0; t < nt; t++) {
                const int8_t *q = w + (t0 + t) * bytes + (g * pairs + p) * 32;
                __m512i v = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)q));
#if defined(__AVX512VNNI__)
                s0[t] = _mm512_dpwssd_epi32(s0[t], v, a);
                s1[t] = _mm512_dpwssd_epi32(s1[t], v, b);
#else
                s0[t] = _mm512_add_epi32(s0[t], _mm512_madd_epi16(v, a));
                s1[t] = _mm512_add_epi32(s1[t], _mm512_madd_epi16(v, b));
#endif
            }
        }
        __m512 d0 = _mm512_set1_ps(dx[i0 * groups + g]), d1 = _mm512_set1_ps(dx[i1 * groups + g]);
        for (int t = 0; t < nt; t++) {
            __m512 d = _mm512_loadu_ps((const float *)(w + (t0 + t) * bytes + TILE * k) + g * TILE);
            acc0[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0[t]), _mm512_mul_ps(d, d0), acc0[t]);
            acc1[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1[t]), _mm512_mul_ps(d, d1), acc1[t]);
        }
    }
    for (int t = 0; t < nt; t++) {
        _mm512_storeu_ps(y + i0 * n + (t0 + t) * TILE, acc0[t]);
        _mm512_storeu_ps(y + i1 * n + (t0 + t) * TILE, acc1[t]);
    }
#elif defined(__AVX2__)
    __m256 acc0[FLIGHT][2], acc1[FLIGHT][2];
    for (int t = 0; t < FLIGHT; t++)
        for (int h = 0; h < 2; h++) acc0[t][h] = acc1[t][h] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m256i s0[FLIGHT][2], s1[FLIGHT][2];
        for (int t = 0; t < FLIGHT; t++)
            for (int h = 0; h < 2; h++) s0[t][h] = s1[t][h] = _mm256_setzero_si256();
        for (int p = 0; p < pairs; p++) {
            __m256i a = _mm256_set1_epi32(x0[g * pairs + p]), b = _mm256_set1_epi32(x1[g * pairs + p]);
            for (int t = 0; t < nt; t++) {
                const int8_t *q = w + (t0 + t) * bytes + (g * pairs + p) * 32;
                for (int h = 0; h < 2; h++) {
                    __m256i v = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(q + 16 * h)));
#if defined(__AVXVNNI__)
                    s0[t][h] = _mm256_dpwssd_avx_epi32(s0[t][h], v, a);
                    s1[t][h] = _mm256_dpwssd_avx_epi32(s1[t][h], v, b);
#else
                    s0[t][h] = _mm256_add_epi32(s0[t][h], _mm256_madd_epi16(v, a));
                    s1[t][h] = _mm256_add_epi32(s1[t][h], _mm256_madd_epi16(v, b));
#endif
                }
            }
        }
        __m256 d0 = _mm256_set1_ps(dx[i0 * groups + g]), d1 = _mm256_set1_ps(dx[i1 * groups + g]);
        for (int t = 0; t < nt; t++)
            for (int h = 0; h < 2; h++) {
                __m256 d = _mm256_loadu_ps((const float *)(w + (t0 + t) * bytes + TILE * k) + g * TILE + 8 * h);
                acc0[t][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0[t][h]), _mm256_mul_ps(d, d0), acc0[t][h]);
                acc1[t][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1[t][h]), _mm256_mul_ps(d, d1), acc1[t][h]);
            }
    }
    for (int t = 0; t < nt; t++)
        for (int h = 0; h < 2; h++) {
            _mm256_storeu_ps(y + i0 * n + (t0 + t) * TILE + 8 * h, acc0[t][h]);
            _mm256_storeu_ps(y + i1 * n + (t0 + t) * TILE + 8 * h, acc1[t][h]);
        }
#else
    for (int t = 0; t < nt; t++) {
        const int8_t *tile = w + (t0 + t) * bytes;
        const float *scales = (const float *)(tile + TILE * k);
        for (int r = 0; r < TILE; r++) {
            float acc0 = 0.f, acc1 = 0.f;
            for (int64_t g = 0; g < groups; g++) {
                int32_t s0 = 0, s1 = 0;
                for (int j = 0; j < group; j++) {
                    int64_t col = g * group + j;
                    int32_t v = tile[(col / 2) * 32 + r * 2 + (col & 1)];
                    s0 += v * xq[i0 * k + col];
                    s1 += v * xq[i1 * k + col];
                }
                acc0 += (float)s0 * (scales[g * TILE + r] * dx[i0 * groups + g]);
                acc1 += (float)s1 * (scales[g * TILE + r] * dx[i1 * groups + g]);
            }
            y[i0 * n + (t0 + t) * TILE + r] = acc0;
            y[i1 * n + (t0 + t) * TILE + r] = acc1;
        }
    }
#endif
}

/* x [m, k] float32, w: n / 16 tiles (n a multiple of 16, k of the group, 16 or 32), y [m, n]
   float32. Returns 0, -1 when the scratch rows cannot be allocated, -2 for another group. */
int mm3_int8_product(const float *x, const int8_t *w, float *y, int64_t m, int64_t n, int64_t k, int group,
                     int threads) {
    if (group != 16 && group != 32) return -2;
    int16_t *xq = malloc(sizeof(int16_t) * m * k);
    float *dx = malloc(sizeof(float) * m * (k / group));
    if (!xq || !dx) {
        free(xq);
        free(dx);
        return -1;
    }
    round_rows(x, m, k, group, xq, dx);
    const int64_t count = n / TILE, runs = (count + FLIGHT - 1) / FLIGHT;
#pragma omp parallel for num_threads(threads > 0 ? threads : 1) schedule(static)
    for (int64_t r = 0; r < runs; r++) {
        int64_t t0 = r * FLIGHT;
        int nt = count - t0 < FLIGHT ? (int)(count - t0) : FLIGHT;
        for (int64_t i = 0; i < m; i += 2)
            tiles(w, xq, dx, y, n, k, group, t0, nt, i, i + 1 < m ? i + 1 : i);
    }
    free(xq);
    free(dx);
    return 0;
}

/* What this build multiplies with: 512 (AVX-512), 256 (AVX2) or 0 (plain C). */
int mm3_int8_vector_bits(void) {
#if defined(__AVX512BW__)
    return 512;
#elif defined(__AVX2__)
    return 256;
#else
    return 0;
#endif
}
