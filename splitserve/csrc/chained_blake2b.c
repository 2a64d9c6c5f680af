/* Chained BLAKE2b-128 block hashes (RFC 7693), one call per prompt: block i's digest is
 * BLAKE2b(digest_size=16) of (block i-1's digest || block i's tokens as little-endian int64),
 * exactly what splitserve/hashing.py computes with hashlib block by block. */
#include <stdint.h>
#include <string.h>

static const uint64_t IV[8] = {
    0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL, 0xa54ff53a5f1d36f1ULL,
    0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL, 0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL};

static const uint8_t SIGMA[10][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4},
    {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13},
    {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11},
    {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5},
    {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0}};

static inline uint64_t rotr(uint64_t x, int n) { return (x >> n) | (x << (64 - n)); }

static inline uint64_t load64(const uint8_t *p) {
    uint64_t x;
    memcpy(&x, p, 8); /* x86-64 and aarch64 are little-endian, as BLAKE2b's words */
    return x;
}

#define G(a, b, c, d, x, y)            \
    do {                               \
        a = a + b + (x);               \
        d = rotr(d ^ a, 32);           \
        c = c + d;                     \
        b = rotr(b ^ c, 24);           \
        a = a + b + (y);               \
        d = rotr(d ^ a, 16);           \
        c = c + d;                     \
        b = rotr(b ^ c, 63);           \
    } while (0)

static void compress(uint64_t h[8], const uint8_t block[128], uint64_t t, int last) {
    uint64_t m[16], v[16];
    for (int i = 0; i < 16; i++) m[i] = load64(block + 8 * i);
    for (int i = 0; i < 8; i++) {
        v[i] = h[i];
        v[i + 8] = IV[i];
    }
    v[12] ^= t; /* byte counter, low word (messages here are far below 2^64 bytes) */
    if (last) v[14] = ~v[14];
    for (int r = 0; r < 12; r++) {
        const uint8_t *s = SIGMA[r % 10];
        G(v[0], v[4], v[8], v[12], m[s[0]], m[s[1]]);
        G(v[1], v[5], v[9], v[13], m[s[2]], m[s[3]]);
        G(v[2], v[6], v[10], v[14], m[s[4]], m[s[5]]);
        G(v[3], v[7], v[11], v[15], m[s[6]], m[s[7]]);
        G(v[0], v[5], v[10], v[15], m[s[8]], m[s[9]]);
        G(v[1], v[6], v[11], v[12], m[s[10]], m[s[11]]);
        G(v[2], v[7], v[8], v[13], m[s[12]], m[s[13]]);
        G(v[3], v[4], v[9], v[14], m[s[14]], m[s[15]]);
    }
    for (int i = 0; i < 8; i++) h[i] ^= v[i] ^ v[i + 8];
}

/* BLAKE2b, no key, 16-byte digest, of the `len` bytes at msg. */
static void blake2b_128(const uint8_t *msg, uint64_t len, uint8_t out[16]) {
    uint64_t h[8];
    uint8_t block[128];
    memcpy(h, IV, sizeof h);
    h[0] ^= 0x01010000ULL ^ 16; /* fan-out 1, depth 1, no key, digest length 16 */
    uint64_t off = 0;
    do {
        uint64_t n = len - off < 128 ? len - off : 128;
        memset(block, 0, sizeof block);
        memcpy(block, msg + off, n);
        off += n;
        compress(h, block, off, off == len);
    } while (off < len);
    memcpy(out, h, 16);
}

/* out[16 * b] = digest of block b; the chain starts at `parent` (the root or block start-1). */
void chained_blake2b_128(const uint8_t parent[16], const int64_t *tokens, int64_t n_blocks, int64_t block_size,
                         uint8_t *out) {
    const uint64_t len = 16 + 8 * (uint64_t)block_size;
    uint8_t msg[16 + 8 * 1024];
    if (block_size > 1024) return; /* the caller checks; a bigger block never reaches here */
    const uint8_t *prev = parent;
    for (int64_t b = 0; b < n_blocks; b++) {
        memcpy(msg, prev, 16);
        memcpy(msg + 16, tokens + b * block_size, 8 * (size_t)block_size);
        blake2b_128(msg, len, out + 16 * b);
        prev = out + 16 * b;
    }
}
