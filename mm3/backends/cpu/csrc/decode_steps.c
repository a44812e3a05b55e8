/* An AR decode step's small operations on the CPU, for mm3.gguf.cpu_native (built into the same
   library as integer_product.c): in the fast numerics torch runs each as a dozen small operations
   (the RMSNorm, the depth decoder's attention over its short cache, an LM decode step's q/k norms,
   rotation and cache write, the guided top-k draws), a few microseconds each in one call here.
   float32 throughout. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The sum of a[j] b[j] over n floats, in 16 float32 lanes (the compiler's vectors). */
static inline float dot(const float *a, const float *b, int64_t n) {
    float lanes[16] = {0.f};
    int64_t j = 0;
    for (; j + 16 <= n; j += 16)
        for (int l = 0; l < 16; l++) lanes[l] += a[j + l] * b[j + l];
    float sum = 0.f;
    for (int l = 0; l < 16; l++) sum += lanes[l];
    for (; j < n; j++) sum += a[j] * b[j];
    return sum;
}

/* out = v / sqrt(mean(v^2) + eps) * w over one row of n floats. */
static inline void rms_row(const float *v, const float *w, float *out, int64_t n, float eps) {
    const float scale = 1.f / sqrtf(dot(v, v, n) / (float)n + eps);
    for (int64_t j = 0; j < n; j++) out[j] = v[j] * scale * w[j];
}

/* y = x / sqrt(mean(x^2) + eps) * w over rows of n floats (the RMSNorm of the fast numerics):
   `outer` groups of `inner` rows, a group's rows side by side, groups `stride` floats apart; y
   holds the rows contiguously. */
void mm3_rms_norm(const float *x, const float *w, float *y, int64_t outer, int64_t inner, int64_t stride, int64_t n,
                  float eps) {
    for (int64_t o = 0; o < outer; o++)
        for (int64_t r = 0; r < inner; r++) rms_row(x + o * stride + r * n, w, y + (o * inner + r) * n, n, eps);
}

/* Attention of s new positions a row over the positions cached before them and themselves (a
   decode step of a short sequence): q, k, v [b][s][heads * d] floats (row r's position i at
   r * row_stride + i * position_stride), k and v first written into the caches [b][kv_heads]
   [capacity][d] at positions at .. at + s - 1; query head h reads key head h / (heads /
   kv_heads); out [b][s][heads * d]. Scores, softmax and sums in float32. Returns 0, -1 where the
   scores of a longer sequence than SHORT cannot be allocated. */
#define SHORT 256
int mm3_attend(const float *q, const float *k, const float *v, int64_t row_stride, int64_t position_stride,
               float *cache_k, float *cache_v, int64_t b, int64_t s, int64_t heads, int64_t kv_heads,
               int64_t capacity, int64_t at, int64_t d, float scale, float *out) {
    float short_scores[SHORT], *scores = at + s <= SHORT ? short_scores : malloc(sizeof(float) * (at + s));
    if (!scores) return -1;
    for (int64_t r = 0; r < b; r++)
        for (int64_t i = 0; i < s; i++)
            for (int64_t h = 0; h < kv_heads; h++) {
                const int64_t from = r * row_stride + i * position_stride + h * d;
                const int64_t to = ((r * kv_heads + h) * capacity + at + i) * d;
                memcpy(cache_k + to, k + from, sizeof(float) * d);
                memcpy(cache_v + to, v + from, sizeof(float) * d);
            }
    const int64_t group = heads / kv_heads;
    for (int64_t r = 0; r < b; r++)
        for (int64_t i = 0; i < s; i++)
            for (int64_t h = 0; h < heads; h++) {
                const float *query = q + r * row_stride + i * position_stride + h * d;
                const float *keys = cache_k + (r * kv_heads + h / group) * capacity * d;
                const float *values = cache_v + (r * kv_heads + h / group) * capacity * d;
                const int64_t length = at + i + 1;
                float top = -INFINITY, total = 0.f;
                for (int64_t j = 0; j < length; j++) {
                    scores[j] = dot(query, keys + j * d, d) * scale;
                    top = fmaxf(top, scores[j]);
                }
                for (int64_t j = 0; j < length; j++) {
                    scores[j] = expf(scores[j] - top);
                    total += scores[j];
                }
                float *o = out + (r * s + i) * heads * d + h * d;
                for (int64_t e = 0; e < d; e++) o[e] = 0.f;
                for (int64_t j = 0; j < length; j++) {
                    const float p = scores[j] / total;
                    const float *value = values + j * d;
                    for (int64_t e = 0; e < d; e++) o[e] += p * value[e];
                }
            }
    if (scores != short_scores) free(scores);
    return 0;
}

/* e^x to about a float32 ulp, written so a loop of them vectorizes (the C library's expf is a call
   a value): Cody-Waite reduction by ln 2 (the multiple rounded by adding 1.5 2^23), Cephes'
   polynomial, 2^n by the exponent bits; 0 below -87 (under the smallest normal float), x clamped
   to 88 above (2^127 e^r: a float exponential overflows just past it). */
static inline float exp_float(float x) {
    const float clamped = x > 88.f ? 88.f : x > -87.f ? x : -87.f, shifter = 12582912.f;
    const float n = (clamped * 1.44269504088896341f + shifter) - shifter;
    float r = fmaf(n, -0.693359375f, clamped);
    r = fmaf(n, 2.12194440e-4f, r);
    float p = 1.9875691500e-4f;
    p = fmaf(p, r, 1.3981999507e-3f);
    p = fmaf(p, r, 8.3334519073e-3f);
    p = fmaf(p, r, 4.1665795894e-2f);
    p = fmaf(p, r, 1.6666665459e-1f);
    p = fmaf(p, r, 5.0000001201e-1f);
    p = fmaf(p, r * r, r) + 1.f;
    union {
        int32_t bits;
        float value;
    } scale = {((int32_t)n + 127) << 23};
    return x < -87.f ? 0.f : p * scale.value;
}

/* The k-th largest of v[n] (k <= n; duplicates counted), by selection on the scratch copy `work`. */
static float kth_largest_of(const float *v, int64_t n, int64_t k, float *work) {
    memcpy(work, v, sizeof(float) * n);
    int64_t low = 0, high = n - 1;
    const int64_t want = k - 1; /* the index it has in descending order */
    while (low < high) {
        const float pivot = work[low + (high - low) / 2];
        int64_t i = low, j = high;
        while (i <= j) {
            while (work[i] > pivot) i++;
            while (work[j] < pivot) j--;
            if (i <= j) {
                const float t = work[i];
                work[i++] = work[j];
                work[j--] = t;
            }
        }
        if (want <= j)
            high = j;
        else if (want >= i)
            low = i;
        else
            break;
    }
    return work[want];
}

/* torch's CPU generator (ATen's mt19937, in the bytes of `Generator.get_state()`: the 32-bit
   outputs left before the next twist at LEFT_AT, the next output's index at NEXT_AT, the 624 words
   at WORDS_AT, each in 64 bits). One 64-bit draw (an int64 `random_` value, an Exponential one) is
   two outputs. The Python side checks these offsets against torch's own draws before it uses them. */
#define MT_N 624
#define MT_M 397
#define LEFT_AT 8
#define NEXT_AT 16
#define WORDS_AT 24
#define UNIFORM_BITS ((INT64_C(1) << 53) - 1) /* the bits of a 64-bit draw a uniform double keeps */

static inline uint32_t mt_mix(uint32_t u, uint32_t v) {
    return (((u & 0x80000000u) | (v & 0x7fffffffu)) >> 1) ^ (0x9908b0dfu & -(v & 1u));
}

/* The 624 words' next generation (the loops vectorize: the first reads ahead of what it writes,
   the second 227 words behind). */
static void mt_twist(uint32_t *w) {
    int i = 0;
    for (; i < MT_N - MT_M; i++) w[i] = w[i + MT_M] ^ mt_mix(w[i], w[i + 1]);
    for (; i < MT_N - 1; i++) w[i] = w[i + MT_M - MT_N] ^ mt_mix(w[i], w[i + 1]);
    w[MT_N - 1] = w[MT_M - 1] ^ mt_mix(w[MT_N - 1], w[0]);
}

/* Moves a generator's state (`state`, get_state()'s bytes) past `draws` 64-bit draws without
   making them: the skipped part of the LM's semantic draw is 180 000 values a frame. */
void mm3_generator_skip(uint8_t *state, int64_t draws) {
    int32_t left;
    uint64_t next, word;
    uint32_t w[MT_N];
    memcpy(&left, state + LEFT_AT, sizeof left);
    memcpy(&next, state + NEXT_AT, sizeof next);
    for (int j = 0; j < MT_N; j++) {
        memcpy(&word, state + WORDS_AT + 8 * j, sizeof word);
        w[j] = (uint32_t)word;
    }
    int64_t outputs = 2 * draws;
    while (outputs > 0) { /* an output takes `left` down by one and twists when it reaches zero */
        const int64_t plain = outputs < left - 1 ? outputs : left - 1;
        left -= (int32_t)plain;
        next += (uint64_t)plain;
        outputs -= plain;
        if (!outputs) break;
        mt_twist(w);
        left = MT_N;
        next = 1;
        outputs--;
    }
    memcpy(state + LEFT_AT, &left, sizeof left);
    memcpy(state + NEXT_AT, &next, sizeof next);
    for (int j = 0; j < MT_N; j++) {
        word = w[j];
        memcpy(state + WORDS_AT + 8 * j, &word, sizeof word);
    }
}

/* torch's Exponential(1) value of a 64-bit draw on the CPU: -log1p(-u) in double, u the draw's
   low 53 bits over 2^53, rounded to float32. */
static inline float exponential_of(int64_t draw) {
    const double u = (double)(draw & UNIFORM_BITS) * (1.0 / 9007199254740992.0);
    return (float)(-1.0 * log1p(-u));
}

/* The reference's draw (mm3.sampling.draw) over `rows` rows of probabilities [n] (`p_stride`
   floats apart) and their raw 64-bit draws (`raw_stride` apart): the first index of the largest
   probability / Exponential value, or of the first NaN, as torch's argmax; the Exponential values
   made only where a probability is not zero or the draw is (0 / 0). */
void mm3_draw_from_raw(const float *probs, const int64_t *raw, int64_t rows, int64_t n, int64_t p_stride,
                       int64_t raw_stride, int64_t *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *p = probs + r * p_stride;
        const int64_t *draws = raw + r * raw_stride;
        int64_t best = 0;
        float best_ratio = -INFINITY;
        for (int64_t i = 0; i < n; i++) {
            const float ratio = p[i] != 0.f || !(draws[i] & UNIFORM_BITS) ? p[i] / exponential_of(draws[i]) : 0.f;
            if (isnan(ratio)) {
                best = i;
                break;
            }
            if (ratio > best_ratio) best_ratio = ratio, best = i;
        }
        out[r] = best;
    }
}

/* The Exponential(1) values of `count` 64-bit draws, into out. */
void mm3_exponentials(const int64_t *draws, int64_t count, float *out) {
    for (int64_t i = 0; i < count; i++) out[i] = exponential_of(draws[i]);
}

/* One draw of the reference's top-k sampling (diffusers' `_sample_top_k`, mm3.sampling) per song:
   the logits [songs * r][n] (r = 2: each song's conditional row c, then its unconditional one u,
   guided as u + (c - u) cfg, in that order of operations; r = 1: c as it is) bounded as
   nan_to_num bounds them (+-1e9), everything below the k-th largest masked, softmax, renormalized,
   then the argmax of probability / q over the song's Exponential(1) draws q [n] (`q_stride` values
   between songs; the first index of a tie or NaN, as torch's argmax). The draws come as floats
   (`q`), or (`q` NULL) as the generator's raw 64-bit values (`raw`), made into Exponential ones
   only where they count: the candidates, and a zero draw anywhere (0 / 0 is NaN). With `excluded` (n flags, or
   NULL) those columns are -inf in c and u first; with `gate` only the columns where c is among its
   k largest are guided, the others -inf (the LM's semantic draw). Up to the rounding of the
   exponentials and sums, so a draw differs from torch's operations only where two candidates'
   ratios lie within a few float32 roundings. Returns 0, -1 without scratch, -3 for a NaN logit
   under `gate` (torch's order of NaNs is not repeated here). */
__attribute__((optimize("fp-contract=off"))) int mm3_top_k_draw(const float *logits, int64_t songs, int64_t r,
                                                               int64_t n, float cfg, int64_t top_k,
                                                               const uint8_t *excluded, int gate, const float *q,
                                                               const int64_t *raw, int64_t q_stride, int64_t *out) {
    float *v = malloc(sizeof(float) * 2 * n);
    if (!v) return -1;
    float *work = v + n;
    const int64_t k = top_k < n ? top_k : n;
    for (int64_t song = 0; song < songs; song++) {
        const float *c = logits + song * r * n, *u = c + n;
        float gate_kth = -INFINITY;
        if (gate) { /* the k-th largest of c, excluded columns -inf */
            for (int64_t i = 0; i < n; i++) {
                if (isnan(c[i])) {
                    free(v);
                    return -3;
                }
                v[i] = excluded && excluded[i] ? -INFINITY : c[i];
            }
            gate_kth = kth_largest_of(v, n, k, work);
        }
        for (int64_t i = 0; i < n; i++) {
            const int out_of_play = excluded && excluded[i];
            const float ci = out_of_play ? -INFINITY : c[i];
            float x = ci;
            if (r == 2) {
                const float ui = out_of_play ? -INFINITY : u[i], difference = ci - ui, scaled = difference * cfg;
                x = ui + scaled;
            }
            if ((gate && ci < gate_kth) || out_of_play) x = -INFINITY;
            v[i] = isnan(x) ? -1e9f : x > 1e9f ? 1e9f : x < -1e9f ? -1e9f : x;
        }
        const float kth = kth_largest_of(v, n, k, work);
        float top = -INFINITY, total = 0.f, renormal = 0.f;
        for (int64_t i = 0; i < n; i++) top = v[i] >= kth && v[i] > top ? v[i] : top;
        for (int64_t i = 0; i < n; i++) {
            work[i] = v[i] >= kth ? exp_float(v[i] - top) : 0.f;
            total += work[i];
        }
        for (int64_t i = 0; i < n; i++) {
            work[i] = work[i] / total;
            renormal += work[i];
        }
        renormal = renormal > 1e-12f ? renormal : 1e-12f;
        if (q) {
            const float *draws = q + song * q_stride;
            for (int64_t i = 0; i < n; i++) work[i] = work[i] / renormal / draws[i];
        } else {
            const int64_t *draws = raw + song * q_stride;
            for (int64_t i = 0; i < n; i++) { /* a positive draw leaves a zero probability's ratio zero */
                const int needed = work[i] != 0.f || !(draws[i] & UNIFORM_BITS);
                work[i] = needed ? work[i] / renormal / exponential_of(draws[i]) : 0.f;
            }
        }
        int64_t best = 0;
        float best_ratio = -INFINITY;
        for (int64_t i = 0; i < n; i++) {
            if (isnan(work[i])) {
                best = i;
                break;
            }
            if (work[i] > best_ratio) best_ratio = work[i], best = i;
        }
        out[song] = best;
    }
    free(v);
    return 0;
}

/* q / sqrt(mean(q^2) + eps) * w (mm3_rms_norm's row), then rotated by the position's
   angles, q cos + rotate_half(q) sin with rotate_half(q) = [-q2, q1] over the two halves, each
   product rounded before the sum as torch's operations round them; into out[d], d <= 1024. */
__attribute__((optimize("fp-contract=off"))) static void norm_rotate(const float *q, const float *w, float eps,
                                                                    const float *cos, const float *sin, int64_t d,
                                                                    float *out) {
    float normed[1024];
    rms_row(q, w, normed, d, eps);
    const int64_t half = d / 2;
    for (int64_t e = 0; e < d; e++) {
        const float turned = (e < half ? -normed[e + half] : normed[e - half]) * sin[e], kept = normed[e] * cos[e];
        out[e] = kept + turned;
    }
}

/* One decode position of the LM's attention up to the attention itself, for b rows: q [b][heads * d]
   and k, v [b][kv_heads * d] (rows `q_stride` and `kv_stride` floats apart: a product's output)
   have their heads normalized (q_norm, k_norm: RMSNorm weights [d]) and rotated (cos, sin [d]: the
   position's angles); k and v are written into the caches [b][kv_heads][capacity][d] at position
   `at`, the query heads into q_out [b][heads][d]. Returns 0, -2 for a head wider than 1024 or odd. */
int mm3_decode_prepare(const float *q, int64_t q_stride, const float *k, const float *v, int64_t kv_stride,
                       const float *q_norm, const float *k_norm, float eps, const float *cos, const float *sin,
                       float *cache_k, float *cache_v, int64_t b, int64_t heads, int64_t kv_heads, int64_t capacity,
                       int64_t at, int64_t d, float *q_out) {
    if (d > 1024 || d % 2) return -2;
    for (int64_t r = 0; r < b; r++) {
        for (int64_t h = 0; h < kv_heads; h++) {
            const int64_t to = ((r * kv_heads + h) * capacity + at) * d;
            norm_rotate(k + r * kv_stride + h * d, k_norm, eps, cos, sin, d, cache_k + to);
            memcpy(cache_v + to, v + r * kv_stride + h * d, sizeof(float) * d);
        }
        for (int64_t h = 0; h < heads; h++)
            norm_rotate(q + r * q_stride + h * d, q_norm, eps, cos, sin, d, q_out + (r * heads + h) * d);
    }
    return 0;
}

int mm3_integer_product(const float *x, const int8_t *w, float *y, int64_t m, int64_t n, int64_t k, int group,
                        int bits, int offsets, int form, int threads);

/* A product's part as the Python side checked it (cpu_native.Bound): its packed weight's address,
   the output rows padded to whole tiles, the columns, the packing (group, bits, offsets, scale
   form) and the output rows kept. */
enum { PART_WEIGHT, PART_N, PART_K, PART_GROUP, PART_BITS, PART_OFFSETS, PART_FORM, PART_OUT, PART_FIELDS };

/* The parts of one product (one stacked packing, or each part its own) over rows x [m][k], their
   outputs side by side in y [m][width]; `scratch` holds m rows of the widest part's padded output. */
static int stage(const float *x, int64_t m, const int64_t *parts, int64_t count, float *scratch, float *y,
                 int64_t width, int threads) {
    int64_t column = 0;
    for (int64_t p = 0; p < count; p++) {
        const int64_t *f = parts + p * PART_FIELDS;
        const int64_t n = f[PART_N], kept = f[PART_OUT];
        float *to = count == 1 && n == width ? y : scratch;
        const int status = mm3_integer_product(x, (const int8_t *)(intptr_t)f[PART_WEIGHT], to, m, n, f[PART_K],
                                               (int)f[PART_GROUP], (int)f[PART_BITS], (int)f[PART_OFFSETS],
                                               (int)f[PART_FORM], threads);
        if (status) return status;
        if (to == scratch)
            for (int64_t i = 0; i < m; i++) memcpy(y + i * width + column, scratch + i * n, sizeof(float) * kept);
        column += kept;
    }
    return 0;
}

/* The widths of a block's products (their parts' kept outputs summed) and the widest part's padded
   output: `counts[t]` parts each for t < `products`, PART_FIELDS values a part. */
static void product_widths(const int64_t *parts, const int64_t *counts, int products, int64_t *widths,
                           int64_t *widest) {
    for (int t = 0; t < products; t++) {
        widths[t] = 0;
        for (int64_t p = 0; p < counts[t]; p++, parts += PART_FIELDS) {
            widths[t] += parts[PART_OUT];
            *widest = parts[PART_N] > *widest ? parts[PART_N] : *widest;
        }
    }
}

/* Whether every part of the `count` from `parts` takes k columns. */
static int parts_take(const int64_t *parts, int64_t count, int64_t k) {
    for (int64_t p = 0; p < count; p++)
        if (parts[p * PART_FIELDS + PART_K] != k) return 0;
    return 1;
}

/* Whether a block's second-half products fit it (`counts[t]` parts each, in order out, gate/up,
   down): out and down `dim` wide, gate/up two halves of the down product's columns, each taking
   what the one before makes; `inner` gets the gate/up half. */
static int leave_fits(const int64_t *parts, const int64_t *counts, int64_t dim, int64_t *inner) {
    int64_t widths[3], widest = 0;
    product_widths(parts, counts, 3, widths, &widest);
    const int64_t *gate_up = parts + counts[0] * PART_FIELDS, *down = gate_up + counts[1] * PART_FIELDS;
    *inner = widths[1] / 2;
    return widths[0] == dim && widths[1] == 2 * *inner && widths[2] == dim && parts_take(parts, counts[0], dim) &&
           parts_take(gate_up, counts[1], dim) && parts_take(down, counts[2], *inner);
}

/* Whether a block's four products (q/k/v, then leave_fits') fit it, q/k/v `qkv_width` wide. */
static int block_fits(const int64_t *parts, const int64_t *counts, int64_t dim, int64_t qkv_width, int64_t *inner) {
    int64_t width, widest = 0;
    product_widths(parts, counts, 1, &width, &widest);
    return width == qkv_width && parts_take(parts, counts[0], dim) &&
           leave_fits(parts + counts[0] * PART_FIELDS, counts + 1, dim, inner);
}

/* A pre-norm block's second half over m rows: x [m][dim] plus the out product of `attended`
   [m][dim] (mid), then mid plus the down product of silu(gate) * up of the gate/up product of
   RMSNorm(mid) (`norm_post`) -> y [m][dim]. `parts` holds the three products' parts in that order,
   `counts` how many each has (gate/up: one stacked packing or one a part), `inner` the gate/up
   half; the caller checked that they fit (block_fits). Returns 0, -1 without scratch, as
   mm3_integer_product. */
__attribute__((optimize("fp-contract=off"))) static int block_leave(const float *x, const float *attended, int64_t m,
                                                                   int64_t dim, int64_t inner,
                                                                   const float *norm_post, float eps,
                                                                   const int64_t *parts, const int64_t *counts,
                                                                   int threads, float *y) {
    int64_t widths[3], widest = 0;
    product_widths(parts, counts, 3, widths, &widest);
    const int64_t *out = parts, *gate_up = out + counts[0] * PART_FIELDS, *down = gate_up + counts[1] * PART_FIELDS;
    float *buffer = malloc(sizeof(float) * m * (2 * dim + 3 * inner + widest));
    if (!buffer) return -1;
    float *mid = buffer, *h = mid + m * dim, *both = h + m * dim, *act = both + m * 2 * inner, *scratch = act + m * inner;
    int status;
    if ((status = stage(attended, m, out, counts[0], scratch, mid, dim, threads))) goto done;
    for (int64_t i = 0; i < m * dim; i++) mid[i] = x[i] + mid[i];
    mm3_rms_norm(mid, norm_post, h, m, 1, dim, dim, eps);
    if ((status = stage(h, m, gate_up, counts[1], scratch, both, 2 * inner, threads))) goto done;
    for (int64_t i = 0; i < m; i++)
        for (int64_t j = 0; j < inner; j++) {
            const float g = both[i * 2 * inner + j], silu = g / (1.f + exp_float(-g));
            act[i * inner + j] = silu * both[i * 2 * inner + inner + j];
        }
    if ((status = stage(act, m, down, counts[2], scratch, y, dim, threads))) goto done;
    for (int64_t i = 0; i < m * dim; i++) y[i] = mid[i] + y[i];
done:
    free(buffer);
    return status;
}

/* One block of the depth decoder over the s new positions of b rows, x [b][s][dim] -> y (as the
   fast numerics' torch operations make it): RMSNorm, the q/k/v product, attention over the cache
   (mm3_attend, which writes k and v at `at`), then block_leave. `parts` holds the four products'
   parts (q/k/v, out, gate/up, down), `counts` how many each has. Returns as block_leave. */
static int depth_block(const float *x, int64_t b, int64_t s, int64_t dim, const float *norm_in,
                       const float *norm_post, float eps, const int64_t *parts, const int64_t *counts, float *cache_k,
                       float *cache_v, int64_t heads, int64_t capacity, int64_t at, float scale, int threads, float *y) {
    const int64_t m = b * s;
    int64_t width, widest = 0, inner;
    product_widths(parts, counts, 1, &width, &widest);
    if (dim % heads || !block_fits(parts, counts, dim, 3 * dim, &inner)) return -2;
    float *buffer = malloc(sizeof(float) * m * (5 * dim + widest));
    if (!buffer) return -1;
    float *h = buffer, *qkv = h + m * dim, *attended = qkv + m * 3 * dim, *scratch = attended + m * dim;
    int status;
    mm3_rms_norm(x, norm_in, h, m, 1, dim, dim, eps);
    if (!(status = stage(h, m, parts, counts[0], scratch, qkv, 3 * dim, threads)) &&
        !(status = mm3_attend(qkv, qkv + dim, qkv + 2 * dim, s * 3 * dim, 3 * dim, cache_k, cache_v, b, s, heads,
                              heads, capacity, at, dim / heads, scale, attended)))
        status = block_leave(x, attended, m, dim, inner, norm_post, eps, parts + counts[0] * PART_FIELDS, counts + 1,
                             threads, y);
    free(buffer);
    return status;
}

/* The depth decoder's blocks over the s new positions of b rows in one call: x [b][s][dim] through
   `layers` blocks (depth_block each: `norms` the addresses of each block's two RMSNorm weights,
   `parts` and `counts` each block's in turn, the caches [layers][b][heads][capacity][dim / heads])
   -> y. A decode step is otherwise a dozen torch operations and five Python-wrapped products a
   block, sixty microseconds of them for the few thousand values a block makes, 28 block steps a
   frame. Returns as depth_block. */
int mm3_depth_layers(const float *x, int64_t b, int64_t s, int64_t dim, int64_t layers, const int64_t *norms, float eps,
                     const int64_t *parts, const int64_t *counts, float *cache_k, float *cache_v, int64_t heads,
                     int64_t capacity, int64_t at, float scale, int threads, float *y) {
    float *other = layers > 1 ? malloc(sizeof(float) * b * s * dim) : NULL;
    if (layers > 1 && !other) return -1;
    const int64_t cached = b * capacity * dim; /* a layer's cache: b rows of heads x capacity x d */
    const float *in = x;
    int status = 0;
    for (int64_t l = 0; l < layers && !status; l++) {
        float *out = (layers - 1 - l) % 2 ? other : y; /* the last block writes y */
        status = depth_block(in, b, s, dim, (const float *)(intptr_t)norms[2 * l],
                             (const float *)(intptr_t)norms[2 * l + 1], eps, parts, counts + 4 * l,
                             cache_k + l * cached, cache_v + l * cached, heads, capacity, at, scale, threads, out);
        for (int t = 0; t < 4; t++) parts += counts[4 * l + t] * PART_FIELDS;
        in = out;
    }
    free(other);
    return status;
}

/* An LM decode step's layer up to its attention, for b rows of one position: RMSNorm of x [b][dim]
   (`norm_in`), the q/k/v product, then mm3_decode_prepare (the heads' norms and rotation, k and v
   written into the layer's caches at `at`) -> q_out [b][heads][d]. `parts` and `counts` are the
   whole layer's (its four products), checked to fit before anything is written, so mm3_lm_leave
   then serves. Returns 0, -1 without scratch, -2 for parts that do not fit. */
int mm3_lm_enter(const float *x, int64_t b, int64_t dim, const float *norm_in, float eps, const int64_t *parts,
                 const int64_t *counts, const float *q_norm, const float *k_norm, float head_eps, const float *cos,
                 const float *sin, float *cache_k, float *cache_v, int64_t heads, int64_t kv_heads, int64_t capacity,
                 int64_t at, int64_t d, int threads, float *q_out) {
    int64_t width, widest = 0, inner;
    const int64_t count = counts[0];
    product_widths(parts, counts, 1, &width, &widest);
    if (!block_fits(parts, counts, dim, (heads + 2 * kv_heads) * d, &inner)) return -2; /* the whole layer, first */
    float *buffer = malloc(sizeof(float) * b * (dim + width + widest));
    if (!buffer) return -1;
    float *h = buffer, *qkv = h + b * dim, *scratch = qkv + b * width;
    mm3_rms_norm(x, norm_in, h, b, 1, dim, dim, eps);
    int status = stage(h, b, parts, count, scratch, qkv, width, threads);
    if (!status)
        status = mm3_decode_prepare(qkv, width, qkv + heads * d, qkv + (heads + kv_heads) * d, width, q_norm, k_norm,
                                    head_eps, cos, sin, cache_k, cache_v, b, heads, kv_heads, capacity, at, d, q_out);
    free(buffer);
    return status;
}

/* An LM decode step's layer after its attention (block_leave over b rows): x [b][dim] and the
   attention's output `attended` [b][dim] -> y [b][dim]; `parts` and `counts` the whole layer's, as
   mm3_lm_enter took them. */
int mm3_lm_leave(const float *x, const float *attended, int64_t b, int64_t dim, const float *norm_post, float eps,
                 const int64_t *parts, const int64_t *counts, int threads, float *y) {
    int64_t inner;
    if (!leave_fits(parts + counts[0] * PART_FIELDS, counts + 1, dim, &inner)) return -2;
    return block_leave(x, attended, b, dim, inner, norm_post, eps, parts + counts[0] * PART_FIELDS, counts + 1,
                       threads, y);
}
