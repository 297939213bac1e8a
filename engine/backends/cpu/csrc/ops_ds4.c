/* ds4 numerics' non-matmul operations (issue 33): the float32 loops of ds4's compiled CPU path
 * (ds4.c built with -O3 -ffast-math: GCC's FMAs and pairings), as engine/model/ds4_float.py
 * models them and the NumPy reference runs them; each function names its ds4_float twin, which
 * is the definition. This file is compiled with -ffp-contract=off like the rest: every fmaf here
 * is one of ds4's, every other product and sum is rounded on its own.
 *
 * expf: ds4_float.expf is the float64 exp rounded to float32 (glibc's expf is correctly rounded
 * in practice); here the C library's exp in double, rounded once: it differs from NumPy's float64
 * exp in the last double bit now and then, which changes the float32 result only where the exact
 * value lies within ~2^-29 ulp of a rounding point.
 *
 * The functions take plain pointers and run with the GIL released; their bindings (Python
 * objects, buffer checks) are at the end, registered on the module by ds4ops_register. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "module.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
/* the FMA clone turns each fmaf into one instruction and vectorizes the elementwise loops */
#define DS4_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define DS4_CLONES
#endif

static inline float expf_ds4(float x) { return (float)exp((double)x); }

/* ds4_float.sigmoid_stable: e = expf(-|x|), 1 / (1 + e) for x >= 0, else e / (1 + e) */
static inline float sigmoid_ds4(float x) {
    const float e = expf_ds4(-fabsf(x));
    const float den = 1.0f + e;
    return x >= 0.0f ? 1.0f / den : e / den;
}

/* ds4_float.hc_split (n = 4): mix [T, 24] -> pre [T, 4], post [T, 4], C [T, 16] (C[a * 4 + b]) */
void ds4_hc_split(const float *mix, int64_t T, const float *sc, const float *base, float eps, int iters, float *pre,
                  float *post, float *C) {
    for (int64_t t = 0; t < T; t++) {
        const float *m = mix + t * 24;
        float z[24], *c = C + t * 16;
        for (int i = 0; i < 24; i++) z[i] = fmaf(m[i], sc[i < 4 ? 0 : i < 8 ? 1 : 2], base[i]);
        for (int i = 0; i < 4; i++) {
            pre[t * 4 + i] = 1.0f / (1.0f + expf_ds4(-z[i])) + eps;
            post[t * 4 + i] = 2.0f / (1.0f + expf_ds4(-z[4 + i]));
        }
        for (int a = 0; a < 4; a++) {
            const float *r = z + 8 + 4 * a;
            float mx = r[0];
            for (int b = 1; b < 4; b++) mx = r[b] > mx ? r[b] : mx;
            float e[4];
            for (int b = 0; b < 4; b++) e[b] = expf_ds4(r[b] - mx);
            const float inv = 1.0f / ((e[0] + e[1]) + (e[2] + e[3]));
            for (int b = 0; b < 4; b++) c[4 * a + b] = fmaf(e[b], inv, eps);
        }
        for (int it = 0; it < iters; it++) {
            if (it > 0)
                for (int a = 0; a < 4; a++) { /* rows; GCC pairs the last one's sum (1+2)+(0+3) */
                    const float *r = c + 4 * a;
                    const float s = a < 3 ? (r[0] + r[1]) + (r[2] + r[3]) : (r[1] + r[2]) + (r[0] + r[3]);
                    const float inv = 1.0f / (s + eps);
                    for (int b = 0; b < 4; b++) c[4 * a + b] *= inv;
                }
            for (int b = 0; b < 4; b++) { /* columns */
                const float inv = 1.0f / (((c[b] + c[4 + b]) + (c[8 + b] + c[12 + b])) + eps);
                for (int a = 0; a < 4; a++) c[4 * a + b] *= inv;
            }
        }
    }
}

/* ds4_float.hc_weighted_sum (order 0, 1, 2, 3) and hc_head's inlined copy (0, 3, 1, 2):
 * out = fma(x[o0], w[o0], x[o1] * w[o1]) + fma(x[o2], w[o2], x[o3] * w[o3]) */
DS4_CLONES
static void hc_sum4_row(const float *w, const float *X, int64_t E, const int *o, float *out) {
    const float *x0 = X + o[0] * E, *x1 = X + o[1] * E, *x2 = X + o[2] * E, *x3 = X + o[3] * E;
    const float w0 = w[o[0]], w1 = w[o[1]], w2 = w[o[2]], w3 = w[o[3]];
    for (int64_t e = 0; e < E; e++) {
        const float p1 = x1[e] * w1, p3 = x3[e] * w3;
        out[e] = fmaf(x0[e], w0, p1) + fmaf(x2[e], w2, p3);
    }
}

void ds4_hc_sum4(const float *w, const float *X, int64_t T, int64_t E, int head, float *out, int threads) {
    static const int plain[4] = {0, 1, 2, 3}, inlined[4] = {0, 3, 1, 2};
    const int nt = thread_count(T, T * 4 * E, 256 * 1024, threads);
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int64_t t = 0; t < T; t++) hc_sum4_row(w + t * 4, X + t * 4 * E, E, head ? inlined : plain, out + t * E);
}

/* ds4_float.hc_post (n = 4): out stream k = fma(C[3,k], x3, fma(post[k], y, C[0,k] x0) + fma(C[1,k], x1, C[2,k] x2)) */
DS4_CLONES
static void hc_post_row(const float *X, const float *c, int64_t k, int64_t E, float pk, const float *y, float *o) {
    const float *x0 = X, *x1 = X + E, *x2 = X + 2 * E, *x3 = X + 3 * E;
    const float c0 = c[k], c1 = c[4 + k], c2 = c[8 + k], c3 = c[12 + k];
    for (int64_t e = 0; e < E; e++) {
        const float p0 = c0 * x0[e], p2 = c2 * x2[e];
        const float a = fmaf(pk, y[e], p0), b = fmaf(c1, x1[e], p2);
        o[e] = fmaf(c3, x3[e], a + b);
    }
}

void ds4_hc_post(const float *y, const float *X, const float *P, const float *Cm, int64_t T, int64_t E, float *out,
                 int threads) {
    const int nt = thread_count(T * 4, T * 4 * E, 64 * 1024, threads);
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int64_t tk = 0; tk < T * 4; tk++) {
        const int64_t t = tk / 4, k = tk % 4;
        hc_post_row(X + t * 4 * E, Cm + t * 16, k, E, P[tk], y + t * E, out + tk * E);
    }
}

/* ds4_float.swiglu (the shared expert: sigmoid(g) * (g * u)) for rows r < w0 and routed_mid
 * ((sigmoid(g) * u) * (g * w[r - w0])) for the rest, after the clamps (limit > 1e-6):
 * g = min(g, limit), u = max(min(u, limit), -limit); g, u [R, n] -> out [R, n] (out may be g) */
void ds4_swiglu(const float *g, const float *u, int64_t R, int64_t n, float limit, const float *w, int64_t w0,
                float *out, int threads) {
    const int clamp = limit > 1.0e-6f;
    const int nt = thread_count(R, R * n, 16 * 1024, threads);
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int64_t r = 0; r < R; r++) {
        const float *gr = g + r * n, *ur = u + r * n;
        float *o = out + r * n;
        const int routed = w != NULL && r >= w0;
        const float wr = routed ? w[r - w0] : 0.0f;
        for (int64_t i = 0; i < n; i++) {
            float gv = gr[i], uv = ur[i];
            if (clamp) {
                gv = gv > limit ? limit : gv;
                uv = uv > limit ? limit : uv;
                uv = uv < -limit ? -limit : uv;
            }
            const float s = sigmoid_ds4(gv);
            if (routed) {
                const float a = s * uv, b = gv * wr;
                o[i] = a * b;
            } else {
                const float gu = gv * uv;
                o[i] = s * gu;
            }
        }
    }
}

/* ds4_float._dot128 as GCC vectorizes ds4's dot_f32 (AVX-512, 16 lanes): per lane, chunks
 * c0..c7 of 16 combine as (fma(c6, q6, c7 q7) + fma(c4, q4, c5 q5)) + (fma(c0, q0, c1 q1) +
 * fma(c2, q2, c3 q3)); then the 16 lanes fold in halves (8, 4, 2, 1) */
DS4_CLONES
static float dot128_ds4(const float *q, const float *k) {
    float v[16];
    for (int l = 0; l < 16; l++) {
#define P(j) (q[16 * (j) + l] * k[16 * (j) + l])
#define F(a, b) fmaf(q[16 * (a) + l], k[16 * (a) + l], P(b))
        const float f67 = F(6, 7), f45 = F(4, 5), f01 = F(0, 1), f23 = F(2, 3);
        v[l] = (f67 + f45) + (f01 + f23);
#undef F
#undef P
    }
    for (int half = 8; half >= 1; half /= 2)
        for (int l = 0; l < half; l++) v[l] = v[l] + v[l + half];
    return v[0];
}

/* ds4_float.attention for one query and heads h0..h1 (head dim 128): scores dot128 * kq_scale,
 * the max over the sink and the scores, denom = expf(sink - max) then += w per key in order,
 * o = fma(w, k, o) per key in order (w = expf(s - max)), out = o * (1 / denom); s: n floats */
DS4_CLONES
static void attn_ds4_query(const float *q, int64_t h0, int64_t h1, const float *const *keys, int64_t n,
                           const float *sinks, float kq_scale, float *out, float *s) {
    for (int64_t h = h0; h < h1; h++) {
        const float *qh = q + h * 128;
        float mx = sinks[h];
        for (int64_t j = 0; j < n; j++) {
            s[j] = dot128_ds4(qh, keys[j]) * kq_scale;
            mx = s[j] > mx ? s[j] : mx;
        }
        float den = expf_ds4(sinks[h] - mx), o[128];
        for (int d = 0; d < 128; d++) o[d] = 0.0f;
        for (int64_t j = 0; j < n; j++) {
            const float w = expf_ds4(s[j] - mx), *k = keys[j];
            den = den + w;
            for (int d = 0; d < 128; d++) o[d] = fmaf(w, k[d], o[d]);
        }
        const float inv = 1.0f / den;
        for (int d = 0; d < 128; d++) out[h * 128 + d] = o[d] * inv;
    }
}

int ds4_attention(const float *q, const float *sinks, float kq_scale, int64_t T, int64_t H, const attn_seg *segs,
                  int64_t nseg, int64_t nmax, float *out, int threads) {
    int failed = 0;
    const int nt = thread_count(T * H, T * H * (nmax + 1) * 128, 64 * 1024, threads);
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        const float **ptrs = (const float **)malloc((size_t)(nmax + 1) * sizeof(float *));
        float *s = (float *)malloc((size_t)(nmax + 1) * sizeof(float));
        if (!ptrs || !s) {
#pragma omp atomic write
            failed = 1;
        }
        /* units of (query, head): a query's key list is rebuilt per unit (cheap against 128-wide dots) */
#pragma omp for schedule(static)
        for (int64_t u = 0; u < T * H; u++) {
            if (!ptrs || !s) continue;
            const int64_t t = u / H, h = u % H;
            const int64_t n = attn_keys_of(segs, nseg, t, 128, ptrs);
            attn_ds4_query(q + t * H * 128, h, h + 1, ptrs, n, sinks, kq_scale, out + t * H * 128, s);
        }
        free(ptrs);
        free(s);
    }
    return failed ? -1 : 0;
}

/* ---- bindings ---- */

/* a C-contiguous float32 buffer of n values (n < 0: any) */
static int f32buf(PyObject *o, Py_buffer *b, int writable, Py_ssize_t n, const char *name) {
    if (PyObject_GetBuffer(o, b, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0)) < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%s must be a C-contiguous%s float32 array", name, writable ? " writable" : "");
        return -1;
    }
    const char *f = b->format ? b->format : "B";
    if (*f == '<' || *f == '=' || *f == '@') f++;
    if (b->itemsize != 4 || strcmp(f, "f") != 0 || (n >= 0 && b->len != n * 4)) {
        PyErr_Format(PyExc_ValueError, "%s must be float32 with %zd values", name, n);
        PyBuffer_Release(b);
        return -1;
    }
    return 0;
}

static void release(Py_buffer *b, int n) {
    for (int i = 0; i < n; i++) PyBuffer_Release(&b[i]);
}

/* ds4_hc_split(mix, scale3, base24, eps, iters, pre, post, C): mix [T, 24] */
static PyObject *py_ds4_hc_split(PyObject *self, PyObject *args) {
    PyObject *o[7];
    float eps;
    int iters;
    long long T;
    if (!PyArg_ParseTuple(args, "LOOOfiOOO", &T, &o[0], &o[1], &o[2], &eps, &iters, &o[3], &o[4], &o[5])) return NULL;
    Py_buffer b[6];
    const Py_ssize_t n[6] = {T * 24, 3, 24, T * 4, T * 4, T * 16};
    static const char *names[6] = {"mix", "scale", "base", "pre", "post", "C"};
    for (int i = 0; i < 6; i++)
        if (f32buf(o[i], &b[i], i >= 3, n[i], names[i]) < 0) {
            release(b, i);
            return NULL;
        }
    Py_BEGIN_ALLOW_THREADS
    ds4_hc_split(b[0].buf, T, b[1].buf, b[2].buf, eps, iters, b[3].buf, b[4].buf, b[5].buf);
    Py_END_ALLOW_THREADS
    release(b, 6);
    Py_RETURN_NONE;
}

/* ds4_hc_sum4(w, X, out, T, E, head): w [T, 4], X [T * 4, E], out [T, E] */
static PyObject *py_ds4_hc_sum4(PyObject *self, PyObject *args) {
    PyObject *o[3];
    long long T, E;
    int head;
    if (!PyArg_ParseTuple(args, "OOOLLp", &o[0], &o[1], &o[2], &T, &E, &head)) return NULL;
    Py_buffer b[3];
    const Py_ssize_t n[3] = {T * 4, T * 4 * E, T * E};
    static const char *names[3] = {"w", "X", "out"};
    for (int i = 0; i < 3; i++)
        if (f32buf(o[i], &b[i], i == 2, n[i], names[i]) < 0) {
            release(b, i);
            return NULL;
        }
    Py_BEGIN_ALLOW_THREADS
    ds4_hc_sum4(b[0].buf, b[1].buf, T, E, head, b[2].buf, 0);
    Py_END_ALLOW_THREADS
    release(b, 3);
    Py_RETURN_NONE;
}

/* ds4_hc_post(y, X, post, C, out, T, E): y [T, E], X and out [T * 4, E], post [T, 4], C [T, 16] */
static PyObject *py_ds4_hc_post(PyObject *self, PyObject *args) {
    PyObject *o[5];
    long long T, E;
    if (!PyArg_ParseTuple(args, "OOOOOLL", &o[0], &o[1], &o[2], &o[3], &o[4], &T, &E)) return NULL;
    Py_buffer b[5];
    const Py_ssize_t n[5] = {T * E, T * 4 * E, T * 4, T * 16, T * 4 * E};
    static const char *names[5] = {"y", "X", "post", "C", "out"};
    for (int i = 0; i < 5; i++)
        if (f32buf(o[i], &b[i], i == 4, n[i], names[i]) < 0) {
            release(b, i);
            return NULL;
        }
    Py_BEGIN_ALLOW_THREADS
    ds4_hc_post(b[0].buf, b[1].buf, b[2].buf, b[3].buf, T, E, b[4].buf, 0);
    Py_END_ALLOW_THREADS
    release(b, 5);
    Py_RETURN_NONE;
}

/* ds4_swiglu(g, u, out, R, n, limit, w_or_None, w0): g, u, out [R, n]; w [R - w0] */
static PyObject *py_ds4_swiglu(PyObject *self, PyObject *args) {
    PyObject *o[4];
    long long R, n, w0;
    float limit;
    if (!PyArg_ParseTuple(args, "OOOLLfOL", &o[0], &o[1], &o[2], &R, &n, &limit, &o[3], &w0)) return NULL;
    const int has_w = o[3] != Py_None;
    if (w0 < 0 || w0 > R) {
        PyErr_SetString(PyExc_ValueError, "ds4_swiglu: 0 <= w0 <= R");
        return NULL;
    }
    Py_buffer b[4];
    const Py_ssize_t cnt[4] = {R * n, R * n, R * n, R - w0};
    static const char *names[4] = {"g", "u", "out", "w"};
    for (int i = 0; i < 3 + has_w; i++)
        if (f32buf(o[i], &b[i], i == 2, cnt[i], names[i]) < 0) {
            release(b, i);
            return NULL;
        }
    Py_BEGIN_ALLOW_THREADS
    ds4_swiglu(b[0].buf, b[1].buf, R, n, limit, has_w ? b[3].buf : NULL, w0, b[2].buf, 0);
    Py_END_ALLOW_THREADS
    release(b, 3 + has_w);
    Py_RETURN_NONE;
}

static PyMethodDef ds4_methods[] = {
    {"ds4_hc_split", py_ds4_hc_split, METH_VARARGS, "ds4_hc_split(T, mix, scale, base, eps, iters, pre, post, C)"},
    {"ds4_hc_sum4", py_ds4_hc_sum4, METH_VARARGS, "ds4_hc_sum4(w, X, out, T, E, head): ds4's HC weighted sums"},
    {"ds4_hc_post", py_ds4_hc_post, METH_VARARGS, "ds4_hc_post(y, X, post, C, out, T, E): ds4's HC post"},
    {"ds4_swiglu", py_ds4_swiglu, METH_VARARGS, "ds4_swiglu(g, u, out, R, n, limit, w, w0): ds4's SwiGLU forms"},
    {NULL, NULL, 0, NULL},
};

int ds4ops_register(PyObject *m) { return PyModule_AddFunctions(m, ds4_methods); }
