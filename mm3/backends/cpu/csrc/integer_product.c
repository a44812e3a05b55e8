/* Few-row products with 8- and 4-bit weights on the CPU, for mm3.gguf.cpu_native (and, at the end,
   the dequantization of a few embedding rows and the repacking of GGUF blocks into the product's
   tiles). The AR step's other small operations are in decode_steps.c, built into the same
   library.

   y[i, n] = sum_k x[i, k] w[n, k], w[n, k] = s[n, k / G] q[n, k] - o[n, k / G]: q int8 (Q8_0,
   Q5_0, Q5_1, Q5_K and Q6_K values) or 0..15 (Q4_0, Q4_1, Q4_K), a scale s per G = 16 or 32
   columns and, for the types with one, an offset o per group.

   Weights come in tiles of 16 rows. Per tile the values: int8 as [K / 2][16][2] (the 32 int16
   lanes of column pair p: row r's columns 2p and 2p + 1 side by side); 4-bit as [K / 4][32] bytes,
   byte j holding lane j of pair 2p in its low nibble and of pair 2p + 1 in its high one. Then the
   scales, [K / G][16], and the offsets likewise where there are some, in one of three forms (as
   exact as the file's, and as small): float32 (FORM_F32); float16 (FORM_F16: the legacy types,
   whose scales are float16 in the file); or per super-block of 256 columns a float16 factor
   [K / 256][16] (then the offsets' factors) and per group an int8 multiple of it [K / G][16] (then
   the offsets'): FORM_SUPER, the K types' own d * scale, exact in float32.

   Each input row is rounded per group to int16 with a float32 scale (the largest value maps to
   32767, 16383 for 4-bit values with VNNI: a relative error of about 1e-5 or 3e-5, far below
   bfloat16's), so a group's dot products are exact integer sums (at most 32 * 32767 * 128 < 2^31);
   each group adds its sum times both scales to a float32 total and takes away its offset times
   the group's sum of (rounded) inputs. The integer multiply-adds take 16 rows at a time (AVX-512;
   AVX2 in two halves; fused where the processor has VNNI); elsewhere the same arithmetic in plain
   C. The 4-bit values take another layout with VNNI (QUADS, below). */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512BW__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define TILE 16
#define FLIGHT 4 /* tiles multiplied together: independent chains of multiply-adds */
/* Bytes ahead in a tile that each step asks into the cache: a frame's weights come from memory or
   a far cache, and the processor's own prefetching left the multiply-adds waiting on them. */
#define AHEAD 2048
/* The kernels below are inlined with the count of tiles a constant (FLIGHT, else 1), so their
   accumulators stay in registers. */
#if defined(__GNUC__)
#define INLINED static inline __attribute__((always_inline))
#else
#define INLINED static inline
#endif

/* With VNNI the 4-bit values are multiplied as bytes, four columns a lane (u8 times s8 multiply-
   adds, no widening): a tile holds them as [K / 8][64] bytes, byte j holding row j / 4's column
   j % 4 of a quad of columns in its low nibble and of the next quad in its high one; the input is
   rounded to 15 bits and split into a signed high byte and a low 7 bits, x = 128 h + l. */
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define QUADS 1
#elif defined(__AVX2__) && !defined(__AVX512BW__) && defined(__AVXVNNI__)
#define QUADS 1
#else
#define QUADS 0
#endif

enum { FORM_F32 = 0, FORM_F16 = 1, FORM_SUPER = 2 }; /* how a tile holds its scales and offsets */
#define SUPER 256                                      /* columns of a super-block (FORM_SUPER) */

typedef struct {
    int64_t k, groups, bytes, value_bytes; /* columns, groups a row, bytes a tile, of its values */
    int64_t supers, super_bytes;           /* FORM_SUPER: super-blocks a row, bytes of their factors */
    int group, bits, offsets, form, per_super;
} shape;

static shape shape_of(int64_t k, int group, int bits, int offsets, int form) {
    const int parts = offsets ? 2 : 1;
    shape s = {k, k / group, 0, bits == 8 ? TILE * k : TILE * k / 2, 0, 0, group, bits, offsets, form, 0};
    if (form == FORM_SUPER) {
        s.supers = k / SUPER;
        s.per_super = SUPER / group;
        s.super_bytes = 2 * TILE * s.supers * parts;
        s.bytes = s.value_bytes + s.super_bytes + TILE * s.groups * parts;
    } else {
        s.bytes = s.value_bytes + TILE * s.groups * parts * (form == FORM_F16 ? 2 : 4);
    }
    return s;
}

/* An IEEE half as a float (every half, subnormals and NaN included, is a float exactly). */
static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF;
    uint32_t bits;
    if (exponent == 0x1F) {
        bits = sign | 0x7F800000u | (mantissa << 13);
    } else if (exponent) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else {
        float v = ldexpf((float)mantissa, -24);
        return sign ? -v : v;
    }
    float v;
    memcpy(&v, &bits, sizeof v);
    return v;
}

/* Row r's scale (part 0) or offset (part 1) of group g in a tile (plain C; the vector loads below
   compute the same float32 values). A super-block's factor times an int8 is exact in float32. */
static inline float scale_of(const int8_t *tile, const shape *s, int64_t g, int part, int r) {
    const int8_t *at = tile + s->value_bytes;
    uint16_t h;
    if (s->form == FORM_SUPER) {
        memcpy(&h, at + ((part * s->supers + g / s->per_super) * TILE + r) * 2, sizeof h);
        return half_to_float(h) * (float)at[s->super_bytes + (part * s->groups + g) * TILE + r];
    }
    if (s->form == FORM_F16) {
        memcpy(&h, at + ((part * s->groups + g) * TILE + r) * 2, sizeof h);
        return half_to_float(h);
    }
    float v;
    memcpy(&v, at + ((part * s->groups + g) * TILE + r) * 4, sizeof v);
    return v;
}

#if defined(__AVX512BW__)
/* The 16 rows' scales (part 0) or offsets (part 1) of group g in a tile. */
static inline __m512 scales16(const int8_t *tile, const shape *s, int64_t g, int part) {
    const int8_t *at = tile + s->value_bytes;
    if (s->form == FORM_SUPER) {
        const int8_t *factor = at + (part * s->supers + g / s->per_super) * TILE * 2;
        __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)factor));
        __m128i q = _mm_loadu_si128((const __m128i *)(at + s->super_bytes + (part * s->groups + g) * TILE));
        return _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)));
    }
    if (s->form == FORM_F16)
        return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(at + (part * s->groups + g) * TILE * 2)));
    return _mm512_loadu_ps((const float *)(at + (part * s->groups + g) * TILE * 4));
}
#elif defined(__AVX2__)
/* Rows 8 h .. 8 h + 7 of the scales (part 0) or offsets (part 1) of group g in a tile. */
static inline __m256 scales8(const int8_t *tile, const shape *s, int64_t g, int part, int h) {
    const int8_t *at = tile + s->value_bytes;
    if (s->form == FORM_F32) return _mm256_loadu_ps((const float *)(at + ((part * s->groups + g) * TILE + 8 * h) * 4));
#if defined(__F16C__)
    if (s->form == FORM_SUPER) {
        const int8_t *factor = at + ((part * s->supers + g / s->per_super) * TILE + 8 * h) * 2;
        __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)factor));
        __m128i q = _mm_loadl_epi64((const __m128i *)(at + s->super_bytes + (part * s->groups + g) * TILE + 8 * h));
        return _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
    }
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(at + ((part * s->groups + g) * TILE + 8 * h) * 2)));
#else
    float v[8];
    for (int r = 0; r < 8; r++) v[r] = scale_of(tile, s, g, part, 8 * h + r);
    return _mm256_loadu_ps(v);
#endif
}
#endif

/* A block holding a NaN or an infinity gets a NaN scale: its rows' outputs are NaN, as a float
   product's would be, so a diverging run is caught downstream. */
static void round_rows(const float *x, int64_t m, shape s, int16_t *xq, float *dx, float *sums) {
    const float limit = QUADS && s.bits == 4 ? 16383.f : 32767.f;
    for (int64_t b = 0; b < m * s.groups; b++) {
        const float *v = x + b * s.group;
        int16_t *q = xq + b * s.group;
        float top = 0.f;
        int finite = 1;
#if defined(__AVX2__)
        /* eight at a time, the same values: a maximum is exact in any order */
        const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
        __m256 most = _mm256_setzero_ps();
        for (int j = 0; j < s.group; j += 8) {
            __m256 a = _mm256_and_ps(_mm256_loadu_ps(v + j), magnitude);
            finite &= _mm256_movemask_ps(_mm256_cmp_ps(a, _mm256_set1_ps(INFINITY), _CMP_LT_OQ)) == 0xFF;
            most = _mm256_max_ps(most, a);
        }
        __m128 half = _mm_max_ps(_mm256_castps256_ps128(most), _mm256_extractf128_ps(most, 1));
        half = _mm_max_ps(half, _mm_movehl_ps(half, half));
        top = _mm_cvtss_f32(_mm_max_ss(half, _mm_shuffle_ps(half, half, 1)));
#else
        for (int j = 0; j < s.group; j++) {
            finite &= isfinite(v[j]) != 0;
            top = fmaxf(top, fabsf(v[j]));
        }
#endif
        if (!finite) {
            dx[b] = sums[b] = NAN;
            for (int j = 0; j < s.group; j++) q[j] = 0;
            continue;
        }
        /* a group too small for its scale to be a normal float (below about 1e-34) counts as zero */
        float d = top >= FLT_MIN * limit ? top / limit : 0.f, inv = d > 0.f ? 1.f / d : 0.f;
        int32_t sum = 0;
        dx[b] = d;
#if defined(__AVX2__)
        /* v * inv rounded to the nearest, ties to even, as lrintf in the default rounding mode */
        __m256i total = _mm256_setzero_si256();
        for (int j = 0; j < s.group; j += 8) {
            __m256i r = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + j), _mm256_set1_ps(inv)));
            total = _mm256_add_epi32(total, r);
            _mm_storeu_si128((__m128i *)(q + j), _mm_packs_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
        }
        __m128i four = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
        four = _mm_add_epi32(four, _mm_shuffle_epi32(four, 0x4E));
        sum = _mm_cvtsi128_si32(_mm_add_epi32(four, _mm_shuffle_epi32(four, 0xB1)));
#else
        for (int j = 0; j < s.group; j++) {
            q[j] = (int16_t)lrintf(v[j] * inv);
            sum += q[j];
        }
#endif
        sums[b] = (float)sum * dx[b]; /* the rounded inputs' sum: the product is exact for them */
    }
}

/* Two int16 inputs side by side as one int32 (a copy: no aliasing of the int16 array). */
static inline int32_t pair_at(const int16_t *xq, int64_t index) {
    int32_t v;
    memcpy(&v, xq + 2 * index, sizeof v);
    return v;
}

/* The value lane j (0..31) of column pair p in a tile's values (plain C). */
static inline int32_t lane(const int8_t *values, shape s, int64_t p, int j) {
    if (s.bits == 8) return values[p * 32 + j];
    uint8_t byte = (uint8_t)values[(p / 2) * 32 + j];
    return (p & 1) ? byte >> 4 : byte & 15;
}

#if QUADS
/* The 4-bit tiles with VNNI: rows i0 and i1 (their high and low bytes `hi`, `lo`, four columns an
   int32) times tiles t0 .. t0 + nt - 1. */
INLINED void quad_tiles(const int8_t *w, const int32_t *hi, const int32_t *lo, const float *dx, const float *sums,
                       float *y, int64_t n, shape s, int64_t t0, int nt, int64_t i0, int64_t i1) {
    const int quads = s.group / 4;
    const int32_t *h0 = hi + i0 * (s.k / 4), *h1 = hi + i1 * (s.k / 4);
    const int32_t *l0 = lo + i0 * (s.k / 4), *l1 = lo + i1 * (s.k / 4);
#if defined(__AVX512BW__)
#define QV __m512i
#define QF __m512
#define QZERO _mm512_setzero_si512()
#define QSET1 _mm512_set1_epi32
#define QLOAD(p) _mm512_loadu_si512((const void *)(p))
#define QAND _mm512_and_si512
#define QSRL _mm512_srli_epi16
#define QDOT _mm512_dpbusd_epi32
#define QCOMBINE(h, l) _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(h, 7), l))
#define QSCALES(tile, s, g, part, v) scales16(tile, s, g, part)
#define QSET1F _mm512_set1_ps
#define QFMA _mm512_fmadd_ps
#define QFNMA _mm512_fnmadd_ps
#define QMUL _mm512_mul_ps
#define QZEROF _mm512_setzero_ps()
#define QSTORE _mm512_storeu_ps
#define HALVES 1
#define LANES 16
#else
#define QV __m256i
#define QF __m256
#define QZERO _mm256_setzero_si256()
#define QSET1 _mm256_set1_epi32
#define QLOAD(p) _mm256_loadu_si256((const __m256i *)(p))
#define QAND _mm256_and_si256
#define QSRL _mm256_srli_epi16
#define QDOT _mm256_dpbusd_avx_epi32
#define QCOMBINE(h, l) _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_slli_epi32(h, 7), l))
#define QSCALES scales8
#define QSET1F _mm256_set1_ps
#define QFMA _mm256_fmadd_ps
#define QFNMA _mm256_fnmadd_ps
#define QMUL _mm256_mul_ps
#define QZEROF _mm256_setzero_ps()
#define QSTORE _mm256_storeu_ps
#define HALVES 2
#define LANES 8
#endif
    const QV low = QSET1(0x0F0F0F0F);
    QF acc0[FLIGHT][HALVES], acc1[FLIGHT][HALVES];
    for (int t = 0; t < FLIGHT; t++)
        for (int v = 0; v < HALVES; v++) acc0[t][v] = acc1[t][v] = QZEROF;
    for (int64_t g = 0; g < s.groups; g++) {
        QV a0[FLIGHT][HALVES], b0[FLIGHT][HALVES], a1[FLIGHT][HALVES], b1[FLIGHT][HALVES]; /* high, low sums */
        for (int t = 0; t < FLIGHT; t++)
            for (int v = 0; v < HALVES; v++) a0[t][v] = b0[t][v] = a1[t][v] = b1[t][v] = QZERO;
        for (int c = 0; c < quads; c += 2) {
            const int64_t at = g * quads + c;
            QV hx0 = QSET1(h0[at]), hy0 = QSET1(h0[at + 1]), lx0 = QSET1(l0[at]), ly0 = QSET1(l0[at + 1]);
            QV hx1 = QSET1(h1[at]), hy1 = QSET1(h1[at + 1]), lx1 = QSET1(l1[at]), ly1 = QSET1(l1[at + 1]);
            for (int t = 0; t < nt; t++) {
                const int8_t *q = w + (t0 + t) * s.bytes + at / 2 * 64;
                __builtin_prefetch(q + AHEAD, 0, 3);
                for (int v = 0; v < HALVES; v++) {
                    QV raw = QLOAD(q + v * (64 / HALVES));
                    QV first = QAND(raw, low), second = QAND(QSRL(raw, 4), low);
                    a0[t][v] = QDOT(QDOT(a0[t][v], first, hx0), second, hy0);
                    b0[t][v] = QDOT(QDOT(b0[t][v], first, lx0), second, ly0);
                    a1[t][v] = QDOT(QDOT(a1[t][v], first, hx1), second, hy1);
                    b1[t][v] = QDOT(QDOT(b1[t][v], first, lx1), second, ly1);
                }
            }
        }
        QF d0 = QSET1F(dx[i0 * s.groups + g]), d1 = QSET1F(dx[i1 * s.groups + g]);
        QF m0 = QSET1F(sums[i0 * s.groups + g]), m1 = QSET1F(sums[i1 * s.groups + g]);
        for (int t = 0; t < nt; t++) {
            const int8_t *tile = w + (t0 + t) * s.bytes;
            for (int v = 0; v < HALVES; v++) {
                QF scale = QSCALES(tile, &s, g, 0, v);
                acc0[t][v] = QFMA(QCOMBINE(a0[t][v], b0[t][v]), QMUL(scale, d0), acc0[t][v]);
                acc1[t][v] = QFMA(QCOMBINE(a1[t][v], b1[t][v]), QMUL(scale, d1), acc1[t][v]);
                if (s.offsets) {
                    QF offset = QSCALES(tile, &s, g, 1, v);
                    acc0[t][v] = QFNMA(offset, m0, acc0[t][v]);
                    acc1[t][v] = QFNMA(offset, m1, acc1[t][v]);
                }
            }
        }
    }
    for (int t = 0; t < nt; t++)
        for (int v = 0; v < HALVES; v++) {
            QSTORE(y + i0 * n + (t0 + t) * TILE + v * LANES, acc0[t][v]);
            QSTORE(y + i1 * n + (t0 + t) * TILE + v * LANES, acc1[t][v]);
        }
}

/* Each row's rounded inputs as bytes, four columns an int32: the high ones (x >> 7, signed) and
   the low 7 bits. */
static void split_rows(const int16_t *xq, int64_t count, int32_t *hi, int32_t *lo) {
    int64_t c = 0;
    /* eight at a time: the high bytes fit an int8 (the 4-bit inputs are at most 16383), so packing
       with saturation keeps them; packing works within 128-bit lanes, the permute puts them in order */
    for (; c + 8 <= count; c += 8) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(xq + 4 * c)), b = _mm256_loadu_si256((const __m256i *)(xq + 4 * c + 16));
        __m256i h = _mm256_packs_epi16(_mm256_srai_epi16(a, 7), _mm256_srai_epi16(b, 7));
        __m256i l = _mm256_packs_epi16(_mm256_and_si256(a, _mm256_set1_epi16(127)), _mm256_and_si256(b, _mm256_set1_epi16(127)));
        _mm256_storeu_si256((__m256i *)(hi + c), _mm256_permute4x64_epi64(h, 0xD8));
        _mm256_storeu_si256((__m256i *)(lo + c), _mm256_permute4x64_epi64(l, 0xD8));
    }
    for (; c < count; c++) {
        uint32_t h = 0, l = 0;
        for (int j = 0; j < 4; j++) {
            int32_t v = xq[4 * c + j];
            h |= (uint32_t)(uint8_t)(int8_t)(v >> 7) << (8 * j);
            l |= (uint32_t)(v & 127) << (8 * j);
        }
        hi[c] = (int32_t)h;
        lo[c] = (int32_t)l;
    }
}
#endif

/* Rows i0 and i1 of the input (the same row twice when one is left) times tiles t0 .. t0 + nt - 1. */
INLINED void tiles(const int8_t *w, const int16_t *xq, const float *dx, const float *sums, float *y, int64_t n,
                  shape s, int64_t t0, int nt, int64_t i0, int64_t i1) {
    const int pairs = s.group / 2;
    const int16_t *x0 = xq + i0 * s.k, *x1 = xq + i1 * s.k;
#if defined(__AVX512BW__)
    __m512 acc0[FLIGHT], acc1[FLIGHT];
    for (int t = 0; t < FLIGHT; t++) acc0[t] = acc1[t] = _mm512_setzero_ps();
    const __m256i low = _mm256_set1_epi8(15);
    for (int64_t g = 0; g < s.groups; g++) {
        __m512i s0[FLIGHT], s1[FLIGHT];
        for (int t = 0; t < FLIGHT; t++) s0[t] = s1[t] = _mm512_setzero_si512();
#if defined(__AVX512VNNI__)
#define DOT512(acc, v, x) _mm512_dpwssd_epi32(acc, v, x)
#else
#define DOT512(acc, v, x) _mm512_add_epi32(acc, _mm512_madd_epi16(v, x))
#endif
        if (s.bits == 8) {
            for (int p = 0; p < pairs; p++) {
                const int64_t at = g * pairs + p;
                __m512i a = _mm512_set1_epi32(pair_at(x0, at)), b = _mm512_set1_epi32(pair_at(x1, at));
                for (int t = 0; t < nt; t++) {
                    const int8_t *q = w + (t0 + t) * s.bytes + (g * pairs + p) * 32;
                    if (!(p & 1)) __builtin_prefetch(q + AHEAD, 0, 3); /* a line every two steps */
                    __m512i v = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)q));
                    s0[t] = DOT512(s0[t], v, a);
                    s1[t] = DOT512(s1[t], v, b);
                }
            }
        } else {
            for (int p = 0; p < pairs; p += 2) {
                const int64_t at = g * pairs + p;
                __m512i a = _mm512_set1_epi32(pair_at(x0, at)), b = _mm512_set1_epi32(pair_at(x1, at));
                __m512i c = _mm512_set1_epi32(pair_at(x0, at + 1)), d = _mm512_set1_epi32(pair_at(x1, at + 1));
                for (int t = 0; t < nt; t++) {
                    const int8_t *q = w + (t0 + t) * s.bytes + (g * pairs + p) / 2 * 32;
                    __builtin_prefetch(q + AHEAD, 0, 3);
                    __m256i raw = _mm256_loadu_si256((const __m256i *)q);
                    __m512i v = _mm512_cvtepu8_epi16(_mm256_and_si256(raw, low));
                    __m512i u = _mm512_cvtepu8_epi16(_mm256_and_si256(_mm256_srli_epi16(raw, 4), low));
                    s0[t] = DOT512(DOT512(s0[t], v, a), u, c);
                    s1[t] = DOT512(DOT512(s1[t], v, b), u, d);
                }
            }
        }
        __m512 d0 = _mm512_set1_ps(dx[i0 * s.groups + g]), d1 = _mm512_set1_ps(dx[i1 * s.groups + g]);
        for (int t = 0; t < nt; t++) {
            const int8_t *tile = w + (t0 + t) * s.bytes;
            __m512 scale = scales16(tile, &s, g, 0);
            acc0[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0[t]), _mm512_mul_ps(scale, d0), acc0[t]);
            acc1[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1[t]), _mm512_mul_ps(scale, d1), acc1[t]);
            if (s.offsets) {
                __m512 offset = scales16(tile, &s, g, 1);
                acc0[t] = _mm512_fnmadd_ps(offset, _mm512_set1_ps(sums[i0 * s.groups + g]), acc0[t]);
                acc1[t] = _mm512_fnmadd_ps(offset, _mm512_set1_ps(sums[i1 * s.groups + g]), acc1[t]);
            }
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
    const __m128i low = _mm_set1_epi8(15);
#if defined(__AVXVNNI__)
#define DOT256(acc, v, x) _mm256_dpwssd_avx_epi32(acc, v, x)
#else
#define DOT256(acc, v, x) _mm256_add_epi32(acc, _mm256_madd_epi16(v, x))
#endif
    for (int64_t g = 0; g < s.groups; g++) {
        __m256i s0[FLIGHT][2], s1[FLIGHT][2];
        for (int t = 0; t < FLIGHT; t++)
            for (int h = 0; h < 2; h++) s0[t][h] = s1[t][h] = _mm256_setzero_si256();
        if (s.bits == 8) {
            for (int p = 0; p < pairs; p++) {
                const int64_t at = g * pairs + p;
                __m256i a = _mm256_set1_epi32(pair_at(x0, at)), b = _mm256_set1_epi32(pair_at(x1, at));
                for (int t = 0; t < nt; t++) {
                    const int8_t *q = w + (t0 + t) * s.bytes + (g * pairs + p) * 32;
                    if (!(p & 1)) __builtin_prefetch(q + AHEAD, 0, 3); /* a line every two steps */
                    for (int h = 0; h < 2; h++) {
                        __m256i v = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(q + 16 * h)));
                        s0[t][h] = DOT256(s0[t][h], v, a);
                        s1[t][h] = DOT256(s1[t][h], v, b);
                    }
                }
            }
        } else {
            for (int p = 0; p < pairs; p += 2) {
                const int64_t at = g * pairs + p;
                __m256i a = _mm256_set1_epi32(pair_at(x0, at)), b = _mm256_set1_epi32(pair_at(x1, at));
                __m256i c = _mm256_set1_epi32(pair_at(x0, at + 1)), d = _mm256_set1_epi32(pair_at(x1, at + 1));
                for (int t = 0; t < nt; t++) {
                    const int8_t *q = w + (t0 + t) * s.bytes + (g * pairs + p) / 2 * 32;
                    __builtin_prefetch(q + AHEAD, 0, 3);
                    for (int h = 0; h < 2; h++) {
                        __m128i raw = _mm_loadu_si128((const __m128i *)(q + 16 * h));
                        __m256i v = _mm256_cvtepu8_epi16(_mm_and_si128(raw, low));
                        __m256i u = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), low));
                        s0[t][h] = DOT256(DOT256(s0[t][h], v, a), u, c);
                        s1[t][h] = DOT256(DOT256(s1[t][h], v, b), u, d);
                    }
                }
            }
        }
        __m256 d0 = _mm256_set1_ps(dx[i0 * s.groups + g]), d1 = _mm256_set1_ps(dx[i1 * s.groups + g]);
        for (int t = 0; t < nt; t++) {
            const int8_t *tile = w + (t0 + t) * s.bytes;
            for (int h = 0; h < 2; h++) {
                __m256 scale = scales8(tile, &s, g, 0, h);
                acc0[t][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0[t][h]), _mm256_mul_ps(scale, d0), acc0[t][h]);
                acc1[t][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1[t][h]), _mm256_mul_ps(scale, d1), acc1[t][h]);
                if (s.offsets) {
                    __m256 offset = scales8(tile, &s, g, 1, h);
                    acc0[t][h] = _mm256_fnmadd_ps(offset, _mm256_set1_ps(sums[i0 * s.groups + g]), acc0[t][h]);
                    acc1[t][h] = _mm256_fnmadd_ps(offset, _mm256_set1_ps(sums[i1 * s.groups + g]), acc1[t][h]);
                }
            }
        }
    }
    for (int t = 0; t < nt; t++)
        for (int h = 0; h < 2; h++) {
            _mm256_storeu_ps(y + i0 * n + (t0 + t) * TILE + 8 * h, acc0[t][h]);
            _mm256_storeu_ps(y + i1 * n + (t0 + t) * TILE + 8 * h, acc1[t][h]);
        }
#else
    (void)x0;
    (void)x1;
    (void)pairs;
    for (int t = 0; t < nt; t++) {
        const int8_t *values = w + (t0 + t) * s.bytes;
        for (int r = 0; r < TILE; r++) {
            float acc0 = 0.f, acc1 = 0.f;
            for (int64_t g = 0; g < s.groups; g++) {
                int32_t s0 = 0, s1 = 0;
                for (int j = 0; j < s.group; j++) {
                    int64_t col = g * s.group + j;
                    int32_t v = lane(values, s, col / 2, r * 2 + (int)(col & 1));
                    s0 += v * xq[i0 * s.k + col];
                    s1 += v * xq[i1 * s.k + col];
                }
                const float scale = scale_of(values, &s, g, 0, r);
                acc0 += (float)s0 * (scale * dx[i0 * s.groups + g]);
                acc1 += (float)s1 * (scale * dx[i1 * s.groups + g]);
                if (s.offsets) {
                    const float offset = scale_of(values, &s, g, 1, r);
                    acc0 -= offset * sums[i0 * s.groups + g];
                    acc1 -= offset * sums[i1 * s.groups + g];
                }
            }
            y[i0 * n + (t0 + t) * TILE + r] = acc0;
            y[i1 * n + (t0 + t) * TILE + r] = acc1;
        }
    }
#endif
}

/* x [m, k] float32, w: n / 16 tiles (n a multiple of 16, k of the group: 16 or 32 values a scale;
   of 256 for FORM_SUPER), bits 8 or 4, offsets 0 or 1, form FORM_*, y [m, n] float32. Returns 0, -1
   when the scratch rows cannot be allocated, -2 for a group, bits, form or k it does not take. */
int mm3_integer_product(const float *x, const int8_t *w, float *y, int64_t m, int64_t n, int64_t k, int group,
                        int bits, int offsets, int form, int threads) {
    if ((group != 16 && group != 32) || (bits != 8 && bits != 4) || k % group || form < FORM_F32 ||
        form > FORM_SUPER || (form == FORM_SUPER && k % SUPER))
        return -2;
    const shape s = shape_of(k, group, bits, offsets, form);
    int16_t *xq = malloc(sizeof(int16_t) * m * k);
    float *dx = malloc(sizeof(float) * m * s.groups), *sums = malloc(sizeof(float) * m * s.groups);
    if (!xq || !dx || !sums) {
        free(xq);
        free(dx);
        free(sums);
        return -1;
    }
    round_rows(x, m, s, xq, dx, sums);
    int32_t *hi = NULL, *lo = NULL;
#if QUADS
    if (s.bits == 4) {
        hi = malloc(sizeof(int32_t) * m * (k / 4));
        lo = malloc(sizeof(int32_t) * m * (k / 4));
        if (!hi || !lo) {
            free(hi);
            free(lo);
            free(xq);
            free(dx);
            free(sums);
            return -1;
        }
        split_rows(xq, m * (k / 4), hi, lo);
    }
#endif
    const int64_t count = n / TILE, runs = (count + FLIGHT - 1) / FLIGHT;
#pragma omp parallel for num_threads(threads > 0 ? threads : 1) schedule(static)
    for (int64_t r = 0; r < runs; r++) {
        int64_t t0 = r * FLIGHT;
        int nt = count - t0 < FLIGHT ? (int)(count - t0) : FLIGHT;
        for (int64_t i = 0; i < m; i += 2) {
            int64_t i1 = i + 1 < m ? i + 1 : i;
#if QUADS
            if (s.bits == 4) {
                if (nt == FLIGHT)
                    quad_tiles(w, hi, lo, dx, sums, y, n, s, t0, FLIGHT, i, i1);
                else
                    for (int t = 0; t < nt; t++) quad_tiles(w, hi, lo, dx, sums, y, n, s, t0 + t, 1, i, i1);
                continue;
            }
#endif
            if (nt == FLIGHT)
                tiles(w, xq, dx, sums, y, n, s, t0, FLIGHT, i, i1);
            else
                for (int t = 0; t < nt; t++) tiles(w, xq, dx, sums, y, n, s, t0 + t, 1, i, i1);
        }
    }
    free(hi);
    free(lo);
    free(xq);
    free(dx);
    free(sums);
    return 0;
}

/* Whether this build holds 4-bit values in quads of columns (VNNI) rather than pairs. */
int mm3_integer_nibble_quads(void) { return QUADS; }

/* What this build multiplies with: 512 (AVX-512), 256 (AVX2) or 0 (plain C). */
int mm3_integer_vector_bits(void) {
#if defined(__AVX512BW__)
    return 512;
#elif defined(__AVX2__)
    return 256;
#else
    return 0;
#endif
}

/* GGUF block types that mm3_dequantize_rows reads (ggml's numbering). */
enum { TYPE_Q4_0 = 2, TYPE_Q8_0 = 8, TYPE_Q4_K = 12, TYPE_Q5_K = 13, TYPE_Q6_K = 14 };

/* The 6-bit scale and min j (0..7) of a Q4_K / Q5_K block's 12 packed bytes. */
static void k4_scale_min(const uint8_t *q, int j, float *scale, float *min) {
    if (j < 4) {
        *scale = (float)(q[j] & 63);
        *min = (float)(q[j + 4] & 63);
    } else {
        *scale = (float)((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
        *min = (float)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

static float half_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
    return half_to_float(h);
}

/* One block of 32 (Q4_0, Q8_0) or 256 (the K types) values as float32, each with the arithmetic of
   mm3.gguf.quants (a scale times a factor exact in float32, then one rounding), bit for bit. */
static void dequantize_block(const uint8_t *b, int type, float *y) {
    if (type == TYPE_Q8_0) {
        const float d = half_at(b);
        for (int j = 0; j < 32; j++) y[j] = (float)(int8_t)b[2 + j] * d;
    } else if (type == TYPE_Q4_0) {
        const float d = half_at(b);
        for (int j = 0; j < 16; j++) {
            y[j] = (float)((b[2 + j] & 0xF) - 8) * d;
            y[j + 16] = (float)((b[2 + j] >> 4) - 8) * d;
        }
    } else if (type == TYPE_Q4_K || type == TYPE_Q5_K) { /* d, dmin, scales[12], (qh[32],) qs[128] */
        const float d = half_at(b), dmin = half_at(b + 2);
        const uint8_t *qh = b + 16, *qs = b + (type == TYPE_Q5_K ? 48 : 16);
        for (int c = 0; c < 4; c++) { /* 64 values: byte k of the chunk's 32 holds values k and 32 + k */
            float s0, m0, s1, m1;
            k4_scale_min(b + 4, 2 * c, &s0, &m0);
            k4_scale_min(b + 4, 2 * c + 1, &s1, &m1);
            const float f0 = d * s0, o0 = dmin * m0, f1 = d * s1, o1 = dmin * m1;
            for (int k = 0; k < 32; k++) {
                int low = qs[32 * c + k] & 0xF, high = qs[32 * c + k] >> 4;
                if (type == TYPE_Q5_K) {
                    low |= ((qh[k] >> (2 * c)) & 1) << 4;
                    high |= ((qh[k] >> (2 * c + 1)) & 1) << 4;
                }
                y[64 * c + k] = (float)low * f0 - o0;
                y[64 * c + 32 + k] = (float)high * f1 - o1;
            }
        }
    } else { /* Q6_K: ql[128], qh[64], scales[16] int8, d */
        const float d = half_at(b + 208);
        for (int h = 0; h < 2; h++) {
            const uint8_t *ql = b + 64 * h, *qh = b + 128 + 32 * h;
            const int8_t *sc = (const int8_t *)(b + 192) + 8 * h;
            for (int k = 0; k < 32; k++) {
                const int q1 = ((ql[k] & 0xF) | (((qh[k] >> 0) & 3) << 4)) - 32;
                const int q2 = ((ql[k + 32] & 0xF) | (((qh[k] >> 2) & 3) << 4)) - 32;
                const int q3 = ((ql[k] >> 4) | (((qh[k] >> 4) & 3) << 4)) - 32;
                const int q4 = ((ql[k + 32] >> 4) | (((qh[k] >> 6) & 3) << 4)) - 32;
                const int is = k / 16;
                float *out = y + 128 * h;
                out[k] = (float)q1 * (d * (float)sc[is]);
                out[k + 32] = (float)q2 * (d * (float)sc[is + 2]);
                out[k + 64] = (float)q3 * (d * (float)sc[is + 4]);
                out[k + 96] = (float)q4 * (d * (float)sc[is + 6]);
            }
        }
    }
}

/* Rows `ids` (count of them) of a table of `rows` rows of GGUF blocks, `row_bytes` a row of k
   values, into y [count, k] float32 (an embedding lookup). Returns 0, -2 for a type it does not
   read or a k that is no whole number of blocks, -3 for an id outside the table (nothing read). */
int mm3_dequantize_rows(const uint8_t *table, int type, int64_t rows, int64_t row_bytes, int64_t k,
                        const int64_t *ids, int64_t count, float *y) {
    int block, bytes;
    switch (type) {
    case TYPE_Q8_0: block = 32, bytes = 34; break;
    case TYPE_Q4_0: block = 32, bytes = 18; break;
    case TYPE_Q4_K: block = 256, bytes = 144; break;
    case TYPE_Q5_K: block = 256, bytes = 176; break;
    case TYPE_Q6_K: block = 256, bytes = 210; break;
    default: return -2;
    }
    if (k % block || row_bytes != k / block * bytes) return -2;
    for (int64_t i = 0; i < count; i++)
        if (ids[i] < 0 || ids[i] >= rows) return -3;
    for (int64_t i = 0; i < count; i++)
        for (int64_t j = 0; j < k / block; j++)
            dequantize_block(table + ids[i] * row_bytes + j * bytes, type, y + i * k + j * block);
    return 0;
}

/* An exact float as an IEEE half's bits, or -1 where it is none (out of range, a lost bit, NaN). */
static int32_t half_bits_exact(float v) {
    if (isnan(v)) return -1;
    uint32_t bits;
    memcpy(&bits, &v, sizeof bits);
    const uint32_t sign = (bits >> 16) & 0x8000;
    const float a = fabsf(v);
    if (a == 0.f) return (int32_t)sign;
    if (isinf(a)) return (int32_t)(sign | 0x7C00);
    int e;
    const float m = frexpf(a, &e); /* a = m 2^e, 0.5 <= m < 1 */
    if (e > 16) return -1;        /* beyond 65504 */
    if (e >= -13) {               /* normal: 11 significant bits */
        const float scaled = ldexpf(m, 11);
        if (scaled != floorf(scaled)) return -1;
        return (int32_t)(sign | ((uint32_t)(e + 14) << 10) | ((uint32_t)scaled - 1024));
    }
    const float steps = ldexpf(a, 24); /* subnormal: a multiple of 2^-24 */
    if (steps != floorf(steps) || steps >= 1024.f) return -1;
    return (int32_t)(sign | (uint32_t)steps);
}

/* Where one row's scale sections go in a tile (`mm3.gguf.cpu_native._tile`): after the values,
   each section [columns][16] of its element size. */
typedef struct {
    int64_t offsets[4];
    int sizes[4];
} tile_plan;

static inline void put_section(int8_t *tile, const tile_plan *p, int section, int r, int64_t column, const void *v) {
    memcpy(tile + p->offsets[section] + (column * TILE + r) * p->sizes[section], v, p->sizes[section]);
}

/* One block of row r: its values into q (k int8 values a row, 0..15 for 4-bit types) and its
   scale sections into the tile. Returns -4 where a Q4_0 offset (8 d) is no float16. */
static int repack_block(const uint8_t *b, int type, int64_t j, int r, int8_t *q, int8_t *tile, const tile_plan *p) {
    if (type == TYPE_Q8_0) {
        memcpy(q, b + 2, 32);
        put_section(tile, p, 0, r, j, b);
    } else if (type == TYPE_Q4_0) {
        for (int i = 0; i < 16; i++) q[i] = (int8_t)(b[2 + i] & 15), q[16 + i] = (int8_t)(b[2 + i] >> 4);
        const int32_t offset = half_bits_exact(8.f * half_at(b));
        if (offset < 0) return -4;
        const uint16_t o = (uint16_t)offset;
        put_section(tile, p, 0, r, j, b);
        put_section(tile, p, 1, r, j, &o);
    } else if (type == TYPE_Q6_K) {
        for (int h = 0; h < 2; h++) {
            const uint8_t *ql = b + 64 * h, *qh = b + 128 + 32 * h;
            int8_t *out = q + 128 * h;
            for (int i = 0; i < 32; i++) {
                out[i] = (int8_t)(((ql[i] & 15) | ((qh[i] & 3) << 4)) - 32);
                out[i + 32] = (int8_t)(((ql[i + 32] & 15) | (((qh[i] >> 2) & 3) << 4)) - 32);
                out[i + 64] = (int8_t)(((ql[i] >> 4) | (((qh[i] >> 4) & 3) << 4)) - 32);
                out[i + 96] = (int8_t)(((ql[i + 32] >> 4) | (((qh[i] >> 6) & 3) << 4)) - 32);
            }
        }
        put_section(tile, p, 0, r, j, b + 208);
        for (int i = 0; i < 16; i++) put_section(tile, p, 1, r, j * 16 + i, b + 192 + i);
    } else { /* Q4_K, Q5_K: d, dmin, scales[12], (qh[32],) qs[128] */
        const uint8_t *qh = b + 16, *qs = b + (type == TYPE_Q5_K ? 48 : 16);
        for (int c = 0; c < 4; c++)
            for (int i = 0; i < 32; i++) {
                int low = qs[32 * c + i] & 15, high = qs[32 * c + i] >> 4;
                if (type == TYPE_Q5_K) {
                    low |= ((qh[i] >> (2 * c)) & 1) << 4;
                    high |= ((qh[i] >> (2 * c + 1)) & 1) << 4;
                }
                q[64 * c + i] = (int8_t)low;
                q[64 * c + 32 + i] = (int8_t)high;
            }
        put_section(tile, p, 0, r, j, b);
        put_section(tile, p, 1, r, j, b + 2);
        for (int g = 0; g < 8; g++) {
            float scale, min;
            k4_scale_min(b + 4, g, &scale, &min);
            const int8_t steps[2] = {(int8_t)scale, (int8_t)min};
            put_section(tile, p, 2, r, j * 8 + g, &steps[0]);
            put_section(tile, p, 3, r, j * 8 + g, &steps[1]);
        }
    }
    return 0;
}

/* A tile's 16 rows of values q [16][k] into its layout: [k / width][16][width] bytes, 4-bit ones
   two lanes a byte (the first in the low nibble). */
static void put_values(const int8_t *q, int64_t k, int bits, int width, int8_t *tile) {
    if (bits == 8) {
        for (int64_t lane = 0; lane < k / width; lane++)
            for (int r = 0; r < TILE; r++)
                memcpy(tile + (lane * TILE + r) * width, q + r * k + lane * width, width);
        return;
    }
    for (int64_t pair = 0; pair < k / (2 * width); pair++)
        for (int r = 0; r < TILE; r++)
            for (int e = 0; e < width; e++) {
                const int8_t *v = q + r * k + 2 * pair * width + e;
                tile[(pair * TILE + r) * width + e] = (int8_t)((v[0] & 15) | (v[width] << 4));
            }
}

/* GGUF block rows [n][row bytes] of Q8_0 or Q4_0 (float16 scales: FORM_F16) or of Q4_K, Q5_K or
   Q6_K (FORM_SUPER) -> the kernel's tiles [n / 16 (up)][tile bytes], zero rows up to whole tiles;
   `quads`: 4-bit values in quads of columns (a VNNI build's layout), else pairs. The same bytes as
   the Python repacking (`cpu_native.repack`), a tile a thread. Returns 0; -1 without scratch; -2
   for a type or k it does not take; -4 where a Q4_0 offset (8 d) is no float16 (the float32 form
   then serves). */
int mm3_repack(const uint8_t *blocks, int type, int64_t n, int64_t k, int quads, int8_t *out, int threads) {
    int block, bytes, bits, group, offsets;
    switch (type) {
    case TYPE_Q8_0: block = 32, bytes = 34, bits = 8, group = 32, offsets = 0; break;
    case TYPE_Q4_0: block = 32, bytes = 18, bits = 4, group = 32, offsets = 1; break;
    case TYPE_Q4_K: block = 256, bytes = 144, bits = 4, group = 32, offsets = 1; break;
    case TYPE_Q5_K: block = 256, bytes = 176, bits = 8, group = 32, offsets = 1; break;
    case TYPE_Q6_K: block = 256, bytes = 210, bits = 8, group = 16, offsets = 0; break;
    default: return -2;
    }
    if (k <= 0 || k % block) return -2;
    const int super = block == 256, parts = offsets ? 2 : 1, width = bits == 4 && quads ? 4 : 2;
    const int64_t blocks_a_row = k / block, groups = k / group, row_bytes = blocks_a_row * bytes;
    tile_plan p = {{0}, {0}};
    int64_t at = TILE * k * bits / 8;
    for (int i = 0; i < (super ? 2 * parts : parts); i++) { /* super: the float16 factors, then the int8 steps */
        const int factor = super && i < parts;
        p.offsets[i] = at;
        p.sizes[i] = super && !factor ? 1 : 2;
        at += TILE * (factor ? blocks_a_row : groups) * p.sizes[i];
    }
    const int64_t tile_size = at, tiles = (n + TILE - 1) / TILE;
    int status = 0;
#pragma omp parallel num_threads(threads > 0 ? threads : 1) reduction(min : status)
    {
        int8_t *q = malloc((size_t)(TILE * k));
        if (!q) status = -1;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            if (!q) continue;
            int8_t *tile = out + t * tile_size;
            memset(tile, 0, (size_t)tile_size);
            memset(q, 0, (size_t)(TILE * k));
            for (int r = 0; r < TILE && t * TILE + r < n; r++)
                for (int64_t j = 0; j < blocks_a_row; j++) {
                    const int done = repack_block(blocks + (t * TILE + r) * row_bytes + j * bytes, type, j, r,
                                                  q + r * k + j * block, tile, &p);
                    if (done < status) status = done;
                }
            put_values(q, k, bits, width, tile);
        }
        free(q);
    }
    return status;
}
