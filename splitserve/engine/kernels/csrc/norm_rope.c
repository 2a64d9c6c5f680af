// The decoder's elementwise layers on CPU, fused: residual add + RMSNorm, and rotary embedding
// of q and k together. fp32 or bf16 activations (`bf16` flag), arithmetic in fp32.
//
// Both follow torch's order of operations and round to the activation dtype wherever torch's
// separate ops would (layers.RMSNorm, layers.apply_rope): a bf16 add or product done in fp32 and
// rounded once is the correctly rounded bf16 op, so only the row reduction's summation order
// differs from torch (it flips a bf16 rounding rarely). Rows are split over OpenMP threads.

#include <math.h>
#include <stdint.h>

static inline float from_bf16(uint16_t x) {
    union { uint32_t u; float f; } c = {.u = (uint32_t)x << 16};
    return c.f;
}

static inline uint16_t to_bf16(float f) {  // round to nearest even, as torch's conversion
    union { float f; uint32_t u; } c = {.f = f};
    if ((c.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((c.u >> 16) | 0x40);  // NaN stays NaN
    return (uint16_t)((c.u + 0x7fffu + ((c.u >> 16) & 1u)) >> 16);
}

static inline float rnd(float x, int bf16) { return bf16 ? from_bf16(to_bf16(x)) : x; }

static inline float load(const void *p, int64_t i, int bf16) {
    return bf16 ? from_bf16(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void store(void *p, int64_t i, float x, int bf16) {
    if (bf16)
        ((uint16_t *)p)[i] = to_bf16(x);
    else
        ((float *)p)[i] = x;
}

// out[r] = w * round(h * rsqrt(mean(h^2) + eps)), h = x[r] (+ residual[r], rounded; written to
// new_res[r]). x and residual rows are strided (element strides), out / new_res contiguous.
void rms_norm(const void *x, const void *residual, const void *w, void *out, void *new_res, int64_t n,
              int64_t hidden, int64_t sx, int64_t sr, float eps, int bf16, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (n > 8)
    for (int64_t r = 0; r < n; r++) {
        float h[hidden];
        float ss = 0.0f;
        for (int64_t i = 0; i < hidden; i++) {
            float v = load(x, r * sx + i, bf16);
            if (residual) v = rnd(v + load(residual, r * sr + i, bf16), bf16);
            h[i] = v;
            ss += v * v;
        }
        if (residual)
            for (int64_t i = 0; i < hidden; i++) store(new_res, r * hidden + i, h[i], bf16);
        float inv = 1.0f / sqrtf(ss / (float)hidden + eps);
        for (int64_t i = 0; i < hidden; i++)
            store(out, r * hidden + i, load(w, i, bf16) * rnd(h[i] * inv, bf16), bf16);
    }
}

// out[t, h] = round(round(qk * cos) + round(swap_halves(qk) * signed_sin)) for each of the
// `heads` heads of token t; qk's tokens strided by `sq` elements (heads contiguous within),
// cos / sin [n, dim] contiguous, out [n, heads, dim] contiguous (may be qk itself when it is).
void rotary(const void *qk, const void *cos, const void *sin, void *out, int64_t n, int64_t heads, int64_t dim,
            int64_t sq, int bf16, int threads) {
    int64_t half = dim / 2;
#pragma omp parallel for schedule(static) num_threads(threads) if (n > 8)
    for (int64_t t = 0; t < n; t++) {
        for (int64_t h = 0; h < heads; h++) {
            int64_t src = t * sq + h * dim, dst = (t * heads + h) * dim;
            float row[dim];
            for (int64_t i = 0; i < dim; i++) row[i] = load(qk, src + i, bf16);
            for (int64_t i = 0; i < dim; i++) {
                float c = load(cos, t * dim + i, bf16), s = load(sin, t * dim + i, bf16);
                float sw = row[i < half ? i + half : i - half];
                store(out, dst + i, rnd(rnd(row[i] * c, bf16) + rnd(sw * s, bf16), bf16), bf16);
            }
        }
    }
}
