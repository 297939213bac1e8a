/* The Q8_0 integer row kernel for 2-8 tokens (AVX-512 VNNI builds): the multi-token step's
 * (MTP verify, batched decode) attention, shared-expert and output-head products.
 *
 * ds4's function per (row, token), as every Q8_0 kernel (kern_q8.c): per 32-value block the exact
 * integer dot of the weight and activation codes, times the float32 product of the two scales
 * (dw * dx), added to a float32 sum in block order.  The build's row kernel (kern_q8_body.h,
 * q8_0_row) decodes 8 blocks of a row once and takes each token through them, then adds that
 * token's 8 block terms one by one: per token and group 8 scalar loads and adds in one dependent
 * chain, which made a 2-token step's Q8_0 products cost 1.14-1.19x a one-token step's CPU time and
 * a 4-token step's 1.8x (issue 37).  Here the tokens' 8 block terms are transposed so that block k
 * of every token is one vector (a lane a token): the 8 additions in block order are 8 vector adds
 * for all tokens at once.  Each lane adds the same float32 values in the same order as the row
 * kernel: bit for bit.  One token keeps the build's kernel (it streams the weights; nothing to share).
 */
#include <stddef.h>
#include <stdint.h>

#include "module.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#include "mrow_transpose.h"

#define MQ_T __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,f16c")))
#define MQ_I MQ_T static inline __attribute__((always_inline))
#define MQ_NT 8 /* tokens a pass */

static kern_q8_fn mq_one[ISA_N]; /* each build's own kernel: one token */

/* A pass's activations arranged once for all its rows (the row loop then does per token only the
 * loads, the VNNI products and the reduction): the weights go in as w + 128 (w ^ 0x80, unsigned)
 * against the signed codes, so each block's dot carries + 128 * sum(x) of the block, taken off as
 * an exact integer (corr); and a group's 8 scales and corrections are kept in mq_sum8's raw lane
 * order (blocks 0 2 4 6 1 3 5 7), so no per-token permute: the block terms are added by block. */
#define MQ_MAXB 512 /* blocks a row (16384 values): wider rows take the build's kernel */
typedef struct {
    float xd[MQ_NT * MQ_MAXB];   /* [t][8 g + i]: token t's scale of block 8 g + raw[i] */
    int32_t corr[MQ_NT * MQ_MAXB]; /* 128 * the sum of those codes */
} mq_prep;

static const int mq_raw[8] = {0, 2, 4, 6, 1, 3, 5, 7};

MQ_T static void mq_arrange(const int8_t *xq, const float *xd, int64_t n, int64_t nb, int nt, mq_prep *p) {
    const int64_t ng = nb / 8;
    for (int t = 0; t < nt; t++)
        for (int64_t g = 0; g < ng; g++)
            for (int i = 0; i < 8; i++) {
                const int64_t blk = 8 * g + mq_raw[i];
                const int8_t *c = xq + t * n + 32 * blk;
                int32_t sum = 0;
                for (int e = 0; e < 32; e++) sum += c[e];
                p->xd[t * nb + 8 * g + i] = xd[t * nb + blk];
                p->corr[t * nb + 8 * g + i] = 128 * sum;
            }
}

/* the 8 blocks' sums of a group in raw order (0 2 4 6 1 3 5 7), from p_k = the int32 lanes of
 * blocks 2k (lanes 0-7) and 2k + 1 (8-15) */
MQ_I __m256i mq_sum8_raw(__m512i p0, __m512i p1, __m512i p2, __m512i p3) {
    const __m512i t01 = _mm512_add_epi32(_mm512_unpacklo_epi32(p0, p1), _mm512_unpackhi_epi32(p0, p1));
    const __m512i t23 = _mm512_add_epi32(_mm512_unpacklo_epi32(p2, p3), _mm512_unpackhi_epi32(p2, p3));
    const __m512i s = _mm512_add_epi32(_mm512_unpacklo_epi64(t01, t23), _mm512_unpackhi_epi64(t01, t23));
    const __m512i o = _mm512_shuffle_i32x4(s, s, _MM_SHUFFLE(3, 1, 2, 0));
    return _mm256_add_epi32(_mm512_castsi512_si256(o), _mm512_extracti64x4_epi64(o, 1));
}

/* one row, nt (2..8) tokens: out[t] */
MQ_I void mq_row(const uint8_t *row, int64_t nb, int64_t n, const int8_t *xq, const float *xd, const mq_prep *pp,
                 float *out, const int nt) {
    const __m256i soff = _mm256_setr_epi32(0, 34, 68, 102, 136, 170, 204, 238);
    const __m256i raw = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m256 acc = _mm256_setzero_ps(); /* lane t: token t's sum */
    int64_t b = 0;
    for (; b + 8 <= nb; b += 8) {
        const uint8_t *q = row + 34 * b;
        __m512i u[4];
        for (int k = 0; k < 4; k++) {
            _mm_prefetch((const char *)(q + 68 * k + 3072), _MM_HINT_T0);
            const __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(q + 68 * k + 2))),
                                                 _mm256_loadu_si256((const __m256i *)(q + 68 * k + 36)), 1);
            u[k] = _mm512_xor_si512(w, flip); /* w + 128 as an unsigned byte */
        }
        const __m256 dw = _mm256_cvtph_ps(_mm256_cvtepi32_epi16(_mm256_i32gather_epi32((const int *)q, soff, 1)));
        const __m256 dwr = _mm256_permutevar8x32_ps(dw, raw); /* in the raw lane order */
        __m256 pv[8];
        for (int t = 0; t < nt; t++) {
            const int8_t *xb = xq + t * n + 32 * b;
            __m512i p[4];
            for (int k = 0; k < 4; k++)
                p[k] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u[k], _mm512_loadu_si512((const void *)(xb + 64 * k)));
            const __m256i s8 = _mm256_sub_epi32(mq_sum8_raw(p[0], p[1], p[2], p[3]),
                                                _mm256_loadu_si256((const __m256i *)(pp->corr + t * nb + b)));
            const __m256 sc = _mm256_mul_ps(dwr, _mm256_loadu_ps(pp->xd + t * nb + b));
            pv[t] = _mm256_mul_ps(sc, _mm256_cvtepi32_ps(s8));
        }
        if (nt == 1) { /* one token: its 8 terms in block order, no transpose */
            float v[8];
            _mm256_storeu_ps(v, pv[0]);
            float a0 = _mm256_cvtss_f32(acc);
            a0 += v[0], a0 += v[4], a0 += v[1], a0 += v[5], a0 += v[2], a0 += v[6], a0 += v[3], a0 += v[7];
            acc = _mm256_set1_ps(a0);
            continue;
        }
        for (int t = nt; t < 8; t++) pv[t] = _mm256_setzero_ps();
        mrow_transpose8(pv); /* pv[i] lane t: token t's term of block b + raw[i] */
        acc = _mm256_add_ps(acc, pv[0]); /* blocks 0, 1, ..., 7 */
        acc = _mm256_add_ps(acc, pv[4]);
        acc = _mm256_add_ps(acc, pv[1]);
        acc = _mm256_add_ps(acc, pv[5]);
        acc = _mm256_add_ps(acc, pv[2]);
        acc = _mm256_add_ps(acc, pv[6]);
        acc = _mm256_add_ps(acc, pv[3]);
        acc = _mm256_add_ps(acc, pv[7]);
    }
    float a[8];
    _mm256_storeu_ps(a, acc);
    for (; b < nb; b++) { /* the last blocks of a row of n % 256 values, one at a time */
        const uint8_t *q = row + 34 * b;
        const __m256i w0 = _mm256_loadu_si256((const __m256i *)(q + 2));
        const __m256i u0 = _mm256_sign_epi8(w0, w0);
        const float d0 = _cvtsh_ss(kern_rd16(q));
        for (int t = 0; t < nt; t++) {
            const __m256i s0 = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(xq + t * n + 32 * b)), w0);
            const __m256i p0 = _mm256_dpbusd_epi32(_mm256_setzero_si256(), u0, s0);
            __m128i h = _mm_add_epi32(_mm256_castsi256_si128(p0), _mm256_extracti128_si256(p0, 1));
            h = _mm_add_epi32(h, _mm_unpackhi_epi64(h, h));
            h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 1));
            a[t] += (d0 * xd[t * (n / 32) + b]) * (float)_mm_cvtsi128_si32(h);
        }
    }
    for (int t = 0; t < nt; t++) out[t] = a[t];
}

MQ_I void mq_q8_0(kern_q8_fn one, const uint8_t *W, ptrdiff_t stride, int64_t n, int64_t r0, int64_t r1,
                  const int8_t *xq, const float *xd, const int16_t *xs, int64_t T, float *y, int64_t ldy) {
    const int64_t nb = n / 32;
    if (T == 1 || nb > MQ_MAXB) { /* (this kernel at one token: 10-20 % less CPU on the head at load 19,
                                      * not measured quiet, where the build's prefetches may matter) */
        one(W, stride, n, r0, r1, xq, xd, xs, T, y, ldy);
        return;
    }
    mq_prep prep;
    float out[MQ_NT];
    for (int64_t t0 = 0; t0 < T; t0 += MQ_NT) {
        const int nt = T - t0 < MQ_NT ? (int)(T - t0) : MQ_NT;
        const int8_t *xqt = xq + t0 * n;
        const float *xdt = xd + t0 * nb;
        mq_arrange(xqt, xdt, n, nb, nt, &prep);
        for (int64_t r = r0; r < r1; r++) {
            const uint8_t *row = W + r * stride;
            switch (nt) { /* constant token counts: the loops unroll, pv stays in registers */
            case 1: mq_row(row, nb, n, xqt, xdt, &prep, out, 1); break;
            case 2: mq_row(row, nb, n, xqt, xdt, &prep, out, 2); break;
            case 3: mq_row(row, nb, n, xqt, xdt, &prep, out, 3); break;
            case 4: mq_row(row, nb, n, xqt, xdt, &prep, out, 4); break;
            case 5: mq_row(row, nb, n, xqt, xdt, &prep, out, 5); break;
            case 6: mq_row(row, nb, n, xqt, xdt, &prep, out, 6); break;
            case 7: mq_row(row, nb, n, xqt, xdt, &prep, out, 7); break;
            default: mq_row(row, nb, n, xqt, xdt, &prep, out, 8); break;
            }
            for (int t = 0; t < nt; t++) y[(t0 + t) * ldy + r] = out[t];
        }
    }
}

/* one entry point per build, each falling back to that build's own kernel */
#define MQ_ENTRY(ISA)                                                                                          \
    MQ_T static void mq_q8_0_##ISA(const uint8_t *W, ptrdiff_t stride, int64_t n, int64_t r0, int64_t r1,      \
                                   const int8_t *xq, const float *xd, const int16_t *xs, int64_t T, float *y,  \
                                   int64_t ldy) {                                                              \
        mq_q8_0(mq_one[ISA], W, stride, n, r0, r1, xq, xd, xs, T, y, ldy);                                     \
    }
MQ_ENTRY(ISA_AVX512)
MQ_ENTRY(ISA_AVX512VBMI)

/* the builds with AVX-512 VNNI take this kernel for Q8_0 from 2 tokens (called by sched_init after
 * the build's own kernels are filled in) */
void mrow_q8_install(int isa) {
    kern_q8_fn mine = isa == ISA_AVX512 ? mq_q8_0_ISA_AVX512 : isa == ISA_AVX512VBMI ? mq_q8_0_ISA_AVX512VBMI : NULL;
    if (!mine || !g_isa[isa].q8[KT_Q8_0] || g_isa[isa].q8[KT_Q8_0] == mine) return;
    mq_one[isa] = g_isa[isa].q8[KT_Q8_0];
    g_isa[isa].q8[KT_Q8_0] = mine;
}
#else
void mrow_q8_install(int isa) { (void)isa; }
#endif
