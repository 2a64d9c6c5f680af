/* Chained BLAKE2b-128 block hashes (RFC 7693), one call per prompt, straight from the Python
 * list of token ids. Block i's digest is BLAKE2b(digest_size=16, salt=digest of block i-1) of
 * block i's tokens as little-endian int64: exactly hashlib.blake2b(data, digest_size=16,
 * salt=parent), which splitserve/hashing.py falls back to. The parent travels in the parameter
 * block, not the message, so a 16-token block is one 128-byte compression.
 *
 * Built against Python.h and loaded with ctypes.PyDLL (the GIL stays held): it reads the list's
 * ints and builds the digests' bytes objects itself. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static const uint64_t IV[8] = {
    0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL, 0xa54ff53a5f1d36f1ULL,
    0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL, 0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL};

static const uint8_t SIGMA[12][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4},
    {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13},
    {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11},
    {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5},
    {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3}};

static inline uint64_t rotr(uint64_t x, int n) { return (x >> n) | (x << (64 - n)); }

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

/* Constant round numbers: the message schedule resolves at compile time. */
#define ROUND(r)                                                        \
    do {                                                                \
        G(v[0], v[4], v[8], v[12], m[SIGMA[r][0]], m[SIGMA[r][1]]);     \
        G(v[1], v[5], v[9], v[13], m[SIGMA[r][2]], m[SIGMA[r][3]]);     \
        G(v[2], v[6], v[10], v[14], m[SIGMA[r][4]], m[SIGMA[r][5]]);    \
        G(v[3], v[7], v[11], v[15], m[SIGMA[r][6]], m[SIGMA[r][7]]);    \
        G(v[0], v[5], v[10], v[15], m[SIGMA[r][8]], m[SIGMA[r][9]]);    \
        G(v[1], v[6], v[11], v[12], m[SIGMA[r][10]], m[SIGMA[r][11]]);  \
        G(v[2], v[7], v[8], v[13], m[SIGMA[r][12]], m[SIGMA[r][13]]);   \
        G(v[3], v[4], v[9], v[14], m[SIGMA[r][14]], m[SIGMA[r][15]]);   \
    } while (0)

/* m: the 16 message words (x86-64 and aarch64 are little-endian, as BLAKE2b's words). */
static void compress(uint64_t h[8], const uint64_t m[16], uint64_t t, int last) {
    uint64_t v[16];
    for (int i = 0; i < 8; i++) {
        v[i] = h[i];
        v[i + 8] = IV[i];
    }
    v[12] ^= t; /* byte counter, low word (messages here are far below 2^64 bytes) */
    if (last) v[14] = ~v[14];
    ROUND(0); ROUND(1); ROUND(2); ROUND(3); ROUND(4); ROUND(5);
    ROUND(6); ROUND(7); ROUND(8); ROUND(9); ROUND(10); ROUND(11);
    for (int i = 0; i < 8; i++) h[i] ^= v[i] ^ v[i + 8];
}

/* BLAKE2b, no key, 16-byte digest, 16-byte salt, of `n` words (n >= 1). */
static void blake2b_128_salted(const uint64_t *words, int64_t n, const uint8_t salt[16], uint8_t out[16]) {
    uint64_t h[8], s[2], tail[16];
    memcpy(h, IV, sizeof h);
    memcpy(s, salt, 16);
    h[0] ^= 0x01010000ULL ^ 16; /* fan-out 1, depth 1, no key, digest length 16 */
    h[4] ^= s[0];               /* parameter block bytes 32..47: the salt */
    h[5] ^= s[1];
    int64_t off = 0;
    for (; n - off > 16; off += 16) compress(h, words + off, 8 * (uint64_t)(off + 16), 0);
    memset(tail, 0, sizeof tail);
    memcpy(tail, words + off, 8 * (size_t)(n - off));
    compress(h, tail, 8 * (uint64_t)n, 1);
    memcpy(out, h, 16);
}

/* A token id as int64, -1 with an error set where it is not an int in range. Ids are small
 * ints: read their one digit straight from the object (PyLong_AsLongLong per id was half the
 * cost of hashing a prompt). */
static inline int as_word(PyObject *o, uint64_t *w) {
#if PY_VERSION_HEX < 0x030C0000
    if (PyLong_CheckExact(o) && (Py_SIZE(o) == 1 || Py_SIZE(o) == 0)) {
        *w = Py_SIZE(o) ? (uint64_t)((PyLongObject *)o)->ob_digit[0] : 0;
        return 0;
    }
#else
    if (PyLong_CheckExact(o) && PyUnstable_Long_IsCompact((PyLongObject *)o)) {
        *w = (uint64_t)(int64_t)PyUnstable_Long_CompactValue((PyLongObject *)o);
        return 0;
    }
#endif
    long long x = PyLong_AsLongLong(o);
    if (x == -1 && PyErr_Occurred()) return -1; /* not an int, or outside int64 */
    *w = (uint64_t)x;
    return 0;
}

/* Is `digest` in one of the containers in the tuple `known`? -1: an error is set. */
static int known_anywhere(PyObject *known, PyObject *digest) {
    for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(known); k++) {
        int found = PySequence_Contains(PyTuple_GET_ITEM(known, k), digest);
        if (found) return found;
    }
    return 0;
}

/* Recently hashed chains. The ingress hashes every prompt, and prompts that matter to routing
 * share prefixes (a system prompt, a conversation's earlier turns): a block whose token ids and
 * parent equal a remembered chain's takes the remembered digest, a comparison instead of a
 * compression. The digests are the same either way (the ids are compared word for word). One
 * way per chain family (its parent and first block), least recently used replaced. */
#define MEMO_WAYS 8
#define MEMO_MAX_WORDS (1 << 16) /* token ids remembered per chain at most */

typedef struct {
    uint8_t parent[16];
    Py_ssize_t block_size, n, cap; /* blocks remembered, blocks there is room for */
    uint64_t *words;               /* n * block_size token ids */
    uint8_t *digests;              /* n * 16 */
    uint64_t used;
} Chain;

static Chain memo[MEMO_WAYS];
static uint64_t memo_clock;
static int memo_busy; /* a call is using the memo (a `known` container's Python code let another thread in) */

/* The remembered chain from `parent` whose first block is `first`, or else a way made free for it. */
static Chain *memo_chain(const uint8_t *parent, Py_ssize_t bs, const uint64_t *first) {
    Chain *c = &memo[0];
    for (int i = 0; i < MEMO_WAYS; i++) {
        Chain *m = &memo[i];
        if (m->n && m->block_size == bs && memcmp(m->parent, parent, 16) == 0 &&
            memcmp(m->words, first, sizeof(uint64_t) * (size_t)bs) == 0) {
            c = m;
            goto found;
        }
        if (m->used < c->used) c = m;
    }
    memcpy(c->parent, parent, 16);
    if (c->block_size != bs) {
        PyMem_RawFree(c->words);
        PyMem_RawFree(c->digests);
        c->words = NULL, c->digests = NULL, c->cap = 0, c->block_size = bs;
    }
    c->n = 0;
found:
    c->used = ++memo_clock;
    return c;
}

/* Remember block b of chain c (b <= c->n: what followed it is dropped). -1: no room (the
 * chain is remembered as far as it went; nothing is raised). */
static int memo_put(Chain *c, Py_ssize_t b, const uint64_t *words, const uint8_t *digest) {
    Py_ssize_t bs = c->block_size;
    if (b >= c->cap) {
        Py_ssize_t cap = c->cap ? c->cap * 2 : 64;
        if (cap * bs > MEMO_MAX_WORDS) return -1;
        uint64_t *w = PyMem_RawRealloc(c->words, sizeof(uint64_t) * (size_t)(cap * bs));
        if (w == NULL) return -1;
        c->words = w;
        uint8_t *d = PyMem_RawRealloc(c->digests, 16 * (size_t)cap);
        if (d == NULL) return -1;
        c->digests = d;
        c->cap = cap;
    }
    memcpy(c->words + b * bs, words, sizeof(uint64_t) * (size_t)bs);
    memcpy(c->digests + 16 * b, digest, 16);
    c->n = b + 1;
    return 0;
}

/* The digests of blocks [start, start + n_blocks) of `tokens` (a list or tuple of ints), the
 * chain starting at `parent`; a new list of bytes, or NULL with an exception set. `known`: None,
 * or a tuple of containers of digests (dicts, the router's KV tables): every `check_every`-th
 * block (and the last) is looked up there, and the chain stops after the first looked-up digest
 * none of them holds (the caller wants only what might be known; the rest costs hashing for
 * nothing). */
PyObject *chained_blake2b_128(PyObject *tokens, Py_ssize_t start, Py_ssize_t n_blocks, Py_ssize_t block_size,
                              const uint8_t *parent, PyObject *known, Py_ssize_t check_every) {
    PyObject *seq = PySequence_Fast(tokens, "token ids must be a sequence of ints");
    if (seq == NULL) return NULL;
    PyObject *out = NULL;
    uint64_t *words = NULL;
    int using_memo = !memo_busy;
    memo_busy = 1;
    if ((start + n_blocks) * block_size > PySequence_Fast_GET_SIZE(seq) || block_size <= 0 || n_blocks < 0 ||
        check_every <= 0 || (known != Py_None && !PyTuple_Check(known))) {
        PyErr_SetString(PyExc_ValueError, "blocks beyond the end of the token ids, or bad arguments");
        goto done;
    }
    PyObject **items = PySequence_Fast_ITEMS(seq) + start * block_size;
    words = PyMem_Malloc(sizeof(uint64_t) * (size_t)block_size);
    out = PyList_New(0);
    if (words == NULL || out == NULL) {
        if (words == NULL) PyErr_NoMemory();
        goto fail;
    }
    uint8_t digest[16];
    const uint8_t *prev = parent;
    Chain *c = NULL; /* the remembered chain this one follows, NULL once it cannot be remembered */
    for (Py_ssize_t b = 0; b < n_blocks; b++) {
        for (Py_ssize_t i = 0; i < block_size; i++) {
            if (as_word(items[b * block_size + i], &words[i]) < 0) goto fail;
        }
        if (b == 0 && using_memo) c = memo_chain(parent, block_size, words);
        if (c != NULL && b < c->n && memcmp(c->words + b * block_size, words, sizeof(uint64_t) * (size_t)block_size) == 0) {
            memcpy(digest, c->digests + 16 * b, 16);
        } else {
            blake2b_128_salted(words, block_size, prev, digest);
            if (c != NULL && memo_put(c, b, words, digest) < 0) c = NULL;
        }
        PyObject *d = PyBytes_FromStringAndSize((const char *)digest, 16);
        if (d == NULL || PyList_Append(out, d) < 0) {
            Py_XDECREF(d);
            goto fail;
        }
        Py_DECREF(d); /* the list holds it */
        prev = (const uint8_t *)PyBytes_AS_STRING(d);
        if (known != Py_None && ((b + 1) % check_every == 0 || b + 1 == n_blocks)) {
            int found = known_anywhere(known, d);
            if (found < 0) goto fail;
            if (!found) break;
        }
    }
    goto done;
fail:
    Py_CLEAR(out);
done:
    if (using_memo) memo_busy = 0;
    PyMem_Free(words);
    Py_DECREF(seq);
    return out;
}
