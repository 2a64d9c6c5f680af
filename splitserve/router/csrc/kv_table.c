/* One tier of the router's KV index (router/kv_table.py): block hash -> the holders' bitmask (a
 * Python int), least recently stored or matched first, as a native type. Built against Python.h
 * and loaded with ctypes.PyDLL (the GIL stays held); `kv_table_type()` hands out the type.
 *
 * Why native: a routing decision looks up every block of a prompt's chain (136 for an 8K-token
 * prompt behind a shared 2K system prompt) in a table of up to a million hashes. A dict of bytes
 * costs three cache misses a lookup (its index, its entry, the key object) and rehashes each
 * fresh digest; here the 16-byte key sits in the entry, the digest's own bytes are the hash, and
 * the lookups of a chain are prefetched together, so their misses overlap.
 *
 * Layout: `entries` (key, value, LRU links) stay where they are allocated, reused through a free
 * list; `slots` is an open-addressed index (linear probing, backward-shift deletion, at most half
 * full) of (32-bit tag << 32 | entry + 1) words. Values are owned references; ints hold no
 * references, so the type needs no GC support. */
#define PY_SSIZE_T_CLEAN
#define _DEFAULT_SOURCE /* MADV_HUGEPAGE */
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>

typedef struct {
    uint8_t key[16];
    PyObject *bits; /* NULL: a free entry */
    int32_t prev, next; /* LRU neighbours (older, newer); for a free entry `next` is the free list */
} Entry;

typedef struct {
    PyObject_HEAD
    Entry *entries;
    int32_t n_entries, cap_entries, free_head;
    uint64_t *slots;
    size_t entries_bytes, slots_bytes; /* as mapped */
    uint64_t mask; /* slots - 1, a power of two minus one */
    int shift;     /* 64 - log2(slots): the home slot is the hash's top bits */
    int32_t oldest, newest;
    Py_ssize_t len;
} Table;

#define NONE (-1)
#define CHUNK 64 /* lookups prefetched together */

/* Zeroed memory for the arrays, mapped on its own: a million entries span 48 MB, and with 4 KB
 * pages nearly every lookup of a chain would also miss the TLB, so ask for huge pages. */
static void *region(size_t bytes) {
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return NULL;
#ifdef MADV_HUGEPAGE
    if (bytes >= (2u << 20)) madvise(p, bytes, MADV_HUGEPAGE);
#endif
    return p;
}

static void unmap(void *p, size_t bytes) {
    if (p != NULL) munmap(p, bytes);
}

static inline uint64_t key_hash(const uint8_t *key) {
    uint64_t h;
    memcpy(&h, key, 8);
    return h * 0x9e3779b97f4a7c15ULL; /* digests are uniform already; this spreads test keys too */
}
static inline uint32_t key_tag(const uint8_t *key) {
    uint32_t t;
    memcpy(&t, key + 8, 4);
    return t;
}
static inline uint64_t home(const Table *t, uint64_t h) { return h >> t->shift; }

/* The key of a hash object: 16-byte bytes, or NULL with TypeError set. */
static const uint8_t *key_of(PyObject *h) {
    if (!PyBytes_CheckExact(h) || PyBytes_GET_SIZE(h) != 16) {
        PyErr_SetString(PyExc_TypeError, "a block hash is 16 bytes (splitserve.hashing)");
        return NULL;
    }
    return (const uint8_t *)PyBytes_AS_STRING(h);
}

/* The slot holding `key`, or the empty slot where it would go (slots[i] == 0). */
static uint64_t probe(const Table *t, const uint8_t *key, uint64_t h) {
    uint64_t i = home(t, h), tag = key_tag(key);
    for (;; i = (i + 1) & t->mask) {
        uint64_t s = t->slots[i];
        if (s == 0) return i;
        if ((s >> 32) == tag && memcmp(t->entries[(uint32_t)s - 1].key, key, 16) == 0) return i;
    }
}

static int32_t find(const Table *t, const uint8_t *key) {
    uint64_t s = t->slots[probe(t, key, key_hash(key))];
    return s ? (int32_t)((uint32_t)s - 1) : NONE;
}

static void unlink_lru(Table *t, int32_t e) {
    Entry *x = &t->entries[e];
    if (x->prev != NONE) t->entries[x->prev].next = x->next; else t->oldest = x->next;
    if (x->next != NONE) t->entries[x->next].prev = x->prev; else t->newest = x->prev;
}

static void link_newest(Table *t, int32_t e) {
    Entry *x = &t->entries[e];
    x->prev = t->newest;
    x->next = NONE;
    if (t->newest != NONE) t->entries[t->newest].next = e; else t->oldest = e;
    t->newest = e;
}

static void make_newest(Table *t, int32_t e) {
    if (t->newest != e) {
        unlink_lru(t, e);
        link_newest(t, e);
    }
}

static int resize_slots(Table *t, uint64_t n) {
    uint64_t *slots = region(n * sizeof *slots);
    if (slots == NULL) return -1;
    unmap(t->slots, t->slots_bytes);
    t->slots = slots;
    t->slots_bytes = n * sizeof *slots;
    t->mask = n - 1;
    t->shift = 64 - __builtin_ctzll(n);
    for (int32_t e = 0; e < t->n_entries; e++) {
        if (t->entries[e].bits == NULL) continue;
        const uint8_t *k = t->entries[e].key;
        t->slots[probe(t, k, key_hash(k))] = ((uint64_t)key_tag(k) << 32) | (uint32_t)(e + 1);
    }
    return 0;
}

/* Room for one more entry: an entry to fill and an index at most half full. */
static int reserve(Table *t) {
    if ((uint64_t)(t->len + 1) * 2 > t->mask + 1 && resize_slots(t, (t->mask + 1) * 2) < 0) return -1;
    if (t->free_head == NONE && t->n_entries == t->cap_entries) {
        if (t->cap_entries >= INT32_MAX / 2) return -1;
        int32_t cap = t->cap_entries ? t->cap_entries * 2 : 64;
        Entry *grown = region(sizeof(Entry) * (size_t)cap);
        if (grown == NULL) return -1;
        if (t->n_entries) memcpy(grown, t->entries, sizeof(Entry) * (size_t)t->n_entries);
        unmap(t->entries, t->entries_bytes);
        t->entries = grown;
        t->entries_bytes = sizeof(Entry) * (size_t)cap;
        t->cap_entries = cap;
    }
    return 0;
}

/* Insert `key` (absent; `slot` is where probe() says it goes), holding `bits` (stolen). */
static int32_t insert(Table *t, uint64_t slot, const uint8_t *key, PyObject *bits) {
    int32_t e;
    if (t->free_head != NONE) {
        e = t->free_head;
        t->free_head = t->entries[e].next;
    } else {
        e = t->n_entries++;
    }
    memcpy(t->entries[e].key, key, 16);
    t->entries[e].bits = bits;
    t->slots[slot] = ((uint64_t)key_tag(key) << 32) | (uint32_t)(e + 1);
    link_newest(t, e);
    t->len++;
    return e;
}

/* Remove the entry in `slot`: backward-shift the probe run after it (no tombstones). */
static void remove_at(Table *t, uint64_t slot) {
    int32_t e = (int32_t)((uint32_t)t->slots[slot] - 1);
    unlink_lru(t, e);
    Py_CLEAR(t->entries[e].bits);
    t->entries[e].next = t->free_head;
    t->free_head = e;
    t->len--;
    uint64_t i = slot, j = slot;
    for (;;) {
        j = (j + 1) & t->mask;
        uint64_t s = t->slots[j];
        if (s == 0) break;
        uint64_t k = home(t, key_hash(t->entries[(uint32_t)s - 1].key));
        /* the entry at j may move back to i unless its home lies cyclically in (i, j] */
        if (((j - k) & t->mask) >= ((j - i) & t->mask)) {
            t->slots[i] = s;
            i = j;
        }
    }
    t->slots[i] = 0;
}

static PyObject *table_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    if (PyTuple_GET_SIZE(args) || (kw && PyDict_GET_SIZE(kw))) {
        PyErr_SetString(PyExc_TypeError, "KVTable() takes no arguments");
        return NULL;
    }
    Table *t = (Table *)type->tp_alloc(type, 0);
    if (t == NULL) return NULL;
    t->free_head = t->oldest = t->newest = NONE;
    if (resize_slots(t, 64) < 0) {
        Py_DECREF(t);
        return PyErr_NoMemory();
    }
    return (PyObject *)t;
}

static void table_dealloc(PyObject *self) {
    Table *t = (Table *)self;
    for (int32_t e = 0; e < t->n_entries; e++) Py_XDECREF(t->entries[e].bits);
    unmap(t->entries, t->entries_bytes);
    unmap(t->slots, t->slots_bytes);
    PyTypeObject *type = Py_TYPE(self);
    type->tp_free(self);
    Py_DECREF(type);
}

static Py_ssize_t table_len(PyObject *self) { return ((Table *)self)->len; }

static int table_contains(PyObject *self, PyObject *h) {
    const uint8_t *key = key_of(h);
    return key == NULL ? -1 : find((Table *)self, key) != NONE;
}

/* The hashes argument as a fast sequence (a new reference), or NULL. */
static PyObject *hash_seq(PyObject *hashes) { return PySequence_Fast(hashes, "hashes must be a sequence"); }

/* 0 if `bit` is a positive int (a holder slot's bit), else -1 with TypeError set. */
static int check_bit(PyObject *bit) {
    static PyObject *zero = NULL;
    if (zero == NULL && (zero = PyLong_FromLong(0)) == NULL) return -1;
    int positive = PyLong_Check(bit) ? PyObject_RichCompareBool(bit, zero, Py_GT) : 0;
    if (positive > 0) return 0;
    if (positive == 0) PyErr_SetString(PyExc_TypeError, "a holder bit is a positive int");
    return -1;
}

/* store(hashes, bit): each hash's holders gain `bit` (an int); each becomes the newest. */
static PyObject *table_store(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) return PyErr_Format(PyExc_TypeError, "store(hashes, bit)");
    if (check_bit(args[1]) < 0) return NULL;
    Table *t = (Table *)self;
    PyObject *seq = hash_seq(args[0]), *bit = args[1];
    if (seq == NULL) return NULL;
    PyObject *was = NULL, *now = NULL; /* the last or-ing, reused: a batch's hashes share holders */
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {
        const uint8_t *key = key_of(items[i]);
        if (key == NULL || reserve(t) < 0) goto fail;
        uint64_t slot = probe(t, key, key_hash(key));
        if (t->slots[slot] == 0) {
            Py_INCREF(bit);
            insert(t, slot, key, bit);
            continue;
        }
        Entry *x = &t->entries[(uint32_t)t->slots[slot] - 1];
        if (x->bits != was) {
            PyObject *or = PyNumber_Or(x->bits, bit);
            if (or == NULL) goto fail;
            Py_XSETREF(now, or);
            Py_INCREF(x->bits);
            Py_XSETREF(was, x->bits);
        }
        Py_INCREF(now);
        Py_SETREF(x->bits, now);
        make_newest(t, (int32_t)(x - t->entries));
    }
    Py_XDECREF(was);
    Py_XDECREF(now);
    Py_DECREF(seq);
    Py_RETURN_NONE;
fail:
    if (!PyErr_Occurred()) PyErr_NoMemory();
    Py_XDECREF(was);
    Py_XDECREF(now);
    Py_DECREF(seq);
    return NULL;
}

/* Drop `bit` from the entry in `slot`'s holders (`clear`: the bits without it); 0 left: remove. */
static int drop_at(Table *t, uint64_t slot, PyObject *clear) {
    Entry *x = &t->entries[(uint32_t)t->slots[slot] - 1];
    PyObject *left = PyNumber_And(x->bits, clear);
    if (left == NULL) return -1;
    int empty = PyObject_Not(left);
    if (empty) {
        Py_DECREF(left);
        remove_at(t, slot);
    } else {
        Py_SETREF(x->bits, left);
    }
    return empty < 0 ? -1 : 0;
}

/* discard(hashes, bit): each hash's holders lose `bit`; a hash nobody holds is forgotten. */
static PyObject *table_discard(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) return PyErr_Format(PyExc_TypeError, "discard(hashes, bit)");
    if (check_bit(args[1]) < 0) return NULL;
    Table *t = (Table *)self;
    PyObject *seq = hash_seq(args[0]);
    if (seq == NULL) return NULL;
    PyObject *clear = PyNumber_Invert(args[1]), *result = NULL;
    if (clear == NULL) goto done;
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {
        const uint8_t *key = key_of(items[i]);
        if (key == NULL) goto done;
        uint64_t slot = probe(t, key, key_hash(key));
        if (t->slots[slot] != 0 && drop_at(t, slot, clear) < 0) goto done;
    }
    result = Py_NewRef(Py_None);
done:
    Py_XDECREF(clear);
    Py_DECREF(seq);
    return result;
}

/* drop_bit(bit): every hash's holders lose `bit` (a worker left). */
static PyObject *table_drop_bit(PyObject *self, PyObject *bit) {
    if (check_bit(bit) < 0) return NULL;
    Table *t = (Table *)self;
    PyObject *clear = PyNumber_Invert(bit);
    if (clear == NULL) return NULL;
    for (int32_t e = 0; e < t->n_entries; e++) {
        PyObject *bits = t->entries[e].bits;
        if (bits == NULL) continue;
        PyObject *held = PyNumber_And(bits, bit);
        int has = held == NULL ? -1 : PyObject_IsTrue(held);
        Py_XDECREF(held);
        if (has < 0 || (has && drop_at(t, probe(t, t->entries[e].key, key_hash(t->entries[e].key)), clear) < 0)) {
            Py_DECREF(clear);
            return NULL;
        }
    }
    Py_DECREF(clear);
    Py_RETURN_NONE;
}

/* evict(n): forget the n least recent hashes (fewer if the table holds fewer). */
static PyObject *table_evict(PyObject *self, PyObject *arg) {
    Table *t = (Table *)self;
    Py_ssize_t n = PyLong_AsSsize_t(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    for (; n > 0 && t->oldest != NONE; n--) {
        const uint8_t *k = t->entries[t->oldest].key;
        remove_at(t, probe(t, k, key_hash(k)));
    }
    Py_RETURN_NONE;
}

/* The entries of items[0:n] in order, up to the first absent one: their count. The lookups go in
 * chunks whose slots, then entries, are prefetched together before any is compared. */
static Py_ssize_t leading(Table *t, PyObject **items, Py_ssize_t n, int32_t *out) {
    uint64_t h[CHUNK];
    const uint8_t *keys[CHUNK];
    for (Py_ssize_t base = 0; base < n; base += CHUNK) {
        Py_ssize_t m = n - base < CHUNK ? n - base : CHUNK;
        for (Py_ssize_t i = 0; i < m; i++) {
            if ((keys[i] = key_of(items[base + i])) == NULL) return -1;
            h[i] = key_hash(keys[i]);
            __builtin_prefetch(&t->slots[home(t, h[i])]);
        }
        for (Py_ssize_t i = 0; i < m; i++) {
            uint64_t s = t->slots[home(t, h[i])];
            if (s) __builtin_prefetch(&t->entries[(uint32_t)s - 1]);
        }
        for (Py_ssize_t i = 0; i < m; i++) {
            uint64_t s = t->slots[probe(t, keys[i], h[i])];
            if (s == 0) return base + i;
            out[base + i] = (int32_t)((uint32_t)s - 1);
        }
    }
    return n;
}

/* runs(hashes): how far `hashes` go in the table, in runs of equal holders: [(end, bits), ...],
 * each run hashes[previous end:end]; the last end is the first hash not held (or the length).
 * Values are compared only where the objects differ (a stored batch shares one object). */
static PyObject *table_runs(PyObject *self, PyObject *hashes) {
    Table *t = (Table *)self;
    PyObject *seq = hash_seq(hashes), *out = NULL;
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), n_runs = 0;
    int32_t *found = PyMem_Malloc(sizeof(int32_t) * (size_t)(n + 1));
    Py_ssize_t *ends = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)(n + 1));
    PyObject **bits = PyMem_Malloc(sizeof(PyObject *) * (size_t)(n + 1));
    if (found == NULL || ends == NULL || bits == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t depth = leading(t, PySequence_Fast_ITEMS(seq), n, found);
    if (depth < 0) goto done;
    for (Py_ssize_t i = 0; i < depth; i++) {
        PyObject *b = t->entries[found[i]].bits;
        if (n_runs) {
            int same = bits[n_runs - 1] == b ? 1 : PyObject_RichCompareBool(bits[n_runs - 1], b, Py_EQ);
            if (same < 0) goto done;
            if (same) {
                ends[n_runs - 1] = i + 1;
                continue;
            }
        }
        bits[n_runs] = Py_NewRef(b); /* owned: building the answer below may run a collection */
        ends[n_runs++] = i + 1;
    }
    out = PyList_New(n_runs);
    for (Py_ssize_t r = 0; out != NULL && r < n_runs; r++) {
        PyObject *run = Py_BuildValue("(nO)", ends[r], bits[r]);
        if (run == NULL) Py_CLEAR(out);
        else PyList_SET_ITEM(out, r, run);
    }
done:
    for (Py_ssize_t r = 0; r < n_runs; r++) Py_DECREF(bits[r]);
    PyMem_Free(found);
    PyMem_Free(ends);
    PyMem_Free(bits);
    Py_DECREF(seq);
    return out;
}

/* touch(hashes): the held ones become the newest, in order. */
static PyObject *table_touch(PyObject *self, PyObject *hashes) {
    Table *t = (Table *)self;
    PyObject *seq = hash_seq(hashes);
    if (seq == NULL) return NULL;
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {
        const uint8_t *key = key_of(items[i]);
        if (key == NULL) {
            Py_DECREF(seq);
            return NULL;
        }
        int32_t e = find(t, key);
        if (e != NONE) make_newest(t, e);
    }
    Py_DECREF(seq);
    Py_RETURN_NONE;
}

/* get(hash): its holders' bits, or None. */
static PyObject *table_get(PyObject *self, PyObject *h) {
    const uint8_t *key = key_of(h);
    if (key == NULL) return NULL;
    int32_t e = find((Table *)self, key);
    return Py_NewRef(e == NONE ? Py_None : ((Table *)self)->entries[e].bits);
}

/* keys(): the hashes, least recent first. */
static PyObject *table_keys(PyObject *self, PyObject *unused) {
    (void)unused;
    Table *t = (Table *)self;
    PyObject *out = PyList_New(t->len);
    Py_ssize_t i = 0;
    for (int32_t e = t->oldest; out != NULL && e != NONE; e = t->entries[e].next, i++) {
        PyObject *k = PyBytes_FromStringAndSize((const char *)t->entries[e].key, 16);
        if (k == NULL) Py_CLEAR(out);
        else PyList_SET_ITEM(out, i, k);
    }
    return out;
}

static PyMethodDef methods[] = {
    {"store", (PyCFunction)(void (*)(void))table_store, METH_FASTCALL, "store(hashes, bit)"},
    {"discard", (PyCFunction)(void (*)(void))table_discard, METH_FASTCALL, "discard(hashes, bit)"},
    {"drop_bit", table_drop_bit, METH_O, "drop_bit(bit)"},
    {"evict", table_evict, METH_O, "evict(n)"},
    {"runs", table_runs, METH_O, "runs(hashes) -> [(end, bits), ...]"},
    {"touch", table_touch, METH_O, "touch(hashes)"},
    {"get", table_get, METH_O, "get(hash) -> bits or None"},
    {"keys", table_keys, METH_NOARGS, "keys() -> hashes, least recent first"},
    {NULL, NULL, 0, NULL}};

static PyType_Slot slots[] = {
    {Py_tp_new, table_new},
    {Py_tp_dealloc, table_dealloc},
    {Py_tp_methods, methods},
    {Py_sq_length, table_len},
    {Py_sq_contains, table_contains},
    {Py_tp_doc, "One tier of the router's KV index: block hash -> holder bits, least recent first."},
    {0, NULL}};

static PyType_Spec spec = {"splitserve.router.kv_table.NativeKVTable", sizeof(Table), 0, Py_TPFLAGS_DEFAULT, slots};

/* The type (a new reference), created on first use. */
PyObject *kv_table_type(void) {
    static PyObject *type = NULL;
    if (type == NULL) type = PyType_FromSpec(&spec);
    return Py_XNewRef(type);
}
