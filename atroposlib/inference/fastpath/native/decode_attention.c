/*
 * Attention for one query token per row on the CPU: the decode step's attention of
 * atropos-serve's engine (atroposlib/inference/fastpath/native/__init__.py builds and loads it).
 *
 * Every row b and key/value head h holds G query rows (the query heads sharing that key/value
 * head, already scaled) against the row's cached keys and values: one or more segments, each
 * the row's own or an entry several rows share (a request's prompt), one softmax over all of
 * them. PyTorch's CPU flash kernel
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

/* Keys and values a row attends to: per row (entries = rows) or shared by several rows
 * (``rowmap`` gives each row its entry), of ``length`` positions, ``mask`` (entries, length)
 * bytes with 1 = attend (NULL: every position). Strides in elements; the last must be 1. */
typedef struct {
    const void *keys;
    const void *values;
    int64_t dtype; /* 0 float32, 1 bfloat16 */
    int64_t k_strides[4];
    int64_t v_strides[4];
    const int64_t *rowmap;
    const uint8_t *mask;
    int64_t length;
} segment_t;

#define MAX_SEGMENTS 4

static void attend_task(const float *q, int64_t b, int64_t h, int group, int dim,
                        const segment_t *segs, int nseg, int64_t width, float *scores, float *o,
                        float *lse) {
    int nv = dim / 16;
    v16f qv[MAX_GROUP][MAX_DIM / 16], row[MAX_DIM / 16], acc[MAX_GROUP][MAX_DIM / 16];
    float top[MAX_GROUP], total[MAX_GROUP];
    for (int g = 0; g < group; g++) {
        top[g] = -INFINITY;
        total[g] = 0.0f;
        for (int j = 0; j < nv; j++) {
            memcpy(&qv[g][j], q + g * dim + 16 * j, sizeof(v16f));
            acc[g][j] = (v16f){0};
        }
    }
    /* pass 1: every segment's scores (masked positions -inf) and their maxima */
    int64_t offset = 0;
    for (int s = 0; s < nseg; s++) {
        const segment_t *seg = &segs[s];
        int64_t entry = seg->rowmap ? seg->rowmap[b] : b;
        const uint8_t *m = seg->mask ? seg->mask + entry * seg->length : NULL;
        int64_t base = entry * seg->k_strides[0] + h * seg->k_strides[1];
        for (int64_t l = 0; l < seg->length; l++) {
            float *column = scores + offset + l;
            if (m && !m[l]) {
                for (int g = 0; g < group; g++) column[g * width] = -INFINITY;
                continue;
            }
            for (int j = 0; j < nv; j++)
                row[j] = load16(seg->keys, (int)seg->dtype, base + l * seg->k_strides[2] + 16 * j);
            for (int g = 0; g < group; g++) {
                v16f dot = qv[g][0] * row[0];
                for (int j = 1; j < nv; j++) dot += qv[g][j] * row[j];
                float value = hsum(dot);
                column[g * width] = value;
                if (value > top[g]) top[g] = value;
            }
        }
        offset += seg->length;
    }
    if (top[0] != -INFINITY) {
        /* the weights, exp vectorised over positions (a masked -inf weighs 0) */
        for (int g = 0; g < group; g++) {
            float *w = scores + g * width, t = top[g], sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int64_t l = 0; l < width; l++) {
                w[l] = exp_nonpositive(w[l] - t);
                sum += w[l];
            }
            total[g] = sum;
        }
        /* pass 2: the weighted sum of every segment's values */
        offset = 0;
        for (int s = 0; s < nseg; s++) {
            const segment_t *seg = &segs[s];
            int64_t entry = seg->rowmap ? seg->rowmap[b] : b;
            const uint8_t *m = seg->mask ? seg->mask + entry * seg->length : NULL;
            int64_t base = entry * seg->v_strides[0] + h * seg->v_strides[1];
            for (int64_t l = 0; l < seg->length; l++) {
                if (m && !m[l]) continue;
                for (int j = 0; j < nv; j++)
                    row[j] = load16(seg->values, (int)seg->dtype, base + l * seg->v_strides[2] + 16 * j);
                for (int g = 0; g < group; g++) {
                    float w = scores[g * width + offset + l];
                    for (int j = 0; j < nv; j++) acc[g][j] += w * row[j];
                }
            }
            offset += seg->length;
        }
    }
    for (int g = 0; g < group; g++) {
        float inv = total[g] > 0.0f ? 1.0f / total[g] : 0.0f;
        for (int j = 0; j < nv; j++) {
            v16f scaled = acc[g][j] * inv;
            memcpy(o + g * dim + 16 * j, &scaled, sizeof(v16f));
        }
        if (lse) lse[g] = total[g] > 0.0f ? top[g] + logf(total[g]) : -INFINITY;
    }
}

/*
 * query:    (batch, heads, group, dim) float32, contiguous, already multiplied by the scale
 * segments: what each row attends to, in order (one softmax over all of them)
 * out:      (batch, heads, group, dim) float32, normalised
 * lse:      (batch, heads, group) float32: log of the sum of exp(score) (NULL: not wanted)
 * Returns 0; -1 for shapes it does not take (dim not a multiple of 16 up to MAX_DIM, group
 * over MAX_GROUP, too many segments, a last stride other than 1); -2 when out of memory.
 */
int atropos_attend_segments(const float *query, int64_t batch, int64_t heads, int64_t group,
                            int64_t dim, const segment_t *segments, int64_t nseg, float *out,
                            float *lse) {
    if (dim > MAX_DIM || dim % 16 || dim < 16 || group > MAX_GROUP || group < 1) return -1;
    if (nseg < 1 || nseg > MAX_SEGMENTS) return -1;
    int64_t width = 0;
    for (int s = 0; s < nseg; s++) {
        if (segments[s].k_strides[3] != 1 || segments[s].v_strides[3] != 1) return -1;
        if (segments[s].dtype != 0 && segments[s].dtype != 1) return -1;
        width += segments[s].length;
    }
    int64_t tasks = batch * heads;
    int failed = 0;
#pragma omp parallel
    {
        float *scores = (float *)malloc(sizeof(float) * (size_t)(group * (width > 0 ? width : 1)));
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t task = 0; task < tasks; task++) {
            if (scores == NULL) continue;
            attend_task(query + task * group * dim, task / heads, task % heads, (int)group,
                        (int)dim, segments, (int)nseg, width, scores, out + task * group * dim,
                        lse ? lse + task * group : NULL);
        }
        free(scores);
    }
    return failed ? -2 : 0;
}
