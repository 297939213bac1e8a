/* Internal declarations of the _kernels module, shared by its three parts:
 *   binding.c  the Python module: argument parsing, buffer checks, the method table, init;
 *   sched.c    the kernel build in use, the thread count and the work split of the matmuls;
 *   ops.c      the non-matmul operations (rmsnorm, hyper-connections, KV rounding, attention).
 * sched.c and ops.c take plain pointers and never touch Python objects, so they run with the GIL
 * released. Everything here has hidden visibility (-fvisibility=hidden): only PyInit is exported. */
#ifndef DS4_MODULE_H
#define DS4_MODULE_H

#include <stddef.h>
#include <stdint.h>

#ifdef _OPENMP
#include <omp.h>
#define OMP_TID() omp_get_thread_num()
#define OMP_NTH() omp_get_num_threads()
#else
#define OMP_TID() 0
#define OMP_NTH() 1
#endif

#include "kern.h"

/* ---- sched.c: the kernel builds and the run-time state ---- */

enum { ISA_GENERIC, ISA_AVX2, ISA_AVX512, ISA_AVX512VBMI, ISA_N };

extern kern_isa g_isa[ISA_N];
extern int g_have[ISA_N];
extern int g_cur;
extern int g_min_t0[ISA_N][KT_MAX]; /* each build's default q8g_min_t, for q8_gemm_min_t(type, 0) */
extern int g_threads;
/* batch invariance: T = 1 takes the in-register exact-weight path (mvt) instead of mv1, so every
 * path sums each (row, token) product in the same order and a token's result does not depend on
 * T, on the path or on the thread count */
extern int g_invariant;

/* fills the builds this machine can run, picks the best, sets the default thread count */
void sched_init(void);

/* threads for `units` independent pieces of `work` (at least min_work each); max_threads 0:
 * the module's setting */
int thread_count(int64_t units, int64_t work, int64_t min_work, int max_threads);

/* y[T, n_rows] = x[T, n_in] @ W.T; path: 0 = by T, 1 = in registers, 2 = panel. -1: no memory */
int run_matmul(const kern_isa *K, int type, const uint8_t *W, ptrdiff_t stride, int64_t n_rows,
               int64_t n_in, const float *x, int64_t T, float *y, int max_threads, int path);

/* one product of matmul_q8_batch: the caller fills type, W, stride, n_rows, n_in, T, x, y; the
 * rest is the scheduler's */
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

int run_matmul_q8_batch(const kern_isa *K, q8_job *jobs, int64_t n_jobs, int max_threads);
void run_dequant(const kern_isa *K, int type, const uint8_t *W, ptrdiff_t stride, int64_t n_rows,
                 int64_t n_in, float *out, int max_threads);

/* ---- ops.c: the non-matmul operations (the functions returning int give -1 when out of memory) ---- */

int ops_round_q8(int bs, const float *x, int64_t T, int64_t n, float *out, int threads);
void ops_hc_split_args(const float *mix, int64_t T, int n, const float *sc, const float *base, float *a);
void ops_hc_split(const float *e, int64_t T, int n, float eps, int iters, float *pre, float *post, float *C);
void ops_rope(const float *x, int64_t R, int64_t W, const float *cs, int64_t npair, int64_t per, float *out,
              int threads);
void ops_rmsnorm(const float *x, const float *w, int64_t R, int64_t n, double eps, float *out, int threads,
                 int ds4);
int ops_hc_post(const float *y, const float *X, const float *P, const float *Cm, int64_t T, int64_t n, int64_t E,
                float *out, int threads);
void ops_hc_pre_mix(const float *P, const float *X, int64_t T, int64_t n, int64_t E, float *out, int threads);
void ops_store_kv(const float *x, int64_t R, int64_t D, int64_t n_nope, float *out, int threads);

/* one segment of attention's keys: keys [K or T * K, D] (per_query: each query its own K rows),
 * mask uint8 [T, K]; with idx (int64 [T, K]) key k of query t is row idx[t, k] of keys [N, D]
 * (the indexer's picks read in place: no [T, K, D] gather) */
typedef struct {
    const float *keys;
    const uint8_t *mask;
    int64_t K;
    int per_query;
    const int64_t *idx;
} attn_seg;

/* The keys query t sees, in segment order then key order (the order both attention forms sum
 * in): pointers to their D-wide rows into ptrs (room for nmax + 1); returns how many. */
static inline int64_t attn_keys_of(const attn_seg *segs, int64_t nseg, int64_t t, int64_t D, const float **ptrs) {
    int64_t n = 0;
    for (int64_t s = 0; s < nseg; s++) {
        const int64_t Kn = segs[s].K;
        const uint8_t *mrow = segs[s].mask + t * Kn;
        const float *keys = segs[s].keys + (segs[s].per_query ? t * Kn * D : 0);
        const int64_t *irow = segs[s].idx ? segs[s].idx + t * Kn : NULL;
        for (int64_t k = 0; k < Kn; k++)
            if (mrow[k]) ptrs[n++] = keys + (irow ? irow[k] : k) * D;
    }
    return n;
}

int ops_attention(const kern_isa *K, const float *q, const float *sinks, double scale, int64_t T, int64_t H,
                  int64_t D, const attn_seg *segs, int64_t nseg, int64_t nmax, float *out, int threads);
uint64_t ops_read_sum(const uint64_t *p, int64_t n);
/* ops_ds4.c: ds4 numerics' float32 forms (engine/model/ds4_float.py), and their bindings */
void ds4_hc_split(const float *mix, int64_t T, const float *sc, const float *base, float eps, int iters, float *pre,
                  float *post, float *C);
void ds4_hc_sum4(const float *w, const float *X, int64_t T, int64_t E, int head, float *out, int threads);
void ds4_hc_post(const float *y, const float *X, const float *P, const float *Cm, int64_t T, int64_t E, float *out,
                 int threads);
void ds4_swiglu(const float *g, const float *u, int64_t R, int64_t n, float limit, const float *w, int64_t w0,
                float *out, int threads);
int ds4_attention(const float *q, const float *sinks, float kq_scale, int64_t T, int64_t H, const attn_seg *segs,
                  int64_t nseg, int64_t nmax, float *out, int threads);
struct _object;
int ds4ops_register(struct _object *m); /* adds the ds4_* functions to the module */
void run_f16_seq(const uint16_t *W, ptrdiff_t stride, int64_t n_rows, int64_t n_in, const float *x, int64_t T,
                 float *y, int max_threads);
/* mrow_q8.c: build `isa`'s Q8_0 integer kernel for 2-8 tokens (its own kernel keeps one token) */
void mrow_q8_install(int isa);
/* mrow_f16.c: kern_f16_seq's function, 8 rows a vector and up to 4 tokens a pass; 0 where this
 * build has no SIMD form (the caller runs kern_f16_seq) */
int mrow_f16_seq(const uint16_t *W, ptrdiff_t stride, int64_t n, int64_t r0, int64_t r1, const float *x, int64_t T,
                 float *y, int64_t ldy);

#endif
