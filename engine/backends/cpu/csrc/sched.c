/* The kernel builds and the work split: which build runs (chosen at init from the CPU's
 * features), how many threads a call gets, and how the matmuls' rows are split among them. The
 * matmul kernels themselves are in kern_*.c; this file decides who runs which rows. */
#include <stdlib.h>

#include "module.h"

kern_isa g_isa[ISA_N];
int g_have[ISA_N];
int g_cur = ISA_GENERIC;
int g_min_t0[ISA_N][KT_MAX];
int g_threads = 1;
int g_invariant = 0;

void sched_init(void) {
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
            mrow_q8_install(ISA_AVX512); /* mrow_q8.c: Q8_0 at 2-8 tokens */
            g_have[ISA_AVX512] = 1;
            g_cur = ISA_AVX512;
            if (__builtin_cpu_supports("avx512vbmi") && __builtin_cpu_supports("gfni")) {
                kern_fill_avx512vbmi(&g_isa[ISA_AVX512VBMI]);
                /* Zen 4: the GEMM form beats the row kernels from 2 tokens an expert (IQ2_XXS,
                 * 2048 x 4096, CPU time x1.30 of one token against x1.61) and from 3 (Q2_K: x1.67
                 * against x2.01), bit for bit the same sums; the builds' defaults (4) were measured
                 * on a Xeon. A multi-token step's experts picked by several rows take it (issue 37) */
                if (__builtin_cpu_is("amd")) {
                    g_isa[ISA_AVX512VBMI].q8g_min_t[KT_IQ2_XXS] = 2;
                    g_isa[ISA_AVX512VBMI].q8g_min_t[KT_Q2_K] = 3;
                }
                mrow_q8_install(ISA_AVX512VBMI);
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
}

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

int thread_count(int64_t units, int64_t work, int64_t min_work, int max_threads) {
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

/* the T = 1 kernels that sum in float64 (the plain formats); the quant formats' factored ones apply
 * block scales to float32 partial sums */
static int mv1_is_f64(int type) { return type == KT_F32 || type == KT_F16 || type == KT_BF16; }

/* path: 0 = by T (mv1 for T = 1, mvt for T <= mvt_max, else panel), 1 = in registers (mv1 / mvt),
 * 2 = panel, 3 = as 0 but every result the float64 sum rounded once (T = 1 of a quant format takes
 * mvt instead of its float32 mv1) */
int run_matmul(const kern_isa *K, int type, const uint8_t *W, ptrdiff_t stride, int64_t n_rows,
               int64_t n_in, const float *x, int64_t T, float *y, int max_threads, int path) {
    if (n_in == 0) {
        memset(y, 0, (size_t)(T * n_rows) * sizeof(float));
        return 0;
    }
    const int64_t rb = n_in / kern_block_elems(type) * kern_block_bytes(type);
    int failed = 0;
    const int mv1_ok = K->mv1[type] && path != 2 && !g_invariant && (path != 3 || mv1_is_f64(type));
    if (T == 1 && mv1_ok) {
        const int64_t na = kern_aux_len(type, n_in);
        float *aux = NULL;
        if (mv1_is_f64(type)) {
            /* the plain formats' float64 kernels read x widened to doubles once (as aux) */
            double *xd = (double *)malloc((size_t)n_in * sizeof(double) + 8);
            if (!xd) return -1;
            for (int64_t i = 0; i < n_in; i++) xd[i] = x[i];
            aux = (float *)xd;
        } else if (na) {
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
    if ((T > 1 || !mv1_ok) && K->mvt[type] && (path == 1 || ((path == 0 || path == 3) && T <= K->mvt_max[type]))) {
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
     * for every 8 rows. Blocks of KERN_KC values keep larger panels and a block of x that caches
     * well; the float64 partial sums wait in yacc and are rounded once after the last block (not
     * in batch-invariant mode, where a token's sums must be in the order of the other paths). */
    const int64_t be = kern_block_elems(type);
    int64_t kc = n_in;
    if (!g_invariant && n_in >= 2 * KERN_KC && T * n_in * (int64_t)sizeof(float) > (1 << 20) && KERN_KC % be == 0)
        kc = KERN_KC;
    double *yacc = NULL;
    if (kc < n_in) {
        yacc = (double *)malloc((size_t)(T * n_rows) * sizeof(double));
        if (!yacc) return -1;
    }
    const int unit = K->panel_rows;
    const size_t need = 2 * (size_t)kern_panel_scratch_d(unit, kc); /* floats */
    const int nt = thread_count((n_rows + unit - 1) / unit, n_rows * n_in * T, 1 << 20, max_threads);
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        int64_t a, b;
        split_rows(n_rows, unit, OMP_TID(), OMP_NTH(), &a, &b);
        if (a < b) {
            double *wbuf = (double *)scratch(need);
            if (!wbuf) {
#pragma omp atomic write
                failed = 1;
            } else {
                for (int64_t k0 = 0; k0 < n_in; k0 += kc) {
                    const int64_t len = n_in - k0 < kc ? n_in - k0 : kc;
                    const int mode = kc == n_in ? 0 : k0 == 0 ? 1 : k0 + len < n_in ? 2 : 3;
                    K->panel(K->dq[type], W + k0 / be * kern_block_bytes(type), stride, len, a, b, x + k0, n_in, T,
                             y, n_rows, wbuf, yacc, mode);
                }
            }
        }
    }
    free(yacc);
    return failed ? -1 : 0;
}

/* Integer activations (ds4 numerics): every token of every x is quantized (Q8_0 or Q8_K blocks, by
 * the job's weight type), then the 16-row units of all the products are split over the threads by
 * work (one product is a batch of one; a layer's routed experts and its shared expert are one
 * fork/join, not one per matrix; jobs may mix weight types) */

/* jobs a and b read the same activation codes: the same x, block size and arrangement */
static int q8_same_codes(const kern_isa *K, const q8_job *a, const q8_job *b) {
    if (a->x != b->x || a->T != b->T || a->n_in != b->n_in || a->gemm != b->gemm) return 0;
    if (kern_q8_block(a->type) != kern_q8_block(b->type)) return 0;
    if (a->gemm) /* x + 128 or not, and in which order */
        return K->q8g_xu[a->type] == K->q8g_xu[b->type] && K->q8g_arrange[a->type] == K->q8g_arrange[b->type];
    return K->q8_arrange[a->type] == K->q8_arrange[b->type];
}

/* relative cost of a weight value for the work split: IQ2_XXS decoding is compute-bound (about
 * 0.27 cycles a value on a Zen 4 core), Q8_0 streams at the read rate (about 0.19), Q2_K about 0.14;
 * a build with faster kernels sets its own (kern_isa.q8_cost) */
static int64_t q8_cost(const kern_isa *K, int type) {
    if (K->q8_cost[type]) return K->q8_cost[type];
    return type == KT_IQ2_XXS ? 6 : type == KT_Q2_K ? 3 : 4;
}

/* a batch's activation buffer sizes (values), its 16-row units and their work */
typedef struct {
    int64_t nq, nd, ns, nu, units, work, gscratch;
} q8_sizes;

/* each job's form (GEMM or rows) and the earlier job whose codes it shares, and the sizes */
static void q8_plan(const kern_isa *K, q8_job *jobs, int64_t n_jobs, q8_sizes *z) {
    memset(z, 0, sizeof(*z));
    for (int64_t i = 0; i < n_jobs; i++) {
        q8_job *j = &jobs[i];
        const int bs = kern_q8_block(j->type);
        j->gemm = K->q8g[j->type] && !g_invariant && j->T >= K->q8g_min_t[j->type];
        z->units += (j->n_rows + 15) / 16;
        z->work += j->n_rows * (j->n_in / kern_block_elems(j->type) * kern_block_bytes(j->type)) * (j->T < 4 ? j->T : 4);
        j->same = -1;
        for (int64_t k = i - 1; k >= 0 && k >= i - 64; k--)   /* (a decode batch's 26-28 jobs) */
            if (jobs[k].same < 0 && q8_same_codes(K, &jobs[k], j)) {
                j->same = k;
                break;
            }
        if (j->same >= 0) continue;
        if (j->gemm) {
            const int64_t g = K->q8g_scratch(j->n_in);
            z->gscratch = g > z->gscratch ? g : z->gscratch;
            z->nu += K->q8g_xu[j->type] ? j->T * j->n_in : 0; /* the form reads x + 128 */
        } else if (K->q8_arrange[j->type])
            z->nu += j->T * j->n_in; /* the row kernel's order */
        z->nq += j->T * j->n_in;
        z->nd += j->T * (j->n_in / bs);
        z->ns += bs == 256 ? j->T * (j->n_in / 16) : 0;
    }
}

/* each job's slices of the shared buffers (a job that shares codes takes the earlier job's), and
 * the job of every 16-row unit */
static void q8_assign(const kern_isa *K, q8_job *jobs, int64_t n_jobs, int8_t *xq, uint8_t *xu, float *xd,
                      int16_t *xs, int64_t *unit_job) {
    int64_t nq = 0, nd = 0, ns = 0, nu = 0;
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
}

/* the parallel region: quantize every job's x, then each thread its run of units, equal in work */
static void q8_run(const kern_isa *K, const q8_job *jobs, int64_t n_jobs, const int64_t *unit_job,
                   const int64_t *unit_cum, int64_t units, int64_t gscratch, int nt, int *failed) {
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
            if (j->xu && K->q8g_arrange[j->type])
                K->q8g_arrange[j->type](j->xq, j->n_in, j->T, (int8_t *)j->xu);
            else if (j->xu)
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
                    *failed = 1;
            } else
                K->q8[j->type](j->W, j->stride, j->n_in, a, b, j->xr ? j->xr : j->xq, j->xd, j->xs, j->T, j->y, j->n_rows);
            u = last + 1;
        }
    }
}

int run_matmul_q8_batch(const kern_isa *K, q8_job *jobs, int64_t n_jobs, int max_threads) {
    q8_sizes z;
    q8_plan(K, jobs, n_jobs, &z);
    const int64_t units = z.units;
    int8_t *xq = (int8_t *)malloc((size_t)z.nq + 1);
    uint8_t *xu = (uint8_t *)malloc((size_t)z.nu + 1); /* a second copy of some jobs' codes: xu or xr */
    float *xd = (float *)malloc((size_t)z.nd * sizeof(float) + 1);
    int16_t *xs = (int16_t *)malloc((size_t)z.ns * sizeof(int16_t) + 1);
    int64_t *unit_job = (int64_t *)malloc((size_t)units * sizeof(int64_t) + 1);
    int64_t *unit_cum = (int64_t *)malloc((size_t)(units + 1) * sizeof(int64_t));
    int failed = !xq || !xu || !xd || !xs || !unit_job || !unit_cum; /* or: a GEMM job's scratch could not be had */
    if (!failed) {
        q8_assign(K, jobs, n_jobs, xq, xu, xd, xs, unit_job);
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
        q8_run(K, jobs, n_jobs, unit_job, unit_cum, units, z.gscratch, thread_count(units, z.work, 64 * 1024, max_threads),
               &failed);
    }
    free(xq);
    free(xu);
    free(xd);
    free(xs);
    free(unit_job);
    free(unit_cum);
    return failed ? -1 : 0;
}

void run_dequant(const kern_isa *K, int type, const uint8_t *W, ptrdiff_t stride, int64_t n_rows,
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

void run_f16_seq(const uint16_t *W, ptrdiff_t stride, int64_t n_rows, int64_t n_in, const float *x, int64_t T,
                 float *y, int max_threads) {
    const int nt = thread_count(n_rows, n_rows * n_in * (T > 0 ? T : 1), 64 * 1024, max_threads);
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        int64_t a, b;
        split_rows(n_rows, 8, OMP_TID(), OMP_NTH(), &a, &b);
        if (!mrow_f16_seq(W, stride, n_in, a, b, x, T, y, n_rows)) /* mrow_f16.c: the SIMD form */
            kern_f16_seq(W, stride, n_in, a, b, x, T, y, n_rows);
    }
}
