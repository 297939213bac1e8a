/* ds4 numerics' F16 matvec (kern_f16_seq's function) for several tokens at once: the multi-token
 * step's (MTP verify, batched decode, prefill) hyper-connection mixes, routers and output HC.
 *
 * kern_f16_seq (kern_q8.c, the portable form) runs token by token: every token re-decodes the
 * weights through a 256 KB table, one scalar product and add per weight, so a T-token step paid T
 * times a one-token step's cost for these matrices (9.75 % of a 2-token verify step's CPU time on
 * the real-width 4-layer file against 6.6 % of a one-token step's: issue 37).  Here 8 rows are one
 * ymm: 8 halves of each row are converted with vcvtph2ps (exact, as the table) and transposed, so a
 * column of 8 rows' weights is one register, shared by up to MR_NT tokens whose sums run as
 * independent chains.  Every (row, token) sum is still the float32 sum in index order of the
 * float32 products fl(w * x) (this file is compiled with -ffp-contract=off: mul, then add, never an
 * FMA): bit for bit kern_f16_seq and ds4_float.f16_matvec, whatever T.  A last group of fewer than 8
 * rows repeats its last row in the spare lanes and stores only its own. */
#include <stddef.h>
#include <stdint.h>

#include "module.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#include "mrow_transpose.h"

#define MR_T __attribute__((target("avx2,f16c")))
#define MR_NT 4 /* tokens a pass: 4 accumulators + 8 weight columns + temporaries fit 16 ymm */

/* rows r..r+nr-1 (nr <= 8) for tokens t0..t0+nt-1 (nt <= MR_NT): y[t * ldy + row] */
MR_T static inline __attribute__((always_inline)) void mr_f16_group(const uint16_t *W, ptrdiff_t stride, int64_t n, int64_t r, int nr, const float *x,
                              int64_t t0, int nt, float *y, int64_t ldy) {
    const uint16_t *row[8];
    for (int k = 0; k < 8; k++) row[k] = W + (r + (k < nr ? k : nr - 1)) * stride;
    __m256 acc[MR_NT];
    for (int t = 0; t < MR_NT; t++) acc[t] = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 c[8];
        for (int k = 0; k < 8; k++) c[k] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row[k] + i)));
        mrow_transpose8(c);
        for (int j = 0; j < 8; j++)
            for (int t = 0; t < nt; t++)
                acc[t] = _mm256_add_ps(acc[t], _mm256_mul_ps(c[j], _mm256_set1_ps(x[(t0 + t) * n + i + j])));
    }
    for (; i < n; i++) { /* the last n % 8 columns, still in index order */
        float w8[8];
        for (int k = 0; k < 8; k++) w8[k] = _cvtsh_ss(row[k][i]);
        const __m256 cw = _mm256_loadu_ps(w8);
        for (int t = 0; t < nt; t++)
            acc[t] = _mm256_add_ps(acc[t], _mm256_mul_ps(cw, _mm256_set1_ps(x[(t0 + t) * n + i])));
    }
    for (int t = 0; t < nt; t++) {
        float o[8];
        _mm256_storeu_ps(o, acc[t]);
        for (int k = 0; k < nr; k++) y[(t0 + t) * ldy + r + k] = o[k];
    }
}

MR_T static void mr_f16_rows(const uint16_t *W, ptrdiff_t stride, int64_t n, int64_t r0, int64_t r1, const float *x,
                             int64_t T, float *y, int64_t ldy) {
    for (int64_t r = r0; r < r1; r += 8) {
        const int nr = r1 - r < 8 ? (int)(r1 - r) : 8;
        for (int64_t t0 = 0; t0 < T; t0 += MR_NT) {
            const int nt = T - t0 < MR_NT ? (int)(T - t0) : MR_NT;
            switch (nt) { /* constant token counts: the compiler keeps the accumulators in registers */
            case 1: mr_f16_group(W, stride, n, r, nr, x, t0, 1, y, ldy); break;
            case 2: mr_f16_group(W, stride, n, r, nr, x, t0, 2, y, ldy); break;
            case 3: mr_f16_group(W, stride, n, r, nr, x, t0, 3, y, ldy); break;
            default: mr_f16_group(W, stride, n, r, nr, x, t0, MR_NT, y, ldy); break;
            }
        }
    }
}

int mrow_f16_seq(const uint16_t *W, ptrdiff_t stride, int64_t n, int64_t r0, int64_t r1, const float *x, int64_t T,
                 float *y, int64_t ldy) {
    if (g_cur == ISA_GENERIC || !g_have[ISA_AVX2]) return 0; /* the portable build: kern_f16_seq */
    mr_f16_rows(W, stride, n, r0, r1, x, T, y, ldy);
    return 1;
}
#else
int mrow_f16_seq(const uint16_t *W, ptrdiff_t stride, int64_t n, int64_t r0, int64_t r1, const float *x, int64_t T,
                 float *y, int64_t ldy) {
    (void)W, (void)stride, (void)n, (void)r0, (void)r1, (void)x, (void)T, (void)y, (void)ldy;
    return 0;
}
#endif
