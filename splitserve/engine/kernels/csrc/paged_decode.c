// Paged decode attention on CPU: one query token per sequence, K/V read straight out of the
// paged cache (no gather copy), each K and V row read once for all query heads of its group.
// The cache is fp32 (paged_decode_f32) or bf16 (paged_decode_bf16: each element widened to
// fp32 as it is read, exactly; all arithmetic in fp32, as SDPA's CPU kernel does for bf16).
//
//   q, out    [num_seqs, num_heads, head_dim]  fp32          contiguous
//   k, v      [num_blocks, block_size, num_kv_heads, head_dim]  rows contiguous; block stride given
//   table     [num_seqs, max_blocks] int64                   block ids, row-major
//   ctx       [num_seqs] int64                               context length (the new token included)
//
// Work is split over sequences with OpenMP. `omp simd` vectorizes the dot
// products and the weighted sums without -ffast-math (no reassociation anywhere else).

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bf16(uint16_t x) {
    union { uint32_t u; float f; } c = {.u = (uint32_t)x << 16};
    return c.f;
}

static float dot_f32(const float *a, const float *b, int64_t n) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

static void axpy_f32(float *y, float a, const float *x, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) y[i] += a * x[i];
}

static float dot_bf16(const float *a, const uint16_t *b, int64_t n) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; i++) s += a[i] * bf16(b[i]);
    return s;
}

static void axpy_bf16(float *y, float a, const uint16_t *x, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) y[i] += a * bf16(x[i]);
}

static void softmax_rows(float *scores, int64_t heads, int64_t len) {
    for (int64_t h = 0; h < heads; h++) {
        float *row = scores + h * len;
        float mx = -INFINITY, sum = 0.0f;
        for (int64_t t = 0; t < len; t++) mx = row[t] > mx ? row[t] : mx;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < len; t++) {
            row[t] = expf(row[t] - mx);
            sum += row[t];
        }
        float inv = 1.0f / sum;
        for (int64_t t = 0; t < len; t++) row[t] *= inv;
    }
}

// One sequence, all heads: each K/V row (all kv heads of one token, contiguous) is read once.
#define ONE_SEQ(NAME, T, DOT, AXPY)                                                                          \
    static void NAME(const float *q, const T *k, const T *v, const int64_t *blocks, int64_t len, float *out,  \
                     int64_t heads, int64_t kvh, int64_t dim, int64_t bs, int64_t kstride, int64_t vstride,   \
                     float scale, float *scores) {                                                           \
        int64_t group = heads / kvh;                                                                         \
        for (int64_t t = 0; t < len; t++) {                                                                  \
            const T *kr = k + blocks[t / bs] * kstride + (t % bs) * kvh * dim;                               \
            for (int64_t h = 0; h < heads; h++)                                                              \
                scores[h * len + t] = DOT(q + h * dim, kr + (h / group) * dim, dim) * scale;                 \
        }                                                                                                    \
        softmax_rows(scores, heads, len);                                                                    \
        memset(out, 0, sizeof(float) * heads * dim);                                                         \
        for (int64_t t = 0; t < len; t++) {                                                                  \
            const T *vr = v + blocks[t / bs] * vstride + (t % bs) * kvh * dim;                               \
            for (int64_t h = 0; h < heads; h++) AXPY(out + h * dim, scores[h * len + t], vr + (h / group) * dim, dim); \
        }                                                                                                    \
    }

ONE_SEQ(one_seq_f32, float, dot_f32, axpy_f32)
ONE_SEQ(one_seq_bf16, uint16_t, dot_bf16, axpy_bf16)

#define PAGED_DECODE(NAME, T, ONE)                                                                           \
    int NAME(const float *q, const T *k, const T *v, const int64_t *table, const int64_t *ctx, float *out,    \
             int64_t num_seqs, int64_t num_heads, int64_t kvh, int64_t dim, int64_t bs, int64_t max_blocks,   \
             int64_t kstride, int64_t vstride, float scale, int threads) {                                   \
        int failed = 0;                                                                                      \
        _Pragma("omp parallel for schedule(dynamic) num_threads(threads)")                                   \
        for (int64_t s = 0; s < num_seqs; s++) {                                                             \
            int64_t len = ctx[s];                                                                            \
            float *scores = malloc(sizeof(float) * num_heads * (len > 0 ? len : 1));                         \
            if (scores == NULL) {                                                                            \
                failed = 1;                                                                                  \
                continue;                                                                                    \
            }                                                                                                \
            int64_t off = s * num_heads * dim;                                                               \
            ONE(q + off, k, v, table + s * max_blocks, len, out + off, num_heads, kvh, dim, bs, kstride,     \
                vstride, scale, scores);                                                                     \
            free(scores);                                                                                    \
        }                                                                                                    \
        return failed;                                                                                       \
    }

PAGED_DECODE(paged_decode_f32, float, one_seq_f32)
PAGED_DECODE(paged_decode_bf16, uint16_t, one_seq_bf16)
