/* engine.backends.cpu._kernels: fast CPU matmul / dequantization kernels for the GGUF block formats.
 *
 * Python API (engine/backends/cpu/kernels.py wraps it with validation and the BLAS path):
 *   matmul(type_id, w, x, y[, threads[, path]])  y[T, n_rows] = x[T, n_in] @ W.T; w: 2-D uint8
 *                                 buffer of packed rows (any row stride, contiguous rows), x / y
 *                                 float32 C-contiguous; threads: thread count of this call (0:
 *                                 set_threads); path: 0 by T, 1 in registers, 2 decoded panel,
 *                                 3 by T with float64 sums at T = 1 for every format
 *   matmul_q8_batch(types, ws, xs, ys[, threads])  ys[i] = the same product with xs[i] quantized
 *                                 per token to Q8_0 / Q8_K blocks first (ds4 numerics; integer dot
 *                                 products), every i in one parallel region
 *   quantize_q8(block, x) / has_q8(type_id)  the activation quantizer (tests) / kernel presence
 *   dequantize(type_id, w, out[, threads])  out[n_rows, n_in] = the decoded rows (bit-exact with
 *                                 quants.py)
 *   set_threads(n) / get_threads() / isa() / set_isa(name) / isas() / mvt_max(type[, n])
 *   set_batch_invariant(on)       a token's result independent of T, path and threads
 *   read_sum(buf)                 sum of a contiguous buffer's 64-bit words (read-bandwidth probe)
 *   tables()                      (iq2xxs grid bytes, ksigns bytes) as built here, for the tests
 *
 * Buffers come in through the buffer protocol (an np.memmap slice is read in place); the GIL is
 * released while the kernels run on OpenMP threads (rows split statically across threads).
 *
 * This file is the binding: it checks the arguments and buffers and calls sched.c (the matmuls'
 * work split) and ops.c (the other operations), which see plain pointers only. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdlib.h>

#include "module.h"

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
    if ((d0 >= 0 && b->shape[0] != d0) || (d1 >= 0 && b->shape[1] != d1)) {
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
    if (path < 0 || path > 3) {
        PyErr_SetString(PyExc_ValueError, "path must be 0 (auto), 1 (registers), 2 (panel) or 3 (auto, float64 sums at T = 1 too)");
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

/* product i of matmul_q8_batch checked into job j: its type (type_o), weight (w_o), input (x_o,
 * or row i / 0 of the 2-D xb2 when NULL) and output (y_o, or row i of yb2 when NULL). The buffers
 * it holds are in b[0..2] (released here on an error; the 2-D forms' slots stay empty). */
static int get_q8_job(const kern_isa *K, PyObject *type_o, PyObject *w_o, PyObject *x_o, PyObject *y_o,
                      const Py_buffer *xb2, const Py_buffer *yb2, Py_ssize_t i, Py_buffer *b, q8_job *j) {
    const long tl = PyLong_AsLong(type_o);
    if (tl == -1 && PyErr_Occurred()) return -1;
    const int type = (int)tl;
    if (check_type(type) < 0) return -1;
    if (!K->q8[type]) {
        PyErr_Format(PyExc_ValueError, "no integer-activation kernel for ggml type %d", type);
        return -1;
    }
    j->type = type;
    if (get_weight(w_o, type, &b[0], &j->n_rows, &j->n_in, &j->stride) < 0) return -1;
    if (!x_o) {
        if (xb2->shape[1] != j->n_in) {
            PyErr_Format(PyExc_ValueError, "xs has %zd columns, product %zd takes %lld", xb2->shape[1], i,
                         (long long)j->n_in);
            PyBuffer_Release(&b[0]);
            return -1;
        }
        j->T = 1;
        j->x = (const float *)xb2->buf + (xb2->shape[0] == 1 ? 0 : i * j->n_in);
    } else {
        if (get_f32(x_o, &b[1], 0, "x", -1, j->n_in) < 0) {
            PyBuffer_Release(&b[0]);
            return -1;
        }
        j->T = b[1].shape[0];
        j->x = (const float *)b[1].buf;
    }
    if (!y_o) {
        if (j->T != 1 || yb2->shape[1] != j->n_rows) {
            PyErr_Format(PyExc_ValueError, "ys as one array takes one token and %zd rows a product; product %zd "
                         "has %lld tokens and %lld rows", yb2->shape[1], i, (long long)j->T, (long long)j->n_rows);
            PyBuffer_Release(&b[0]);
            PyBuffer_Release(&b[1]);
            return -1;
        }
        j->y = (float *)yb2->buf + i * j->n_rows;
    } else {
        if (get_f32(y_o, &b[2], 1, "y", j->T, j->n_rows) < 0) {
            PyBuffer_Release(&b[0]);
            PyBuffer_Release(&b[1]);
            return -1;
        }
        j->y = (float *)b[2].buf;
    }
    j->W = (const uint8_t *)b[0].buf;
    if (j->n_in == 0 || j->T == 0) { /* nothing to multiply: zeros, and no rows to schedule */
        memset(j->y, 0, (size_t)(j->T * j->n_rows) * sizeof(float));
        j->n_rows = 0;
    }
    return 0;
}

/* matmul_q8_batch(types, ws, xs, ys[, threads]): ys[i] = q8(xs[i]) @ ws[i].T for every i, in one
 * parallel region; types: one ggml type id for all, or one per product.  One token a product (a
 * decode step) may pass xs as one float32 array [1 or n, n_in] (every product's input, or product
 * i's in row i) and ys as one array [n, n_rows] (product i's output in row i): no list of row
 * views to build, and a shared input is quantized once per format */
static PyObject *py_matmul_q8_batch(PyObject *self, PyObject *args) {
    int threads = 0;
    PyObject *to, *wl, *xl, *yl;
    if (!PyArg_ParseTuple(args, "OOOO|i", &to, &wl, &xl, &yl, &threads)) return NULL;
    const kern_isa *K = &g_isa[g_cur];
    const int x2d = !PyList_Check(xl) && !PyTuple_Check(xl), y2d = !PyList_Check(yl) && !PyTuple_Check(yl);
    Py_buffer xb2, yb2; /* the 2-D forms */
    memset(&xb2, 0, sizeof(xb2));
    memset(&yb2, 0, sizeof(yb2));
    PyObject *tf = NULL; /* one type per product; NULL: `to` is the type of all */
    if (!PyLong_Check(to)) {
        tf = PySequence_Fast(to, "types must be an int or a sequence of ints");
        if (!tf) return NULL;
    }
    PyObject *wf = PySequence_Fast(wl, "ws must be a sequence"), *xf = NULL, *yf = NULL;
    if (!wf) {
        Py_XDECREF(tf);
        return NULL;
    }
    xf = x2d ? (Py_INCREF(xl), xl) : PySequence_Fast(xl, "xs must be a sequence or a 2-D float32 array");
    yf = !xf ? NULL : y2d ? (Py_INCREF(yl), yl) : PySequence_Fast(yl, "ys must be a sequence or a 2-D float32 array");
    if (!xf || !yf) {
        Py_XDECREF(xf);
        Py_XDECREF(tf);
        Py_DECREF(wf);
        return NULL;
    }
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(wf);
    PyObject *ret = NULL;
    Py_buffer *bufs = NULL;
    q8_job *jobs = NULL;
    Py_ssize_t got = 0; /* jobs whose three buffers are held (the 2-D forms' slots stay empty) */
    if ((!x2d && PySequence_Fast_GET_SIZE(xf) != n) || (!y2d && PySequence_Fast_GET_SIZE(yf) != n) ||
        (tf && PySequence_Fast_GET_SIZE(tf) != n)) {
        PyErr_SetString(PyExc_ValueError, "types, ws, xs and ys must have the same length");
        goto done;
    }
    if (x2d && get_f32(xl, &xb2, 0, "xs", -1, -1) < 0) goto done;
    if (x2d && xb2.shape[0] != 1 && xb2.shape[0] != n) {
        PyErr_Format(PyExc_ValueError, "xs as one array must have 1 or %zd rows, not %zd", n, xb2.shape[0]);
        goto done;
    }
    if (y2d && get_f32(yl, &yb2, 1, "ys", n, -1) < 0) goto done;
    bufs = (Py_buffer *)calloc((size_t)(3 * n + 1), sizeof(Py_buffer));
    jobs = (q8_job *)calloc((size_t)(n + 1), sizeof(q8_job));
    if (!bufs || !jobs) {
        PyErr_NoMemory();
        goto done;
    }
    for (; got < n; got++)
        if (get_q8_job(K, tf ? PySequence_Fast_GET_ITEM(tf, got) : to, PySequence_Fast_GET_ITEM(wf, got),
                       x2d ? NULL : PySequence_Fast_GET_ITEM(xf, got), y2d ? NULL : PySequence_Fast_GET_ITEM(yf, got),
                       &xb2, &yb2, got, bufs + 3 * got, jobs + got) < 0)
            goto done;
    {
        int rc;
        Py_BEGIN_ALLOW_THREADS
        rc = run_matmul_q8_batch(K, jobs, n, threads);
        Py_END_ALLOW_THREADS
        if (rc < 0) {
            PyErr_NoMemory();
            goto done;
        }
    }
    ret = Py_None;
    Py_INCREF(ret);
done:
    for (Py_ssize_t i = 0; i < got; i++)
        for (int k = 0; k < 3; k++) PyBuffer_Release(&bufs[3 * i + k]);   /* (empty slots: no-ops) */
    PyBuffer_Release(&xb2);
    PyBuffer_Release(&yb2);
    free(bufs);
    free(jobs);
    Py_XDECREF(tf);
    Py_DECREF(wf);
    Py_DECREF(xf);
    Py_DECREF(yf);
    return ret;
}

/* quantize_q8(block, x) -> (codes bytes, scales bytes, sums bytes): one row of float32 x as Q8_0
 * (block 32) or Q8_K (block 256, with the int16 sums of 16) activations (tests) */
static PyObject *py_quantize_q8(PyObject *self, PyObject *args) {
    int bs;
    PyObject *xo;
    if (!PyArg_ParseTuple(args, "iO", &bs, &xo)) return NULL;
    if (bs != 32 && bs != 256) {
        PyErr_SetString(PyExc_ValueError, "block must be 32 (Q8_0) or 256 (Q8_K)");
        return NULL;
    }
    Py_buffer xb;
    if (PyObject_GetBuffer(xo, &xb, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return NULL;
    if (xb.itemsize != 4 || !fmt_is(&xb, 'f') || (xb.len / 4) % bs) {
        PyBuffer_Release(&xb);
        PyErr_SetString(PyExc_ValueError, "x must be float32 with a length that is a multiple of the block");
        return NULL;
    }
    const int64_t n = xb.len / 4;
    PyObject *q = PyBytes_FromStringAndSize(NULL, n), *d = PyBytes_FromStringAndSize(NULL, n / bs * 4);
    PyObject *s = PyBytes_FromStringAndSize(NULL, bs == 256 ? n / 16 * 2 : 0);
    if (!q || !d || !s) {
        Py_XDECREF(q);
        Py_XDECREF(d);
        Py_XDECREF(s);
        PyBuffer_Release(&xb);
        return NULL;
    }
    if (bs == 32)
        kern_quant_q8_0((const float *)xb.buf, n, (int8_t *)PyBytes_AS_STRING(q), (float *)PyBytes_AS_STRING(d));
    else
        kern_quant_q8_k((const float *)xb.buf, n, (int8_t *)PyBytes_AS_STRING(q), (float *)PyBytes_AS_STRING(d),
                        (int16_t *)PyBytes_AS_STRING(s));
    PyBuffer_Release(&xb);
    return Py_BuildValue("(NNN)", q, d, s);
}

/* round_q8(block, x, out[, threads]): out = the values q * d of x's Q8_0 (block 32) or Q8_K (256)
 * quantization, row by row (numerics.q8_0_round / q8_k_round, bit-exact) */
static PyObject *py_round_q8(PyObject *self, PyObject *args) {
    int bs, threads = 0;
    PyObject *xo, *oo;
    if (!PyArg_ParseTuple(args, "iOO|i", &bs, &xo, &oo, &threads)) return NULL;
    if (bs != 32 && bs != 256) {
        PyErr_SetString(PyExc_ValueError, "block must be 32 (Q8_0) or 256 (Q8_K)");
        return NULL;
    }
    Py_buffer xb, ob;
    if (get_f32(xo, &xb, 0, "x", -1, -1) < 0) return NULL;
    const int64_t T = xb.shape[0], n = xb.shape[1];
    if (n % bs) {
        PyBuffer_Release(&xb);
        PyErr_Format(PyExc_ValueError, "rows of %lld values are not a multiple of the block %d", (long long)n, bs);
        return NULL;
    }
    if (get_f32(oo, &ob, 1, "out", T, n) < 0) {
        PyBuffer_Release(&xb);
        return NULL;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = ops_round_q8(bs, (const float *)xb.buf, T, n, (float *)ob.buf, threads);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&xb);
    PyBuffer_Release(&ob);
    if (rc < 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* hc_split(mix, n, scale, base, eps, iters, pre, post, c, a, exp): ops_hc_split_args into a
 * [T, 2n + n*n], then exp(a, a) (the caller passes numpy.exp: the reference's exponentials), then
 * ops_hc_split */
static PyObject *py_hc_split(PyObject *self, PyObject *args) {
    int n, iters;
    float eps;
    PyObject *mo, *so, *bo, *po, *qo, *co, *ao, *fn;
    if (!PyArg_ParseTuple(args, "OiOOfiOOOOO", &mo, &n, &so, &bo, &eps, &iters, &po, &qo, &co, &ao, &fn))
        return NULL;
    if (n < 1 || n > 16 || iters < 1) {
        PyErr_SetString(PyExc_ValueError, "hc_split: n must be in 1..16 and iters >= 1");
        return NULL;
    }
    const int w = 2 * n + n * n;
    Py_buffer mb, sb, bb, pb, qb, cb, ab;
    if (get_f32(mo, &mb, 0, "mix", -1, w) < 0) return NULL;
    const int64_t T = mb.shape[0];
    int got = 1;
    PyObject *ret = NULL;
    if (get_f32(so, &sb, 0, "scale", 1, 3) < 0) goto done;
    got++;
    if (get_f32(bo, &bb, 0, "base", 1, w) < 0) goto done;
    got++;
    if (get_f32(po, &pb, 1, "pre", T, n) < 0) goto done;
    got++;
    if (get_f32(qo, &qb, 1, "post", T, n) < 0) goto done;
    got++;
    if (get_f32(co, &cb, 1, "c", T, n * n) < 0) goto done;
    got++;
    if (get_f32(ao, &ab, 1, "a", T, w) < 0) goto done;
    got++;
    ops_hc_split_args((const float *)mb.buf, T, n, (const float *)sb.buf, (const float *)bb.buf, (float *)ab.buf);
    PyObject *r = PyObject_CallFunctionObjArgs(fn, ao, ao, NULL); /* exp(a, out=a) */
    if (!r) goto done;
    Py_DECREF(r);
    ops_hc_split((const float *)ab.buf, T, n, eps, iters, (float *)pb.buf, (float *)qb.buf, (float *)cb.buf);
    ret = Py_None;
    Py_INCREF(ret);
done:
    {
        Py_buffer *all[7] = {&mb, &sb, &bb, &pb, &qb, &cb, &ab};
        for (int k = 0; k < got; k++) PyBuffer_Release(all[k]);
    }
    return ret;
}

/* rope(x, cs, per, out[, threads]): ops_rope; x and out [R, W], cs [R / per, 2 npair] */
static PyObject *py_rope(PyObject *self, PyObject *args) {
    PyObject *xo, *co, *oo;
    long long per;
    int threads = 0;
    if (!PyArg_ParseTuple(args, "OOLO|i", &xo, &co, &per, &oo, &threads)) return NULL;
    Py_buffer xb, cb, ob;
    if (get_f32(xo, &xb, 0, "x", -1, -1) < 0) return NULL;
    const int64_t R = xb.shape[0], W = xb.shape[1];
    if (per < 1 || R % per) {
        PyBuffer_Release(&xb);
        PyErr_SetString(PyExc_ValueError, "rope: per must be >= 1 and divide the rows of x");
        return NULL;
    }
    if (get_f32(co, &cb, 0, "cs", R / per, -1) < 0) {
        PyBuffer_Release(&xb);
        return NULL;
    }
    const int64_t npair = cb.shape[1] / 2;
    if (cb.shape[1] % 2 || 2 * npair > W) {
        PyBuffer_Release(&xb);
        PyBuffer_Release(&cb);
        PyErr_SetString(PyExc_ValueError, "rope: cs must hold (cos, sin) pairs, at most W / 2 of them");
        return NULL;
    }
    if (get_f32(oo, &ob, 1, "out", R, W) < 0) {
        PyBuffer_Release(&xb);
        PyBuffer_Release(&cb);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    ops_rope((const float *)xb.buf, R, W, (const float *)cb.buf, npair, (int64_t)per, (float *)ob.buf, threads);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&xb);
    PyBuffer_Release(&cb);
    PyBuffer_Release(&ob);
    Py_RETURN_NONE;
}

/* rmsnorm(x, w_or_None, eps, out[, threads[, ds4]]): ops_rmsnorm */
static PyObject *py_rmsnorm(PyObject *self, PyObject *args) {
    PyObject *xo, *wo, *oo;
    double eps;
    int threads = 0, ds4 = 0;
    if (!PyArg_ParseTuple(args, "OOdO|ii", &xo, &wo, &eps, &oo, &threads, &ds4)) return NULL;
    Py_buffer xb, wb, ob;
    if (get_f32(xo, &xb, 0, "x", -1, -1) < 0) return NULL;
    const int64_t R = xb.shape[0], n = xb.shape[1];
    const int has_w = wo != Py_None;
    if (has_w && get_f32(wo, &wb, 0, "w", 1, n) < 0) {
        PyBuffer_Release(&xb);
        return NULL;
    }
    if (get_f32(oo, &ob, 1, "out", R, n) < 0) {
        PyBuffer_Release(&xb);
        if (has_w) PyBuffer_Release(&wb);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    ops_rmsnorm((const float *)xb.buf, has_w ? (const float *)wb.buf : NULL, R, n, eps, (float *)ob.buf, threads,
                ds4);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&xb);
    if (has_w) PyBuffer_Release(&wb);
    PyBuffer_Release(&ob);
    Py_RETURN_NONE;
}

/* hc_post(y, X, post, C, out[, threads]): ops_hc_post */
static PyObject *py_hc_post(PyObject *self, PyObject *args) {
    PyObject *yo, *xo, *po, *co, *oo;
    int threads = 0;
    if (!PyArg_ParseTuple(args, "OOOOO|i", &yo, &xo, &po, &co, &oo, &threads)) return NULL;
    Py_buffer yb, xb, pb, cb, ob;
    int got = 0;
    PyObject *ret = NULL;
    if (get_f32(yo, &yb, 0, "y", -1, -1) < 0) return NULL;
    got++;
    const int64_t T = yb.shape[0], E = yb.shape[1];
    if (get_f32(po, &pb, 0, "post", T, -1) < 0) goto done;
    got++;
    const int64_t n = pb.shape[1];
    if (n < 1 || n > 16) {
        PyErr_SetString(PyExc_ValueError, "hc_post: 1..16 streams");
        goto done;
    }
    if (get_f32(xo, &xb, 0, "X", T * n, E) < 0) goto done;
    got++;
    if (get_f32(co, &cb, 0, "C", T, n * n) < 0) goto done;
    got++;
    if (get_f32(oo, &ob, 1, "out", T * n, E) < 0) goto done;
    got++;
    {
        int rc;
        Py_BEGIN_ALLOW_THREADS
        rc = ops_hc_post((const float *)yb.buf, (const float *)xb.buf, (const float *)pb.buf, (const float *)cb.buf,
                         T, n, E, (float *)ob.buf, threads);
        Py_END_ALLOW_THREADS
        if (rc < 0) {
            PyErr_NoMemory();
            goto done;
        }
    }
    ret = Py_None;
    Py_INCREF(ret);
done:
    {
        Py_buffer *all[5] = {&yb, &pb, &xb, &cb, &ob};
        for (int k = 0; k < got; k++) PyBuffer_Release(all[k]);
    }
    return ret;
}

/* hc_pre_mix(pre, X, out[, threads]): ops_hc_pre_mix */
static PyObject *py_hc_pre_mix(PyObject *self, PyObject *args) {
    PyObject *po, *xo, *oo;
    int threads = 0;
    if (!PyArg_ParseTuple(args, "OOO|i", &po, &xo, &oo, &threads)) return NULL;
    Py_buffer pb, xb, ob;
    if (get_f32(po, &pb, 0, "pre", -1, -1) < 0) return NULL;
    const int64_t T = pb.shape[0], n = pb.shape[1];
    if (n < 1 || n > 16) {
        PyBuffer_Release(&pb);
        PyErr_SetString(PyExc_ValueError, "hc_pre_mix: 1..16 streams");
        return NULL;
    }
    if (get_f32(xo, &xb, 0, "X", T * n, -1) < 0) {
        PyBuffer_Release(&pb);
        return NULL;
    }
    const int64_t E = xb.shape[1];
    if (get_f32(oo, &ob, 1, "out", T, E) < 0) {
        PyBuffer_Release(&pb);
        PyBuffer_Release(&xb);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    ops_hc_pre_mix((const float *)pb.buf, (const float *)xb.buf, T, n, E, (float *)ob.buf, threads);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&pb);
    PyBuffer_Release(&xb);
    PyBuffer_Release(&ob);
    Py_RETURN_NONE;
}

/* store_kv(rows, n_nope, out[, threads]): ops_store_kv */
static PyObject *py_store_kv(PyObject *self, PyObject *args) {
    PyObject *xo, *oo;
    long long n_nope;
    int threads = 0;
    if (!PyArg_ParseTuple(args, "OLO|i", &xo, &n_nope, &oo, &threads)) return NULL;
    Py_buffer xb, ob;
    if (get_f32(xo, &xb, 0, "rows", -1, -1) < 0) return NULL;
    const int64_t R = xb.shape[0], D = xb.shape[1];
    if (n_nope < 0 || n_nope > D || n_nope % 64) {
        PyBuffer_Release(&xb);
        PyErr_Format(PyExc_ValueError, "store_kv: n_nope %lld must be a multiple of 64 in 0..%lld", n_nope, (long long)D);
        return NULL;
    }
    if (get_f32(oo, &ob, 1, "out", R, D) < 0) {
        PyBuffer_Release(&xb);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    ops_store_kv((const float *)xb.buf, R, D, (int64_t)n_nope, (float *)ob.buf, threads);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&xb);
    PyBuffer_Release(&ob);
    Py_RETURN_NONE;
}

/* one (keys, mask, per_query[, idx]) segment of attention: its buffers held in kb, mb, ib (released
 * here on an error) and described in seg. idx (int64 [T, K], or None): key k of query t is row
 * idx[t, k] of keys [N, D]; every index is checked against N, attended or not */
static int get_segment(PyObject *it, int64_t T, int64_t D, Py_buffer *kb, Py_buffer *mb, Py_buffer *ib,
                       attn_seg *seg) {
    PyObject *ko, *mo, *io = Py_None;
    int perq;
    if (!PyArg_ParseTuple(it, "OOp|O", &ko, &mo, &perq, &io)) return -1;
    if (get_f32(ko, kb, 0, "keys", -1, D) < 0) return -1;
    if (PyObject_GetBuffer(mo, mb, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyBuffer_Release(kb);
        return -1;
    }
    const int64_t Km = mb->ndim == 2 ? mb->shape[1] : -1;
    const int has_idx = io != Py_None;
    if (mb->ndim != 2 || mb->itemsize != 1 || mb->shape[0] != T ||
        (!has_idx && kb->shape[0] != (perq ? T * Km : Km)) || (has_idx && perq)) {
        PyErr_SetString(PyExc_ValueError, "attention: a mask must be uint8 [T, K] and its keys [K or T * K, D] "
                                          "(with idx: [N, D], not per query)");
        goto fail;
    }
    const int64_t *idx = NULL;
    if (has_idx) {
        if (PyObject_GetBuffer(io, ib, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) goto fail;
        if (ib->ndim != 2 || ib->itemsize != 8 || (!fmt_is(ib, 'q') && !fmt_is(ib, 'l')) || ib->shape[0] != T ||
            ib->shape[1] != Km) {
            PyErr_SetString(PyExc_ValueError, "attention: idx must be int64 [T, K], the mask's shape");
            PyBuffer_Release(ib);
            goto fail;
        }
        idx = (const int64_t *)ib->buf;
        const int64_t N = kb->shape[0];
        for (int64_t i = 0; i < T * Km; i++)
            if (idx[i] < 0 || idx[i] >= N) {
                PyErr_Format(PyExc_ValueError, "attention: idx %lld is not a row of the %lld keys",
                             (long long)idx[i], (long long)N);
                PyBuffer_Release(ib);
                goto fail;
            }
    }
    *seg = (attn_seg){(const float *)kb->buf, (const uint8_t *)mb->buf, Km, perq, idx};
    return 0;
fail:
    PyBuffer_Release(kb);
    PyBuffer_Release(mb);
    return -1;
}

/* attention(q, sinks, out, segments, scale[, threads]): ops_attention; a segment is (keys, mask,
 * per_query); q not scaled (the scores are (q . key) * scale in float64) */
static PyObject *py_attention(PyObject *self, PyObject *args) {
    PyObject *qo, *so, *oo, *sl;
    double scale;
    int threads = 0, ds4 = 0;  /* ds4: ds4 numerics' float32 form (ops_ds4.c, head dim 128) */
    if (!PyArg_ParseTuple(args, "OOOOd|ip", &qo, &so, &oo, &sl, &scale, &threads, &ds4)) return NULL;
    const kern_isa *K = &g_isa[g_cur];
    if (!K->attn && !ds4) {
        PyErr_SetString(PyExc_ValueError, "attention: no kernel in this build");
        return NULL;
    }
    Py_buffer qb, sb, ob;
    if (get_f32(so, &sb, 0, "sinks", 1, -1) < 0) return NULL;
    const int64_t H = sb.shape[1];
    if (get_f32(qo, &qb, 0, "q", -1, -1) < 0) {
        PyBuffer_Release(&sb);
        return NULL;
    }
    const int64_t D = qb.shape[1], T = H > 0 ? qb.shape[0] / H : 0;
    if (ds4 && D != 128) {
        PyErr_SetString(PyExc_ValueError, "attention: ds4's form is the head dim 128 one");
        PyBuffer_Release(&qb);
        PyBuffer_Release(&sb);
        return NULL;
    }
    PyObject *segf = NULL, *ret = NULL;
    Py_buffer *kb = NULL, *mb = NULL, *ib = NULL;
    attn_seg *segs = NULL;
    Py_ssize_t nseg = 0, held = 0;
    if (H < 1 || qb.shape[0] != T * H) {
        PyErr_SetString(PyExc_ValueError, "attention: q must have T * H rows");
        PyBuffer_Release(&qb);
        PyBuffer_Release(&sb);
        return NULL;
    }
    if (get_f32(oo, &ob, 1, "out", T * H, D) < 0) {
        PyBuffer_Release(&qb);
        PyBuffer_Release(&sb);
        return NULL;
    }
    segf = PySequence_Fast(sl, "segments must be a sequence");
    if (!segf) goto done;
    nseg = PySequence_Fast_GET_SIZE(segf);
    kb = (Py_buffer *)calloc((size_t)nseg + 1, sizeof(Py_buffer));
    mb = (Py_buffer *)calloc((size_t)nseg + 1, sizeof(Py_buffer));
    ib = (Py_buffer *)calloc((size_t)nseg + 1, sizeof(Py_buffer));
    segs = (attn_seg *)calloc((size_t)nseg + 1, sizeof(attn_seg));
    if (!kb || !mb || !ib || !segs) {
        PyErr_NoMemory();
        goto done;
    }
    int64_t nmax = 0;
    for (; held < nseg; held++) {
        if (get_segment(PySequence_Fast_GET_ITEM(segf, held), T, D, &kb[held], &mb[held], &ib[held], &segs[held]) < 0)
            goto done;
        nmax += segs[held].K;
    }
    {
        int rc;
        Py_BEGIN_ALLOW_THREADS
        rc = ds4 ? ds4_attention((const float *)qb.buf, (const float *)sb.buf, (float)scale, T, H, segs, nseg, nmax,
                                 (float *)ob.buf, threads)
                 : ops_attention(K, (const float *)qb.buf, (const float *)sb.buf, scale, T, H, D, segs, nseg, nmax,
                                 (float *)ob.buf, threads);
        Py_END_ALLOW_THREADS
        if (rc < 0) {
            PyErr_NoMemory();
            goto done;
        }
    }
    ret = Py_None;
    Py_INCREF(ret);
done:
    for (Py_ssize_t i = 0; i < held; i++) {
        PyBuffer_Release(&kb[i]);
        PyBuffer_Release(&mb[i]);
        if (segs[i].idx) PyBuffer_Release(&ib[i]);
    }
    free(kb);
    free(mb);
    free(ib);
    free(segs);
    Py_XDECREF(segf);
    PyBuffer_Release(&qb);
    PyBuffer_Release(&sb);
    PyBuffer_Release(&ob);
    return ret;
}

static PyObject *py_has_q8(PyObject *self, PyObject *arg) {
    long type = PyLong_AsLong(arg);
    if (type == -1 && PyErr_Occurred()) return NULL;
    return PyBool_FromLong(type >= 0 && type < KT_MAX && g_isa[g_cur].q8[type] != NULL);
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
    uint64_t total;
    Py_BEGIN_ALLOW_THREADS
    total = ops_read_sum(p, n);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&b);
    return PyLong_FromUnsignedLongLong(total);
}

/* f16_seq(w, x, y, n_in): ds4 numerics' F16 matvec (kern_f16_seq), w C-contiguous halves
 * [n_rows, n_in], x float32 [T, n_in], y float32 [T, n_rows] (kernels.matmul_f16_seq checks them) */
static PyObject *py_f16_seq(PyObject *self, PyObject *args) {
    PyObject *wo, *xo, *yo;
    long long n_in;
    if (!PyArg_ParseTuple(args, "OOOL", &wo, &xo, &yo, &n_in)) return NULL;
    Py_buffer w, x, y;
    if (PyObject_GetBuffer(wo, &w, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (PyObject_GetBuffer(xo, &x, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&w);
        return NULL;
    }
    if (PyObject_GetBuffer(yo, &y, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&w);
        PyBuffer_Release(&x);
        return NULL;
    }
    PyObject *ret = NULL;
    const int64_t n = (int64_t)n_in;
    const int64_t rows = n > 0 ? (int64_t)(w.len / 2) / n : 0, T = n > 0 ? (int64_t)(x.len / 4) / n : 0;
    if (n <= 0 || w.len != rows * n * 2 || x.len != T * n * 4 || y.len != T * rows * 4) {
        PyErr_SetString(PyExc_ValueError, "f16_seq: w [rows, n_in] halves, x [T, n_in] and y [T, rows] float32");
    } else {
        Py_BEGIN_ALLOW_THREADS
        run_f16_seq((const uint16_t *)w.buf, (ptrdiff_t)n, rows, n, (const float *)x.buf, T, (float *)y.buf, 0);
        Py_END_ALLOW_THREADS
        ret = Py_None;
        Py_INCREF(ret);
    }
    PyBuffer_Release(&w);
    PyBuffer_Release(&x);
    PyBuffer_Release(&y);
    return ret;
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

static PyObject *py_batch_invariant(PyObject *self, PyObject *noargs) { return PyBool_FromLong(g_invariant); }

static PyObject *py_has_attention(PyObject *self, PyObject *noargs) { return PyBool_FromLong(g_isa[g_cur].attn != NULL); }

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
            kern_q8_use(g_isa[i].q8_maxmag, g_isa[i].q8_codes);
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

/* q8_gemm_min_t(type[, n]) -> the smallest T the integer GEMM form takes (0: none for this type
 * and instruction set, or batch-invariant mode); n >= 1 sets it for every instruction set, n = 0
 * puts back each build's own default (they differ: kern_iq2_vbmi.h) */
static PyObject *py_q8_gemm_min_t(PyObject *self, PyObject *args) {
    int type, n = -1;
    if (!PyArg_ParseTuple(args, "i|i", &type, &n)) return NULL;
    if (check_type(type) < 0) return NULL;
    const int prev = g_isa[g_cur].q8g[type] && !g_invariant ? g_isa[g_cur].q8g_min_t[type] : 0;
    if (n >= 1) {
        for (int i = 0; i < ISA_N; i++) g_isa[i].q8g_min_t[type] = n;
    } else if (n == 0) {
        for (int i = 0; i < ISA_N; i++) g_isa[i].q8g_min_t[type] = g_min_t0[i][type];
    }
    return PyLong_FromLong(prev);
}

static PyObject *py_tables(PyObject *self, PyObject *noargs) {
    return Py_BuildValue("(y#y#)", (const char *)kern_iq2xxs_grid, (Py_ssize_t)sizeof(kern_iq2xxs_grid),
                         (const char *)kern_ksigns, (Py_ssize_t)sizeof(kern_ksigns));
}

static PyMethodDef methods[] = {
    {"matmul", py_matmul, METH_VARARGS, "matmul(type_id, w, x, y[, threads[, path]]): y = x @ W.T (float32)"},
    {"matmul_q8_batch", py_matmul_q8_batch, METH_VARARGS,
     "matmul_q8_batch(types, ws, xs, ys[, threads]): ys[i] = q8(xs[i]) @ ws[i].T, one parallel region "
     "(types: one type id, or one per product)"},
    {"quantize_q8", py_quantize_q8, METH_VARARGS, "quantize_q8(block, x) -> (codes, scales, sums) as bytes"},
    {"round_q8", py_round_q8, METH_VARARGS, "round_q8(block, x, out[, threads]): out = Q8_0/Q8_K-rounded x"},
    {"attention", py_attention, METH_VARARGS, "attention(q, sinks, out, segments, scale[, threads[, ds4]]): per-query softmax attention, float64 inside (ds4: ds4's float32 form)"},
    {"store_kv", py_store_kv, METH_VARARGS, "store_kv(rows, n_nope, out[, threads]): FP8 + F16 rounding of KV rows"},
    {"hc_post", py_hc_post, METH_VARARGS, "hc_post(y, X, post, C, out[, threads]): hyper-connection post mix"},
    {"hc_pre_mix", py_hc_pre_mix, METH_VARARGS, "hc_pre_mix(pre, X, out[, threads]): hyper-connection pre mix"},
    {"hc_split", py_hc_split, METH_VARARGS,
     "hc_split(mix, n, scale, base, eps, iters, pre, post, c, a, exp): hyper-connection weights (float32; "
     "exp: numpy.exp, applied in place to the scratch a [T, 2n + n*n])"},
    {"rope", py_rope, METH_VARARGS, "rope(x, cs, per, out[, threads]): RoPE of x's rows, bit for bit the reference's"},
    {"rmsnorm", py_rmsnorm, METH_VARARGS, "rmsnorm(x, w_or_None, eps, out[, threads]): row RMS norm (float64 sums)"},
    {"q8_gemm_min_t", py_q8_gemm_min_t, METH_VARARGS,
     "q8_gemm_min_t(type_id[, n]) -> smallest T of the integer GEMM form, 0 = none (sets it)"},
    {"has_q8", py_has_q8, METH_O, "has_q8(type_id) -> whether an integer-activation kernel exists"},
    {"dequantize", py_dequantize, METH_VARARGS, "dequantize(type_id, w, out[, threads]): out = decoded rows of w"},
    {"f16_seq", py_f16_seq, METH_VARARGS, "f16_seq(w, x, y, n_in): ds4 numerics' F16 matvec, float32 sums in index order"},
    {"read_sum", py_read_sum, METH_O, "read_sum(buf): sum of the buffer's uint64 words (bandwidth probe)"},
    {"set_threads", py_set_threads, METH_O, "set_threads(n): OpenMP threads used by the kernels"},
    {"get_threads", py_get_threads, METH_NOARGS, "get_threads() -> int"},
    {"batch_invariant", py_batch_invariant, METH_NOARGS, "batch_invariant() -> the current setting"},
    {"has_attention", py_has_attention, METH_NOARGS, "has_attention() -> whether this build has the attention kernel"},
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
    PyModuleDef_HEAD_INIT, "engine.backends.cpu._kernels", "Fast CPU kernels for GGUF block formats.", -1, methods,
};

PyMODINIT_FUNC PyInit__kernels(void) {
    sched_init();
    PyObject *m = PyModule_Create(&moddef);
    if (!m) return NULL;
#ifndef DS4_KERNELS_SRC_HASH
#define DS4_KERNELS_SRC_HASH ""
#endif
    PyModule_AddStringConstant(m, "source_hash", DS4_KERNELS_SRC_HASH);
    if (ds4ops_register(m) < 0) {
        Py_DECREF(m);
        return NULL;
    }
#ifdef _OPENMP
    PyModule_AddIntConstant(m, "openmp", 1);
#else
    PyModule_AddIntConstant(m, "openmp", 0);
#endif
    return m;
}
