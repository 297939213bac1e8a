/* SIMD matmul kernels, written once against a 16-lane float vector layer (V16) that the
 * including file defines: one __m512 (kern_avx512.c) or a pair of __m256 (kern_avx2.c).
 *
 * Layer: vzero vset1 vloadu vstoreu vfma vmul vadd vsub vhsum; v_i8x16 / v_u8x16 (16 bytes in an
 * __m128i -> 16 floats); v_f16 / v_bf16 (16 halves at p); v_2x8 (two runs of 8 floats); v_flip16
 * (negate the lanes whose bit is set in the 16-bit mask at p); V16I (16 int32 lanes): vi_u8x16_mem
 * (16 bytes at p, zero-extended), vi_and, vi_srli, vi_cvt.  KSUF(name) names this build's
 * functions; PRP x PTT is the panel's register tile, MVT_NT the tokens per in-register pass.
 *
 * Three paths (the dispatcher in sched.c, run_matmul, picks one by T):
 * T = 1 ("mv1"): every weight row is decoded in registers, a block at a time, and multiplied
 *   into x; block and sub-block scales are applied to partial sums instead of to every weight,
 *   and the K-quant minimums use per-call sums of x (aux) instead of per-weight subtractions.
 * small T ("mvt"): rows decoded in registers to their exact weights, MVT_NT tokens per pass.
 * larger T ("panel"): a panel of rows is decoded (with this build's exact dequantizer) into a
 *   float buffer that stays in L2, then register tiles of PRP rows x PTT tokens run over it.
 * Every path reads each weight from memory once per call whatever T. */

/* software prefetch KERN_PF bytes ahead of the decoder (the hardware prefetchers stop at 4 KiB
 * pages, and the compute-heavy decode loops leave few loads in flight); rows are usually
 * contiguous, so running past a row's end prefetches the next one */
#ifndef KERN_PF
#define KERN_PF 2048       /* quant formats: decode-bound, fewer bytes per second */
#endif
#ifndef KERN_PF_PLAIN
#define KERN_PF_PLAIN 4096 /* F32 / F16 / BF16 stream faster: prefetch further ahead */
#endif
#ifndef KERN_PF_L2
#define KERN_PF_L2 8192     /* and a second, further prefetch into L2 */
#endif
#if KERN_PF > 0
#define PFL(p, d, h) _mm_prefetch((const char *)(p) + (d), h)
#define PF1(p) (PFL(p, KERN_PF, _MM_HINT_T0), PFL(p, KERN_PF_L2, _MM_HINT_T1))
#define PF2(p) (PF1(p), PF1((const char *)(p) + 64))
#define PFP1(p) (PFL(p, KERN_PF_PLAIN, _MM_HINT_T0), PFL(p, KERN_PF_PLAIN + KERN_PF_L2, _MM_HINT_T1))
#define PFP2(p) (PFP1(p), PFP1((const char *)(p) + 64))
#else
#define PF1(p) ((void)0)
#define PF2(p) ((void)0)
#define PFP1(p) ((void)0)
#define PFP2(p) ((void)0)
#endif

/* ------------------------------------------------------------------------------------------ */
/* Float64 accumulation (the reference's: quants.matvec(..., accumulate=np.float64), NumpyOps.attention).
 * A product of a float32 weight and a float32 activation is exact in double (24 + 24 bits < 53), so
 * a double sum differs from the exact one by far less than a float32 ulp and its one rounding to
 * float32 equals the reference's except when the exact sum lies within ~2^-29 ulp of a rounding
 * boundary: whatever order either side sums in, the float32 results agree. VD8 is 8 doubles: one
 * __m512d, or a pair of __m256d on AVX2. vd_lo / vd_hi: lanes 0-7 / 8-15 of a V16 as doubles. */
#if defined(__AVX512F__)
typedef __m512d VD8;
KI VD8 vdzero(void) { return _mm512_setzero_pd(); }
KI VD8 vdset1(double d) { return _mm512_set1_pd(d); }
KI VD8 vdload(const double *p) { return _mm512_loadu_pd(p); }
KI VD8 vdloadf(const float *p) { return _mm512_cvtps_pd(_mm256_loadu_ps(p)); }
KI void vdstore(double *p, VD8 v) { _mm512_storeu_pd(p, v); }
KI VD8 vdfma(VD8 a, VD8 b, VD8 c) { return _mm512_fmadd_pd(a, b, c); }
KI VD8 vdadd(VD8 a, VD8 b) { return _mm512_add_pd(a, b); }
KI VD8 vdmul(VD8 a, VD8 b) { return _mm512_mul_pd(a, b); }
KI double vdhsum(VD8 v) {
    const __m256d h = _mm256_add_pd(_mm512_castpd512_pd256(v), _mm512_extractf64x4_pd(v, 1));
    const __m128d q = _mm_add_pd(_mm256_castpd256_pd128(h), _mm256_extractf128_pd(h, 1));
    return _mm_cvtsd_f64(_mm_add_sd(q, _mm_unpackhi_pd(q, q)));
}
KI VD8 vd_lo(V16 v) { return _mm512_cvtps_pd(_mm512_castps512_ps256(v)); }
KI VD8 vd_hi(V16 v) { return _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))); }
/* the double panel's register tile: 4 rows x up to 3 tokens x 2 accumulators = 24 zmm */
#define DPR 4
#define DPT 3
#else
typedef struct {
    __m256d a, b;
} VD8;
KI VD8 vdmk(__m256d a, __m256d b) {
    VD8 v = {a, b};
    return v;
}
KI VD8 vdzero(void) { return vdmk(_mm256_setzero_pd(), _mm256_setzero_pd()); }
KI VD8 vdset1(double d) { return vdmk(_mm256_set1_pd(d), _mm256_set1_pd(d)); }
KI VD8 vdload(const double *p) { return vdmk(_mm256_loadu_pd(p), _mm256_loadu_pd(p + 4)); }
KI VD8 vdloadf(const float *p) { return vdmk(_mm256_cvtps_pd(_mm_loadu_ps(p)), _mm256_cvtps_pd(_mm_loadu_ps(p + 4))); }
KI void vdstore(double *p, VD8 v) {
    _mm256_storeu_pd(p, v.a);
    _mm256_storeu_pd(p + 4, v.b);
}
KI VD8 vdfma(VD8 x, VD8 y, VD8 z) { return vdmk(_mm256_fmadd_pd(x.a, y.a, z.a), _mm256_fmadd_pd(x.b, y.b, z.b)); }
KI VD8 vdadd(VD8 x, VD8 y) { return vdmk(_mm256_add_pd(x.a, y.a), _mm256_add_pd(x.b, y.b)); }
KI VD8 vdmul(VD8 x, VD8 y) { return vdmk(_mm256_mul_pd(x.a, y.a), _mm256_mul_pd(x.b, y.b)); }
KI double vdhsum(VD8 v) {
    const __m256d h = _mm256_add_pd(v.a, v.b);
    const __m128d q = _mm_add_pd(_mm256_castpd256_pd128(h), _mm256_extractf128_pd(h, 1));
    return _mm_cvtsd_f64(_mm_add_sd(q, _mm_unpackhi_pd(q, q)));
}
KI VD8 vd_lo(V16 v) { return vdmk(_mm256_cvtps_pd(_mm256_castps256_ps128(v.a)), _mm256_cvtps_pd(_mm256_extractf128_ps(v.a, 1))); }
KI VD8 vd_hi(V16 v) { return vdmk(_mm256_cvtps_pd(_mm256_castps256_ps128(v.b)), _mm256_cvtps_pd(_mm256_extractf128_ps(v.b, 1))); }
/* 2 rows x up to 2 tokens x 2 accumulators x 2 halves = 16 ymm */
#define DPR 2
#define DPT 2
#endif

/* ------------------------------------------------------------------------------------------ */
/* T = 1 kernels */

/* plain formats (F32 / F16 / BF16), float64 sums: 16 values at a time, lanes 0-7 and 8-15 into
 * their own accumulators (four chains: two 16-value steps per pass) */
#define KERN_DEF_MV1_PLAIN(fmt, ES, LOAD16, SCALAR, PF)                                              \
    static void KSUF(mv1_##fmt)(const uint8_t *W, ptrdiff_t stride, int64_t n, int64_t r0, int64_t r1, \
                                const float *x, const float *aux, float *y) {                        \
        const double *xd = (const double *)aux; /* x as doubles (run_matmul) */                      \
        (void)x;                                                                                     \
        for (int64_t r = r0; r < r1; r++) {                                                          \
            const uint8_t *w = W + r * stride;                                                       \
            VD8 a0 = vdzero(), a1 = vdzero(), a2 = vdzero(), a3 = vdzero();                          \
            int64_t k = 0;                                                                           \
            for (; k + 32 <= n; k += 32) {                                                           \
                PF(w + (ES) * k);                                                                    \
                const V16 w0 = LOAD16(w + (ES) * k), w1 = LOAD16(w + (ES) * (k + 16));               \
                a0 = vdfma(vd_lo(w0), vdload(xd + k), a0);                                           \
                a1 = vdfma(vd_hi(w0), vdload(xd + k + 8), a1);                                       \
                a2 = vdfma(vd_lo(w1), vdload(xd + k + 16), a2);                                      \
                a3 = vdfma(vd_hi(w1), vdload(xd + k + 24), a3);                                      \
            }                                                                                        \
            for (; k + 16 <= n; k += 16) {                                                           \
                const V16 w0 = LOAD16(w + (ES) * k);                                                 \
                a0 = vdfma(vd_lo(w0), vdload(xd + k), a0);                                           \
                a1 = vdfma(vd_hi(w0), vdload(xd + k + 8), a1);                                       \
            }                                                                                        \
            double s = vdhsum(vdadd(vdadd(a0, a2), vdadd(a1, a3)));                                  \
            for (; k < n; k++) s += (double)SCALAR(w + (ES) * k) * xd[k];                            \
            y[r] = (float)s;                                                                         \
        }                                                                                            \
    }

#define KERN_F32_AT(p) kern_bits_f32(kern_rd32(p))
#define KERN_F16_AT(p) KERN_F16(kern_rd16(p))
#define KERN_BF16_AT(p) kern_bits_f32((uint32_t)kern_rd16(p) << 16)
#define KERN_PF_F32(p) PFP2(p)
#define KERN_PF_HALF(p) PFP1(p)
KERN_DEF_MV1_PLAIN(f32, 4, vloadu, KERN_F32_AT, KERN_PF_F32)
KERN_DEF_MV1_PLAIN(f16, 2, v_f16, KERN_F16_AT, KERN_PF_HALF)
KERN_DEF_MV1_PLAIN(bf16, 2, v_bf16, KERN_BF16_AT, KERN_PF_HALF)

/* y = sum_b d_b * (q_b . x_b) */
static void KSUF(mv1_q8_0)(const uint8_t *W, ptrdiff_t stride, int64_t n, int64_t r0, int64_t r1,
                           const float *x, const float *aux, float *y) {
    (void)aux;
    const int64_t nb = n / 32;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = W + r * stride;
        V16 a0 = vzero(), a1 = vzero();
        int64_t b = 0;
        for (; b + 2 <= nb; b += 2) {
            const uint8_t *q = row + 34 * b;
            const float *xb = x + 32 * b;
            PF2(q);
            V16 s0 = vmul(v_i8x16(_mm_loadu_si128((const __m128i *)(q + 2))), vloadu(xb));
            V16 s1 = vmul(v_i8x16(_mm_loadu_si128((const __m128i *)(q + 36))), vloadu(xb + 32));
            s0 = vfma(v_i8x16(_mm_loadu_si128((const __m128i *)(q + 18))), vloadu(xb + 16), s0);
            s1 = vfma(v_i8x16(_mm_loadu_si128((const __m128i *)(q + 52))), vloadu(xb + 48), s1);
            a0 = vfma(vset1(KERN_F16(kern_rd16(q))), s0, a0);
            a1 = vfma(vset1(KERN_F16(kern_rd16(q + 34))), s1, a1);
        }
        for (; b < nb; b++) {
            const uint8_t *q = row + 34 * b;
            const float *xb = x + 32 * b;
            V16 s0 = vmul(v_i8x16(_mm_loadu_si128((const __m128i *)(q + 2))), vloadu(xb));
            s0 = vfma(v_i8x16(_mm_loadu_si128((const __m128i *)(q + 18))), vloadu(xb + 16), s0);
            a0 = vfma(vset1(KERN_F16(kern_rd16(q))), s0, a0);
        }
        y[r] = vhsum(vadd(a0, a1));
    }
}

/* y = sum_b 2^(e_b-128) * (kvalues[nibbles_b] . x_b) */
static void KSUF(mv1_mxfp4)(const uint8_t *W, ptrdiff_t stride, int64_t n, int64_t r0, int64_t r1,
                            const float *x, const float *aux, float *y) {
    (void)aux;
    const int64_t nb = n / 32;
    const __m128i kv = _mm_loadu_si128((const __m128i *)kern_mxfp4_kvalues);
    const __m128i m4 = _mm_set1_epi8(15);
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = W + r * stride;
        V16 a0 = vzero(), a1 = vzero();
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = row + 17 * b;
            const float *xb = x + 32 * b;
            if (!(b & 3)) PF2(blk);
            const __m128i q = _mm_loadu_si128((const __m128i *)(blk + 1));
            const __m128i lo = _mm_shuffle_epi8(kv, _mm_and_si128(q, m4));
            const __m128i hi = _mm_shuffle_epi8(kv, _mm_and_si128(_mm_srli_epi16(q, 4), m4));
            V16 s = vmul(v_i8x16(lo), vloadu(xb));
            s = vfma(v_i8x16(hi), vloadu(xb + 16), s);
            if (b & 1)
                a1 = vfma(vset1(kern_e8m0_tab[blk[0]]), s, a1);
            else
                a0 = vfma(vset1(kern_e8m0_tab[blk[0]]), s, a0);
        }
        y[r] = vhsum(vadd(a0, a1));
    }
}

/* Q4_K block preparation: the 8 sub-block scales d*sc as floats into sc, and the minimums'
 * contribution dmin * (mn . X) added to the 8-lane accumulator am (X = aux: sums of x over each
 * 32-value sub-block).  The 6-bit unpacking is ggml's 32-bit word form of quants._q4_k_scale_min. */
static inline __attribute__((always_inline)) __m256 KSUF(q4k_prep)(const uint8_t *blk, const float *xs, float *sc,
                                                                  __m256 am) {
    const float d = KERN_F16(kern_rd16(blk));
    const float dmin = KERN_F16(kern_rd16(blk + 2));
    uint32_t u[4];
    memcpy(u, blk + 4, 12);
    const uint32_t k1 = 0x3f3f3f3f, k2 = 0x0f0f0f0f, k3 = 0x03030303;
    u[3] = ((u[2] >> 4) & k2) | (((u[1] >> 6) & k3) << 4);
    const uint32_t mlo = u[1] & k1;
    u[1] = (u[2] & k2) | (((u[0] >> 6) & k3) << 4);
    u[2] = mlo;
    u[0] &= k1;
    /* u[0..1]: the 8 scales, u[2..3]: the 8 minimums (bytes) */
    const __m128i sm = _mm_loadu_si128((const __m128i *)u);
    const __m256 scf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sm));
    const __m256 mnf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sm, 8)));
    _mm256_storeu_ps(sc, _mm256_mul_ps(scf, _mm256_set1_ps(d)));
    return _mm256_fmadd_ps(_mm256_mul_ps(mnf, _mm256_set1_ps(dmin)), _mm256_loadu_ps(xs), am);
}

static inline float kern_hsum8(__m256 h) {
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    q = _mm_add_ss(q, _mm_movehdup_ps(q));
    return _mm_cvtss_f32(q);
}

/* y = sum_b [ sum_s d*sc_s (q_s . x_s) - dmin * sum_s mn_s X_s ]  (32-value sub-blocks; X_s =
 * sums of x: aux).  The scales of block b+1 are prepared while block b is multiplied. */
static void KSUF(mv1_q4_k)(const uint8_t *W, ptrdiff_t stride, int64_t n, int64_t r0, int64_t r1,
                           const float *x, const float *aux, float *y) {
    const int64_t nb = n / 256;
    float sc[2][8] __attribute__((aligned(32)));
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = W + r * stride;
        V16 a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero();
        __m256 am = _mm256_setzero_ps();
        if (nb) am = KSUF(q4k_prep)(row, aux, sc[0], am);
        for (int64_t b = 0; b < nb; b++) {
            const int cur = (int)(b & 1);
            if (b + 1 < nb) am = KSUF(q4k_prep)(row + 144 * (b + 1), aux + 8 * (b + 1), sc[cur ^ 1], am);
            __asm__ volatile("" ::: "memory");
            const uint8_t *qs = row + 144 * b + 16;
            const float *xb = x + 256 * b;
            const float *s = sc[cur];
            PF2(qs - 16);
            PF1(qs + 112);
            for (int p = 0; p < 4; p++) {
                /* bytes 16h..16h+15 of the 32: low nibbles -> values 64p+16h.., high -> 64p+32+16h.. */
                const V16I b0 = vi_u8x16_mem(qs + 32 * p), b1 = vi_u8x16_mem(qs + 32 * p + 16);
                const float *xp = xb + 64 * p;
                V16 l = vmul(vi_cvt(vi_and(b0, 15)), vloadu(xp));
                V16 h = vmul(vi_cvt(vi_srli(b0, 4)), vloadu(xp + 32));
                l = vfma(vi_cvt(vi_and(b1, 15)), vloadu(xp + 16), l);
                h = vfma(vi_cvt(vi_srli(b1, 4)), vloadu(xp + 48), h);
                if (p & 1) {
                    a2 = vfma(vset1(s[2 * p]), l, a2);
                    a3 = vfma(vset1(s[2 * p + 1]), h, a3);
                } else {
                    a0 = vfma(vset1(s[2 * p]), l, a0);
                    a1 = vfma(vset1(s[2 * p + 1]), h, a1);
                }
            }
        }
        y[r] = vhsum(vadd(vadd(a0, a1), vadd(a2, a3))) - kern_hsum8(am);
    }
}

/* Q2_K block preparation: the 16 sub-block scales d*(sc & 15) into dl, and dmin * (mn . X) into
 * the 8-lane accumulator am (X = aux: sums of x over each 16-value sub-block). */
static inline __attribute__((always_inline)) __m256 KSUF(q2k_prep)(const uint8_t *blk, const float *xs, float *dl,
                                                                  __m256 am) {
    const __m256 d = _mm256_set1_ps(KERN_F16(kern_rd16(blk + 80)));
    const __m256 dmin = _mm256_set1_ps(KERN_F16(kern_rd16(blk + 82)));
    const __m128i sc = _mm_loadu_si128((const __m128i *)blk);
    const __m128i m4 = _mm_set1_epi8(15);
    const __m128i lo = _mm_and_si128(sc, m4), hi = _mm_and_si128(_mm_srli_epi16(sc, 4), m4);
    _mm256_storeu_ps(dl, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo))));
    _mm256_storeu_ps(dl + 8, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)))));
    am = _mm256_fmadd_ps(_mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi))), _mm256_loadu_ps(xs), am);
    return _mm256_fmadd_ps(_mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)))),
                           _mm256_loadu_ps(xs + 8), am);
}

/* y = sum_b [ sum_s d*sc_s (q_s . x_s) - dmin * sum_s mn_s X_s ]  (16-value sub-blocks).
 * Element 128h + 32j + l is bits 2j..2j+1 of qs[32h + l]; sub-block 8h + 2j + l/16. */
static void KSUF(mv1_q2_k)(const uint8_t *W, ptrdiff_t stride, int64_t n, int64_t r0, int64_t r1,
                           const float *x, const float *aux, float *y) {
    const int64_t nb = n / 256;
    float dl[2][16] __attribute__((aligned(64)));
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = W + r * stride;
        V16 a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero();
        __m256 am = _mm256_setzero_ps();
        if (nb) am = KSUF(q2k_prep)(row, aux, dl[0], am);
        for (int64_t b = 0; b < nb; b++) {
            const int cur = (int)(b & 1);
            if (b + 1 < nb) am = KSUF(q2k_prep)(row + 84 * (b + 1), aux + 16 * (b + 1), dl[cur ^ 1], am);
            __asm__ volatile("" ::: "memory");
            const uint8_t *qs = row + 84 * b + 16;
            const float *xb = x + 256 * b;
            PF2(qs - 16);
            for (int h = 0; h < 2; h++) {
                const V16I q0 = vi_u8x16_mem(qs + 32 * h), q1 = vi_u8x16_mem(qs + 32 * h + 16);
                const float *xh = xb + 128 * h;
                const float *dh = dl[cur] + 8 * h;
                V16 s0 = vmul(vi_cvt(vi_and(q0, 3)), vloadu(xh));
                V16 s1 = vmul(vi_cvt(vi_and(q1, 3)), vloadu(xh + 16));
                V16 s2 = vmul(vi_cvt(vi_and(vi_srli(q0, 2), 3)), vloadu(xh + 32));
                V16 s3 = vmul(vi_cvt(vi_and(vi_srli(q1, 2), 3)), vloadu(xh + 48));
                a0 = vfma(vset1(dh[0]), s0, a0);
                a1 = vfma(vset1(dh[1]), s1, a1);
                a2 = vfma(vset1(dh[2]), s2, a2);
                a3 = vfma(vset1(dh[3]), s3, a3);
                s0 = vmul(vi_cvt(vi_and(vi_srli(q0, 4), 3)), vloadu(xh + 64));
                s1 = vmul(vi_cvt(vi_and(vi_srli(q1, 4), 3)), vloadu(xh + 80));
                s2 = vmul(vi_cvt(vi_srli(q0, 6)), vloadu(xh + 96));
                s3 = vmul(vi_cvt(vi_srli(q1, 6)), vloadu(xh + 112));
                a0 = vfma(vset1(dh[4]), s0, a0);
                a1 = vfma(vset1(dh[5]), s1, a1);
                a2 = vfma(vset1(dh[6]), s2, a2);
                a3 = vfma(vset1(dh[7]), s3, a3);
            }
        }
        y[r] = vhsum(vadd(vadd(a0, a1), vadd(a2, a3))) - kern_hsum8(am);
    }
}

/* IQ2_XXS block (256-bit integer ops, shared by both builds): from the 8 (a0, a1) pairs, the a0
 * words (grid indices) and the a1 words (sign indices, scale) in group order, and the 256-bit
 * sign mask returned (bit e = element e negative: ksigns bytes computed as 7-bit index |
 * parity << 7; byte k holds the signs of elements 8k..8k+7) */
static inline __attribute__((always_inline)) __m256i KSUF(iq2xxs_signs)(const uint8_t *qs, __m256i *a0, __m256i *a1) {
    const __m256i q0 = _mm256_loadu_si256((const __m256i *)qs);
    const __m256i q1 = _mm256_loadu_si256((const __m256i *)(qs + 32));
    const __m256i perm = _mm256_setr_epi32(1, 3, 5, 7, 0, 2, 4, 6);
    const __m256i t0 = _mm256_permutevar8x32_epi32(q0, perm);
    const __m256i t1 = _mm256_permutevar8x32_epi32(q1, perm);
    *a1 = _mm256_permute2x128_si256(t0, t1, 0x20);
    *a0 = _mm256_permute2x128_si256(t0, t1, 0x31);
    /* the four 7-bit sign indices of each a1 into its four bytes */
    __m256i s = _mm256_and_si256(*a1, _mm256_set1_epi32(0x7F));
    s = _mm256_or_si256(s, _mm256_and_si256(_mm256_slli_epi32(*a1, 1), _mm256_set1_epi32(0x7F00)));
    s = _mm256_or_si256(s, _mm256_and_si256(_mm256_slli_epi32(*a1, 2), _mm256_set1_epi32(0x7F0000)));
    s = _mm256_or_si256(s, _mm256_and_si256(_mm256_slli_epi32(*a1, 3), _mm256_set1_epi32(0x7F000000)));
    /* parity of each byte into its bit 0 (bits shifted in from the next byte stay above bit 3) */
    __m256i p = _mm256_xor_si256(s, _mm256_srli_epi32(s, 4));
    p = _mm256_xor_si256(p, _mm256_srli_epi32(p, 2));
    p = _mm256_xor_si256(p, _mm256_srli_epi32(p, 1));
    return _mm256_or_si256(s, _mm256_slli_epi32(_mm256_and_si256(p, _mm256_set1_epi8(1)), 7));
}

/* IQ2_XXS block preparation for the float kernels: the 32 grid indices (as row offsets), the
 * sign mask (iq2xxs_signs) and the 8 sub-block scales db. */
static inline __attribute__((always_inline)) void KSUF(iq2xxs_prep)(const uint8_t *qs, float d, uint32_t *goff,
                                                                   uint8_t *signs, float *db, const int with_goff) {
    __m256i a0, a1;
    _mm256_storeu_si256((__m256i *)signs, KSUF(iq2xxs_signs)(qs, &a0, &a1));
    /* grid row offsets in 8-byte units (row g = 32 bytes = 4 units), element order */
    if (with_goff) {
    const __m128i a0l = _mm256_castsi256_si128(a0), a0h = _mm256_extracti128_si256(a0, 1);
    _mm256_storeu_si256((__m256i *)goff, _mm256_slli_epi32(_mm256_cvtepu8_epi32(a0l), 2));
    _mm256_storeu_si256((__m256i *)(goff + 8), _mm256_slli_epi32(_mm256_cvtepu8_epi32(_mm_srli_si128(a0l, 8)), 2));
    _mm256_storeu_si256((__m256i *)(goff + 16), _mm256_slli_epi32(_mm256_cvtepu8_epi32(a0h), 2));
    _mm256_storeu_si256((__m256i *)(goff + 24), _mm256_slli_epi32(_mm256_cvtepu8_epi32(_mm_srli_si128(a0h, 8)), 2));
    }
    /* db = d * (0.5 + (a1 >> 28)) * 0.25 */
    __m256 f = _mm256_cvtepi32_ps(_mm256_srli_epi32(a1, 28));
    f = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(d), _mm256_add_ps(_mm256_set1_ps(0.5f), f)), _mm256_set1_ps(0.25f));
    _mm256_storeu_ps(db, f);
}

/* y = sum_b sum_ib db_ib * (grid . (+-x_ib)): the grid as floats (8 KiB table), the signs
 * applied to x as a lane mask */
static void KSUF(mv1_iq2_xxs)(const uint8_t *W, ptrdiff_t stride, int64_t n, int64_t r0, int64_t r1,
                              const float *x, const float *aux, float *y) {
    (void)aux;
    const int64_t nb = n / 256;
    const char *G = (const char *)kern_iq2xxs_gridf; /* 32 bytes per grid row */
    /* two sets of prepared tables: block b+1 is prepared while block b is multiplied (the grid
     * offsets come straight from the a0 words: shifts on the integer ports, not loads) */
    uint8_t signs[2][32] __attribute__((aligned(32)));
    float db[2][8] __attribute__((aligned(32)));
#define GROW(a, l) ((const float *)(G + ((size_t)(((a) >> (8 * (l))) & 0xFF) << 5)))
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = W + r * stride;
        V16 a0 = vzero(), a1 = vzero();
        if (nb) KSUF(iq2xxs_prep)(row + 2, KERN_F16(kern_rd16(row)), NULL, signs[0], db[0], 0);
        for (int64_t b = 0; b < nb; b++) {
            const int cur = (int)(b & 1);
            if (b + 1 < nb) {
                const uint8_t *nx = row + 66 * (b + 1);
                KSUF(iq2xxs_prep)(nx + 2, KERN_F16(kern_rd16(nx)), NULL, signs[cur ^ 1], db[cur ^ 1], 0);
            }
            /* read the prepared tables back from memory (scalar loads), not lane by lane out of
             * the vector registers that built them */
            __asm__ volatile("" ::: "memory");
            PF2(row + 66 * b);
            const uint8_t *qs = row + 66 * b + 2;
            const float *xb = x + 256 * b;
            for (int ib = 0; ib < 8; ib += 2) {
                const uint32_t A = kern_rd32(qs + 8 * ib), B = kern_rd32(qs + 8 * ib + 8);
                const uint8_t *sg = signs[cur] + 4 * ib;
                const float *xi = xb + 32 * ib;
                V16 t0 = vmul(v_2x8(GROW(A, 0), GROW(A, 1)), v_flip16(vloadu(xi), sg));
                V16 t1 = vmul(v_2x8(GROW(B, 0), GROW(B, 1)), v_flip16(vloadu(xi + 32), sg + 4));
                t0 = vfma(v_2x8(GROW(A, 2), GROW(A, 3)), v_flip16(vloadu(xi + 16), sg + 2), t0);
                t1 = vfma(v_2x8(GROW(B, 2), GROW(B, 3)), v_flip16(vloadu(xi + 48), sg + 6), t1);
                a0 = vfma(vset1(db[cur][ib]), t0, a0);
                a1 = vfma(vset1(db[cur][ib + 1]), t1, a1);
            }
        }
        y[r] = vhsum(vadd(a0, a1));
    }
#undef GROW
}

/* ------------------------------------------------------------------------------------------ */
/* Exact SIMD dequantizers for the formats the auto-vectorizer does badly (the panel path decodes
 * with these).  Same float32 operations, in the same order, as kern_dequant_body.h / quants.py:
 * separate multiplies and subtractions, never fused. */

static void KSUF(dqs_q2_k)(const uint8_t *src, float *dst, int64_t n) {
    float dl[16] __attribute__((aligned(64))), ml[16] __attribute__((aligned(64)));
    const __m128i m4 = _mm_set1_epi8(15);
    for (int64_t b = 0; b < n / 256; b++) {
        const uint8_t *blk = src + 84 * b;
        PF2(blk);
        const __m128i sc = _mm_loadu_si128((const __m128i *)blk);
        vstoreu(dl, vmul(vset1(KERN_F16(kern_rd16(blk + 80))), v_u8x16(_mm_and_si128(sc, m4))));
        vstoreu(ml, vmul(vset1(KERN_F16(kern_rd16(blk + 82))), v_u8x16(_mm_and_si128(_mm_srli_epi16(sc, 4), m4))));
        __asm__ volatile("" ::: "memory");
        const uint8_t *qs = blk + 16;
        float *o = dst + 256 * b;
        for (int h = 0; h < 2; h++) {
            const V16I q0 = vi_u8x16_mem(qs + 32 * h), q1 = vi_u8x16_mem(qs + 32 * h + 16);
            float *oh = o + 128 * h;
            const float *dh = dl + 8 * h, *mh = ml + 8 * h;
            vstoreu(oh, vsub(vmul(vset1(dh[0]), vi_cvt(vi_and(q0, 3))), vset1(mh[0])));
            vstoreu(oh + 16, vsub(vmul(vset1(dh[1]), vi_cvt(vi_and(q1, 3))), vset1(mh[1])));
            vstoreu(oh + 32, vsub(vmul(vset1(dh[2]), vi_cvt(vi_and(vi_srli(q0, 2), 3))), vset1(mh[2])));
            vstoreu(oh + 48, vsub(vmul(vset1(dh[3]), vi_cvt(vi_and(vi_srli(q1, 2), 3))), vset1(mh[3])));
            vstoreu(oh + 64, vsub(vmul(vset1(dh[4]), vi_cvt(vi_and(vi_srli(q0, 4), 3))), vset1(mh[4])));
            vstoreu(oh + 80, vsub(vmul(vset1(dh[5]), vi_cvt(vi_and(vi_srli(q1, 4), 3))), vset1(mh[5])));
            vstoreu(oh + 96, vsub(vmul(vset1(dh[6]), vi_cvt(vi_srli(q0, 6))), vset1(mh[6])));
            vstoreu(oh + 112, vsub(vmul(vset1(dh[7]), vi_cvt(vi_srli(q1, 6))), vset1(mh[7])));
        }
    }
}

static void KSUF(dqs_q4_k)(const uint8_t *src, float *dst, int64_t n) {
    float dl[8] __attribute__((aligned(32))), ml[8] __attribute__((aligned(32)));
    for (int64_t b = 0; b < n / 256; b++) {
        const uint8_t *blk = src + 144 * b;
        PF2(blk);
        PF1(blk + 128);
        uint8_t sc[8], mn[8];
        kern_q4_k_scale_min(blk + 4, sc, mn);
        const __m256 d = _mm256_set1_ps(KERN_F16(kern_rd16(blk)));
        const __m256 dmin = _mm256_set1_ps(KERN_F16(kern_rd16(blk + 2)));
        _mm256_storeu_ps(dl, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)sc)))));
        _mm256_storeu_ps(ml, _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)mn)))));
        __asm__ volatile("" ::: "memory");
        const uint8_t *qs = blk + 16;
        float *o = dst + 256 * b;
        for (int p = 0; p < 4; p++) {
            const V16I b0 = vi_u8x16_mem(qs + 32 * p), b1 = vi_u8x16_mem(qs + 32 * p + 16);
            float *op = o + 64 * p;
            const V16 a0 = vset1(dl[2 * p]), m0 = vset1(ml[2 * p]);
            const V16 a1 = vset1(dl[2 * p + 1]), m1 = vset1(ml[2 * p + 1]);
            vstoreu(op, vsub(vmul(a0, vi_cvt(vi_and(b0, 15))), m0));
            vstoreu(op + 16, vsub(vmul(a0, vi_cvt(vi_and(b1, 15))), m0));
            vstoreu(op + 32, vsub(vmul(a1, vi_cvt(vi_srli(b0, 4))), m1));
            vstoreu(op + 48, vsub(vmul(a1, vi_cvt(vi_srli(b1, 4))), m1));
        }
    }
}

static void KSUF(dqs_iq2_xxs)(const uint8_t *src, float *dst, int64_t n) {
    const double *G = (const double *)kern_iq2xxs_gridf;
    uint32_t goff[2][32] __attribute__((aligned(32)));
    uint8_t signs[2][32] __attribute__((aligned(32)));
    float db[2][8] __attribute__((aligned(32)));
    const int64_t nb = n / 256;
    if (nb) KSUF(iq2xxs_prep)(src + 2, KERN_F16(kern_rd16(src)), goff[0], signs[0], db[0], 1);
    for (int64_t b = 0; b < nb; b++) {
        const int cur = (int)(b & 1);
        if (b + 1 < nb) {
            const uint8_t *nx = src + 66 * (b + 1);
            KSUF(iq2xxs_prep)(nx + 2, KERN_F16(kern_rd16(nx)), goff[cur ^ 1], signs[cur ^ 1], db[cur ^ 1], 1);
        }
        __asm__ volatile("" ::: "memory");
        PF2(src + 66 * b);
        float *o = dst + 256 * b;
        for (int ib = 0; ib < 8; ib++) {
            const uint32_t *g = goff[cur] + 4 * ib;
            const uint8_t *sg = signs[cur] + 4 * ib;
            const V16 dv = vset1(db[cur][ib]);
            vstoreu(o + 32 * ib, vmul(dv, v_flip16(v_2x8((const float *)(G + g[0]), (const float *)(G + g[1])), sg)));
            vstoreu(o + 32 * ib + 16, vmul(dv, v_flip16(v_2x8((const float *)(G + g[2]), (const float *)(G + g[3])), sg + 2)));
        }
    }
}

static void KSUF(dqs_mxfp4)(const uint8_t *src, float *dst, int64_t n) {
    const __m128i kv = _mm_loadu_si128((const __m128i *)kern_mxfp4_kvalues);
    const __m128i m4 = _mm_set1_epi8(15);
    for (int64_t b = 0; b < n / 32; b++) {
        const uint8_t *blk = src + 17 * b;
        if (!(b & 3)) PF2(blk);
        const V16 d = vset1(kern_e8m0_tab[blk[0]]);
        const __m128i q = _mm_loadu_si128((const __m128i *)(blk + 1));
        vstoreu(dst + 32 * b, vmul(d, v_i8x16(_mm_shuffle_epi8(kv, _mm_and_si128(q, m4)))));
        vstoreu(dst + 32 * b + 16, vmul(d, v_i8x16(_mm_shuffle_epi8(kv, _mm_and_si128(_mm_srli_epi16(q, 4), m4)))));
    }
}

/* ------------------------------------------------------------------------------------------ */
/* Small T ("mvt"): every row is decoded in registers, 32 values at a time, to its exact weights,
 * which are multiplied into up to MVT_NT tokens at once (more tokens: the row, by then in L1, is
 * decoded again for the next group of tokens; it is read from memory once). */

#define AI static inline __attribute__((always_inline))

/* acc[t] += w0 * x_t[k..k+15], then w1 * x_t[k+16..k+31], for the NT tokens in float64: per
 * token two accumulators (lanes 0-7 and 8-15 of every 16 values), k ascending 16 at a time, then
 * vdhsum of their sum -- the order of the panel's register tiles, so that both paths give every
 * (row, token) the same float32 result (batch invariance) */
#define MVT_FMA32(k)                                                                              \
    do {                                                                                          \
        const VD8 w0l_ = vd_lo(w0), w0h_ = vd_hi(w0), w1l_ = vd_lo(w1), w1h_ = vd_hi(w1);         \
        _Pragma("GCC unroll 4") for (int t_ = 0; t_ < NT; t_++) {                                 \
            const float *xk_ = x + t_ * ldx + (k);                                                \
            acc[t_][0] = vdfma(w0l_, vdloadf(xk_), acc[t_][0]);                                   \
            acc[t_][1] = vdfma(w0h_, vdloadf(xk_ + 8), acc[t_][1]);                               \
            acc[t_][0] = vdfma(w1l_, vdloadf(xk_ + 16), acc[t_][0]);                              \
            acc[t_][1] = vdfma(w1h_, vdloadf(xk_ + 24), acc[t_][1]);                              \
        }                                                                                         \
    } while (0)

#define MVT_BEGIN                                                                                 \
    VD8 acc[4][2];                                                                                \
    _Pragma("GCC unroll 4") for (int t_ = 0; t_ < NT; t_++) acc[t_][0] = acc[t_][1] = vdzero();

#define MVT_END                                                                                   \
    _Pragma("GCC unroll 4") for (int t_ = 0; t_ < NT; t_++) res[t_] = vdhsum(vdadd(acc[t_][0], acc[t_][1]));

/* plain formats: LOAD16(p) decodes 16 values at byte p; ES = bytes per value; SCALAR(p) one value */
#define KERN_DEF_MVT_PLAIN(fmt, ES, LOAD16, SCALAR)                                               \
    AI void KSUF(mvt_row_##fmt)(const uint8_t *w, int64_t n, const float *x, int64_t ldx, double *res, const int NT) { \
        MVT_BEGIN                                                                                 \
        int64_t k = 0;                                                                            \
        for (; k + 32 <= n; k += 32) {                                                            \
            PFP1(w + (ES) * k);                                                                   \
            if ((ES) == 4) PFP1(w + (ES) * k + 64);                                               \
            const V16 w0 = LOAD16(w + (ES) * k), w1 = LOAD16(w + (ES) * (k + 16));                \
            MVT_FMA32(k);                                                                         \
        }                                                                                         \
        for (; k + 16 <= n; k += 16) {                                                            \
            const V16 w0 = LOAD16(w + (ES) * k);                                                  \
            const VD8 wl_ = vd_lo(w0), wh_ = vd_hi(w0);                                           \
            _Pragma("GCC unroll 4") for (int t_ = 0; t_ < NT; t_++) {                             \
                acc[t_][0] = vdfma(wl_, vdloadf(x + t_ * ldx + k), acc[t_][0]);                   \
                acc[t_][1] = vdfma(wh_, vdloadf(x + t_ * ldx + k + 8), acc[t_][1]);               \
            }                                                                                     \
        }                                                                                         \
        MVT_END                                                                                   \
        for (; k < n; k++) {                                                                      \
            const double wk = SCALAR(w + (ES) * k);                                               \
            for (int t_ = 0; t_ < NT; t_++) res[t_] += wk * x[t_ * ldx + k];                      \
        }                                                                                         \
    }

KERN_DEF_MVT_PLAIN(f32, 4, vloadu, KERN_F32_AT)
KERN_DEF_MVT_PLAIN(f16, 2, v_f16, KERN_F16_AT)
KERN_DEF_MVT_PLAIN(bf16, 2, v_bf16, KERN_BF16_AT)

AI void KSUF(mvt_row_q8_0)(const uint8_t *row, int64_t n, const float *x, int64_t ldx, double *res, const int NT) {
    MVT_BEGIN
    for (int64_t b = 0; b < n / 32; b++) {
        const uint8_t *q = row + 34 * b;
        if (!(b & 1)) PF2(q);
        const V16 d = vset1(KERN_F16(kern_rd16(q)));
        const V16 w0 = vmul(v_i8x16(_mm_loadu_si128((const __m128i *)(q + 2))), d);
        const V16 w1 = vmul(v_i8x16(_mm_loadu_si128((const __m128i *)(q + 18))), d);
        MVT_FMA32(32 * b);
    }
    MVT_END
}

AI void KSUF(mvt_row_mxfp4)(const uint8_t *row, int64_t n, const float *x, int64_t ldx, double *res, const int NT) {
    const __m128i kv = _mm_loadu_si128((const __m128i *)kern_mxfp4_kvalues);
    const __m128i m4 = _mm_set1_epi8(15);
    MVT_BEGIN
    for (int64_t b = 0; b < n / 32; b++) {
        const uint8_t *blk = row + 17 * b;
        if (!(b & 3)) PF2(blk);
        const V16 d = vset1(kern_e8m0_tab[blk[0]]);
        const __m128i q = _mm_loadu_si128((const __m128i *)(blk + 1));
        const V16 w0 = vmul(v_i8x16(_mm_shuffle_epi8(kv, _mm_and_si128(q, m4))), d);
        const V16 w1 = vmul(v_i8x16(_mm_shuffle_epi8(kv, _mm_and_si128(_mm_srli_epi16(q, 4), m4))), d);
        MVT_FMA32(32 * b);
    }
    MVT_END
}

AI void KSUF(mvt_row_q4_k)(const uint8_t *row, int64_t n, const float *x, int64_t ldx, double *res, const int NT) {
    float dl[8] __attribute__((aligned(32))), ml[8] __attribute__((aligned(32)));
    MVT_BEGIN
    for (int64_t b = 0; b < n / 256; b++) {
        const uint8_t *blk = row + 144 * b;
        PF2(blk);
        PF1(blk + 128);
        uint8_t sc[8], mn[8];
        kern_q4_k_scale_min(blk + 4, sc, mn);
        _mm256_storeu_ps(dl, _mm256_mul_ps(_mm256_set1_ps(KERN_F16(kern_rd16(blk))),
                                           _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)sc)))));
        _mm256_storeu_ps(ml, _mm256_mul_ps(_mm256_set1_ps(KERN_F16(kern_rd16(blk + 2))),
                                           _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)mn)))));
        __asm__ volatile("" ::: "memory");
        const uint8_t *qs = blk + 16;
        for (int p = 0; p < 4; p++) {
            const V16I b0 = vi_u8x16_mem(qs + 32 * p), b1 = vi_u8x16_mem(qs + 32 * p + 16);
            {
                const V16 a = vset1(dl[2 * p]), m = vset1(ml[2 * p]);
                const V16 w0 = vsub(vmul(a, vi_cvt(vi_and(b0, 15))), m);
                const V16 w1 = vsub(vmul(a, vi_cvt(vi_and(b1, 15))), m);
                MVT_FMA32(256 * b + 64 * p);
            }
            {
                const V16 a = vset1(dl[2 * p + 1]), m = vset1(ml[2 * p + 1]);
                const V16 w0 = vsub(vmul(a, vi_cvt(vi_srli(b0, 4))), m);
                const V16 w1 = vsub(vmul(a, vi_cvt(vi_srli(b1, 4))), m);
                MVT_FMA32(256 * b + 64 * p + 32);
            }
        }
    }
    MVT_END
}

AI void KSUF(mvt_row_q2_k)(const uint8_t *row, int64_t n, const float *x, int64_t ldx, double *res, const int NT) {
    float dl[16] __attribute__((aligned(64))), ml[16] __attribute__((aligned(64)));
    const __m128i m4 = _mm_set1_epi8(15);
    MVT_BEGIN
    for (int64_t b = 0; b < n / 256; b++) {
        const uint8_t *blk = row + 84 * b;
        PF2(blk);
        const __m128i sc = _mm_loadu_si128((const __m128i *)blk);
        vstoreu(dl, vmul(vset1(KERN_F16(kern_rd16(blk + 80))), v_u8x16(_mm_and_si128(sc, m4))));
        vstoreu(ml, vmul(vset1(KERN_F16(kern_rd16(blk + 82))), v_u8x16(_mm_and_si128(_mm_srli_epi16(sc, 4), m4))));
        __asm__ volatile("" ::: "memory");
        const uint8_t *qs = blk + 16;
        for (int h = 0; h < 2; h++) {
            const V16I q0 = vi_u8x16_mem(qs + 32 * h), q1 = vi_u8x16_mem(qs + 32 * h + 16);
            _Pragma("GCC unroll 4") for (int j = 0; j < 4; j++) {
                const int s0 = 8 * h + 2 * j;
                const V16 w0 = vsub(vmul(vset1(dl[s0]), vi_cvt(vi_and(vi_srli(q0, 2 * j), 3))), vset1(ml[s0]));
                const V16 w1 = vsub(vmul(vset1(dl[s0 + 1]), vi_cvt(vi_and(vi_srli(q1, 2 * j), 3))), vset1(ml[s0 + 1]));
                MVT_FMA32(256 * b + 128 * h + 32 * j);
            }
        }
    }
    MVT_END
}

AI void KSUF(mvt_row_iq2_xxs)(const uint8_t *row, int64_t n, const float *x, int64_t ldx, double *res, const int NT) {
    const double *G = (const double *)kern_iq2xxs_gridf;
    uint32_t goff[2][32] __attribute__((aligned(32)));
    uint8_t signs[2][32] __attribute__((aligned(32)));
    float db[2][8] __attribute__((aligned(32)));
    const int64_t nb = n / 256;
    MVT_BEGIN
    if (nb) KSUF(iq2xxs_prep)(row + 2, KERN_F16(kern_rd16(row)), goff[0], signs[0], db[0], 1);
    for (int64_t b = 0; b < nb; b++) {
        const int cur = (int)(b & 1);
        if (b + 1 < nb) {
            const uint8_t *nx = row + 66 * (b + 1);
            KSUF(iq2xxs_prep)(nx + 2, KERN_F16(kern_rd16(nx)), goff[cur ^ 1], signs[cur ^ 1], db[cur ^ 1], 1);
        }
        __asm__ volatile("" ::: "memory");
        PF2(row + 66 * b);
        for (int ib = 0; ib < 8; ib++) {
            const uint32_t *g = goff[cur] + 4 * ib;
            const uint8_t *sg = signs[cur] + 4 * ib;
            const V16 dv = vset1(db[cur][ib]);
            const V16 w0 = vmul(dv, v_flip16(v_2x8((const float *)(G + g[0]), (const float *)(G + g[1])), sg));
            const V16 w1 = vmul(dv, v_flip16(v_2x8((const float *)(G + g[2]), (const float *)(G + g[3])), sg + 2));
            MVT_FMA32(256 * b + 32 * ib);
        }
    }
    MVT_END
}

/* rows r0..r1-1, all T tokens: y[t*ldy + r] */
#define KERN_DEF_MVT(fmt)                                                                         \
    static void KSUF(mvt_##fmt)(const uint8_t *W, ptrdiff_t stride, int64_t n, int64_t r0, int64_t r1, \
                                const float *x, int64_t T, float *y, int64_t ldy) {               \
        for (int64_t r = r0; r < r1; r++) {                                                       \
            const uint8_t *row = W + r * stride;                                                  \
            for (int64_t t = 0; t < T; t += MVT_NT) {                                             \
                double res[4] = {0.0, 0.0, 0.0, 0.0};                                             \
                const int nt = T - t < MVT_NT ? (int)(T - t) : MVT_NT;                            \
                const float *xt = x + t * n;                                                      \
                switch (nt) {                                                                     \
                case 1: KSUF(mvt_row_##fmt)(row, n, xt, n, res, 1); break;                        \
                case 2: KSUF(mvt_row_##fmt)(row, n, xt, n, res, 2); break;                        \
                MVT_CASES34(fmt)                                                                  \
                }                                                                                 \
                for (int tt = 0; tt < nt; tt++) y[(t + tt) * ldy + r] = (float)res[tt];           \
            }                                                                                     \
        }                                                                                         \
    }

KERN_DEF_MVT(f32)
KERN_DEF_MVT(f16)
KERN_DEF_MVT(bf16)
KERN_DEF_MVT(q8_0)
KERN_DEF_MVT(mxfp4)
KERN_DEF_MVT(q4_k)
KERN_DEF_MVT(q2_k)
KERN_DEF_MVT(iq2_xxs)

/* ------------------------------------------------------------------------------------------ */
/* T >= 2: decoded panel x register tiles */

/* res[i*NT + t] = w_i . x_t over the first n16 values (a multiple of 16), in float64: the panel's
 * rows as doubles (ldw apart), x as floats; per (row, token) two accumulators (lanes 0-7 and 8-15
 * of every 16 values), k ascending, as MVT_FMA32 (batch invariance) */
#define KERN_DEF_DTILE(name, NR, NT)                                                                \
    static inline __attribute__((always_inline)) void KSUF(dtile_##name)(                            \
        const double *w, int64_t ldw, const float *x, int64_t ldx, int64_t n16, double *res) {       \
        VD8 acc[NR][NT][2];                                                                         \
        _Pragma("GCC unroll 8") for (int i = 0; i < NR; i++)                                        \
            _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) acc[i][t][0] = acc[i][t][1] = vdzero(); \
        for (int64_t k = 0; k < n16; k += 16) {                                                     \
            VD8 xl[NT], xh[NT];                                                                     \
            _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) {                                  \
                xl[t] = vdloadf(x + t * ldx + k);                                                   \
                xh[t] = vdloadf(x + t * ldx + k + 8);                                               \
            }                                                                                       \
            _Pragma("GCC unroll 8") for (int i = 0; i < NR; i++) {                                  \
                const VD8 wl = vdload(w + i * ldw + k), wh = vdload(w + i * ldw + k + 8);           \
                _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) {                              \
                    acc[i][t][0] = vdfma(wl, xl[t], acc[i][t][0]);                                  \
                    acc[i][t][1] = vdfma(wh, xh[t], acc[i][t][1]);                                  \
                }                                                                                   \
            }                                                                                       \
        }                                                                                           \
        _Pragma("GCC unroll 8") for (int i = 0; i < NR; i++)                                        \
            _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++)                                    \
                res[i * NT + t] = vdhsum(vdadd(acc[i][t][0], acc[i][t][1]));                        \
    }

KERN_DEF_DTILE(full1, DPR, 1)
KERN_DEF_DTILE(full2, DPR, 2)
KERN_DEF_DTILE(one1, 1, 1)
KERN_DEF_DTILE(one2, 1, 2)
#if DPT > 2
KERN_DEF_DTILE(full3, DPR, 3)
KERN_DEF_DTILE(one3, 1, 3)
#define KERN_DTILE3(kind, w, ldw, x, ldx, n16, res) case 3: KSUF(dtile_##kind##3)(w, ldw, x, ldx, n16, res); break;
#else
#define KERN_DTILE3(kind, w, ldw, x, ldx, n16, res)
#endif
#define KERN_DTILE_CALL(kind, nt, w, ldw, x, ldx, n16, res)                                         \
    switch (nt) {                                                                                   \
    case 1: KSUF(dtile_##kind##1)(w, ldw, x, ldx, n16, res); break;                                 \
    KERN_DTILE3(kind, w, ldw, x, ldx, n16, res)                                                     \
    default: KSUF(dtile_##kind##2)(w, ldw, x, ldx, n16, res); break;                                \
    }

/* the panel path (kern_panel_fn): rows decoded exactly (float32, dq) and widened to doubles once a
 * panel, every token's sums in float64; one rounding to float32 at the end of the row (or, for
 * column blocks, partial sums kept in yacc: mode 1 first block, 2 middle, 3 last) */
static void KSUF(panel)(kern_dq_fn dq, const uint8_t *W, ptrdiff_t stride, int64_t n_in, int64_t r0, int64_t r1,
                        const float *x, int64_t ldx, int64_t T, float *y, int64_t ldy, double *wbuf, double *yacc,
                        int mode) {
    const int64_t ldw = kern_ldw(n_in);
    const int64_t n16 = n_in & ~(int64_t)15;
    const int64_t pr = kern_panel_rows_d(DPR, n_in);
    float *stage = (float *)(wbuf + pr * ldw); /* one decoded row (kern_panel_scratch_d) */
    for (int64_t p0 = r0; p0 < r1; p0 += pr) {
        const int64_t np = p0 + pr < r1 ? pr : r1 - p0;
        for (int64_t i = 0; i < np; i++) {
            dq(W + (p0 + i) * stride, stage, n_in);
            double *wd = wbuf + i * ldw;
            for (int64_t k = 0; k < n_in; k++) wd[k] = stage[k];
        }
        for (int64_t t = 0; t < T; t += DPT) {
            const int nt = (int)(T - t < DPT ? T - t : DPT);
            const float *xt = x + t * ldx;
            for (int64_t i = 0; i < np; i += DPR) {
                const int nr = (int)(np - i < DPR ? np - i : DPR);
                const double *wp = wbuf + i * ldw;
                double res[DPR * DPT];
                if (nr == DPR) {
                    KERN_DTILE_CALL(full, nt, wp, ldw, xt, ldx, n16, res);
                } else {
                    for (int ii = 0; ii < nr; ii++)
                        KERN_DTILE_CALL(one, nt, wp + ii * ldw, ldw, xt, ldx, n16, res + ii * nt);
                }
                for (int ii = 0; ii < nr; ii++) {
                    for (int tt = 0; tt < nt; tt++) {
                        double s = res[ii * nt + tt];
                        const double *wr = wp + ii * ldw;
                        const float *xr = xt + tt * ldx;
                        for (int64_t k = n16; k < n_in; k++) s += wr[k] * xr[k];
                        const int64_t o = (t + tt) * ldy + p0 + i + ii;
                        if (mode == 0)
                            y[o] = (float)s;
                        else if (mode == 1)
                            yacc[o] = s;
                        else if (mode == 2)
                            yacc[o] += s;
                        else
                            y[o] = (float)(yacc[o] + s);
                    }
                }
            }
        }
    }
}

/* ---- attention of one query (NumpyOps.attention's math: float64 throughout, one rounding of the
 * output; exp in double per score). Register tiles of 4 heads x 4 keys (scores) and 4 heads x 32
 * values (weighted sum); a key is widened to doubles in registers once a tile. Heads h0..h1-1, any
 * number: the keys are taken a chunk of KERN_ATTN_KC at a time (128 KiB at D 512, in L2) by every
 * group of 4 heads in turn, so a call reads its keys from L3 or memory twice (scores, sum) however
 * many heads it has, where one call per 4 heads read them twice per 4 heads (at 2176 keys, 4.25 MiB,
 * that was half the time). Each score and each output value is summed in the order it always was
 * (d ascending in 8 lanes, then vdhsum; keys 0..n-1: the output sums wait in acc between chunks),
 * so the bits depend on neither the chunking nor the heads a call takes. ---- */

/* scores s[h][k] = (q_h . key_k) * scale, as the reference's einsum then * scale, for 4 heads
 * (qg: their queries as doubles, row stride D; the first nh kept; sg: row stride n) over nc keys */
KI void KSUF(attn_scores4)(const double *qg, int64_t D, int nh, const float *const *keys, int64_t nc,
                           double scale, double *sg, int64_t n) {
    const int64_t D8 = D / 8 * 8;
    for (int64_t k0 = 0; k0 < nc; k0 += 4) {
        const int nk = nc - k0 < 4 ? (int)(nc - k0) : 4;
        const float *kp[4]; /* missing keys repeat the first one; their scores are dropped */
        for (int j = 0; j < 4; j++) kp[j] = keys[k0 + (j < nk ? j : 0)];
        VD8 acc[4][4];
        for (int h = 0; h < 4; h++)
            for (int j = 0; j < 4; j++) acc[h][j] = vdzero();
        for (int64_t d = 0; d < D8; d += 8) {
            VD8 kv[4];
            for (int j = 0; j < 4; j++) kv[j] = vdloadf(kp[j] + d);
            for (int h = 0; h < 4; h++) {
                const VD8 qv = vdload(qg + h * D + d);
                for (int j = 0; j < 4; j++) acc[h][j] = vdfma(qv, kv[j], acc[h][j]);
            }
        }
        for (int h = 0; h < nh; h++)
            for (int j = 0; j < nk; j++) {
                double sc = vdhsum(acc[h][j]);
                for (int64_t d = D8; d < D; d++) sc += qg[h * D + d] * kp[j][d];
                sg[h * n + k0 + j] = sc * scale;
            }
    }
}

/* ag[h][d] += sum over nc keys of p[h][k] key_k[d], d < D8, for 4 heads (pg: their weights at the
 * chunk's first key, row stride n; ag: row stride D): 4 heads x 32 values per pass, then 8 */
KI void KSUF(attn_wsum4)(const double *pg, int64_t n, const float *const *keys, int64_t nc, int64_t D8, double *ag,
                         int64_t D) {
    int64_t d = 0;
    for (; d + 32 <= D8; d += 32) {
        VD8 acc[4][4];
        for (int h = 0; h < 4; h++)
            for (int c = 0; c < 4; c++) acc[h][c] = vdload(ag + h * D + d + 8 * c);
        for (int64_t k = 0; k < nc; k++) {
            VD8 kv[4];
            for (int c = 0; c < 4; c++) kv[c] = vdloadf(keys[k] + d + 8 * c);
            for (int h = 0; h < 4; h++) {
                const VD8 p = vdset1(pg[h * n + k]);
                for (int c = 0; c < 4; c++) acc[h][c] = vdfma(p, kv[c], acc[h][c]);
            }
        }
        for (int h = 0; h < 4; h++)
            for (int c = 0; c < 4; c++) vdstore(ag + h * D + d + 8 * c, acc[h][c]);
    }
    for (; d < D8; d += 8) {
        VD8 acc[4];
        for (int h = 0; h < 4; h++) acc[h] = vdload(ag + h * D + d);
        for (int64_t k = 0; k < nc; k++) {
            const VD8 kv = vdloadf(keys[k] + d);
            for (int h = 0; h < 4; h++) acc[h] = vdfma(vdset1(pg[h * n + k]), kv, acc[h]);
        }
        for (int h = 0; h < 4; h++) vdstore(ag + h * D + d, acc[h]);
    }
}

static void KSUF(attn_query)(const float *q, int64_t D, int64_t h0, int64_t h1, const float *const *keys, int64_t n,
                             const float *sinks, double scale, float *out, double *sbuf) {
    const int nh = (int)(h1 - h0), ng = (nh + 3) / 4, nhp = 4 * ng;
    const int64_t D8 = D / 8 * 8;
    double *sc = sbuf;          /* scores, then weights [nhp][n] (padding heads: weights 0) */
    double *qd = sc + nhp * n;  /* the queries as doubles [nhp][D] (padding heads repeat h0's) */
    double *acc = qd + nhp * D; /* the output's sums [nhp][D] (d < D8) */
    double *den = acc + nhp * D;
    for (int h = 0; h < nhp; h++) {
        const float *qh = q + (h0 + (h < nh ? h : 0)) * D;
        for (int64_t d = 0; d < D; d++) qd[h * D + d] = qh[d];
    }
    for (int64_t c0 = 0; c0 < n; c0 += KERN_ATTN_KC) {
        const int64_t nc = n - c0 < KERN_ATTN_KC ? n - c0 : KERN_ATTN_KC;
        for (int g = 0; g < ng; g++)
            KSUF(attn_scores4)(qd + 4 * g * D, D, nh - 4 * g < 4 ? nh - 4 * g : 4, keys + c0, nc, scale,
                               sc + 4 * g * n + c0, n);
    }
    /* softmax with the sink in the denominator */
    for (int h = 0; h < nh; h++) {
        double *sh = sc + h * n;
        const double sink = sinks[h0 + h];
        double m = sink;
        for (int64_t k = 0; k < n; k++) m = sh[k] > m ? sh[k] : m;
        double dsum = exp(sink - m);
        for (int64_t k = 0; k < n; k++) {
            sh[k] = exp(sh[k] - m);
            dsum += sh[k];
        }
        den[h] = dsum;
    }
    for (int h = nh; h < nhp; h++)
        for (int64_t k = 0; k < n; k++) sc[h * n + k] = 0.0;
    /* out_h = sum_k p[h][k] key_k / den_h, rounded to float32 once */
    for (int h = 0; h < nhp; h++)
        for (int64_t d = 0; d < D8; d++) acc[h * D + d] = 0.0;
    for (int64_t c0 = 0; c0 < n; c0 += KERN_ATTN_KC) {
        const int64_t nc = n - c0 < KERN_ATTN_KC ? n - c0 : KERN_ATTN_KC;
        for (int g = 0; g < ng; g++) KSUF(attn_wsum4)(sc + 4 * g * n + c0, n, keys + c0, nc, D8, acc + 4 * g * D, D);
    }
    for (int h = 0; h < nh; h++) {
        float *o = out + (h0 + h) * D;
        for (int64_t d = 0; d < D8; d++) o[d] = (float)(acc[h * D + d] / den[h]);
        for (int64_t dd = D8; dd < D; dd++) {
            double a = 0.0;
            for (int64_t k = 0; k < n; k++) a += sc[h * n + k] * keys[k][dd];
            o[dd] = (float)(a / den[h]);
        }
    }
}

static void KSUF(fill_simd)(kern_isa *k) {
    k->attn = KSUF(attn_query);
    k->mv1[KT_F32] = KSUF(mv1_f32);
    k->mv1[KT_F16] = KSUF(mv1_f16);
    k->mv1[KT_BF16] = KSUF(mv1_bf16);
    k->mv1[KT_Q8_0] = KSUF(mv1_q8_0);
    k->mv1[KT_Q2_K] = KSUF(mv1_q2_k);
    k->mv1[KT_Q4_K] = KSUF(mv1_q4_k);
    k->mv1[KT_IQ2_XXS] = KSUF(mv1_iq2_xxs);
    k->mv1[KT_MXFP4] = KSUF(mv1_mxfp4);
    k->dq[KT_Q2_K] = KSUF(dqs_q2_k);
    k->dq[KT_Q4_K] = KSUF(dqs_q4_k);
    k->dq[KT_IQ2_XXS] = KSUF(dqs_iq2_xxs);
    k->dq[KT_MXFP4] = KSUF(dqs_mxfp4);
    k->mvt[KT_F32] = KSUF(mvt_f32);
    k->mvt[KT_F16] = KSUF(mvt_f16);
    k->mvt[KT_BF16] = KSUF(mvt_bf16);
    k->mvt[KT_Q8_0] = KSUF(mvt_q8_0);
    k->mvt[KT_Q2_K] = KSUF(mvt_q2_k);
    k->mvt[KT_Q4_K] = KSUF(mvt_q4_k);
    k->mvt[KT_IQ2_XXS] = KSUF(mvt_iq2_xxs);
    k->mvt[KT_MXFP4] = KSUF(mvt_mxfp4);
    for (int t = 0; t < KT_MAX; t++) k->mvt_max[t] = MVT_T_MAX;
    k->panel = KSUF(panel);
    k->panel_rows = DPR;
}
