/* The per-record costs of the dedup step in C: record IDs and Bloom probes, a batch per call.
 *
 * An optional accelerator of dedup/ids.py and dedup/buckets.py (built when the installing machine
 * has a C compiler; setup.py). Every function here computes exactly what the pure-Python path
 * computes, bit for bit, so that IDs and saved filters are the same with or without it:
 *
 * - record_pair_ids: dedup.ids.pair_id for (str|int, str|int) pairs: BLAKE2b-128 with the person
 *   "eosflow-id-v1" of b"j" + orjson.dumps([key, value]) (orjson's escapes, reproduced below),
 *   read little-endian, top bit cleared. Any other pair is handed to the Python fallback.
 * - Bloom filters in rbloom 1.5's layout (its save_bytes after the 8 bytes of k): bit i in
 *   byte i / 8 at 1 << i % 8, over len(bits) * 8 bits; the k indexes of a 127-bit ID come from
 *   rbloom's LCG over the ID as a u128: state = state * A + 1, index = (state >> 32 as u64) % bits.
 *
 * tests/unit/test_native.py checks both against the Python path (orjson + hashlib, and rbloom).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <limits.h>
#include <stdint.h>
#include <string.h>

#if !defined(__SIZEOF_INT128__)
#error "a compiler with unsigned __int128 is needed (GCC, Clang)"
#endif

typedef unsigned __int128 u128;

/* ---- BLAKE2b (RFC 7693), unkeyed, 16-byte digest, with a person ---- */

static const uint64_t IV[8] = {
    0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL, 0xa54ff53a5f1d36f1ULL,
    0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL, 0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL,
};

/* the message schedule; rounds 10 and 11 reuse rows 0 and 1 */
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
    {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
};

static uint64_t START[8]; /* the state after the parameter block (digest 16, person) */

static inline uint64_t rotr64(uint64_t x, int n) { return (x >> n) | (x << (64 - n)); }

static inline uint64_t load64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap64(v);
#endif
    return v;
}

#define G(a, b, c, d, x, y)          \
    do {                             \
        a = a + b + x;               \
        d = rotr64(d ^ a, 32);       \
        c = c + d;                   \
        b = rotr64(b ^ c, 24);       \
        a = a + b + y;               \
        d = rotr64(d ^ a, 16);       \
        c = c + d;                   \
        b = rotr64(b ^ c, 63);       \
    } while (0)

static void compress(uint64_t h[8], const uint8_t block[128], uint64_t t, int last) {
    uint64_t m[16], v[16];
    for (int i = 0; i < 16; i++) m[i] = load64(block + 8 * i);
    for (int i = 0; i < 8; i++) {
        v[i] = h[i];
        v[i + 8] = IV[i];
    }
    v[12] ^= t; /* messages here are far below 2**64 bytes: the high counter word stays 0 */
    if (last) v[14] = ~v[14];
    /* the rounds spelled out, so that the message indexes are constants */
#define ROUND(r)                                                      \
    do {                                                              \
        G(v[0], v[4], v[8], v[12], m[SIGMA[(r) % 10][0]], m[SIGMA[(r) % 10][1]]);   \
        G(v[1], v[5], v[9], v[13], m[SIGMA[(r) % 10][2]], m[SIGMA[(r) % 10][3]]);   \
        G(v[2], v[6], v[10], v[14], m[SIGMA[(r) % 10][4]], m[SIGMA[(r) % 10][5]]);  \
        G(v[3], v[7], v[11], v[15], m[SIGMA[(r) % 10][6]], m[SIGMA[(r) % 10][7]]);  \
        G(v[0], v[5], v[10], v[15], m[SIGMA[(r) % 10][8]], m[SIGMA[(r) % 10][9]]);  \
        G(v[1], v[6], v[11], v[12], m[SIGMA[(r) % 10][10]], m[SIGMA[(r) % 10][11]]); \
        G(v[2], v[7], v[8], v[13], m[SIGMA[(r) % 10][12]], m[SIGMA[(r) % 10][13]]); \
        G(v[3], v[4], v[9], v[14], m[SIGMA[(r) % 10][14]], m[SIGMA[(r) % 10][15]]); \
    } while (0)
    ROUND(0);
    ROUND(1);
    ROUND(2);
    ROUND(3);
    ROUND(4);
    ROUND(5);
    ROUND(6);
    ROUND(7);
    ROUND(8);
    ROUND(9);
    ROUND(10);
    ROUND(11);
#undef ROUND
    for (int i = 0; i < 8; i++) h[i] ^= v[i] ^ v[i + 8];
}

/* The ID of data: its BLAKE2b-128 digest read little-endian, top bit cleared. */
static u128 digest_id(const uint8_t *data, size_t len) {
    uint64_t h[8];
    uint8_t block[128];
    uint64_t t = 0;
    memcpy(h, START, sizeof h);
    while (len > 128) {
        t += 128;
        compress(h, data, t, 0);
        data += 128;
        len -= 128;
    }
    memset(block, 0, sizeof block);
    memcpy(block, data, len);
    t += len;
    compress(h, block, t, 1);
    /* the digest is h[0], h[1] as little-endian bytes: read back as a little-endian u128 */
    return ((u128)(h[1] & 0x7fffffffffffffffULL) << 64) | (u128)h[0];
}

static void init_start(void) {
    static const char person[] = "eosflow-id-v1";
    uint8_t param[64];
    memset(param, 0, sizeof param);
    param[0] = 16; /* digest length */
    param[2] = 1;  /* fanout */
    param[3] = 1;  /* depth */
    memcpy(param + 48, person, sizeof person - 1);
    for (int i = 0; i < 8; i++) START[i] = IV[i] ^ load64(param + 8 * i);
}

/* ---- 127-bit IDs as Python ints ---- */

static PyObject *id_to_long(u128 id) {
    uint8_t b[16];
    for (int i = 0; i < 16; i++) b[i] = (uint8_t)(id >> (8 * i));
#if PY_VERSION_HEX >= 0x030D0000
    return PyLong_FromUnsignedNativeBytes(b, 16, Py_ASNATIVEBYTES_LITTLE_ENDIAN);
#else
    return _PyLong_FromByteArray(b, 16, 1, 0);
#endif
}

/* The ID as rbloom reads its hash: a signed 128-bit int (-2**127 <= id < 2**127; IDs are
 * 0 <= id < 2**127) taken as a u128. -1 with an exception set otherwise. */
static int long_to_id(PyObject *o, u128 *out) {
    uint8_t b[16];
    if (!PyLong_Check(o)) {
        PyErr_Format(PyExc_TypeError, "an ID is an int, got %.100s", Py_TYPE(o)->tp_name);
        return -1;
    }
#if PY_VERSION_HEX >= 0x030D0000
    Py_ssize_t size = PyLong_AsNativeBytes(o, b, 16, Py_ASNATIVEBYTES_LITTLE_ENDIAN);
    if (size < 0) return -1;
    if (size > 16) {
        PyErr_SetString(PyExc_OverflowError, "an ID does not fit a signed 128-bit int");
        return -1;
    }
#else
    if (_PyLong_AsByteArray((PyLongObject *)o, b, 16, 1, 1) < 0) return -1;
#endif
    u128 v = 0;
    for (int i = 15; i >= 0; i--) v = (v << 8) | b[i];
    *out = v;
    return 0;
}

/* ---- orjson's encoding of [key, value] for str and int ---- */

typedef struct {
    uint8_t *buf;
    size_t len, cap;
    uint8_t small[256];
} Buf;

static int buf_reserve(Buf *b, size_t more) {
    if (b->len + more <= b->cap) return 0;
    size_t cap = (b->len + more) * 2;
    uint8_t *bigger = PyMem_Malloc(cap);
    if (bigger == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    memcpy(bigger, b->buf, b->len);
    if (b->buf != b->small) PyMem_Free(b->buf);
    b->buf = bigger;
    b->cap = cap;
    return 0;
}

static const char HEX[] = "0123456789abcdef";

/* 1: encoded; 0: not a fast-path value (the caller falls back); -1: error. */
static int encode(Buf *b, PyObject *o) {
    if (PyUnicode_CheckExact(o)) {
        Py_ssize_t n;
        const char *s = PyUnicode_AsUTF8AndSize(o, &n);
        if (s == NULL) { /* surrogates: orjson refuses them, the fallback says so */
            PyErr_Clear();
            return 0;
        }
        if (buf_reserve(b, (size_t)n * 6 + 2) < 0) return -1;
        uint8_t *w = b->buf + b->len;
        *w++ = '"';
        for (Py_ssize_t i = 0; i < n; i++) {
            uint8_t c = (uint8_t)s[i];
            if (c >= 0x20 && c != '"' && c != '\\') {
                *w++ = c;
                continue;
            }
            *w++ = '\\';
            switch (c) {
                case '"': *w++ = '"'; break;
                case '\\': *w++ = '\\'; break;
                case '\b': *w++ = 'b'; break;
                case '\t': *w++ = 't'; break;
                case '\n': *w++ = 'n'; break;
                case '\f': *w++ = 'f'; break;
                case '\r': *w++ = 'r'; break;
                default:
                    *w++ = 'u';
                    *w++ = '0';
                    *w++ = '0';
                    *w++ = (uint8_t)HEX[c >> 4];
                    *w++ = (uint8_t)HEX[c & 15];
            }
        }
        *w++ = '"';
        b->len = (size_t)(w - b->buf);
        return 1;
    }
    if (PyLong_CheckExact(o)) { /* not bool: PyBool is a subclass */
        int overflow;
        long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
        if (overflow || (v == -1 && PyErr_Occurred())) { /* orjson's u64 range, and errors */
            PyErr_Clear();
            return 0;
        }
        char digits[24];
        int n = snprintf(digits, sizeof digits, "%lld", v);
        if (buf_reserve(b, (size_t)n) < 0) return -1;
        memcpy(b->buf + b->len, digits, (size_t)n);
        b->len += (size_t)n;
        return 1;
    }
    return 0;
}

/* A new reference to pair_id(key, value): computed here for (str|int, str|int), else by
 * fallback(key, value). NULL with an exception set on errors. */
static PyObject *one_pair_id(Buf *b, PyObject *key, PyObject *value, PyObject *fallback) {
    b->len = 0;
    b->buf[b->len++] = 'j';
    b->buf[b->len++] = '[';
    int ok = encode(b, key);
    if (ok > 0) {
        if (buf_reserve(b, 1) < 0) return NULL;
        b->buf[b->len++] = ',';
        ok = encode(b, value);
    }
    if (ok < 0) return NULL;
    if (ok == 0) return PyObject_CallFunctionObjArgs(fallback, key, value, NULL);
    if (buf_reserve(b, 1) < 0) return NULL;
    b->buf[b->len++] = ']';
    return id_to_long(digest_id(b->buf, b->len));
}

/* record_pair_ids(records, fn, fallback) -> list[int] | None: pair_id(key, fn(value)) of each
 * record (key, value, timestamp) of a batch, the dedup step's IDs without two Python lists.
 * None, before fn is called, if a record is not a tuple of 3 (the caller's Python path then
 * decides what it is). The batch is read from a copy: fn may do anything to the list. */
static PyObject *record_pair_ids(PyObject *self, PyObject *args) {
    PyObject *records, *fn, *fallback;
    if (!PyArg_ParseTuple(args, "O!OO:record_pair_ids", &PyList_Type, &records, &fn, &fallback))
        return NULL;
    PyObject *batch = PyList_AsTuple(records);
    if (batch == NULL) return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(batch);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *record = PyTuple_GET_ITEM(batch, i);
        if (!PyTuple_CheckExact(record) || PyTuple_GET_SIZE(record) != 3) {
            Py_DECREF(batch);
            Py_RETURN_NONE;
        }
    }
    PyObject *out = PyList_New(0);
    if (out == NULL) {
        Py_DECREF(batch);
        return NULL;
    }
    Buf b;
    b.buf = b.small;
    b.cap = sizeof b.small;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *record = PyTuple_GET_ITEM(batch, i); /* held by batch */
        PyObject *value = PyObject_CallOneArg(fn, PyTuple_GET_ITEM(record, 1));
        if (value == NULL) goto error;
        PyObject *id = one_pair_id(&b, PyTuple_GET_ITEM(record, 0), value, fallback);
        Py_DECREF(value);
        if (id == NULL) goto error;
        int rc = PyList_Append(out, id);
        Py_DECREF(id);
        if (rc < 0) goto error;
    }
    if (b.buf != b.small) PyMem_Free(b.buf);
    Py_DECREF(batch);
    return out;
error:
    if (b.buf != b.small) PyMem_Free(b.buf);
    Py_DECREF(batch);
    Py_DECREF(out);
    return NULL;
}

/* ---- Bloom filters in rbloom's layout ---- */

#define LCG_A ((((u128)0x2360ed051fc65da4ULL) << 64) | (u128)0x4385df649fcb5cedULL)

/* k as rbloom computes it is ln 2 * bits per ID: 1 to a few dozen. */
static int check_k(unsigned long long k) {
    if (k < 1 || k > 1000) {
        PyErr_Format(PyExc_ValueError, "a filter of k=%llu hashes (1 to 1000)", k);
        return -1;
    }
    return 0;
}

static int filter_bits(Py_buffer *view, uint64_t *bits) {
    if (view->len == 0) {
        PyErr_SetString(PyExc_ValueError, "a filter of 0 bits");
        return -1;
    }
    *bits = (uint64_t)view->len * 8;
    return 0;
}

/* rbloom's next index: its LCG's next state, bits 32 to 95, modulo the filter's bits. */
static inline uint64_t next_index(u128 *state, uint64_t nbits) {
    *state = *state * LCG_A + 1;
    return (uint64_t)(*state >> 32) % nbits;
}

static inline int probe(const uint8_t *bits, uint64_t nbits, uint64_t k, u128 state) {
    for (uint64_t j = 0; j < k; j++) {
        uint64_t i = next_index(&state, nbits);
        if (!(bits[i >> 3] & (1u << (i & 7)))) return 0;
    }
    return 1;
}

/* bloom_add(bits: bytearray, k, ids: list[int]): adds the IDs. (Tried, and no faster on filters of
 * 100,000 IDs: prefetching the next ID's bits while setting this one's; a remainder without a
 * division. The k random memory accesses per ID are the cost.) */
static PyObject *bloom_add(PyObject *self, PyObject *args) {
    Py_buffer view;
    unsigned long long k;
    PyObject *ids;
    if (!PyArg_ParseTuple(args, "w*KO!:bloom_add", &view, &k, &PyList_Type, &ids)) return NULL;
    uint64_t nbits;
    if (filter_bits(&view, &nbits) < 0 || check_k(k) < 0) goto error;
    uint8_t *bits = view.buf;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(ids); i++) {
        u128 state;
        if (long_to_id(PyList_GET_ITEM(ids, i), &state) < 0) goto error;
        for (uint64_t j = 0; j < k; j++) {
            uint64_t b = next_index(&state, nbits);
            bits[b >> 3] |= (uint8_t)(1u << (b & 7));
        }
    }
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
error:
    PyBuffer_Release(&view);
    return NULL;
}

/* bloom_contains(bits, k, id) -> bool */
static PyObject *bloom_contains(PyObject *self, PyObject *args) {
    Py_buffer view;
    unsigned long long k;
    PyObject *id;
    if (!PyArg_ParseTuple(args, "y*KO:bloom_contains", &view, &k, &id)) return NULL;
    uint64_t nbits;
    u128 state;
    int found = -1;
    if (filter_bits(&view, &nbits) == 0 && check_k(k) == 0 && long_to_id(id, &state) == 0)
        found = probe(view.buf, nbits, k, state);
    PyBuffer_Release(&view);
    if (found < 0) return NULL;
    return PyBool_FromLong(found);
}

/* bloom_or(bits, other): bits |= other, two filters of one size. */
static PyObject *bloom_or(PyObject *self, PyObject *args) {
    Py_buffer a, b;
    if (!PyArg_ParseTuple(args, "w*y*:bloom_or", &a, &b)) return NULL;
    if (a.len != b.len) {
        PyBuffer_Release(&a);
        PyBuffer_Release(&b);
        PyErr_SetString(PyExc_ValueError, "filters of different sizes");
        return NULL;
    }
    uint8_t *x = a.buf;
    const uint8_t *y = b.buf;
    for (Py_ssize_t i = 0; i < a.len; i++) x[i] |= y[i];
    PyBuffer_Release(&a);
    PyBuffer_Release(&b);
    Py_RETURN_NONE;
}

/* Filter views for a batch: buffers, sizes in bits and k of each filter in a list. */
typedef struct {
    Py_ssize_t n, got;
    Py_buffer *views;
    uint64_t *sizes, *ks;
} Filters;

static void filters_release(Filters *f) {
    for (Py_ssize_t i = 0; i < f->got; i++) PyBuffer_Release(&f->views[i]);
    PyMem_Free(f->views);
    PyMem_Free(f->sizes);
    PyMem_Free(f->ks);
}

static int filters_get(Filters *f, PyObject *filters, PyObject *ks) {
    f->n = PyList_GET_SIZE(filters);
    f->got = 0;
    size_t cells = f->n ? (size_t)f->n : 1;
    f->views = PyMem_Calloc(cells, sizeof(Py_buffer));
    f->sizes = PyMem_Calloc(cells, sizeof(uint64_t));
    f->ks = PyMem_Calloc(cells, sizeof(uint64_t));
    if (f->views == NULL || f->sizes == NULL || f->ks == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    if (PyList_GET_SIZE(ks) != f->n) {
        PyErr_SetString(PyExc_ValueError, "filters and ks differ in length");
        return -1;
    }
    for (; f->got < f->n; f->got++) {
        Py_ssize_t i = f->got;
        f->ks[i] = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(ks, i));
        if (f->ks[i] == (uint64_t)-1 && PyErr_Occurred()) return -1;
        if (check_k(f->ks[i]) < 0) return -1;
        if (PyObject_GetBuffer(PyList_GET_ITEM(filters, i), &f->views[i], PyBUF_SIMPLE) < 0)
            return -1;
        if (filter_bits(&f->views[i], &f->sizes[i]) < 0) {
            PyBuffer_Release(&f->views[i]);
            return -1;
        }
    }
    return 0;
}

static inline int filters_hit(const Filters *f, u128 state) {
    for (Py_ssize_t i = 0; i < f->n; i++)
        if (probe(f->views[i].buf, f->sizes[i], f->ks[i], state)) return 1;
    return 0;
}

static int append_index(PyObject *list, Py_ssize_t i) {
    PyObject *o = PyLong_FromSsize_t(i);
    if (o == NULL) return -1;
    int rc = PyList_Append(list, o);
    Py_DECREF(o);
    return rc;
}

/* The start of a timestamp's bucket as Python computes it (ts - ts % size, floored); -1 when
 * it does not fit an int64 (the Python way then). */
static inline int bucket_start(long long t, long long size, long long *start) {
    long long r = t % size;
    if (r < 0) r += size;
    if (t < LLONG_MIN + r) return -1;
    *start = t - r;
    return 0;
}

/* decide(ids, timestamps, cutoff, filters, ks, pending, bucket_ms) -> (out, groups, candidates,
 * late, copies) | None: dedup.core.Deduplicator.check's pass over a batch, in order (None: a
 * batch with other than exact int IDs and int64 timestamps, for the Python pass; then nothing
 * was changed). Per record: older than cutoff: its index in late (out True, for the caller to
 * decide); an ID in pending (the set of IDs recorded since the last flush, and the fresh ones
 * of this batch so far): out False, counted in copies; a hit in some filter: its index in
 * candidates (out True, resolved by the caller); else fresh: out True, its ID added to pending
 * and appended to groups[its bucket's start], a dict of lists in the batch's order. */
static PyObject *decide(PyObject *self, PyObject *args) {
    PyObject *ids, *timestamps, *filters, *ks, *pending;
    long long cutoff, size;
    if (!PyArg_ParseTuple(args, "O!O!LO!O!O!L:decide", &PyList_Type, &ids, &PyList_Type,
                          &timestamps, &cutoff, &PyList_Type, &filters, &PyList_Type, &ks,
                          &PySet_Type, &pending, &size))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(ids);
    if (PyList_GET_SIZE(timestamps) != n) {
        PyErr_SetString(PyExc_ValueError, "ids and timestamps differ in length");
        return NULL;
    }
    if (size < 1) {
        PyErr_SetString(PyExc_ValueError, "bucket_ms must be >= 1");
        return NULL;
    }
    /* Checked before anything changes: exact ints only, so that no Python code (an int
     * subclass's __hash__ or __index__) runs while the lists' items are borrowed, and
     * timestamps whose bucket fits an int64; anything else goes the Python way (None). */
    long long *starts = PyMem_Malloc((n ? (size_t)n : 1) * sizeof(long long));
    if (starts == NULL) return PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *ts = PyList_GET_ITEM(timestamps, i);
        int overflow;
        long long t;
        if (!PyLong_CheckExact(PyList_GET_ITEM(ids, i)) || !PyLong_CheckExact(ts)) goto python;
        t = PyLong_AsLongLongAndOverflow(ts, &overflow);
        if (overflow || bucket_start(t, size, &starts[i]) < 0) goto python;
        if (t < cutoff) starts[i] = LLONG_MIN; /* late: no bucket */
    }
    Filters f;
    PyObject *out = PyList_New(n), *groups = PyDict_New(), *candidates = PyList_New(0),
             *late = PyList_New(0), *group = NULL, *result = NULL;
    long long group_start = LLONG_MIN;
    Py_ssize_t copies = 0;
    if (filters_get(&f, filters, ks) < 0 || out == NULL || groups == NULL || candidates == NULL ||
        late == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *id = PyList_GET_ITEM(ids, i);
        PyObject *verdict = Py_True;
        if (starts[i] == LLONG_MIN) {
            if (append_index(late, i) < 0) goto done;
        } else {
            int seen = PySet_Contains(pending, id);
            if (seen < 0) goto done;
            if (seen) {
                verdict = Py_False;
                copies++;
            } else {
                u128 state;
                if (long_to_id(id, &state) < 0) goto done;
                if (filters_hit(&f, state)) {
                    if (append_index(candidates, i) < 0) goto done;
                } else {
                    if (group == NULL || starts[i] != group_start) { /* usually one per batch */
                        PyObject *key = PyLong_FromLongLong(starts[i]);
                        if (key == NULL) goto done;
                        group = PyDict_GetItemWithError(groups, key); /* borrowed */
                        if (group == NULL && !PyErr_Occurred()) {
                            PyObject *fresh = PyList_New(0);
                            if (fresh != NULL && PyDict_SetItem(groups, key, fresh) == 0)
                                group = fresh;
                            Py_XDECREF(fresh); /* the dict holds it */
                        }
                        Py_DECREF(key);
                        if (group == NULL) goto done;
                        group_start = starts[i];
                    }
                    if (PySet_Add(pending, id) < 0 || PyList_Append(group, id) < 0) goto done;
                }
            }
        }
        Py_INCREF(verdict);
        PyList_SET_ITEM(out, i, verdict);
    }
    result = Py_BuildValue("(OOOOn)", out, groups, candidates, late, copies);
done:
    filters_release(&f);
    PyMem_Free(starts);
    Py_XDECREF(out);
    Py_XDECREF(groups);
    Py_XDECREF(candidates);
    Py_XDECREF(late);
    return result;
python:
    PyMem_Free(starts);
    Py_RETURN_NONE;
}

/* pack_ids(ids: list[int]) -> bytes: each ID as 16 little-endian bytes (int.to_bytes(16,
 * "little"), with its OverflowError for a negative ID or one of more than 128 bits). */
static PyObject *pack_ids(PyObject *self, PyObject *arg) {
    if (!PyList_Check(arg)) {
        PyErr_SetString(PyExc_TypeError, "pack_ids takes a list of ints");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(arg);
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * 16);
    if (out == NULL) return NULL;
    uint8_t *b = (uint8_t *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++, b += 16) {
        PyObject *o = PyList_GET_ITEM(arg, i);
        if (!PyLong_Check(o)) {
            PyErr_Format(PyExc_TypeError, "an ID is an int, got %.100s", Py_TYPE(o)->tp_name);
            goto error;
        }
#if PY_VERSION_HEX >= 0x030D0000
        Py_ssize_t need = PyLong_AsNativeBytes(
            o, b, 16,
            Py_ASNATIVEBYTES_LITTLE_ENDIAN | Py_ASNATIVEBYTES_UNSIGNED_BUFFER |
                Py_ASNATIVEBYTES_REJECT_NEGATIVE);
        if (need < 0) goto error;
        if (need > 16) {
            PyErr_SetString(PyExc_OverflowError, "int too big to convert");
            goto error;
        }
#else
        if (_PyLong_AsByteArray((PyLongObject *)o, b, 16, 1, 0) < 0) goto error;
#endif
    }
    return out;
error:
    Py_DECREF(out);
    return NULL;
}

static PyMethodDef methods[] = {
    {"record_pair_ids", record_pair_ids, METH_VARARGS, "pair_id(key, fn(value)) per record."},
    {"decide", decide, METH_VARARGS, "Deduplicator.check's pass over a batch."},
    {"pack_ids", pack_ids, METH_O, "Each ID as 16 little-endian bytes, joined."},
    {"bloom_add", bloom_add, METH_VARARGS, "Adds IDs to a filter (rbloom's layout)."},
    {"bloom_contains", bloom_contains, METH_VARARGS, "Whether a filter may hold an ID."},
    {"bloom_or", bloom_or, METH_VARARGS, "ORs a filter into another of its size."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "dedup._native", "The dedup step's per-record costs in C.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__native(void) {
    init_start();
    return PyModule_Create(&module);
}
