/* engine._kernels: fast CPU matmul / dequantization kernels for the GGUF block formats.
 *
 * Python API (engine/kernels.py wraps it with validation and the BLAS path):
 *   matmul(type_id, w, x, y[, threads[, path]])  y[T, n_rows] = x[T, n_in] @ W.T; w: 2-D uint8
 *                                 buffer of packed rows (any row stride, contiguous rows), x / y
 *                                 float32 C-contiguous; threads: thread count of this call (0:
 *                                 set_threads); path: 0 by T, 1 in registers, 2 decoded panel
 *   dequantize(type_id, w, out[, threads])  out[n_rows, n_in] = the decoded rows (bit-exact with
 *                                 quants.py)
 *   set_threads(n) / get_threads() / isa() / set_isa(name) / isas() / mvt_max(type[, n])
 *   set_batch_invariant(on)       a token's result independent of T, path and threads
 *   read_sum(buf)                 sum of a contiguous buffer's 64-bit words (read-bandwidth probe)
 *   tables()                      (iq2xxs grid bytes, ksigns bytes) as built here, for the tests
 *
 * Buffers come in through the buffer protocol (an np.memmap slice is read in place); the GIL is
 * released while the kernels run on OpenMP threads (rows split statically across threads). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdlib.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "csrc/kern.h"

enum { ISA_GENERIC, ISA_AVX2, ISA_AVX512, ISA_N };

static kern_isa g_isa[ISA_N];
static int g_have[ISA_N];
static int g_cur = ISA_GENERIC;
static int g_threads = 1;
/* batch invariance: T = 1 takes the in-register exact-weight path (mvt) instead of mv1, so every
 * path sums each (row, token) product in the same order and a token's result does not depend on
 * T, on the path or on the thread count */
static int g_invariant = 0;

/* per-thread scratch (panel buffers), kept between calls */
static __thread float *tls_buf;
static __thread size_t tls_cap;

static float *scratch(size_t n_floats) {
    if (n_floats > tls_cap) {
        free(tls_buf);
        size_t bytes = (n_floats * sizeof(float) + 63) & ~(size_t)63;
        tls_buf = (float *)aligned_alloc(64, bytes);
        tls_cap = tls_buf ? n_floats : 0;
    }
    return tls_buf;
}

static int thread_count(int64_t units, int64_t work, int64_t min_work, int max_threads) {
    int64_t n = max_threads > 0 ? max_threads : g_threads;
    int64_t by_work = work / (min_work > 0 ? min_work : 1);
    if (by_work < n) n = by_work;
    if (units < n) n = units;
    return n < 1 ? 1 : (int)n;
}

/* rows [*a, *b) of thread tid out of nth, in units of `unit` rows */
static void split_rows(int64_t n_rows, int64_t unit, int tid, int nth, int64_t *a, int64_t *b) {
    int64_t units = (n_rows + unit - 1) / unit;
    int64_t u0 = units * tid / nth, u1 = units * (tid + 1) / nth;
    *a = u0 * unit;
    *b = u1 * unit < n_rows ? u1 * unit : n_rows;
}

#ifdef _OPENMP
#define OMP_TID() omp_get_thread_num()
#define OMP_NTH() omp_get_num_threads()
#else
#define OMP_TID() 0
#define OMP_NTH() 1
#endif

/* path: 0 = by T (mv1 for T = 1, mvt for T <= mvt_max, else panel), 1 = in registers (mv1 / mvt),
 * 2 = panel */
static int run_matmul(const kern_isa *K, int type, const uint8_t *W, ptrdiff_t stride, int64_t n_rows,
                      int64_t n_in, const float *x, int64_t T, float *y, int max_threads, int path) {
    if (n_in == 0) {
        memset(y, 0, (size_t)(T * n_rows) * sizeof(float));
        return 0;
    }
    const int64_t rb = n_in / kern_block_elems(type) * kern_block_bytes(type);
    int failed = 0;
    if (T == 1 && K->mv1[type] && path != 2 && !g_invariant) {
        const int64_t na = kern_aux_len(type, n_in);
        float *aux = NULL;
        if (na) {
            aux = (float *)malloc((size_t)na * sizeof(float));
            if (!aux) return -1;
            kern_aux_fill(type, x, n_in, aux);
        }
        const kern_mv1_fn f = K->mv1[type];
        const int nt = thread_count((n_rows + 15) / 16, n_rows * rb, 64 * 1024, max_threads);
#pragma omp parallel num_threads(nt) if (nt > 1)
        {
            int64_t a, b;
            split_rows(n_rows, 16, OMP_TID(), OMP_NTH(), &a, &b);
            if (a < b) f(W, stride, n_in, a, b, x, aux, y);
        }
        free(aux);
        return 0;
    }
    if ((T > 1 || g_invariant) && K->mvt[type] && (path == 1 || (path == 0 && T <= K->mvt_max[type]))) {
        const kern_mvt_fn f = K->mvt[type];
        const int nt = thread_count((n_rows + 15) / 16, n_rows * rb * T, 64 * 1024, max_threads);
#pragma omp parallel num_threads(nt) if (nt > 1)
        {
            int64_t a, b;
            split_rows(n_rows, 16, OMP_TID(), OMP_NTH(), &a, &b);
            if (a < b) f(W, stride, n_in, a, b, x, T, y, n_rows);
        }
        return 0;
    }
    const int unit = K->panel_rows;
    const size_t need = (size_t)(kern_panel_rows(unit, n_in) * kern_ldw(n_in));
    const int nt = thread_count((n_rows + unit - 1) / unit, n_rows * n_in * T, 1 << 20, max_threads);
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        int64_t a, b;
        split_rows(n_rows, unit, OMP_TID(), OMP_NTH(), &a, &b);
        if (a < b) {
            float *wbuf = scratch(need);
            if (!wbuf) {
#pragma omp atomic write
                failed = 1;
            } else {
                K->panel(K->dq[type], W, stride, n_in, a, b, x, T, y, n_rows, wbuf);
            }
        }
    }
    return failed ? -1 : 0;
}

static void run_dequant(const kern_isa *K, int type, const uint8_t *W, ptrdiff_t stride, int64_t n_rows,
                        int64_t n_in, float *out, int max_threads) {
    const kern_dq_fn dq = K->dq[type];
    const int nt = thread_count(n_rows, n_rows * n_in, 128 * 1024, max_threads);
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        int64_t a, b;
        split_rows(n_rows, 1, OMP_TID(), OMP_NTH(), &a, &b);
        for (int64_t r = a; r < b; r++) dq(W + r * stride, out + r * n_in, n_in);
    }
}

/* ------------------------------------------------------------------------------------------ */
/* argument handling */

static int fmt_is(const Py_buffer *b, char code) {
    const char *f = b->format;
    if (f == NULL) return code == 'B';
    if (*f == '<' || *f == '=' || *f == '@') f++;
    return f[0] == code && f[1] == 0;
}

static int check_type(int type) {
    if (type < 0 || type >= KT_MAX || !kern_block_elems(type)) {
        PyErr_Format(PyExc_ValueError, "unsupported ggml type %d", type);
        return -1;
    }
    return 0;
}

/* w: 2-D uint8, contiguous along the row; fills n_rows, n_in, stride */
static int get_weight(PyObject *o, int type, Py_buffer *b, int64_t *n_rows, int64_t *n_in, ptrdiff_t *stride) {
    if (PyObject_GetBuffer(o, b, PyBUF_STRIDES | PyBUF_FORMAT) < 0) {
        PyErr_Clear();
        PyErr_SetString(PyExc_ValueError, "w must be a 2-D uint8 array whose rows are contiguous");
        return -1;
    }
    const int be = kern_block_elems(type), bb = kern_block_bytes(type);
    if (b->ndim != 2 || b->itemsize != 1 || !fmt_is(b, 'B')) {
        PyErr_SetString(PyExc_ValueError, "w must be a 2-D uint8 array");
        goto fail;
    }
    if (b->shape[1] > 1 && b->strides[1] != 1) {
        PyErr_SetString(PyExc_ValueError, "w rows must be contiguous (last axis stride 1)");
        goto fail;
    }
    if (b->shape[1] % bb) {
        PyErr_Format(PyExc_ValueError, "w rows of %zd bytes are not a multiple of the block size %d",
                     b->shape[1], bb);
        goto fail;
    }
    *n_rows = b->shape[0];
    *n_in = b->shape[1] / bb * be;
    *stride = b->strides[0];
    return 0;
fail:
    PyBuffer_Release(b);
    return -1;
}

static int get_f32(PyObject *o, Py_buffer *b, int writable, const char *name, int64_t d0, int64_t d1) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(o, b, flags) < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%s must be a C-contiguous%s float32 array", name,
                     writable ? " writable" : "");
        return -1;
    }
    if (b->ndim != 2 || b->itemsize != 4 || !fmt_is(b, 'f')) {
        PyErr_Format(PyExc_ValueError, "%s must be a 2-D float32 array", name);
        goto fail;
    }
    if ((d0 >= 0 && b->shape[0] != d0) || b->shape[1] != d1) {
        PyErr_Format(PyExc_ValueError, "%s has shape (%zd, %zd), expected (%lld, %lld)", name, b->shape[0],
                     b->shape[1], (long long)(d0 >= 0 ? d0 : b->shape[0]), (long long)d1);
        goto fail;
    }
    return 0;
fail:
    PyBuffer_Release(b);
    return -1;
}

static PyObject *py_matmul(PyObject *self, PyObject *args) {
    int type, threads = 0, path = 0;
    PyObject *wo, *xo, *yo;
    if (!PyArg_ParseTuple(args, "iOOO|ii", &type, &wo, &xo, &yo, &threads, &path)) return NULL;
    if (path < 0 || path > 2) {
        PyErr_SetString(PyExc_ValueError, "path must be 0 (auto), 1 (registers) or 2 (panel)");
        return NULL;
    }
    if (check_type(type) < 0) return NULL;
    Py_buffer wb, xb, yb;
    int64_t n_rows, n_in;
    ptrdiff_t stride;
    if (get_weight(wo, type, &wb, &n_rows, &n_in, &stride) < 0) return NULL;
    if (get_f32(xo, &xb, 0, "x", -1, n_in) < 0) {
        PyBuffer_Release(&wb);
        return NULL;
    }
    const int64_t T = xb.shape[0];
    if (get_f32(yo, &yb, 1, "y", T, n_rows) < 0) {
        PyBuffer_Release(&wb);
        PyBuffer_Release(&xb);
        return NULL;
    }
    int rc = 0;
    if (T > 0 && n_rows > 0) {
        const kern_isa *K = &g_isa[g_cur];
        Py_BEGIN_ALLOW_THREADS
        rc = run_matmul(K, type, (const uint8_t *)wb.buf, stride, n_rows, n_in, (const float *)xb.buf, T,
                        (float *)yb.buf, threads, path);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&wb);
    PyBuffer_Release(&xb);
    PyBuffer_Release(&yb);
    if (rc < 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *py_dequantize(PyObject *self, PyObject *args) {
    int type, threads = 0;
    PyObject *wo, *oo;
    if (!PyArg_ParseTuple(args, "iOO|i", &type, &wo, &oo, &threads)) return NULL;
    if (check_type(type) < 0) return NULL;
    Py_buffer wb, ob;
    int64_t n_rows, n_in;
    ptrdiff_t stride;
    if (get_weight(wo, type, &wb, &n_rows, &n_in, &stride) < 0) return NULL;
    if (get_f32(oo, &ob, 1, "out", n_rows, n_in) < 0) {
        PyBuffer_Release(&wb);
        return NULL;
    }
    if (n_rows > 0 && n_in > 0) {
        const kern_isa *K = &g_isa[g_cur];
        Py_BEGIN_ALLOW_THREADS
        run_dequant(K, type, (const uint8_t *)wb.buf, stride, n_rows, n_in, (float *)ob.buf, threads);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&wb);
    PyBuffer_Release(&ob);
    Py_RETURN_NONE;
}

static PyObject *py_read_sum(PyObject *self, PyObject *arg) {
    Py_buffer b;
    if (PyObject_GetBuffer(arg, &b, PyBUF_SIMPLE) < 0) return NULL;
    const uint64_t *p = (const uint64_t *)b.buf;
    const int64_t n = (int64_t)(b.len / 8);
    uint64_t total = 0;
    Py_BEGIN_ALLOW_THREADS
    const int nt = thread_count(n, n, 1 << 16, 0);
#pragma omp parallel for num_threads(nt) schedule(static) reduction(+ : total) if (nt > 1)
    for (int64_t i = 0; i < n; i++) total += p[i];
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&b);
    return PyLong_FromUnsignedLongLong(total);
}

static PyObject *py_set_threads(PyObject *self, PyObject *arg) {
    long n = PyLong_AsLong(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    if (n < 1 || n > 1024) {
        PyErr_SetString(PyExc_ValueError, "thread count must be in 1..1024");
        return NULL;
    }
    g_threads = (int)n;
    Py_RETURN_NONE;
}

static PyObject *py_get_threads(PyObject *self, PyObject *noargs) { return PyLong_FromLong(g_threads); }

static PyObject *py_set_batch_invariant(PyObject *self, PyObject *arg) {
    int on = PyObject_IsTrue(arg);
    if (on < 0) return NULL;
    int prev = g_invariant;
    g_invariant = on;
    return PyBool_FromLong(prev);
}

static PyObject *py_isa(PyObject *self, PyObject *noargs) { return PyUnicode_FromString(g_isa[g_cur].name); }

static PyObject *py_isas(PyObject *self, PyObject *noargs) {
    PyObject *l = PyList_New(0);
    if (!l) return NULL;
    for (int i = 0; i < ISA_N; i++) {
        if (!g_have[i]) continue;
        PyObject *s = PyUnicode_FromString(g_isa[i].name);
        if (!s || PyList_Append(l, s) < 0) {
            Py_XDECREF(s);
            Py_DECREF(l);
            return NULL;
        }
        Py_DECREF(s);
    }
    return l;
}

static PyObject *py_set_isa(PyObject *self, PyObject *arg) {
    const char *name = PyUnicode_AsUTF8(arg);
    if (!name) return NULL;
    for (int i = 0; i < ISA_N; i++) {
        if (g_have[i] && strcmp(g_isa[i].name, name) == 0) {
            PyObject *prev = PyUnicode_FromString(g_isa[g_cur].name);
            g_cur = i;
            return prev;
        }
    }
    PyErr_Format(PyExc_ValueError, "instruction set %s is not available on this machine", name);
    return NULL;
}

static PyObject *py_mvt_max(PyObject *self, PyObject *args) {
    int type, n = -1;
    if (!PyArg_ParseTuple(args, "i|i", &type, &n)) return NULL;
    if (check_type(type) < 0) return NULL;
    int prev = g_isa[g_cur].mvt_max[type];
    if (n >= 0) {
        for (int i = 0; i < ISA_N; i++) g_isa[i].mvt_max[type] = n;
    }
    return PyLong_FromLong(prev);
}

static PyObject *py_tables(PyObject *self, PyObject *noargs) {
    return Py_BuildValue("(y#y#)", (const char *)kern_iq2xxs_grid, (Py_ssize_t)sizeof(kern_iq2xxs_grid),
                         (const char *)kern_ksigns, (Py_ssize_t)sizeof(kern_ksigns));
}

static PyMethodDef methods[] = {
    {"matmul", py_matmul, METH_VARARGS, "matmul(type_id, w, x, y[, threads[, path]]): y = x @ W.T (float32)"},
    {"dequantize", py_dequantize, METH_VARARGS, "dequantize(type_id, w, out[, threads]): out = decoded rows of w"},
    {"read_sum", py_read_sum, METH_O, "read_sum(buf): sum of the buffer's uint64 words (bandwidth probe)"},
    {"set_threads", py_set_threads, METH_O, "set_threads(n): OpenMP threads used by the kernels"},
    {"get_threads", py_get_threads, METH_NOARGS, "get_threads() -> int"},
    {"set_batch_invariant", py_set_batch_invariant, METH_O,
     "set_batch_invariant(on) -> previous: T = 1 summed in the order of the batched paths"},
    {"isa", py_isa, METH_NOARGS, "isa() -> name of the kernel build in use"},
    {"isas", py_isas, METH_NOARGS, "isas() -> kernel builds this machine can run"},
    {"set_isa", py_set_isa, METH_O, "set_isa(name) -> previous name (tests: force a build)"},
    {"mvt_max", py_mvt_max, METH_VARARGS, "mvt_max(type_id[, n]) -> largest T of the in-register path (sets it)"},
    {"tables", py_tables, METH_NOARGS, "tables() -> (iq2xxs grid bytes, ksigns bytes)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moddef = {
    PyModuleDef_HEAD_INIT, "engine._kernels", "Fast CPU kernels for GGUF block formats.", -1, methods,
};

PyMODINIT_FUNC PyInit__kernels(void) {
    kern_tables_init();
    kern_fill_generic(&g_isa[ISA_GENERIC]);
    g_have[ISA_GENERIC] = 1;
    g_cur = ISA_GENERIC;
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) {
        kern_fill_avx2(&g_isa[ISA_AVX2]);
        g_have[ISA_AVX2] = 1;
        g_cur = ISA_AVX2;
        if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
            __builtin_cpu_supports("avx512vl")) {
            kern_fill_avx512(&g_isa[ISA_AVX512]);
            g_have[ISA_AVX512] = 1;
            g_cur = ISA_AVX512;
        }
    }
#endif
#ifdef _OPENMP
    g_threads = omp_get_num_procs();
#endif
    if (g_threads < 1) g_threads = 1;
    PyObject *m = PyModule_Create(&moddef);
    if (!m) return NULL;
#ifdef _OPENMP
    PyModule_AddIntConstant(m, "openmp", 1);
#else
    PyModule_AddIntConstant(m, "openmp", 0);
#endif
    return m;
}
