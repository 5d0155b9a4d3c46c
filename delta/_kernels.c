/* Compiled loops for the codec's per-change bookkeeping (the module kernels.py wraps and documents).
 *
 * Every function takes contiguous buffers (numpy arrays) and releases the GIL while it loops. Word
 * arrays may be 1, 2, 4 or 8 bytes per word; position arrays 4 or 8. Nothing here trusts a piece:
 * every offset read from one is checked against its limit before it is stored, and positions are
 * checked against the array they index.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define PREFETCH_AHEAD 32

static uint64_t load_word(const void *base, Py_ssize_t width, Py_ssize_t i) {
    switch (width) {
    case 1: return ((const uint8_t *)base)[i];
    case 2: return ((const uint16_t *)base)[i];
    case 4: return ((const uint32_t *)base)[i];
    default: return ((const uint64_t *)base)[i];
    }
}

static void store_word(void *base, Py_ssize_t width, Py_ssize_t i, uint64_t v) {
    switch (width) {
    case 1: ((uint8_t *)base)[i] = (uint8_t)v; break;
    case 2: ((uint16_t *)base)[i] = (uint16_t)v; break;
    case 4: ((uint32_t *)base)[i] = (uint32_t)v; break;
    default: ((uint64_t *)base)[i] = v; break;
    }
}

static int64_t load_index(const void *base, Py_ssize_t width, Py_ssize_t i) {
    return width == 4 ? (int64_t)((const int32_t *)base)[i] : ((const int64_t *)base)[i];
}

static void store_index(void *base, Py_ssize_t width, Py_ssize_t i, int64_t v) {
    if (width == 4)
        ((int32_t *)base)[i] = (int32_t)v;
    else
        ((int64_t *)base)[i] = v;
}

/* A buffer's item count and width, taken from its bytes and the width it claims. */
static int take(PyObject *obj, Py_buffer *view, int writable) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0)
        return -1;
    if (view->itemsize != 1 && view->itemsize != 2 && view->itemsize != 4 && view->itemsize != 8) {
        PyErr_SetString(PyExc_ValueError, "buffers must hold 1, 2, 4 or 8 bytes per item");
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

#define COUNT(view) ((view).len / (view).itemsize)

static void release(Py_buffer *views, int n) {
    for (int k = 0; k < n; k++)
        if (views[k].obj != NULL)
            PyBuffer_Release(&views[k]);
}

/* locations(gaps u8, bounds i64, offsets i64, limits i64, out i64) -> (status, where, value) */
static PyObject *locations(PyObject *self, PyObject *args) {
    PyObject *objs[5];
    Py_buffer v[5] = {{0}};
    if (!PyArg_ParseTuple(args, "OOOOO", &objs[0], &objs[1], &objs[2], &objs[3], &objs[4]))
        return NULL;
    for (int k = 0; k < 5; k++)
        if (take(objs[k], &v[k], k == 4) < 0) {
            release(v, k);
            return NULL;
        }
    if (v[0].itemsize != 1 || v[1].itemsize != 8 || v[2].itemsize != 8 || v[3].itemsize != 8 || v[4].itemsize != 8 ||
        COUNT(v[2]) != COUNT(v[1]) - 1 || COUNT(v[3]) != COUNT(v[2]) || COUNT(v[1]) < 1 ||
        ((const int64_t *)v[1].buf)[COUNT(v[1]) - 1] != COUNT(v[4])) {
        release(v, 5);
        PyErr_SetString(PyExc_ValueError, "locations: mismatched buffers");
        return NULL;
    }
    const uint8_t *gaps = v[0].buf;
    const int64_t *bounds = v[1].buf, *offsets = v[2].buf, *limits = v[3].buf;
    int64_t *out = v[4].buf;
    Py_ssize_t n = v[0].len, wanted = COUNT(v[4]), runs = COUNT(v[2]);
    int64_t found = 0, total = 0, pending = 0, status = 0, where = 0, value = 0;
    Py_ssize_t run = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        uint8_t byte = gaps[i];
        if (byte == 255) {
            pending += 255;
            continue;
        }
        if (found < wanted) {
            while (run < runs && bounds[run + 1] <= found) { /* the run holding change `found` */
                run++;
                total = 0;
            }
            total += pending + byte + 1;
            if (total > limits[run]) {
                status = 2;
                where = run;
                value = total - 1;
                break;
            }
            out[found] = total - 1 + offsets[run];
        }
        found++;
        pending = 0;
    }
    if (status == 0) {
        status = (found == wanted && pending == 0) ? 0 : 1;
        where = found;
        value = pending;
    }
    Py_END_ALLOW_THREADS
    release(v, 5);
    return Py_BuildValue("(LLL)", (long long)status, (long long)where, (long long)value);
}

/* moves(codes u8, first, values uN, literal u8) -> literals: key differences of 4-bit codes */
static PyObject *moves(PyObject *self, PyObject *args) {
    PyObject *objs[3];
    Py_ssize_t first;
    Py_buffer v[3] = {{0}};
    if (!PyArg_ParseTuple(args, "OnOO", &objs[0], &first, &objs[1], &objs[2]))
        return NULL;
    for (int k = 0; k < 3; k++)
        if (take(objs[k], &v[k], k > 0) < 0) {
            release(v, k);
            return NULL;
        }
    Py_ssize_t count = COUNT(v[1]), width = v[1].itemsize;
    if (v[0].itemsize != 1 || v[2].itemsize != 1 || COUNT(v[2]) != count || first < 0 ||
        (first + count + 1) / 2 > v[0].len) {
        release(v, 3);
        PyErr_SetString(PyExc_ValueError, "moves: mismatched buffers");
        return NULL;
    }
    const uint8_t *codes = v[0].buf;
    uint8_t *literal = v[2].buf;
    uint64_t ones = width == 8 ? UINT64_MAX : ((uint64_t)1 << (width * 8)) - 1;
    long long literals = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t k = 0; k < count; k++) {
        Py_ssize_t j = first + k;
        uint64_t code = (codes[j >> 1] >> ((j & 1) * 4)) & 15;
        literal[k] = code == 15;
        literals += code == 15;
        uint64_t zig = code + 1; /* stored value = zigzag(key difference) - 1 */
        store_word(v[1].buf, width, k, ((zig >> 1) ^ ((zig & 1) * ones)) & ones);
    }
    Py_END_ALLOW_THREADS
    release(v, 3);
    return PyLong_FromLongLong(literals);
}

static int compare_i64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* moved(positions iN, where i64, old uN, new uN, bound, out iN) -> count written to out */
static PyObject *moved(PyObject *self, PyObject *args) {
    PyObject *objs[5];
    unsigned long long bound;
    Py_buffer v[5] = {{0}};
    if (!PyArg_ParseTuple(args, "OOOOKO", &objs[0], &objs[1], &objs[2], &objs[3], &bound, &objs[4]))
        return NULL;
    for (int k = 0; k < 5; k++)
        if (take(objs[k], &v[k], k == 4) < 0) {
            release(v, k);
            return NULL;
        }
    Py_ssize_t size = COUNT(v[0]), changes = COUNT(v[1]), iw = v[0].itemsize, ww = v[2].itemsize;
    if ((iw != 4 && iw != 8) || v[4].itemsize != iw || v[1].itemsize != 8 || v[3].itemsize != ww ||
        COUNT(v[2]) != changes || COUNT(v[3]) != changes || COUNT(v[4]) < size + changes) {
        release(v, 5);
        PyErr_SetString(PyExc_ValueError, "moved: mismatched buffers");
        return NULL;
    }
    int64_t *leaving = malloc(sizeof(int64_t) * (changes + 1)), *joining = malloc(sizeof(int64_t) * (changes + 1));
    if (leaving == NULL || joining == NULL) {
        free(leaving);
        free(joining);
        release(v, 5);
        return PyErr_NoMemory();
    }
    const int64_t *where = v[1].buf;
    uint64_t magnitude = (((uint64_t)1) << (ww * 8 - 1)) - 1;
    Py_ssize_t left = 0, joined = 0, k = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t j = 0; j < changes; j++) {
        int was = (load_word(v[2].buf, ww, j) & magnitude) <= bound;
        int now = (load_word(v[3].buf, ww, j) & magnitude) <= bound;
        if (was && !now)
            leaving[left++] = where[j];
        else if (now && !was)
            joining[joined++] = where[j];
    }
    qsort(leaving, left, sizeof(int64_t), compare_i64);
    qsort(joining, joined, sizeof(int64_t), compare_i64);
    /* The entry is copied in runs between the positions that leave or join (memcpy), which are few
       next to it; each such position is found by binary search from where the last one was. */
    const char *src = v[0].buf;
    char *dst = v[4].buf;
    Py_ssize_t i = 0, a = 0, b = 0;
    while (a < left || b < joined) {
        int joins = b < joined && (a == left || joining[b] < leaving[a]); /* the next event is a join */
        int64_t next = joins ? joining[b] : leaving[a];
        Py_ssize_t lo = i, hi = size; /* the first entry at or after `next` */
        while (lo < hi) {
            Py_ssize_t mid = lo + (hi - lo) / 2;
            if (load_index(src, iw, mid) < next)
                lo = mid + 1;
            else
                hi = mid;
        }
        memcpy(dst + k * iw, src + i * iw, (lo - i) * iw);
        k += lo - i;
        i = lo;
        if (joins) {
            store_index(dst, iw, k++, joining[b++]);
        } else {
            if (i < size && load_index(src, iw, i) == next)
                i++; /* it leaves */
            a++;
        }
    }
    memcpy(dst + k * iw, src + i * iw, (size - i) * iw);
    k += size - i;
    Py_END_ALLOW_THREADS
    free(leaving);
    free(joining);
    release(v, 5);
    return PyLong_FromSsize_t(k);
}

/* ranked(small iN, words uN, start, stop, ranks i64, small_max, sift, out i64) -> ranks taken */
static PyObject *ranked(PyObject *self, PyObject *args) {
    PyObject *objs[4];
    Py_ssize_t start, stop;
    unsigned long long small_max;
    int sift;
    Py_buffer v[4] = {{0}};
    if (!PyArg_ParseTuple(args, "OOnnOKpO", &objs[0], &objs[1], &start, &stop, &objs[2], &small_max, &sift, &objs[3]))
        return NULL;
    for (int k = 0; k < 4; k++)
        if (take(objs[k], &v[k], k == 3) < 0) {
            release(v, k);
            return NULL;
        }
    Py_ssize_t size = COUNT(v[0]), iw = v[0].itemsize, ww = v[1].itemsize, nwords = COUNT(v[1]);
    Py_ssize_t wanted = COUNT(v[2]);
    if ((iw != 4 && iw != 8) || v[2].itemsize != 8 || v[3].itemsize != 8 || COUNT(v[3]) != wanted) {
        release(v, 4);
        PyErr_SetString(PyExc_ValueError, "ranked: mismatched buffers");
        return NULL;
    }
    const int64_t *ranks = v[2].buf;
    int64_t *out = v[3].buf;
    uint64_t magnitude = (((uint64_t)1) << (ww * 8 - 1)) - 1;
    Py_ssize_t taken = 0;
    Py_BEGIN_ALLOW_THREADS
    Py_ssize_t lo = 0, hi = size; /* the first entry at or after `start` */
    while (lo < hi) {
        Py_ssize_t mid = lo + (hi - lo) / 2;
        if (load_index(v[0].buf, iw, mid) < start)
            lo = mid + 1;
        else
            hi = mid;
    }
    if (!sift) { /* every entry of the segment counts: rank r is entry lo + r, if it is in the segment */
        for (; taken < wanted; taken++) {
            int64_t r = ranks[taken];
            if (r < 0 || r >= size - lo)
                break;
            int64_t p = load_index(v[0].buf, iw, lo + r);
            if (p >= stop || p < 0 || p >= nwords || (taken && r <= ranks[taken - 1]))
                break;
            out[taken] = p;
        }
    } else { /* a walk over the segment's entries, skipping words above small_max */
        int64_t seen = 0;
        for (Py_ssize_t q = lo; q < size && taken < wanted; q++) {
            int64_t p = load_index(v[0].buf, iw, q);
            if (p >= stop || p < 0 || p >= nwords)
                break;
            if ((load_word(v[1].buf, ww, p) & magnitude) > small_max)
                continue;
            if (seen == ranks[taken])
                out[taken++] = p;
            seen++;
        }
    }
    Py_END_ALLOW_THREADS
    release(v, 4);
    return PyLong_FromSsize_t(taken);
}

/* write(words uN, positions i64, values uN, literal u8 (empty: none), floating, old uN, new uN) -> written.
   Changes words in place: where literal, the value itself, else the key difference added to the
   word's order-preserving key (bitdiff.py). Returns -1, writing nothing, if a position is out of bounds. */
static PyObject *write_words(PyObject *self, PyObject *args) {
    PyObject *objs[6];
    int floating;
    Py_buffer v[6] = {{0}};
    if (!PyArg_ParseTuple(args, "OOOOpOO", &objs[0], &objs[1], &objs[2], &objs[3], &floating, &objs[4], &objs[5]))
        return NULL;
    for (int k = 0; k < 6; k++)
        if (take(objs[k], &v[k], k == 0 || k >= 4) < 0) {
            release(v, k);
            return NULL;
        }
    Py_ssize_t n = COUNT(v[1]), size = COUNT(v[0]), width = v[0].itemsize;
    int literals = v[3].len > 0;
    if (v[1].itemsize != 8 || v[2].itemsize != width || COUNT(v[2]) != n || (literals && v[3].len != n) ||
        v[4].itemsize != width || v[5].itemsize != width || COUNT(v[4]) != n || COUNT(v[5]) != n) {
        release(v, 6);
        PyErr_SetString(PyExc_ValueError, "write: mismatched buffers");
        return NULL;
    }
    const int64_t *positions = v[1].buf;
    const uint8_t *literal = v[3].buf;
    unsigned shift = (unsigned)(width * 8 - 1);
    uint64_t ones = width == 8 ? UINT64_MAX : ((uint64_t)1 << (width * 8)) - 1, magnitude = ones >> 1;
    Py_ssize_t written = n;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t j = 0; j < n; j++)
        if (positions[j] < 0 || positions[j] >= size) {
            written = -1;
            break;
        }
    char *base = v[0].buf;
    for (Py_ssize_t j = 0; written >= 0 && j < n; j++) {
        /* The changes are scattered over many cache lines: ask for lines well ahead of their write. */
        if (j + PREFETCH_AHEAD < n)
            __builtin_prefetch(base + positions[j + PREFETCH_AHEAD] * width, 1);
        uint64_t was = load_word(v[0].buf, width, positions[j]), move = load_word(v[2].buf, width, j), now;
        if (literals && literal[j]) {
            now = move;
        } else if (floating) {
            uint64_t key = ((was ^ ((was >> shift) * magnitude)) + move) & ones;
            now = key ^ ((key >> shift) * magnitude);
        } else {
            now = (was + move) & ones;
        }
        store_word(v[4].buf, width, j, was);
        store_word(v[5].buf, width, j, now);
        store_word(v[0].buf, width, positions[j], now);
    }
    Py_END_ALLOW_THREADS
    release(v, 6);
    return PyLong_FromSsize_t(written);
}

static PyMethodDef methods[] = {
    {"write", write_words, METH_VARARGS, "Changes written into words in place (kernels.write_changes)."},
    {"locations", locations, METH_VARARGS, "Change locations from a gap stream (kernels.change_locations)."},
    {"moves", moves, METH_VARARGS, "Key differences of packed 4-bit codes (kernels.key_moves)."},
    {"moved", moved, METH_VARARGS, "A small-word index entry moved over a write (kernels.moved_small_positions)."},
    {"ranked", ranked, METH_VARARGS, "Small words of given ranks off an index entry (kernels.ranked_positions)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernels", NULL, -1, methods};

PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&module); }
