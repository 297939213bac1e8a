/* The non-matmul operations of the cpu backend, in C: each reproduces its NumPy reference's
 * arithmetic (the reference is named at each function), so FastOps can call it without changing
 * a bit. This file is compiled with -ffp-contract=off like the rest. Plain pointers in, no
 * Python: binding.c checks the buffers and releases the GIL around these calls. */
#include <math.h>
#include <stdlib.h>

#include "module.h"

/* round_q8: out = the values q * d of x's Q8_0 (block 32) or Q8_K (256) quantization, row by
 * row (numerics.q8_0_round / q8_k_round, bit-exact) */
int ops_round_q8(int bs, const float *x, int64_t T, int64_t n, float *out, int threads) {
    int8_t *q = (int8_t *)malloc((size_t)(T * n) + 1);
    float *d = (float *)malloc((size_t)(T * (n / bs)) * sizeof(float) + 1);
    int16_t *s = (int16_t *)malloc((size_t)(T * (n / 16)) * sizeof(int16_t) + 1);
    const int failed = !q || !d || !s;
    if (!failed) {
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
    }
    free(q);
    free(d);
    free(s);
    return failed ? -1 : 0;
}

/* hc_split, in two halves around NumPy's exp (NumpyOps.hc_split bit for bit; at decode the
 * reference is ~90 NumPy calls on 4 x 4 arrays, twice a layer):
 *   z = mix * scale[part] + base;  pre = sigmoid(z[:n]) + eps;  post = 2 sigmoid(z[n:2n])
 *   C = softmax over j of z[2n:] as [n][n] (row i, column j), + eps
 *   C /= column sums + eps; then iters - 1 times: C /= row sums + eps, C /= column sums + eps
 * The exponentials are NumPy's (the caller's np.exp between the halves): the reference's float32
 * exp is not libm's expf (they differ in the last bit for ~40% of arguments), and one ulp in C
 * reaches the Q8 codes of the next matmul's input.
 *
 * ops_hc_split_args: a [T, 2n + n*n], the exponentials' arguments: -z for the sigmoids, z - the
 * row's maximum for the softmax (the maximum taken as 0 where it is not finite, as the reference). */
void ops_hc_split_args(const float *mix, int64_t T, int n, const float *sc, const float *base, float *a) {
    const int w = 2 * n + n * n;
    for (int64_t t = 0; t < T; t++) {
        const float *m = mix + t * w;
        float *at = a + t * w;
        for (int i = 0; i < n; i++) {
            at[i] = -(m[i] * sc[0] + base[i]);
            at[n + i] = -(m[n + i] * sc[1] + base[n + i]);
        }
        for (int i = 0; i < n; i++) {
            float *z = at + 2 * n + i * n, mx = -INFINITY;
            for (int j = 0; j < n; j++) {
                z[j] = m[2 * n + i * n + j] * sc[2] + base[2 * n + i * n + j];
                mx = z[j] > mx ? z[j] : mx;
            }
            if (!isfinite(mx)) mx = 0.0f;
            for (int j = 0; j < n; j++) z[j] -= mx;
        }
    }
}

/* ops_hc_split: the rest, from e = exp(a) */
void ops_hc_split(const float *e, int64_t T, int n, float eps, int iters, float *pre, float *post, float *C) {
    const int w = 2 * n + n * n;
    for (int64_t t = 0; t < T; t++) {
        const float *et = e + t * w;
        float *c = C + t * n * n;
        for (int i = 0; i < n; i++) {
            pre[t * n + i] = 1.0f / (1.0f + et[i]) + eps;
            post[t * n + i] = 2.0f * (1.0f / (1.0f + et[n + i]));
        }
        for (int i = 0; i < n; i++) {
            const float *z = et + 2 * n + i * n;
            float s = 0.0f;
            for (int j = 0; j < n; j++) s += z[j];
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
}

/* rope: numerics.apply_rope on the rows of x [R, W] (NumpyOps.rope bit for bit): the last 2 npair
 * values in (even, odd) pairs, pair p rotated by (c, s) = row r / per of cs [R / per, 2 npair]
 * (the caller's float32 cos and sin, s negated for the inverse), each product and sum rounded to
 * float32 as the reference's lanes are (this file has no FMA contraction):
 *   o[2p] = x0 * c - x1 * s;  o[2p + 1] = x0 * s + x1 * c
 * the first W - 2 npair values copied; out may be x (each pair is read before it is written). */
void ops_rope(const float *x, int64_t R, int64_t W, const float *cs, int64_t npair, int64_t per, float *out,
              int threads) {
    const int64_t r = W - 2 * npair;
    const int nt = thread_count(R, R * W, 256 * 1024, threads);
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int64_t row = 0; row < R; row++) {
        const float *xr = x + row * W, *c = cs + (row / per) * 2 * npair;
        float *o = out + row * W;
        if (o != xr)
            for (int64_t i = 0; i < r; i++) o[i] = xr[i];
        for (int64_t p = 0; p < npair; p++) {
            const float x0 = xr[r + 2 * p], x1 = xr[r + 2 * p + 1], cp = c[2 * p], sp = c[2 * p + 1];
            const float a = x0 * cp, b = x1 * sp, u = x0 * sp, v = x1 * cp;
            o[r + 2 * p] = a - b;
            o[r + 2 * p + 1] = u + v;
        }
    }
}

/* rmsnorm(x, w_or_None, eps, out[, threads[, ds4]]): NumpyOps.rmsnorm row by row (x [rows, n]):
 * the squares summed in float64 (8 partial sums), inv = float32(1 / sqrt(sum / n + eps)) in float64,
 * out = float32(x * inv) (* w). The reference sums pairwise in float64, so inv matches it except
 * in the rare case where the float64 sums' last-bit difference crosses a float32 rounding point.
 * ds4 != 0: ds4 numerics' form (numerics.rmsnorm_ds4, ds4.c rms_norm_weight): the same float64 sum,
 * then float32 steps inv = 1.0f / sqrtf((float)(sum / n) + eps) and out = (x * w) * inv. */
void ops_rmsnorm(const float *x, const float *w, int64_t R, int64_t n, double eps, float *out, int threads,
                 int ds4) {
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
        if (ds4) {
            const float inv = 1.0f / sqrtf((float)(tot / (double)n) + (float)eps);
            if (w)
                for (i = 0; i < n; i++) o[i] = (xr[i] * w[i]) * inv;
            else
                for (i = 0; i < n; i++) o[i] = xr[i] * inv;
            continue;
        }
        const float inv = (float)(1.0 / sqrt(tot / (double)n + eps));
        if (w)
            for (i = 0; i < n; i++) o[i] = (xr[i] * inv) * w[i];
        else
            for (i = 0; i < n; i++) o[i] = xr[i] * inv;
    }
}

/* one (token, stream) of hc_post: elementwise over E, so the AVX-512 clone vectorizes it with the
 * same float64 operations per element (no reassociation) */
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
 * with the sum over j in float64 (y [T, E], X and out [T*n, E], post [T, n], C [T, n*n]). The
 * NumPy float32 form is a batched 4 x 5 x 4096 matmul per token; this is one pass over X. */
int ops_hc_post(const float *y, const float *X, const float *P, const float *Cm, int64_t T, int64_t n, int64_t E,
                float *out, int threads) {
    int failed = 0;
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
    return failed ? -1 : 0;
}

/* hc_pre_mix(pre, X, out): NumpyOps.hc_pre_mix in its arithmetic: out[t] = float32(sum_i
 * float64(pre[t, i]) * X[t*n + i]) with the sum over the streams in float64, in order (pre [T, n],
 * X [T*n, E], out [T, E]). In C to avoid BLAS set-up for a 1 x 4 x 4096 product at every decode
 * call; the tokens split over threads at prefill */
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

void ops_hc_pre_mix(const float *P, const float *X, int64_t T, int64_t n, int64_t E, float *out, int threads) {
    const int nt = thread_count(T, T * n * E, 256 * 1024, threads);
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int64_t t = 0; t < T; t++) hc_pre_mix_row(P + t * n, X + t * n * E, n, E, out + t * E);
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
void ops_store_kv(const float *x, int64_t R, int64_t D, int64_t n_nope, float *out, int threads) {
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
}

/* attention(q, sinks, out, segments, scale[, threads]): NumpyOps.attention in C (float64 inside).
 * q and out [T * H, D] (queries not scaled), sinks [1, H]; segments: (keys [K or T * K, D], mask uint8 [T, K],
 * per_query) triples, or with idx rows of keys picked per query (attn_seg). Units of (query, hu heads) are split over the threads: hu is 16 where that
 * leaves two units a thread, else 8 or 4 (a unit reads its keys twice whatever its heads: larger
 * units read them less often). A head's arithmetic depends on neither hu, T nor the split. */
int ops_attention(const kern_isa *K, const float *q, const float *sinks, double scale, int64_t T, int64_t H,
                  int64_t D, const attn_seg *segs, int64_t nseg, int64_t nmax, float *out, int threads) {
    const int64_t want = 2 * (int64_t)(threads > 0 ? threads : g_threads);
    int64_t hu = 16;
    while (hu > 4 && T * ((H + hu - 1) / hu) < want) hu /= 2;
    const int64_t nhb = (H + hu - 1) / hu, units = T * nhb;
    int failed = 0;
    const int nt = thread_count(units, units * hu * (nmax + 1) * D, 64 * 1024, threads);
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        const float **ptrs = (const float **)malloc((size_t)(nmax + 1) * sizeof(float *));
        double *sbuf = (double *)malloc((size_t)KERN_ATTN_SBUF(hu, nmax + 1, D) * sizeof(double));
        if (!ptrs || !sbuf) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t u = 0; u < units; u++) {
            if (!ptrs || !sbuf) continue;
            const int64_t t = u / nhb, hb = u % nhb;
            const int64_t n = attn_keys_of(segs, nseg, t, D, ptrs);
            const int64_t h0 = hu * hb, h1 = h0 + hu < H ? h0 + hu : H;
            K->attn(q + t * H * D, D, h0, h1, ptrs, n, sinks, scale, out + t * H * D, sbuf);
        }
        free(ptrs);
        free(sbuf);
    }
    return failed ? -1 : 0;
}

/* read_sum: the sum of n 64-bit words (a read-bandwidth probe for scripts/bench_kernels.py) */
uint64_t ops_read_sum(const uint64_t *p, int64_t n) {
    uint64_t total = 0;
    const int nt = thread_count(n, n, 1 << 16, 0);
#pragma omp parallel for num_threads(nt) schedule(static) reduction(+ : total) if (nt > 1)
    for (int64_t i = 0; i < n; i++) total += p[i];
    return total;
}
