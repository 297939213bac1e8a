/* engine.backends.cpu._kernels: fast CPU matmul / dequantization kernels for the GGUF block formats.
 *
 * Python API (engine/backends/cpu/kernels.py wraps it with validation and the BLAS path):
 *   matmul(type_id, w, x, y[, threads[, path]])  y[T, n_rows] = x[T, n_in] @ W.T; w: 2-D uint8
 *                                 buffer of packed rows (any row stride, contiguous rows), x / y
 *                                 float32 C-contiguous; threads: thread count of this call (0:
 *                                 set_threads); path: 0 by T, 1 in registers, 2 decoded panel
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
 * released while the kernels run on OpenMP threads (rows split statically across threads). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdlib.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "kern.h"

enum { ISA_GENERIC, ISA_AVX2, ISA_AVX512, ISA_AVX512VBMI, ISA_N };

static kern_isa g_isa[ISA_N];
static int g_have[ISA_N];
static int g_cur = ISA_GENERIC;
static int g_min_t0[ISA_N][KT_MAX]; /* each build's default q8g_min_t, for q8_gemm_min_t(type, 0) */
static int g_threads = 1;
/* batch invariance: T = 1 takes the in-register exact-weight path (mvt) instead of mv1, so every
 * path sums each (row, token) product in the same order and a token's result does not depend on
 * T, on the path or on the thread count */
static int g_invariant = 0;

/* column block of the panel path for wide inputs (run_matmul) */
#define KERN_KC 1024

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
        /* rows in 16s (whole cache lines of y), but a short matrix row by row: the 24 x 16384
         * hyper-connection weights split 16 / 8 took two thirds of the time on one thread */
        const int64_t unit = n_rows < 256 ? 1 : 16;
        const int nt = thread_count((n_rows + unit - 1) / unit, n_rows * rb, 64 * 1024, max_threads);
#pragma omp parallel num_threads(nt) if (nt > 1)
        {
            int64_t a, b;
            split_rows(n_rows, unit, OMP_TID(), OMP_NTH(), &a, &b);
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
    /* Column blocks: a panel of rows sweeps all of x (T x n_in floats), and the panel holds
     * 256 KiB / n_in rows, so a wide x (8192 values x 512 tokens = 16 MiB) was re-read from memory
     * for every 8 rows. Blocks of KERN_KC values keep 64-row panels and a block of x that caches
     * well; the partial sums are added into y (a different summation order: not in batch-invariant
     * mode, where a token's sums must not depend on T). */
    const int64_t be = kern_block_elems(type);
    int64_t kc = n_in;
    if (!g_invariant && n_in >= 2 * KERN_KC && T * n_in * (int64_t)sizeof(float) > (1 << 20) && KERN_KC % be == 0)
        kc = KERN_KC;
    const int unit = K->panel_rows;
    const size_t need = (size_t)(kern_panel_rows(unit, kc) * kern_ldw(kc));
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
                for (int64_t k0 = 0; k0 < n_in; k0 += kc) {
                    const int64_t len = n_in - k0 < kc ? n_in - k0 : kc;
                    K->panel(K->dq[type], W + k0 / be * kern_block_bytes(type), stride, len, a, b, x + k0, n_in, T,
                             y, n_rows, wbuf, k0 > 0);
                }
            }
        }
    }
    return failed ? -1 : 0;
}

/* Integer activations (ds4 numerics): every token of every x is quantized (Q8_0 or Q8_K blocks, by
 * the job's weight type), then the 16-row units of all the products are split over the threads by
 * work (one product is a batch of one; a layer's routed experts and its shared expert are one
 * fork/join, not one per matrix; jobs may mix weight types) */
typedef struct {
    int type;
    const uint8_t *W;
    ptrdiff_t stride;
    int64_t n_rows, n_in, T;
    const float *x;
    float *y;
    int8_t *xq; /* quantized x, filled here */
    uint8_t *xu; /* xq + 128 (GEMM form, signed weight codes) */
    int8_t *xr; /* xq in the row kernel's order (kern_isa.q8_arrange), else NULL */
    float *xd;
    int16_t *xs;
    int gemm;   /* take the GEMM form (many tokens) */
    int64_t same; /* an earlier job whose activation codes this one reads (the same x, quantized and
                   * arranged the same way: a decode step's experts all take one token), else -1 */
} q8_job;

/* jobs a and b read the same activation codes: the same x, block size and arrangement */
static int q8_same_codes(const kern_isa *K, const q8_job *a, const q8_job *b) {
    if (a->x != b->x || a->T != b->T || a->n_in != b->n_in || a->gemm != b->gemm) return 0;
    if (kern_q8_block(a->type) != kern_q8_block(b->type)) return 0;
    if (a->gemm) return K->q8g_xu[a->type] == K->q8g_xu[b->type]; /* x + 128 or not */
    return K->q8_arrange[a->type] == K->q8_arrange[b->type];
}

/* relative cost of a weight value for the work split: IQ2_XXS decoding is compute-bound (about
 * 0.27 cycles a value on a Zen 4 core), Q8_0 streams at the read rate (about 0.19), Q2_K about 0.14;
 * a build with faster kernels sets its own (kern_isa.q8_cost) */
static int64_t q8_cost(const kern_isa *K, int type) {
    if (K->q8_cost[type]) return K->q8_cost[type];
    return type == KT_IQ2_XXS ? 6 : type == KT_Q2_K ? 3 : 4;
}

static int run_matmul_q8_batch(const kern_isa *K, q8_job *jobs, int64_t n_jobs, int max_threads) {
    int64_t nq = 0, nd = 0, ns = 0, nu = 0, units = 0, work = 0, gscratch = 0;
    for (int64_t i = 0; i < n_jobs; i++) {
        q8_job *j = &jobs[i];
        const int bs = kern_q8_block(j->type);
        j->gemm = K->q8g[j->type] && !g_invariant && j->T >= K->q8g_min_t[j->type];
        units += (j->n_rows + 15) / 16;
        work += j->n_rows * (j->n_in / kern_block_elems(j->type) * kern_block_bytes(j->type)) * (j->T < 4 ? j->T : 4);
        j->same = -1;
        for (int64_t k = i - 1; k >= 0 && k >= i - 64; k--)   /* (a decode batch's 26-28 jobs) */
            if (jobs[k].same < 0 && q8_same_codes(K, &jobs[k], j)) {
                j->same = k;
                break;
            }
        if (j->same >= 0) continue;
        if (j->gemm) {
            const int64_t g = K->q8g_scratch(j->n_in);
            gscratch = g > gscratch ? g : gscratch;
            nu += K->q8g_xu[j->type] ? j->T * j->n_in : 0; /* the form reads x + 128 */
        } else if (K->q8_arrange[j->type])
            nu += j->T * j->n_in; /* the row kernel's order */
        nq += j->T * j->n_in;
        nd += j->T * (j->n_in / bs);
        ns += bs == 256 ? j->T * (j->n_in / 16) : 0;
    }
    int8_t *xq = (int8_t *)malloc((size_t)nq + 1);
    uint8_t *xu = (uint8_t *)malloc((size_t)nu + 1); /* a second copy of some jobs' codes: xu or xr */
    float *xd = (float *)malloc((size_t)nd * sizeof(float) + 1);
    int16_t *xs = (int16_t *)malloc((size_t)ns * sizeof(int16_t) + 1);
    int64_t *unit_job = (int64_t *)malloc((size_t)units * sizeof(int64_t) + 1);
    int64_t *unit_cum = (int64_t *)malloc((size_t)(units + 1) * sizeof(int64_t));
    if (!xq || !xu || !xd || !xs || !unit_job || !unit_cum) {
        free(xq);
        free(xu);
        free(xd);
        free(xs);
        free(unit_job);
        free(unit_cum);
        return -1;
    }
    nq = nd = ns = nu = 0;
    for (int64_t i = 0, u = 0; i < n_jobs; i++) {
        q8_job *j = &jobs[i];
        const int bs = kern_q8_block(j->type);
        for (int64_t r = 0; r < j->n_rows; r += 16) unit_job[u++] = i;
        if (j->same >= 0) {
            const q8_job *k = &jobs[j->same];
            j->xq = k->xq;
            j->xd = k->xd;
            j->xs = k->xs;
            j->xu = k->xu;
            j->xr = k->xr;
            continue;
        }
        j->xq = xq + nq;
        j->xd = xd + nd;
        j->xs = bs == 256 ? xs + ns : NULL;
        j->xu = j->gemm && K->q8g_xu[j->type] ? xu + nu : NULL;
        j->xr = !j->gemm && K->q8_arrange[j->type] ? (int8_t *)xu + nu : NULL;
        nu += j->xu || j->xr ? j->T * j->n_in : 0;
        nq += j->T * j->n_in;
        nd += j->T * (j->n_in / bs);
        ns += bs == 256 ? j->T * (j->n_in / 16) : 0;
    }
    /* the units' work (rows x values x (tokens + 2): decoding a row costs about two tokens'
     * products, times the format's cost), summed: the threads split the work, not the unit count
     * (a prefill's experts have 1 to 32 tokens each) */
    unit_cum[0] = 0;
    for (int64_t u = 0; u < units; u++) {
        const q8_job *j = &jobs[unit_job[u]];
        /* the GEMM form: decoding and packing a row costs about two tokens, and a token's products
         * about a quarter of the row kernels' */
        unit_cum[u + 1] = unit_cum[u] + 16 * j->n_in * q8_cost(K, j->type) * (j->gemm ? (j->T + 3) / 4 + 2 : j->T + 2);
    }
    const int nt = thread_count(units, work, 64 * 1024, max_threads);
    int failed = 0; /* a GEMM job's scratch could not be had */
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        const int tid = OMP_TID(), nth = OMP_NTH();
        /* quantize: jobs split over threads (each job's tokens are few); codes a row kernel reads
         * in its own order are arranged here, once a job (not once a thread and call) */
        for (int64_t i = tid; i < n_jobs; i += nth) {
            const q8_job *j = &jobs[i];
            if (j->same >= 0) continue;
            for (int64_t t = 0; t < j->T; t++) {
                if (kern_q8_block(j->type) == 32)
                    kern_quant_q8_0(j->x + t * j->n_in, j->n_in, j->xq + t * j->n_in, j->xd + t * (j->n_in / 32));
                else
                    kern_quant_q8_k(j->x + t * j->n_in, j->n_in, j->xq + t * j->n_in, j->xd + t * (j->n_in / 256),
                                    j->xs + t * (j->n_in / 16));
            }
            if (j->xu)
                for (int64_t k = 0; k < j->T * j->n_in; k++) j->xu[k] = (uint8_t)j->xq[k] ^ 0x80u;
            if (j->xr) K->q8_arrange[j->type](j->xq, j->n_in, j->T, j->xr);
        }
#pragma omp barrier
        /* a contiguous run of 16-row units of all jobs per thread, equal in work */
        int64_t u0 = 0, u1 = 0;
        {
            const int64_t w0 = unit_cum[units] * tid / nth, w1 = unit_cum[units] * (tid + 1) / nth;
            while (u0 < units && unit_cum[u0] < w0) u0++;
            u1 = u0;
            while (u1 < units && unit_cum[u1] < w1) u1++;
            if (tid == nth - 1) u1 = units;
        }
        int64_t u = u0;
        while (u < u1) {
            const int64_t i = unit_job[u];
            int64_t first = u; /* the first unit of job i */
            while (first > 0 && unit_job[first - 1] == i) first--;
            int64_t last = u;
            while (last + 1 < u1 && unit_job[last + 1] == i) last++;
            const q8_job *j = &jobs[i];
            const int64_t a = (u - first) * 16, b = (last + 1 - first) * 16 < j->n_rows ? (last + 1 - first) * 16 : j->n_rows;
            if (j->gemm) {
                uint8_t *gs = (uint8_t *)scratch((size_t)(gscratch + 3) / 4);
                if (gs)
                    K->q8g[j->type](j->W, j->stride, j->n_in, a, b, j->xq, j->xu, j->xd, j->xs, j->T, j->y, j->n_rows, gs);
                else
#pragma omp atomic write
                    failed = 1;
            } else
                K->q8[j->type](j->W, j->stride, j->n_in, a, b, j->xr ? j->xr : j->xq, j->xd, j->xs, j->T, j->y, j->n_rows);
            u = last + 1;
        }
    }
    free(xq);
    free(xu);
    free(xd);
    free(xs);
    free(unit_job);
    free(unit_cum);
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
    for (; got < n; got++) {
        Py_buffer *b = bufs + 3 * got;
        q8_job *j = jobs + got;
        const long tl = PyLong_AsLong(tf ? PySequence_Fast_GET_ITEM(tf, got) : to);
        if (tl == -1 && PyErr_Occurred()) goto done;
        const int type = (int)tl;
        if (check_type(type) < 0) goto done;
        if (!K->q8[type]) {
            PyErr_Format(PyExc_ValueError, "no integer-activation kernel for ggml type %d", type);
            goto done;
        }
        j->type = type;
        if (get_weight(PySequence_Fast_GET_ITEM(wf, got), type, &b[0], &j->n_rows, &j->n_in, &j->stride) < 0) goto done;
        if (x2d) {
            if (xb2.shape[1] != j->n_in) {
                PyErr_Format(PyExc_ValueError, "xs has %zd columns, product %zd takes %lld", xb2.shape[1], got,
                             (long long)j->n_in);
                PyBuffer_Release(&b[0]);
                goto done;
            }
            j->T = 1;
            j->x = (const float *)xb2.buf + (xb2.shape[0] == 1 ? 0 : got * j->n_in);
        } else {
            if (get_f32(PySequence_Fast_GET_ITEM(xf, got), &b[1], 0, "x", -1, j->n_in) < 0) {
                PyBuffer_Release(&b[0]);
                goto done;
            }
            j->T = b[1].shape[0];
            j->x = (const float *)b[1].buf;
        }
        if (y2d) {
            if (j->T != 1 || yb2.shape[1] != j->n_rows) {
                PyErr_Format(PyExc_ValueError, "ys as one array takes one token and %zd rows a product; product %zd "
                             "has %lld tokens and %lld rows", yb2.shape[1], got, (long long)j->T, (long long)j->n_rows);
                PyBuffer_Release(&b[0]);
                PyBuffer_Release(&b[1]);
                goto done;
            }
            j->y = (float *)yb2.buf + got * j->n_rows;
        } else {
            if (get_f32(PySequence_Fast_GET_ITEM(yf, got), &b[2], 1, "y", j->T, j->n_rows) < 0) {
                PyBuffer_Release(&b[0]);
                PyBuffer_Release(&b[1]);
                goto done;
            }
            j->y = (float *)b[2].buf;
        }
        j->W = (const uint8_t *)b[0].buf;
        if (j->n_in == 0 || j->T == 0) { /* nothing to multiply: zeros, and no rows to schedule */
            memset(j->y, 0, (size_t)(j->T * j->n_rows) * sizeof(float));
            j->n_rows = 0;
        }
    }
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
    const float *x = (const float *)xb.buf;
    float *out = (float *)ob.buf;
    int8_t *q = (int8_t *)malloc((size_t)(T * n) + 1);
    float *d = (float *)malloc((size_t)(T * (n / bs)) * sizeof(float) + 1);
    int16_t *s = (int16_t *)malloc((size_t)(T * (n / 16)) * sizeof(int16_t) + 1);
    const int failed = !q || !d || !s;
    if (!failed) {
        Py_BEGIN_ALLOW_THREADS
        const int nt = thread_count(T, T * n, 256 * 1024, threads);
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
        for (int64_t t = 0; t < T; t++) {
            int8_t *qt = q + t * n;
            float *dt = d + t * (n / bs);
            if (bs == 32)
                kern_quant_q8_0(x + t * n, n, qt, dt);
            else
                kern_quant_q8_k(x + t * n, n, qt, dt, s + t * (n / 16));
            float *o = out + t * n;
            for (int64_t b = 0; b < n / bs; b++)
                for (int64_t i = b * bs; i < (b + 1) * bs; i++) o[i] = (float)qt[i] * dt[b];
        }
        Py_END_ALLOW_THREADS
    }
    free(q);
    free(d);
    free(s);
    PyBuffer_Release(&xb);
    PyBuffer_Release(&ob);
    if (failed) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* hc_split(mix, n, scale, base, eps, iters, pre, post, c): the hyper-connection weights of every
 * token (NumpyOps.hc_split in float32 C: at decode the reference's ~90 NumPy calls on 4 x 4
 * arrays cost ~0.25 ms a call, twice a layer):
 *   z = mix * scale[part] + base;  pre = sigmoid(z[:n]) + eps;  post = 2 sigmoid(z[n:2n])
 *   C = softmax over j of z[2n:] as [n][n] (row i, column j), + eps
 *   C /= column sums + eps; then iters - 1 times: C /= row sums + eps, C /= column sums + eps */
static PyObject *py_hc_split(PyObject *self, PyObject *args) {
    int n, iters;
    float eps;
    PyObject *mo, *so, *bo, *po, *qo, *co;
    if (!PyArg_ParseTuple(args, "OiOOfiOOO", &mo, &n, &so, &bo, &eps, &iters, &po, &qo, &co)) return NULL;
    if (n < 1 || n > 16 || iters < 1) {
        PyErr_SetString(PyExc_ValueError, "hc_split: n must be in 1..16 and iters >= 1");
        return NULL;
    }
    const int w = 2 * n + n * n;
    Py_buffer mb, sb, bb, pb, qb, cb;
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
    {
        const float *mix = (const float *)mb.buf, *sc = (const float *)sb.buf, *base = (const float *)bb.buf;
        float *pre = (float *)pb.buf, *post = (float *)qb.buf, *C = (float *)cb.buf;
        Py_BEGIN_ALLOW_THREADS
        for (int64_t t = 0; t < T; t++) {
            const float *m = mix + t * w;
            float *c = C + t * n * n;
            for (int i = 0; i < n; i++) {
                const float zp = m[i] * sc[0] + base[i], zq = m[n + i] * sc[1] + base[n + i];
                pre[t * n + i] = 1.0f / (1.0f + expf(-zp)) + eps;
                post[t * n + i] = 2.0f * (1.0f / (1.0f + expf(-zq)));
            }
            for (int i = 0; i < n; i++) {
                float z[16], mx = -INFINITY, s = 0.0f;
                for (int j = 0; j < n; j++) {
                    z[j] = m[2 * n + i * n + j] * sc[2] + base[2 * n + i * n + j];
                    mx = z[j] > mx ? z[j] : mx;
                }
                if (!isfinite(mx)) mx = 0.0f;
                for (int j = 0; j < n; j++) s += (z[j] = expf(z[j] - mx));
                for (int j = 0; j < n; j++) c[i * n + j] = z[j] / s + eps;
            }
            for (int it = 0; it < iters; it++) {
                if (it > 0) /* rows */
                    for (int i = 0; i < n; i++) {
                        float s = 0.0f;
                        for (int j = 0; j < n; j++) s += c[i * n + j];
                        s += eps;
                        for (int j = 0; j < n; j++) c[i * n + j] /= s;
                    }
                for (int j = 0; j < n; j++) { /* columns */
                    float s = 0.0f;
                    for (int i = 0; i < n; i++) s += c[i * n + j];
                    s += eps;
                    for (int i = 0; i < n; i++) c[i * n + j] /= s;
                }
            }
        }
        Py_END_ALLOW_THREADS
    }
    ret = Py_None;
    Py_INCREF(ret);
done:
    {
        Py_buffer *all[6] = {&mb, &sb, &bb, &pb, &qb, &cb};
        for (int k = 0; k < got; k++) PyBuffer_Release(all[k]);
    }
    return ret;
}

/* rmsnorm(x, w_or_None, eps, out[, threads]): NumpyOps.rmsnorm row by row (x [rows, n]): the
 * squares summed in float64 (8 partial sums), inv = float32(1 / sqrt(sum / n + eps)) in float64,
 * out = float32(x * inv) (* w). The reference sums pairwise in float64, so inv matches it except
 * in the rare case where the float64 sums' last-bit difference crosses a float32 rounding point. */
static PyObject *py_rmsnorm(PyObject *self, PyObject *args) {
    PyObject *xo, *wo, *oo;
    double eps;
    int threads = 0;
    if (!PyArg_ParseTuple(args, "OOdO|i", &xo, &wo, &eps, &oo, &threads)) return NULL;
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
    const float *x = (const float *)xb.buf, *w = has_w ? (const float *)wb.buf : NULL;
    float *out = (float *)ob.buf;
    Py_BEGIN_ALLOW_THREADS
    const int nt = thread_count(R, R * n, 64 * 1024, threads);
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int64_t r = 0; r < R; r++) {
        const float *xr = x + r * n;
        float *o = out + r * n;
        double s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        int64_t i = 0;
        for (; i + 8 <= n; i += 8)
            for (int k = 0; k < 8; k++) s[k] += (double)xr[i + k] * (double)xr[i + k];
        double tot = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
        for (; i < n; i++) tot += (double)xr[i] * (double)xr[i];
        const float inv = (float)(1.0 / sqrt(tot / (double)n + eps));
        if (w)
            for (i = 0; i < n; i++) o[i] = (xr[i] * inv) * w[i];
        else
            for (i = 0; i < n; i++) o[i] = xr[i] * inv;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&xb);
    if (has_w) PyBuffer_Release(&wb);
    PyBuffer_Release(&ob);
    Py_RETURN_NONE;
}

/* one (token, stream) of hc_post: elementwise over E, so the AVX-512 clone vectorizes it with the
 * same float64 operations per element (no reassociation): a decode call 23 -> 12.5 us, hot */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("avx512f", "default")))
#endif
static void hc_post_row(const float *Xt, const float *Ct, int64_t n, int64_t k, int64_t E, float pk, const float *yt,
                        double *acc, float *o) {
    for (int64_t e = 0; e < E; e++) acc[e] = 0.0;
    for (int64_t j = 0; j < n; j++) {
        const double c = (double)Ct[j * n + k];
        const float *xj = Xt + j * E;
        for (int64_t e = 0; e < E; e++) acc[e] += c * (double)xj[e];
    }
    for (int64_t e = 0; e < E; e++) o[e] = (float)((double)(pk * yt[e]) + acc[e]);
}

/* hc_post(y, X, post, C, out[, threads]): NumpyOps.hc_post in the same arithmetic: per token t
 * and stream k, out[t*n + k] = float32(float32(post[t, k] * y[t]) + sum_j C[t, j, k] * X[t*n + j])
 * with the sum over j in float64 (y [T, E], X and out [T*n, E], post [T, n], C [T, n*n]). At a
 * 512-token prefill the NumPy float32 form cost ~40 ms a call (a batched 4 x 5 x 4096 matmul per
 * token); this is one pass over X. */
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
        const float *y = (const float *)yb.buf, *X = (const float *)xb.buf, *P = (const float *)pb.buf,
                    *Cm = (const float *)cb.buf;
        float *out = (float *)ob.buf;
        int failed = 0;
        Py_BEGIN_ALLOW_THREADS
        const int nt = thread_count(T * n, T * n * E, 64 * 1024, threads);
#pragma omp parallel num_threads(nt) if (nt > 1)
        {
            double *acc = (double *)malloc((size_t)(E > 0 ? E : 1) * sizeof(double));
            if (!acc) {
#pragma omp atomic write
                failed = 1;
            }
#pragma omp for schedule(static)
            for (int64_t tk = 0; tk < T * n; tk++) {
                if (!acc) continue;
                const int64_t t = tk / n, k = tk % n;
                hc_post_row(X + t * n * E, Cm + t * n * n, n, k, E, P[t * n + k], y + t * E, acc, out + tk * E);
            }
            free(acc);
        }
        Py_END_ALLOW_THREADS
        if (failed) {
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

/* hc_pre_mix(pre, X, out): NumpyOps.hc_pre_mix in its arithmetic: out[t] = float32(sum_i
 * float64(pre[t, i]) * X[t*n + i]) with the sum over the streams in float64, in order (pre [T, n],
 * X [T*n, E], out [T, E]). FastOps' float32 np.matmul cost 31.8 us a call inside a decode step (BLAS
 * set-up for a 1 x 4 x 4096 product), this 10.8; the tokens split over threads at prefill */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("avx512f", "default")))
#endif
static void hc_pre_mix_row(const float *P, const float *Xt, int64_t n, int64_t E, float *o) {
    int64_t e = 0;
    for (; e + 8 <= E; e += 8) { /* 8 columns at a time in registers: no float64 row buffer */
        double a[8];
        for (int q = 0; q < 8; q++) a[q] = (double)P[0] * (double)Xt[e + q];
        for (int64_t i = 1; i < n; i++)
            for (int q = 0; q < 8; q++) a[q] += (double)P[i] * (double)Xt[i * E + e + q];
        for (int q = 0; q < 8; q++) o[e + q] = (float)a[q];
    }
    for (; e < E; e++) {
        double a = (double)P[0] * (double)Xt[e];
        for (int64_t i = 1; i < n; i++) a += (double)P[i] * (double)Xt[i * E + e];
        o[e] = (float)a;
    }
}

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
    const float *P = (const float *)pb.buf, *X = (const float *)xb.buf;
    float *out = (float *)ob.buf;
    Py_BEGIN_ALLOW_THREADS
    const int nt = thread_count(T, T * n * E, 256 * 1024, threads);
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int64_t t = 0; t < T; t++) hc_pre_mix_row(P + t * n, X + t * n * E, n, E, out + t * E);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&pb);
    PyBuffer_Release(&xb);
    PyBuffer_Release(&ob);
    Py_RETURN_NONE;
}

/* ---- the KV rows' storage rounding (numerics.fp8_e4m3_roundtrip + f16_round), float32 ops in
 * numerics.py's order, so bit-identical to it (this file is compiled with -ffp-contract=off) ---- */

/* numerics.e4m3_round: nearest E4M3FN value, |v| clamped at 448, ties to even, sign as v < 0 */
static float e4m3_round_f(float v) {
    float av = fabsf(v);
    av = av > 448.0f ? 448.0f : av; /* (NaN stays NaN, as np.minimum) */
    int ex = 0;
    (void)frexpf(av, &ex);
    const int step = (ex - 1 > -6 ? ex - 1 : -6) - 3;
    const float q = ldexpf(rintf(ldexpf(av, -step)), step);
    return v < 0.0f ? -q : q;
}

/* numerics.f16_round: round to the nearest float16 (ties to even, overflow to inf), as float32:
 * v / ulp rounded to an integer and scaled back (exact: ulp is a power of two) */
static float f16_round_f(float v) {
    const float a = fabsf(v);
    if (!(a < INFINITY)) return v; /* inf, NaN */
    int ex = 0;
    (void)frexpf(a, &ex);          /* a = f 2^ex, f in [0.5, 1): the float16 ulp is 2^(ex - 11) */
    const int ue = ex - 11 > -24 ? ex - 11 : -24;
    const float r = ldexpf(rintf(ldexpf(v, -ue)), ue);
    return fabsf(r) > 65504.0f ? copysignf(INFINITY, v) : r;
}

/* numerics._pow2_scale for FP8: 2^ceil(log2f(max(amax, 1e-4) * fl(1/448))), log2f correctly
 * rounded (float64 log2 rounded to float32, as numerics._log2f); a non-finite exponent (amax
 * inf or NaN) makes the reference's int32 cast INT_MIN and its scale 0: the same here */
static float fp8_scale(float amax) {
    const float a = amax > 1.0e-4f || amax != amax ? amax : 1.0e-4f; /* np.maximum keeps NaN */
    const float r = a * (1.0f / 448.0f);
    const float l = (float)log2((double)r);
    if (!isfinite(l)) return 0.0f;
    return ldexpf(1.0f, (int)ceilf(l));
}

/* store_kv(rows, n_nope, out[, threads]): out = f16_round(fp8_e4m3_roundtrip(rows, n_nope)) row
 * by row (rows [R, D] float32, n_nope a multiple of 64 and <= D) */
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
    const float *x = (const float *)xb.buf;
    float *out = (float *)ob.buf;
    Py_BEGIN_ALLOW_THREADS
    const int nt = thread_count(R, R * D, 64 * 1024, threads);
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int64_t r = 0; r < R; r++) {
        const float *xr = x + r * D;
        float *o = out + r * D;
        for (int64_t b = 0; b < n_nope; b += 64) {
            float amax = 0.0f;
            int has_nan = 0;
            for (int i = 0; i < 64; i++) {
                const float a = fabsf(xr[b + i]);
                has_nan |= a != a;
                amax = a > amax ? a : amax;
            }
            const float scale = fp8_scale(has_nan ? NAN : amax);
            for (int i = 0; i < 64; i++) {
                float v = xr[b + i] / scale;
                v = v < -448.0f ? -448.0f : v > 448.0f ? 448.0f : v; /* (NaN stays NaN, as np.clip) */
                o[b + i] = f16_round_f(e4m3_round_f(v) * scale);
            }
        }
        for (int64_t i = n_nope; i < D; i++) o[i] = f16_round_f(xr[i]);
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&xb);
    PyBuffer_Release(&ob);
    Py_RETURN_NONE;
}

/* attention(q, sinks, out, segments[, threads]): FastOps.attention in C. q and out [T * H, D]
 * (pre-scaled queries), sinks [1, H]; segments: (keys [K or T * K, D], mask uint8 [T, K],
 * per_query) triples. Units of (query, 4 heads) are split over the threads; a unit's arithmetic
 * does not depend on T or the split. */
static PyObject *py_attention(PyObject *self, PyObject *args) {
    PyObject *qo, *so, *oo, *sl;
    int threads = 0;
    if (!PyArg_ParseTuple(args, "OOOO|i", &qo, &so, &oo, &sl, &threads)) return NULL;
    const kern_isa *K = &g_isa[g_cur];
    if (!K->attn) {
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
    PyObject *segf = NULL, *ret = NULL;
    Py_buffer *kb = NULL, *mb = NULL;
    int *perq = NULL;
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
    perq = (int *)calloc((size_t)nseg + 1, sizeof(int));
    if (!kb || !mb || !perq) {
        PyErr_NoMemory();
        goto done;
    }
    int64_t nmax = 0;
    for (; held < nseg; held++) {
        PyObject *it = PySequence_Fast_GET_ITEM(segf, held), *ko, *mo;
        if (!PyArg_ParseTuple(it, "OOp", &ko, &mo, &perq[held])) goto done;
        if (get_f32(ko, &kb[held], 0, "keys", -1, D) < 0) goto done;
        if (PyObject_GetBuffer(mo, &mb[held], PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
            PyBuffer_Release(&kb[held]);
            goto done;
        }
        const Py_buffer *m = &mb[held];
        const int64_t Km = m->ndim == 2 ? m->shape[1] : -1;
        if (m->ndim != 2 || m->itemsize != 1 || m->shape[0] != T ||
            kb[held].shape[0] != (perq[held] ? T * Km : Km)) {
            PyErr_SetString(PyExc_ValueError, "attention: a mask must be uint8 [T, K] and its keys [K or T * K, D]");
            PyBuffer_Release(&kb[held]);
            PyBuffer_Release(&mb[held]);
            goto done;
        }
        nmax += Km;
    }
    {
        const float *q = (const float *)qb.buf, *sinks = (const float *)sb.buf;
        float *out = (float *)ob.buf;
        const int64_t nhb = (H + 3) / 4, units = T * nhb;
        int failed = 0;
        Py_BEGIN_ALLOW_THREADS
        const int nt = thread_count(units, units * 4 * (nmax + 1) * D, 64 * 1024, threads);
#pragma omp parallel num_threads(nt) if (nt > 1)
        {
            const float **ptrs = (const float **)malloc((size_t)(nmax + 1) * sizeof(float *));
            float *sbuf = (float *)malloc((size_t)(4 * nmax + 4) * sizeof(float));
            if (!ptrs || !sbuf) {
#pragma omp atomic write
                failed = 1;
            }
#pragma omp for schedule(static)
            for (int64_t u = 0; u < units; u++) {
                if (!ptrs || !sbuf) continue;
                const int64_t t = u / nhb, hb = u % nhb;
                int64_t n = 0;
                for (Py_ssize_t s = 0; s < nseg; s++) {
                    const int64_t Kn = mb[s].shape[1];
                    const uint8_t *mrow = (const uint8_t *)mb[s].buf + t * Kn;
                    const float *keys = (const float *)kb[s].buf + (perq[s] ? t * Kn * D : 0);
                    for (int64_t k = 0; k < Kn; k++)
                        if (mrow[k]) ptrs[n++] = keys + k * D;
                }
                const int64_t h0 = 4 * hb, h1 = h0 + 4 < H ? h0 + 4 : H;
                K->attn(q + t * H * D, D, h0, h1, ptrs, n, sinks, out + t * H * D, sbuf);
            }
            free(ptrs);
            free(sbuf);
        }
        Py_END_ALLOW_THREADS
        if (failed) {
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
    }
    free(kb);
    free(mb);
    free(perq);
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
    {"attention", py_attention, METH_VARARGS, "attention(q, sinks, out, segments[, threads]): per-query softmax attention"},
    {"store_kv", py_store_kv, METH_VARARGS, "store_kv(rows, n_nope, out[, threads]): FP8 + F16 rounding of KV rows"},
    {"hc_post", py_hc_post, METH_VARARGS, "hc_post(y, X, post, C, out[, threads]): hyper-connection post mix"},
    {"hc_pre_mix", py_hc_pre_mix, METH_VARARGS, "hc_pre_mix(pre, X, out[, threads]): hyper-connection pre mix"},
    {"hc_split", py_hc_split, METH_VARARGS,
     "hc_split(mix, n, scale, base, eps, iters, pre, post, c): hyper-connection weights (float32)"},
    {"rmsnorm", py_rmsnorm, METH_VARARGS, "rmsnorm(x, w_or_None, eps, out[, threads]): row RMS norm (float64 sums)"},
    {"q8_gemm_min_t", py_q8_gemm_min_t, METH_VARARGS,
     "q8_gemm_min_t(type_id[, n]) -> smallest T of the integer GEMM form, 0 = none (sets it)"},
    {"has_q8", py_has_q8, METH_O, "has_q8(type_id) -> whether an integer-activation kernel exists"},
    {"dequantize", py_dequantize, METH_VARARGS, "dequantize(type_id, w, out[, threads]): out = decoded rows of w"},
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
            __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni")) {
            kern_fill_avx512(&g_isa[ISA_AVX512]);
            g_have[ISA_AVX512] = 1;
            g_cur = ISA_AVX512;
            if (__builtin_cpu_supports("avx512vbmi") && __builtin_cpu_supports("gfni")) {
                kern_fill_avx512vbmi(&g_isa[ISA_AVX512VBMI]);
                g_have[ISA_AVX512VBMI] = 1;
                g_cur = ISA_AVX512VBMI;
            }
        }
    }
#endif
    kern_q8_use(g_isa[g_cur].q8_maxmag, g_isa[g_cur].q8_codes);
    for (int i = 0; i < ISA_N; i++) memcpy(g_min_t0[i], g_isa[i].q8g_min_t, sizeof(g_min_t0[i]));
#ifdef _OPENMP
    g_threads = omp_get_num_procs();
#endif
    if (g_threads < 1) g_threads = 1;
    PyObject *m = PyModule_Create(&moddef);
    if (!m) return NULL;
#ifndef DS4_KERNELS_SRC_HASH
#define DS4_KERNELS_SRC_HASH ""
#endif
    PyModule_AddStringConstant(m, "source_hash", DS4_KERNELS_SRC_HASH);
#ifdef _OPENMP
    PyModule_AddIntConstant(m, "openmp", 1);
#else
    PyModule_AddIntConstant(m, "openmp", 0);
#endif
    return m;
}
