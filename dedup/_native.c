/* The per-record costs of the dedup step in C: record IDs and Bloom probes, a batch per call.
 *
 * An optional accelerator of dedup/ids.py and dedup/buckets.py (built when the installing machine
 * has a C compiler; setup.py). Every function here computes exactly what the pure-Python path
 * computes, bit for bit, so that IDs and saved filters are the same with or without it:
 *
 * - pair_ids: dedup.ids.pair_id for (str|int, str|int) pairs: BLAKE2b-128 with the person
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
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
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
    for (int r = 0; r < 12; r++) {
        const uint8_t *s = SIGMA[r];
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
    return _PyLong_FromByteArray(b, 16, 1, 0);
}

/* The ID as a u128; -1 with an exception set unless 0 <= id < 2**128. */
static int long_to_id(PyObject *o, u128 *out) {
    uint8_t b[16];
    if (!PyLong_Check(o)) {
        PyErr_Format(PyExc_TypeError, "an ID is an int, got %.100s", Py_TYPE(o)->tp_name);
        return -1;
    }
#if PY_VERSION_HEX >= 0x030D0000
    if (_PyLong_AsByteArray((PyLongObject *)o, b, 16, 1, 0, 1) < 0) return -1;
#else
    if (_PyLong_AsByteArray((PyLongObject *)o, b, 16, 1, 0) < 0) return -1;
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

/* pair_ids(keys, values, fallback) -> list[int]: pair_id(keys[i], values[i]) for each i,
 * fallback(key, value) for pairs other than (str|int, str|int). */
static PyObject *pair_ids(PyObject *self, PyObject *args) {
    PyObject *keys, *values, *fallback;
    if (!PyArg_ParseTuple(args, "O!O!O:pair_ids", &PyList_Type, &keys, &PyList_Type, &values,
                          &fallback))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(keys);
    if (PyList_GET_SIZE(values) != n) {
        PyErr_SetString(PyExc_ValueError, "keys and values differ in length");
        return NULL;
    }
    PyObject *out = PyList_New(n);
    if (out == NULL) return NULL;
    Buf b;
    b.buf = b.small;
    b.cap = sizeof b.small;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = PyList_GET_ITEM(keys, i), *value = PyList_GET_ITEM(values, i), *id;
        b.len = 0;
        b.buf[b.len++] = 'j';
        b.buf[b.len++] = '[';
        int ok = encode(&b, key);
        if (ok > 0) {
            if (buf_reserve(&b, 1) < 0) goto error;
            b.buf[b.len++] = ',';
            ok = encode(&b, value);
        }
        if (ok < 0) goto error;
        if (ok > 0) {
            if (buf_reserve(&b, 1) < 0) goto error;
            b.buf[b.len++] = ']';
            id = id_to_long(digest_id(b.buf, b.len));
        } else {
            id = PyObject_CallFunctionObjArgs(fallback, key, value, NULL);
        }
        if (id == NULL) goto error;
        PyList_SET_ITEM(out, i, id);
    }
    if (b.buf != b.small) PyMem_Free(b.buf);
    return out;
error:
    if (b.buf != b.small) PyMem_Free(b.buf);
    Py_DECREF(out);
    return NULL;
}

/* ---- Bloom filters in rbloom's layout ---- */

#define LCG_A ((((u128)0x2360ed051fc65da4ULL) << 64) | (u128)0x4385df649fcb5cedULL)

static int filter_bits(Py_buffer *view, uint64_t *bits) {
    if (view->len == 0) {
        PyErr_SetString(PyExc_ValueError, "a filter of 0 bits");
        return -1;
    }
    *bits = (uint64_t)view->len * 8;
    return 0;
}

static inline int probe(const uint8_t *bits, uint64_t nbits, uint64_t k, u128 state) {
    for (uint64_t j = 0; j < k; j++) {
        state = state * LCG_A + 1;
        uint64_t i = (uint64_t)(state >> 32) % nbits;
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
    if (filter_bits(&view, &nbits) < 0) goto error;
    uint8_t *bits = view.buf;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(ids); i++) {
        u128 state;
        if (long_to_id(PyList_GET_ITEM(ids, i), &state) < 0) goto error;
        for (uint64_t j = 0; j < k; j++) {
            state = state * LCG_A + 1;
            uint64_t b = (uint64_t)(state >> 32) % nbits;
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
    if (filter_bits(&view, &nbits) == 0 && long_to_id(id, &state) == 0)
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

/* bloom_probe(filters: list[bytearray], ks: list[int], ids: list[int]) -> bytes: per ID, 1 if
 * some filter may hold it, else 0 (filter f has ks[f] hashes). Each ID is probed in the
 * filters' order until one hits. */
static PyObject *bloom_probe(PyObject *self, PyObject *args) {
    PyObject *filters, *ks, *ids;
    if (!PyArg_ParseTuple(args, "O!O!O!:bloom_probe", &PyList_Type, &filters, &PyList_Type, &ks,
                          &PyList_Type, &ids))
        return NULL;
    Py_ssize_t nf = PyList_GET_SIZE(filters), n = PyList_GET_SIZE(ids);
    if (PyList_GET_SIZE(ks) != nf) {
        PyErr_SetString(PyExc_ValueError, "filters and ks differ in length");
        return NULL;
    }
    Py_buffer *views = PyMem_Calloc(nf ? (size_t)nf : 1, sizeof(Py_buffer));
    uint64_t *sizes = PyMem_Calloc(nf ? (size_t)nf : 1, sizeof(uint64_t));
    uint64_t *kk = PyMem_Calloc(nf ? (size_t)nf : 1, sizeof(uint64_t));
    PyObject *out = NULL;
    Py_ssize_t got = 0;
    if (views == NULL || sizes == NULL || kk == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (; got < nf; got++) {
        kk[got] = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(ks, got));
        if (kk[got] == (uint64_t)-1 && PyErr_Occurred()) goto done;
        if (PyObject_GetBuffer(PyList_GET_ITEM(filters, got), &views[got], PyBUF_SIMPLE) < 0)
            goto done;
        if (filter_bits(&views[got], &sizes[got]) < 0) {
            PyBuffer_Release(&views[got]);
            goto done;
        }
    }
    out = PyBytes_FromStringAndSize(NULL, n);
    if (out == NULL) goto done;
    char *flags = PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++) {
        u128 state;
        if (long_to_id(PyList_GET_ITEM(ids, i), &state) < 0) {
            Py_CLEAR(out);
            goto done;
        }
        char hit = 0;
        for (Py_ssize_t f = 0; f < nf && !hit; f++)
            hit = (char)probe(views[f].buf, sizes[f], kk[f], state);
        flags[i] = hit;
    }
done:
    for (Py_ssize_t f = 0; f < got; f++) PyBuffer_Release(&views[f]);
    PyMem_Free(views);
    PyMem_Free(sizes);
    PyMem_Free(kk);
    return out;
}

static PyMethodDef methods[] = {
    {"pair_ids", pair_ids, METH_VARARGS, "pair_id of each (keys[i], values[i]), in a batch."},
    {"bloom_add", bloom_add, METH_VARARGS, "Adds IDs to a filter (rbloom's layout)."},
    {"bloom_contains", bloom_contains, METH_VARARGS, "Whether a filter may hold an ID."},
    {"bloom_or", bloom_or, METH_VARARGS, "ORs a filter into another of its size."},
    {"bloom_probe", bloom_probe, METH_VARARGS, "Per ID, 1 if some filter may hold it."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "dedup._native", "The dedup step's per-record costs in C.", -1, methods,
};

PyMODINIT_FUNC PyInit__native(void) {
    init_start();
    return PyModule_Create(&module);
}
