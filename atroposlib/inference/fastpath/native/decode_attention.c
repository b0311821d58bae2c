/*
 * Attention for one query token per row on the CPU: the decode step's attention of
 * atropos-serve's engine (atroposlib/inference/fastpath/native/__init__.py builds and loads it).
 *
 * Every row b and key/value head h holds G query rows (the query heads sharing that key/value
 * head, already scaled) against the row's L cached keys and values. PyTorch's CPU flash kernel
 * does the same work as one tiny block per (b, h); at G = 3 and a few hundred keys its set-up
 * costs more than the arithmetic. Here each (b, h) is two passes over its keys and values:
 * scores into a buffer, then the softmax-weighted sum of the values, float32 throughout (as
 * PyTorch's kernel accumulates). Positions whose mask byte is 0 are skipped; a row with none
 * left gets zeros and a log-sum-exp of -inf.
 *
 * Keys and values are bfloat16 (dtype 1) or float32 (dtype 0), any strides in elements; the
 * query, output and log-sum-exp are contiguous float32.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_DIM 256
#define MAX_GROUP 16

static inline float bf16_to_float(uint16_t x) {
    union {
        uint32_t u;
        float f;
    } bits;
    bits.u = (uint32_t)x << 16;
    return bits.f;
}

/* exp(x) for x <= 0 in a form the compiler vectorises (glibc's expf is scalar unless the whole
 * file is built with -ffast-math): 2^n * e^r with |r| <= ln2/2 and Cephes' degree-6 polynomial,
 * within 2 ulp of expf; below -87.3 (where float32 runs out of normal numbers) it is 0. */
static inline float exp_nonpositive(float x) {
    float clamped = x < -87.3f ? -87.3f : x;
    /* round to nearest by the 1.5 * 2^23 trick (|value| < 2^22 here), which vectorises */
    float n = (clamped * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = clamped - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union {
        uint32_t u;
        float f;
    } scale;
    scale.u = (uint32_t)((int32_t)n + 127) << 23;
    return x < -87.3f ? 0.0f : p * scale.f;
}

typedef float v16f __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef uint32_t v16u __attribute__((vector_size(64)));

/* 16 consecutive elements (bfloat16 or float32) as float32 lanes. */
static inline v16f load16(const void *base, int dtype, int64_t offset) {
    v16f out;
    if (dtype == 1) {
        v16h half;
        memcpy(&half, (const uint16_t *)base + offset, sizeof(half));
        v16u bits = __builtin_convertvector(half, v16u) << 16;
        memcpy(&out, &bits, sizeof(out));
    } else {
        memcpy(&out, (const float *)base + offset, sizeof(out));
    }
    return out;
}

static inline float hsum(v16f x) {
    x += __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    x += __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3);
    x += __builtin_shufflevector(x, x, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1);
    return x[0] + x[1];
}

/*
 * query:  (batch, heads, group, dim) float32, contiguous, already multiplied by the scale
 * keys, values: (batch, heads, length, dim) at the given strides (elements), dtype 0/1
 * mask:   (batch, length) bytes, 1 = attend, contiguous; NULL = every position
 * out:    (batch, heads, group, dim) float32, normalised
 * lse:    (batch, heads, group) float32: log of the sum of exp(score) (NULL: not wanted)
 * Returns 0, or -1 for shapes it does not take (dim > MAX_DIM, group > MAX_GROUP).
 */
int atropos_decode_attention(const float *query, const void *keys, const void *values, int dtype,
                             const int64_t *k_strides, const int64_t *v_strides,
                             const uint8_t *mask, float *out, float *lse, int64_t batch,
                             int64_t heads, int64_t group, int64_t length, int64_t dim) {
    if (dim > MAX_DIM || dim % 16 || group > MAX_GROUP || dim < 16 || group < 1) return -1;
    if (k_strides[3] != 1 || v_strides[3] != 1) return -1; /* rows of contiguous elements */
    int64_t tasks = batch * heads;
    int failed = 0;
#pragma omp parallel
    {
        float *scores = (float *)malloc(sizeof(float) * (size_t)(group * (length > 0 ? length : 1)));
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t task = 0; task < tasks; task++) {
            if (scores == NULL) continue;
            int64_t b = task / heads, h = task % heads;
            const float *q = query + task * group * dim;
            const uint8_t *m = mask ? mask + b * length : NULL;
            int nv = (int)(dim / 16);
            v16f qv[MAX_GROUP][MAX_DIM / 16], row[MAX_DIM / 16], acc[MAX_GROUP][MAX_DIM / 16];
            float top[MAX_GROUP], total[MAX_GROUP];
            for (int g = 0; g < group; g++) {
                top[g] = -INFINITY;
                for (int j = 0; j < nv; j++) {
                    memcpy(&qv[g][j], q + g * dim + 16 * j, sizeof(v16f));
                    acc[g][j] = (v16f){0};
                }
            }
            int64_t kbase = b * k_strides[0] + h * k_strides[1];
            int64_t vbase = b * v_strides[0] + h * v_strides[1];
            /* pass 1: scores and their maxima */
            for (int64_t l = 0; l < length; l++) {
                if (m && !m[l]) {
                    for (int g = 0; g < group; g++) scores[g * length + l] = -INFINITY;
                    continue;
                }
                for (int j = 0; j < nv; j++) row[j] = load16(keys, dtype, kbase + l * k_strides[2] + 16 * j);
                for (int g = 0; g < group; g++) {
                    v16f dot = qv[g][0] * row[0];
                    for (int j = 1; j < nv; j++) dot += qv[g][j] * row[j];
                    float s = hsum(dot);
                    scores[g * length + l] = s;
                    if (s > top[g]) top[g] = s;
                }
            }
            /* pass 2: weights (exp vectorised over positions; masked ones weigh 0), then the
               weighted sum of the values */
            for (int g = 0; g < group; g++) {
                float *w = scores + g * length, t = top[g], sum = 0.0f;
#pragma omp simd reduction(+ : sum)
                for (int64_t l = 0; l < length; l++) {
                    float e = exp_nonpositive(w[l] - t);
                    w[l] = (m && !m[l]) ? 0.0f : e;
                    sum += w[l];
                }
                total[g] = sum;
            }
            if (top[0] != -INFINITY) {
                for (int64_t l = 0; l < length; l++) {
                    if (m && !m[l]) continue;
                    for (int j = 0; j < nv; j++) row[j] = load16(values, dtype, vbase + l * v_strides[2] + 16 * j);
                    for (int g = 0; g < group; g++) {
                        float w = scores[g * length + l];
                        for (int j = 0; j < nv; j++) acc[g][j] += w * row[j];
                    }
                }
            }
            float *o = out + task * group * dim;
            for (int g = 0; g < group; g++)
                for (int j = 0; j < nv; j++) memcpy(o + g * dim + 16 * j, &acc[g][j], sizeof(v16f));
            for (int g = 0; g < group; g++) {
                float *og = o + g * dim;
                if (total[g] > 0.0f) {
                    float inv = 1.0f / total[g];
#pragma omp simd
                    for (int d = 0; d < dim; d++) og[d] *= inv;
                }
                if (lse) lse[task * group + g] = total[g] > 0.0f ? top[g] + logf(total[g]) : -INFINITY;
            }
        }
        free(scores);
    }
    return failed ? -2 : 0;
}
