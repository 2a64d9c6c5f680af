// Paged decode attention on CPU, fp32: one query token per sequence, K/V read straight out of
// the paged cache (no gather copy), each K and V row read once for all query heads of its group.
//
//   q, out    [num_seqs, num_heads, head_dim]               contiguous
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

static float dot(const float *a, const float *b, int64_t n) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

static void axpy(float *y, float a, const float *x, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) y[i] += a * x[i];
}

// One sequence, all heads: each K/V row (all kv heads of one token, contiguous) is read once.
static void one_seq(const float *q, const float *k, const float *v, const int64_t *blocks, int64_t len,
                    float *out, int64_t heads, int64_t kvh, int64_t dim, int64_t bs, int64_t kstride,
                    int64_t vstride, float scale, float *scores) {
    int64_t group = heads / kvh;
    for (int64_t t = 0; t < len; t++) {
        const float *kr = k + blocks[t / bs] * kstride + (t % bs) * kvh * dim;
        for (int64_t h = 0; h < heads; h++) scores[h * len + t] = dot(q + h * dim, kr + (h / group) * dim, dim) * scale;
    }
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
    memset(out, 0, sizeof(float) * heads * dim);
    for (int64_t t = 0; t < len; t++) {
        const float *vr = v + blocks[t / bs] * vstride + (t % bs) * kvh * dim;
        for (int64_t h = 0; h < heads; h++) axpy(out + h * dim, scores[h * len + t], vr + (h / group) * dim, dim);
    }
}

int paged_decode_f32(const float *q, const float *k, const float *v, const int64_t *table, const int64_t *ctx,
                     float *out, int64_t num_seqs, int64_t num_heads, int64_t kvh, int64_t dim, int64_t bs,
                     int64_t max_blocks, int64_t kstride, int64_t vstride, float scale, int threads) {
    int failed = 0;
#pragma omp parallel for schedule(dynamic) num_threads(threads)
    for (int64_t s = 0; s < num_seqs; s++) {
        int64_t len = ctx[s];
        float *scores = malloc(sizeof(float) * num_heads * (len > 0 ? len : 1));
        if (scores == NULL) {
            failed = 1;
            continue;
        }
        int64_t off = s * num_heads * dim;
        one_seq(q + off, k, v, table + s * max_blocks, len, out + off, num_heads, kvh, dim, bs, kstride, vstride,
                scale, scores);
        free(scores);
    }
    return failed;
}
