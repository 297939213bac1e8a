/* Integer-activation kernels (ds4 numerics; kern_q8.c has the quantizers and the portable
 * versions), 256-bit integer SIMD shared by the AVX2 and AVX-512 builds.  The including file
 * defines KSUF and Q8_DOT_U8S8(acc, u, s): acc (8 x int32) += the sums of 4 products of unsigned
 * bytes u with signed bytes s (AVX-512 VNNI: one vpdpbusd; AVX2: maddubs + madd).
 *
 * A weight block is decoded to bytes in registers once and multiplied into up to Q8_NT tokens'
 * int8 codes; the integer sums are exact, and each block's integer goes into float32 as ds4's CPU
 * path takes it (kern_q8.c): times the float32 product of the weight and activation scales, added
 * to a float32 accumulator in block order -- whatever order the lanes took the integer products in,
 * the float32 steps are those of the reference (engine/model/ds4_matmul.py), bit for bit.  Signed
 * weights (Q8_0) use |w| as the unsigned operand and
 * move the sign onto the activation (sign_epi8); activation codes are never -128 (the quantizers
 * scale the block maximum to 127 and clamp to [-127, 127]: a block whose largest magnitude is below
 * about 3.7e-37, where 127 / max overflows to inf, gives +-127 and 0 for its zeros and NaNs, as
 * numerics._codes decides), so the sign move cannot overflow.  Every weight byte is read once per
 * call whatever T: the token loop runs inside the row, which stays in L1. */

#ifndef Q8_NT
#define Q8_NT 4 /* tokens per pass: 16 ymm registers (AVX2); the AVX-512 build takes 8 */
#endif

/* the sum of the 8 int32 lanes of a block's integer dot (exact: every block sum is below 2^31) */
KI int32_t q8_hsum(__m256i p) {
    __m128i h = _mm_add_epi32(_mm256_castsi256_si128(p), _mm256_extracti128_si256(p, 1));
    h = _mm_add_epi32(h, _mm_unpackhi_epi64(h, h));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 1));
    return _mm_cvtsi128_si32(h);
}

/* maddubs + madd with per-lane int16 multipliers (the sub-block scales) */
KI __m256i q8_dot_scaled(__m256i acc, __m256i u, __m256i s, __m256i sc16) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), sc16));
}

/* 8 blocks' int32 lanes -> one vector of the 8 block sums, in block order (exact integer sums:
 * unpacks pair the blocks' lanes, as q8_0_sum8 does in 512 bits).  Fed one block k of 8 at a time
 * (q8_sum8_add): block pairs are combined as they come, so only 4 partial vectors stay live;
 * q8_sum8_end gives the sums */
KI void q8_sum8_add(__m256i *h, __m256i *prev, int k, __m256i p) {
    if (k & 1) /* per 128-bit half: [b2k b2k+1 b2k b2k+1] partial sums */
        h[k >> 1] = _mm256_add_epi32(_mm256_unpacklo_epi32(*prev, p), _mm256_unpackhi_epi32(*prev, p));
    else
        *prev = p;
}
KI __m256i q8_sum8_end(const __m256i *h) {
    /* per half: [b0 b1 b2 b3] and [b4 b5 b6 b7] partial sums */
    const __m256i b0 = _mm256_add_epi32(_mm256_unpacklo_epi64(h[0], h[1]), _mm256_unpackhi_epi64(h[0], h[1]));
    const __m256i b1 = _mm256_add_epi32(_mm256_unpacklo_epi64(h[2], h[3]), _mm256_unpackhi_epi64(h[2], h[3]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(b0, b1, 0x20), _mm256_permute2x128_si256(b0, b1, 0x31));
}
/* ---- Q8_0 weights x Q8_0 activations: y = sum_b (dw_b * dx_b) * (qw_b . qx_b), in block order ---- */
/* blocks [b, nb) of a row one at a time into acc: the tail that both forms below leave */
KI void q8_0_blocks(const uint8_t *row, int64_t b, int64_t nb, int64_t n, const int8_t *xq, const float *xd,
                    float *acc, const int nt) {
    for (; b < nb; b++) {
        const uint8_t *q = row + 34 * b;
        const __m256i w0 = _mm256_loadu_si256((const __m256i *)(q + 2));
        const __m256i u0 = _mm256_sign_epi8(w0, w0);
        const float d0 = KERN_F16(kern_rd16(q));
        for (int t = 0; t < nt; t++) {
            const __m256i s0 = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(xq + t * n + 32 * b)), w0);
            const __m256i p0 = Q8_DOT_U8S8(_mm256_setzero_si256(), u0, s0);
            acc[t] += (d0 * xd[t * (n / 32) + b]) * (float)q8_hsum(p0);
        }
    }
}

KI __m256i q8_0_sum8_avx2(const __m256i *p) {
    __m256i h[4], prev = p[0];
    for (int k = 0; k < 8; k++) q8_sum8_add(h, &prev, k, p[k]);
    return q8_sum8_end(h);
}

/* One token (decode), 8 blocks a step, 256-bit (both builds): a block's dot is |w| (unsigned)
 * against x with w's sign; the 8 blocks' int32 lanes are summed across registers (q8_0_sum8_avx2:
 * about 2.6 instructions a block, against 8 for a horizontal sum of each) and converted at once,
 * then each block's (d_w * d_x) * (float)dot is added to *acc in block order (ds4's order,
 * kern_q8.c).  Returns the blocks done (the caller adds the rest one by one) */
KI int64_t KSUF(q8_0_t1)(const uint8_t *row, int64_t nb, const int8_t *xq, const float *xd, float *acc) {
    int64_t b = 0;
    for (; b + 8 <= nb; b += 8) {
        const uint8_t *q = row + 34 * b;
        const int8_t *xb = xq + 32 * b;
        __m256i p[8];
        for (int k = 0; k < 8; k++) {
            if (!(k & 1)) { /* one L1 and one L2 prefetch per block pair (see the AVX2 row below) */
                PFL(q + 34 * k, 3072, _MM_HINT_T0);
                PFL(q + 34 * k, 16384, _MM_HINT_T1);
            }
            const __m256i w = _mm256_loadu_si256((const __m256i *)(q + 34 * k + 2));
            p[k] = Q8_DOT_U8S8(_mm256_setzero_si256(), _mm256_sign_epi8(w, w),
                               _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(xb + 32 * k)), w));
        }
        /* the 8 blocks' (d_w * d_x) * (float)dot in vector lanes (the same float32 products), then
         * added in block order */
        const __m256 dw = _mm256_cvtph_ps(_mm_setr_epi16(kern_rd16(q), kern_rd16(q + 34), kern_rd16(q + 68), kern_rd16(q + 102),
                                                         kern_rd16(q + 136), kern_rd16(q + 170), kern_rd16(q + 204),
                                                         kern_rd16(q + 238)));
        float pv[8];
        _mm256_storeu_ps(pv, _mm256_mul_ps(_mm256_mul_ps(dw, _mm256_loadu_ps(xd + b)), _mm256_cvtepi32_ps(q8_0_sum8_avx2(p))));
        float a = *acc;
        for (int k = 0; k < 8; k++) a += pv[k];
        *acc = a;
    }
    return b;
}

#ifdef Q8_HAVE_512
/* AVX-512 form, 8 blocks a step: the weight codes of a block pair are one zmm (|w| and the mask of
 * its negative bytes, decoded once for all tokens), and a token's codes for the pair one load, so a
 * token costs a load, a masked negate and a vpdpbusd per pair.  The per-block reduction is what
 * used to dominate at 2-8 tokens (per block and token: extract, add, convert, a scalar scale
 * product, broadcast, fma): here the four pairs' int32 lanes are summed across registers with
 * unpacks (exact integer sums, each lane a block's) to one ymm of the 8 block sums, converted once
 * and multiplied into the float64 accumulator by the 8 blocks' scale products (dw * dx: exact in
 * float64) in one fma.  The int sums and the scale products are the exact values of the other
 * forms; only the order of the float64 additions differs (the result is the exact sum rounded
 * once, but for ~2^-29 of values, as every build's).  The same kernel runs at every token count,
 * so set_batch_invariant's promise (a token's bits whatever T) holds. */
/* the 8 blocks' sums of a group, from p_k = the int32 lanes of blocks 2k (lanes 0-7) and 2k + 1
 * (lanes 8-15): in block order 0 2 4 6 1 3 5 7 */
KI __m256i q8_0_sum8(__m512i p0, __m512i p1, __m512i p2, __m512i p3) {
    const __m512i t01 = _mm512_add_epi32(_mm512_unpacklo_epi32(p0, p1), _mm512_unpackhi_epi32(p0, p1));
    const __m512i t23 = _mm512_add_epi32(_mm512_unpacklo_epi32(p2, p3), _mm512_unpackhi_epi32(p2, p3));
    /* 128-bit chunk c: the sums of chunk c of p0, p1, p2, p3 (chunks 0-1: block 2k, 2-3: 2k + 1) */
    const __m512i s = _mm512_add_epi32(_mm512_unpacklo_epi64(t01, t23), _mm512_unpackhi_epi64(t01, t23));
    const __m512i o = _mm512_shuffle_i32x4(s, s, _MM_SHUFFLE(3, 1, 2, 0)); /* chunks 0 2 | 1 3 */
    return _mm256_add_epi32(_mm512_castsi512_si256(o), _mm512_extracti64x4_epi64(o, 1));
}

/* one token: q8_0_t1's 256-bit form (VNNI on ymm), 1.16-1.18x this loop's at one token on Zen 4
 * (the same sums and float32 steps: bit for bit) */
KI void KSUF(q8_0_row)(const uint8_t *row, int64_t nb, int64_t n, const int8_t *xq, const float *xd, float *out,
                       const int nt) {
    float acc[Q8_NT];
    for (int t = 0; t < nt; t++) acc[t] = 0.0f;
    const __m512i zero = _mm512_setzero_si512();
    /* the blocks' scales (the first 4 bytes of blocks 0..7 of a group: one gather), and the
     * permutation that takes q8_0_sum8's order (0 2 4 6 1 3 5 7) to block order */
    const __m256i soff = _mm256_setr_epi32(0, 34, 68, 102, 136, 170, 204, 238);
    const __m256i nat = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    int64_t b = 0;
    if (nt == 1) b = KSUF(q8_0_t1)(row, nb, xq, xd, acc);
    for (; b + 8 <= nb; b += 8) {
        const uint8_t *q = row + 34 * b;
        __m512i u[4];
        __mmask64 neg[4];
        for (int k = 0; k < 4; k++) {
            /* a prefetch per block pair (68 bytes, about a line), as the ymm form below */
            PFL(q + 68 * k, 3072, _MM_HINT_T0);
            PFL(q + 68 * k, 16384, _MM_HINT_T1);
            const __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(q + 68 * k + 2))),
                                                 _mm256_loadu_si256((const __m256i *)(q + 68 * k + 36)), 1);
            u[k] = _mm512_abs_epi8(w); /* -128 -> 0x80: 128 as the unsigned operand */
            neg[k] = _mm512_movepi8_mask(w);
        }
        const __m128i dh = _mm256_cvtepi32_epi16(_mm256_i32gather_epi32((const int *)q, soff, 1));
        const __m256 dw = _mm256_cvtph_ps(dh);
        for (int t = 0; t < nt; t++) {
            const int8_t *xb = xq + t * n + 32 * b;
            __m512i p[4];
            for (int k = 0; k < 4; k++) {
                const __m512i xv = _mm512_loadu_si512((const void *)(xb + 64 * k));
                p[k] = _mm512_dpbusd_epi32(zero, u[k], _mm512_mask_sub_epi8(xv, neg[k], zero, xv));
            }
            /* the 8 blocks' (dw * dx) * (float)dot, then added in block order */
            const __m256 sc = _mm256_mul_ps(dw, _mm256_loadu_ps(xd + t * (n / 32) + b));
            const __m256i s8 = _mm256_permutevar8x32_epi32(q8_0_sum8(p[0], p[1], p[2], p[3]), nat);
            float pv[8];
            _mm256_storeu_ps(pv, _mm256_mul_ps(sc, _mm256_cvtepi32_ps(s8)));
            float a = acc[t];
            for (int k = 0; k < 8; k++) a += pv[k];
            acc[t] = a;
        }
    }
    q8_0_blocks(row, b, nb, n, xq, xd, acc, nt); /* the last blocks of a row of n % 256 values */
    for (int t = 0; t < nt; t++) out[t] = acc[t];
}
#else

/* AVX2 form.  One token (decode): q8_0_t1.  Zen 3 decodes a token mostly in this kernel (the output
 * head and the attention projections).  More tokens: a
 * block pair a step, each block's lanes summed on their own (8 blocks' lanes of several tokens do
 * not fit 16 ymm registers); the same float32 steps, so a token's bits do not depend on T. */
KI void KSUF(q8_0_row)(const uint8_t *row, int64_t nb, int64_t n, const int8_t *xq, const float *xd, float *out,
                       const int nt) {
    float acc[Q8_NT];
    for (int t = 0; t < nt; t++) acc[t] = 0.0f;
    int64_t b = 0;
    if (nt == 1) b = KSUF(q8_0_t1)(row, nb, xq, xd, acc);
    for (; b + 2 <= nb; b += 2) {
        const uint8_t *q = row + 34 * b;
        /* one L1 and one L2 prefetch per block pair (68 bytes, about a line): PF2's two of each
         * (a line every 34 bytes) issue twice the prefetches for the same lines and streamed large
         * matrices from DRAM more slowly.  Farther distances than PF2's (3 KiB, 16 KiB) measured the
         * same or better. */
        PFL(q, 3072, _MM_HINT_T0);
        PFL(q, 16384, _MM_HINT_T1);
        const __m256i w0 = _mm256_loadu_si256((const __m256i *)(q + 2));
        const __m256i w1 = _mm256_loadu_si256((const __m256i *)(q + 36));
        const __m256i u0 = _mm256_sign_epi8(w0, w0), u1 = _mm256_sign_epi8(w1, w1);
        const float d0 = KERN_F16(kern_rd16(q)), d1 = KERN_F16(kern_rd16(q + 34));
        for (int t = 0; t < nt; t++) {
            const int8_t *xb = xq + t * n + 32 * b;
            const float *dt = xd + t * (n / 32) + b;
            const __m256i s0 = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)xb), w0);
            const __m256i s1 = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(xb + 32)), w1);
            const __m256i p0 = Q8_DOT_U8S8(_mm256_setzero_si256(), u0, s0);
            const __m256i p1 = Q8_DOT_U8S8(_mm256_setzero_si256(), u1, s1);
            acc[t] += (d0 * dt[0]) * (float)q8_hsum(p0);
            acc[t] += (d1 * dt[1]) * (float)q8_hsum(p1);
        }
    }
    q8_0_blocks(row, b, nb, n, xq, xd, acc, nt);
    for (int t = 0; t < nt; t++) out[t] = acc[t];
}
#endif

/* ---- IQ2_XXS weights x Q8_K activations: y = 1/8 sum_b (d_b dx_b) sum_g (2 s_g + 1) (grid.sign . qx) ----
 * Decode cost dominates here (8 bytes carry 32 weights).  The AVX-512 form computes a block's 32
 * sign bytes for all 8 groups at once in vector registers (iq2xxs_signs) and takes a group pair's 8
 * sign bytes as its mask register; the AVX2 form looks a group's sign rows up in a table (below);
 * the grid rows are loads (a gather measured slower on Zen 3 and Zen 4).  With VBMI + GFNI,
 * kern_iq2_vbmi.h replaces both kernels. */
#ifdef Q8_HAVE_512
/* IQ2_XXS groups 2p, 2p + 1 of a block (qs = block + 2): their 64 grid bytes (unsigned magnitudes;
 * 8 row loads composed in registers: with only F/BW/VL/VNNI, a 2-bit code table with word
 * permutes, a gather, and scalar stores to a buffer were all slower on Zen 4; the byte-permute
 * tables of kern_iq2_vbmi.h need VBMI) and the mask of their negative values, from the
 * block's sign bytes sgq (iq2xxs_signs: bytes 8p..8p+7, one per 8 values) */
KI __m512i KSUF(iq2_pair)(const uint8_t *qs, const long long *sgq, int p, __mmask64 *neg) {
    /* sign byte k of the pair holds the signs of its elements 8k..8k+7 in bits 0..7, so the pair's
     * 8 sign bytes read as one 64-bit word are the mask itself (bit e = element e negative); a
     * register shuffle + test that spelled the same mask out made the row kernel slower */
    const uint8_t *q = qs + 16 * p;
    *neg = _cvtu64_mask64((unsigned long long)sgq[p]);
    return _mm512_set_epi64((long long)kern_iq2xxs_grid64[q[11]], (long long)kern_iq2xxs_grid64[q[10]],
                            (long long)kern_iq2xxs_grid64[q[9]], (long long)kern_iq2xxs_grid64[q[8]],
                            (long long)kern_iq2xxs_grid64[q[3]], (long long)kern_iq2xxs_grid64[q[2]],
                            (long long)kern_iq2xxs_grid64[q[1]], (long long)kern_iq2xxs_grid64[q[0]]);
}

/* AVX-512 form: two groups (64 weights) per zmm; the sign bits become a mask register and the
 * negation one masked subtract; a group pair's VNNI dot is multiplied by its two group scales
 * (2 s + 1) lane-wise and summed into one int32 accumulator per token */
KI void KSUF(q8_iq2_xxs_row)(const uint8_t *row, int64_t nb, int64_t n, const int8_t *xq, const float *xd,
                             float *out, const int nt) {
    float acc[Q8_NT];
    for (int t = 0; t < nt; t++) acc[t] = 0.0f;
    const __m512i zero = _mm512_setzero_si512();
    /* int32 lanes 0-7 <- scale of group 2p, lanes 8-15 <- group 2p + 1 */
    const __m512i sidx[4] = {_mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0),
                             _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2),
                             _mm512_set_epi32(5, 5, 5, 5, 5, 5, 5, 5, 4, 4, 4, 4, 4, 4, 4, 4),
                             _mm512_set_epi32(7, 7, 7, 7, 7, 7, 7, 7, 6, 6, 6, 6, 6, 6, 6, 6)};
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + 66 * b;
        PF2(blk);
        const float d = KERN_F16(kern_rd16(blk));
        __m256i a0, a1;
        const __m256i sg = KSUF(iq2xxs_signs)(blk + 2, &a0, &a1);
        long long sgq[4];
        _mm256_storeu_si256((__m256i *)sgq, sg);
        const __m512i ls8 = _mm512_castsi256_si512(
            _mm256_add_epi32(_mm256_slli_epi32(_mm256_srli_epi32(a1, 28), 1), _mm256_set1_epi32(1)));
        __m512i is[Q8_NT];
        for (int t = 0; t < nt; t++) is[t] = _mm512_setzero_si512();
        for (int p = 0; p < 4; p++) {
            __mmask64 neg;
            const __m512i gv = KSUF(iq2_pair)(blk + 2, sgq, p, &neg);
            const __m512i lp = _mm512_permutexvar_epi32(sidx[p], ls8);
            for (int t = 0; t < nt; t++) {
                const __m512i xv = _mm512_loadu_si512((const void *)(xq + t * n + 256 * b + 64 * p));
                const __m512i dot = _mm512_dpbusd_epi32(zero, gv, _mm512_mask_sub_epi8(xv, neg, zero, xv));
                is[t] = _mm512_add_epi32(is[t], _mm512_mullo_epi32(dot, lp));
            }
        }
        for (int t = 0; t < nt; t++) {
            const __m512i s = is[t];
            const __m256i s8 = _mm256_add_epi32(_mm512_castsi512_si256(s), _mm512_extracti64x4_epi64(s, 1));
            acc[t] += (d * xd[t * (n / 256) + b]) * (float)q8_hsum(s8);
        }
    }
    for (int t = 0; t < nt; t++) out[t] = 0.125f * acc[t];
}
#else
/* AVX2 form.  A group's 4 grid rows are loads composed into a ymm; its sign fields become rows of
 * +1 / -1 bytes that vpsignb applies to the activations.  The GEMM form's row decoder
 * (kern_gemm_avx2.h) looks the sign rows up in a table (kern_iq2xxs_sign64: a load and a blend each,
 * iq2_group); the row kernel spreads a whole block's sign fields in vector registers (below). */
KI __m256i KSUF(iq2_rows4)(const uint64_t *tab, uint64_t i0, uint64_t i1, uint64_t i2, uint64_t i3) {
    __m256i r = _mm256_castsi128_si256(_mm_loadl_epi64((const __m128i *)(tab + i0)));
    r = _mm256_blend_epi32(r, _mm256_set1_epi64x((long long)tab[i1]), 0x0C);
    r = _mm256_blend_epi32(r, _mm256_set1_epi64x((long long)tab[i2]), 0x30);
    return _mm256_blend_epi32(r, _mm256_set1_epi64x((long long)tab[i3]), 0xC0);
}

/* IQ2_XXS group g of a block (q = block + 2 + 8 g, aux its second word): its 32 grid bytes
 * (unsigned magnitudes) and, in *sv, its sign rows as +1 / -1 bytes (vpsignb's operand) */
KI __m256i KSUF(iq2_group)(const uint8_t *q, uint32_t aux, __m256i *sv) {
    *sv = KSUF(iq2_rows4)(kern_iq2xxs_sign64, aux & 127, (aux >> 7) & 127, (aux >> 14) & 127, (aux >> 21) & 127);
    return _mm256_set_epi64x((long long)kern_iq2xxs_grid64[q[3]], (long long)kern_iq2xxs_grid64[q[2]],
                             (long long)kern_iq2xxs_grid64[q[1]], (long long)kern_iq2xxs_grid64[q[0]]);
}

/* The row kernel spreads a block's signs and scales in vector registers once per block
 * (iq2_block_signs, ~20 ops), so a group's sign rows are 4 vector ops (shuffle, and, compare, or)
 * and its scale one shuffle, against ~14 scalar and vector ops a group for the table rows
 * (iq2_group): ~230 instructions a block against ~320.  The grid rows stay loads (a gather measured
 * slower on Zen 3 and Zen 4). */
/* the 8 groups' aux words (signs and scale) of a block: dwords [g0 g1 g4 g5 | g2 g3 g6 g7] */
KI __m256i KSUF(iq2_aux8)(const uint8_t *qs) {
    const __m256 a = _mm256_loadu_ps((const float *)qs), b = _mm256_loadu_ps((const float *)(qs + 32));
    return _mm256_castps_si256(_mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* the block's 32 sign bytes (ksigns: the 7 bits of a field and their parity in bit 7), arranged
 * for a per-group in-lane shuffle: the low lane holds fields 0 and 1 of all 8 groups, the high lane
 * fields 2 and 3 (group g at byte pair 2 p(g), g = iq2_grp[p]), and *scb the 8 group scales 2 s + 1 as
 * bytes p(g) of both lanes */
KI __m256i KSUF(iq2_block_signs)(__m256i au, __m256i *scb) {
    __m256i x = _mm256_and_si256(au, _mm256_set1_epi32(0x0FFFFFFF));
    /* the 4 fields of 7 bits to bytes: each step moves the fields above a byte boundary up by one */
    x = _mm256_add_epi32(x, _mm256_and_si256(x, _mm256_set1_epi32(0x0FFFFF80)));
    x = _mm256_add_epi32(x, _mm256_and_si256(x, _mm256_set1_epi32(0x1FFF8000)));
    x = _mm256_add_epi32(x, _mm256_and_si256(x, _mm256_set1_epi32(0x3F800000)));
    /* bit 7 of a byte = the parity of its 7 bits: of the xor of its nibbles, from a 16-entry table */
    const __m256i ptab = _mm256_setr_epi8(0, -128, -128, 0, -128, 0, 0, -128, -128, 0, 0, -128, 0, -128, -128, 0, 0, -128,
                                          -128, 0, -128, 0, 0, -128, -128, 0, 0, -128, 0, -128, -128, 0);
    const __m256i nib = _mm256_and_si256(_mm256_xor_si256(x, _mm256_srli_epi16(x, 4)), _mm256_set1_epi8(15));
    x = _mm256_or_si256(x, _mm256_shuffle_epi8(ptab, nib));
    /* per lane: bytes 0, 1 of its 4 dwords, then bytes 2, 3; then the low qwords to the low lane */
    const __m256i pick = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15, 0, 1, 4, 5, 8, 9, 12, 13, 2,
                                          3, 6, 7, 10, 11, 14, 15);
    const __m256i sg = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(x, pick), _MM_SHUFFLE(3, 1, 2, 0));
    const __m256i sc = _mm256_or_si256(_mm256_srli_epi32(au, 27), _mm256_set1_epi32(1)); /* 2 (aux >> 28) + 1 */
    const __m256i pk = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 0, 4, 8, 12, -1, -1,
                                        -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
    *scb = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(sc, pk), _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4));
    return sg;
}

/* a group's 32 grid bytes (q = block + 2 + 8 g): its 4 indices come from one 32-bit load, and the
 * rows are 2 movq + 2 movhpd + an insert (the load ports, not the vector ALUs, bounded this kernel) */
KI __m256i KSUF(iq2_grid4)(const uint8_t *q) {
    const uint32_t ix = kern_rd32(q);
    const uint64_t *t = kern_iq2xxs_grid64;
    const __m128i lo = _mm_castpd_si128(_mm_loadh_pd(_mm_castsi128_pd(_mm_loadl_epi64((const __m128i *)(t + (ix & 255)))),
                                                     (const double *)(t + ((ix >> 8) & 255))));
    const __m128i hi = _mm_castpd_si128(_mm_loadh_pd(_mm_castsi128_pd(_mm_loadl_epi64((const __m128i *)(t + ((ix >> 16) & 255)))),
                                                     (const double *)(t + (ix >> 24))));
    return _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
}

/* groups are taken in the order of their byte positions p in iq2_block_signs's lanes, so that the
 * shuffle controls step by an add rather than a load each: group iq2_grp[p] sits at byte pair 2 p
 * (signs) and byte p (scale) */
static const int iq2_grp[8] = {0, 1, 4, 5, 2, 3, 6, 7};

/* one block's exact integer dots (int32 lanes, group scales applied) for nt tokens: is[t] */
KI void KSUF(iq2_block)(const uint8_t *blk, __m256i sg, __m256i scb, const int8_t *xb, int64_t n, const int nt,
                       __m256i *is) {
    const __m256i bits = _mm256_set1_epi64x(0x8040201008040201LL), one = _mm256_set1_epi8(1);
    for (int t = 0; t < nt; t++) is[t] = _mm256_setzero_si256();
    __m256i cs = _mm256_set_epi64x(0x0101010101010101LL, 0, 0x0101010101010101LL, 0); /* byte pair 2 p (signs) */
    __m256i cl = _mm256_set1_epi16((short)0xFF00);                                      /* byte p (scale) */
#pragma GCC unroll 8
    for (int p = 0; p < 8; p++) {
        const int g = iq2_grp[p];
        const __m256i gv = KSUF(iq2_grid4)(blk + 2 + 8 * g);
        const __m256i m = _mm256_and_si256(_mm256_shuffle_epi8(sg, cs), bits);
        const __m256i sv = _mm256_or_si256(_mm256_cmpeq_epi8(m, bits), one); /* +1 / -1 */
        const __m256i ls = _mm256_shuffle_epi8(scb, cl);
        cs = _mm256_add_epi8(cs, _mm256_set1_epi8(2));
        cl = _mm256_add_epi16(cl, _mm256_set1_epi16(1));
        for (int t = 0; t < nt; t++) {
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(xb + t * n + 32 * g));
            is[t] = q8_dot_scaled(is[t], gv, _mm256_sign_epi8(xv, sv), ls);
        }
    }
}

/* blocks [b, nb) of a row one at a time into acc[0..nt) (ds4's float32 block steps; the 1/8 is
 * applied by the caller): the general path, and the tail of the one-token form */
KI void KSUF(iq2_blocks)(const uint8_t *row, int64_t b, int64_t nb, int64_t n, const int8_t *xq, const float *xd,
                         float *acc, const int nt) {
    for (; b < nb; b++) {
        const uint8_t *blk = row + 66 * b;
        PF2(blk);
        __m256i is[Q8_NT], scb;
        const __m256i sg = KSUF(iq2_block_signs)(KSUF(iq2_aux8)(blk + 2), &scb);
        KSUF(iq2_block)(blk, sg, scb, xq + 256 * b, n, nt, is);
        for (int t = 0; t < nt; t++) acc[t] += (KERN_F16(kern_rd16(blk)) * xd[t * (n / 256) + b]) * (float)q8_hsum(is[t]);
    }
}

/* One token (decode), NR rows (w, w + stride, ...) side by side, 8 blocks a step: a block's int32
 * lanes are summed across registers as they come (q8_sum8_add / q8_sum8_end) and 8 blocks'
 * converted at once, then each block's (d * d_x) * (float)dot is added in block order, each row on
 * its own float32 chain (the one-block-at-a-time form's steps, bit for bit).  A block's sum and
 * float32 step had put ~30 cycles of latency at the end of every block (horizontal sum, convert,
 * multiply, add), and a block's ~230 instructions fill the out-of-order window: one row ran at the
 * pace of that chain.  Summing 8 blocks at once took 1.19x; two rows side by side, both rows'
 * signs spread before either's groups (independent chains, the activation codes loaded once),
 * 1.27-1.30x of the old kernel (Zen 4, in L2 and from DRAM alike). */
KI void KSUF(iq2_rows_t1)(const uint8_t *w, ptrdiff_t stride, int64_t nb, int64_t n, const int8_t *xq,
                          const float *xd, float *out, const int NR) {
    float a[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    int64_t b = 0;
    for (; b + 8 <= nb; b += 8) {
        const __m256i z = _mm256_setzero_si256();
        __m256i h[4][4], prev[4] = {z, z, z, z};
        for (int k = 0; k < 8; k++) {
            __m256i sg[4], scb[4];
#pragma GCC unroll 4
            for (int r = 0; r < NR; r++) {
                const uint8_t *blk = w + r * stride + 66 * (b + k);
                PF2(blk);
                sg[r] = KSUF(iq2_block_signs)(KSUF(iq2_aux8)(blk + 2), &scb[r]);
            }
#pragma GCC unroll 4
            for (int r = 0; r < NR; r++) {
                __m256i is;
                KSUF(iq2_block)(w + r * stride + 66 * (b + k), sg[r], scb[r], xq + 256 * (b + k), n, 1, &is);
                q8_sum8_add(h[r], &prev[r], k, is);
            }
        }
#pragma GCC unroll 4
        for (int r = 0; r < NR; r++) {
            float sv[8];
            _mm256_storeu_ps(sv, _mm256_cvtepi32_ps(q8_sum8_end(h[r])));
            for (int k = 0; k < 8; k++) a[r] += (KERN_F16(kern_rd16(w + r * stride + 66 * (b + k))) * xd[b + k]) * sv[k];
        }
    }
    for (int r = 0; r < NR; r++) {
        KSUF(iq2_blocks)(w + r * stride, b, nb, n, xq, xd, &a[r], 1);
        out[r] = 0.125f * a[r];
    }
}

KI void KSUF(q8_iq2_xxs_row)(const uint8_t *row, int64_t nb, int64_t n, const int8_t *xq, const float *xd,
                             float *out, const int nt) {
    if (nt == 1) {
        KSUF(iq2_rows_t1)(row, 0, nb, n, xq, xd, out, 1);
        return;
    }
    float acc[Q8_NT];
    for (int t = 0; t < nt; t++) acc[t] = 0.0f;
    KSUF(iq2_blocks)(row, 0, nb, n, xq, xd, acc, nt);
    for (int t = 0; t < nt; t++) out[t] = 0.125f * acc[t];
}

#endif

/* 8 lanes of kern_q2k_block at once (isum, summs: exact int32 sums; d, dmin, dx float32 per lane):
 * (float)((double)isum * (double)(dx * d) - (double)(((float)summs * dx) * dmin)), the same
 * operations lane by lane (the AVX2 one-token rows and both builds' GEMM forms) */
KI __m256 q2k_terms8(__m256i isum, __m256i summs, __m256 d, __m256 dmin, __m256 dx) {
    const __m256 dall = _mm256_mul_ps(dx, d);
    const __m256 mins = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(summs), dx), dmin);
    __m128 h[2];
    for (int k = 0; k < 2; k++) {
        const __m256d i = _mm256_cvtepi32_pd(k ? _mm256_extracti128_si256(isum, 1) : _mm256_castsi256_si128(isum));
        const __m256d da = _mm256_cvtps_pd(k ? _mm256_extractf128_ps(dall, 1) : _mm256_castps256_ps128(dall));
        const __m256d mi = _mm256_cvtps_pd(k ? _mm256_extractf128_ps(mins, 1) : _mm256_castps256_ps128(mins));
        h[k] = _mm256_cvtpd_ps(_mm256_sub_pd(_mm256_mul_pd(i, da), mi));
    }
    return _mm256_set_m128(h[1], h[0]);
}

/* ---- Q2_K weights x Q8_K activations:
 * y = sum_b dx_b [ d_b sum_s (sc_s & 15) (q_s . qx_s) - dmin_b sum_s (sc_s >> 4) bsum_s ] ---- */
#ifdef Q8_HAVE_512
/* AVX-512 form: the 64 code bytes are one zmm; shift j yields elements 32j.. (low half) and
 * 128 + 32j.. (high half) together, with the matching halves of x and four sub-block scales;
 * the scales go in with vpdpwssd and both sums stay in vector lanes to the end of the row (a
 * horizontal sum of the minimums per block is slower).  The codes come arranged by q2k_pair_x
 * (kern_isa.q8_arrange), so vector j of a block is one load instead of two half loads and an
 * insert */
KI void KSUF(q2k_block)(const uint8_t *blk, const int8_t *xb, const int16_t *xsb, int64_t n, const int nt, __m256i *is,
                        __m256i *ms) {
    const __m512i m3 = _mm512_set1_epi8(3);
    /* int16 lane -> sub-block index: 128-bit quarter k of shift j holds sub-block
     * {2j, 2j+1, 8+2j, 9+2j}[k] */
    static const int16_t pix[4][32] __attribute__((aligned(64))) = {
        {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 8, 8, 8, 8, 8, 8, 8, 8, 9, 9, 9, 9, 9, 9, 9, 9},
        {2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3, 10, 10, 10, 10, 10, 10, 10, 10, 11, 11, 11, 11, 11, 11, 11, 11},
        {4, 4, 4, 4, 4, 4, 4, 4, 5, 5, 5, 5, 5, 5, 5, 5, 12, 12, 12, 12, 12, 12, 12, 12, 13, 13, 13, 13, 13, 13, 13, 13},
        {6, 6, 6, 6, 6, 6, 6, 6, 7, 7, 7, 7, 7, 7, 7, 7, 14, 14, 14, 14, 14, 14, 14, 14, 15, 15, 15, 15, 15, 15, 15, 15}};
    const __m128i sc = _mm_loadu_si128((const __m128i *)blk);
    const __m512i lo16 = _mm512_castsi256_si512(_mm256_cvtepu8_epi16(_mm_and_si128(sc, _mm_set1_epi8(15))));
    const __m256i hi16 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(sc, 4), _mm_set1_epi8(15)));
    const __m512i q = _mm512_loadu_si512((const void *)(blk + 16));
    __m512i v[4], scv[4];
    for (int j = 0; j < 4; j++) {
        v[j] = _mm512_and_si512(_mm512_srli_epi16(q, 2 * j), m3);
        scv[j] = _mm512_permutexvar_epi16(_mm512_load_si512(pix[j]), lo16);
    }
    for (int t = 0; t < nt; t++) {
        const int8_t *x = xb + t * n;
        __m512i s = _mm512_setzero_si512();
        for (int j = 0; j < 4; j++)
            s = _mm512_dpwssd_epi32(s, _mm512_maddubs_epi16(v[j], _mm512_loadu_si512((const void *)(x + 64 * j))), scv[j]);
        is[t] = _mm256_add_epi32(_mm512_castsi512_si256(s), _mm512_extracti64x4_epi64(s, 1));
        ms[t] = _mm256_madd_epi16(hi16, _mm256_loadu_si256((const __m256i *)(xsb + t * (n / 16))));
    }
}
#else
/* AVX2 form: the sub-block scales of a shift j go to their int16 lanes with one shuffle of the 16
 * scale bytes (0x80 control bytes zero-extend them), and the minimums stay in vector lanes to the
 * end of the block, as the AVX-512 form: faster than a scalar scale set-up and a horizontal sum
 * per block, from DRAM and from L2 alike.  A block's int32 lanes for nt tokens: is[t] (codes times
 * scales against the codes) and ms[t] (the minimums' scales against the sums of 16 codes) */
KI void KSUF(q2k_block)(const uint8_t *blk, const int8_t *xb, const int16_t *xsb, int64_t n, const int nt, __m256i *is,
                        __m256i *ms) {
    const __m256i m3 = _mm256_set1_epi8(3);
    const __m128i sc = _mm_loadu_si128((const __m128i *)blk);
    const __m256i lo2 = _mm256_broadcastsi128_si256(_mm_and_si128(sc, _mm_set1_epi8(15)));
    const __m256i hi16 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(sc, 4), _mm_set1_epi8(15)));
    const __m256i q0 = _mm256_loadu_si256((const __m256i *)(blk + 16));
    const __m256i q1 = _mm256_loadu_si256((const __m256i *)(blk + 48));
    for (int t = 0; t < nt; t++) is[t] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) {
        /* shift j of q0 holds sub-blocks 2j (low 128 bits: values 32j..) and 2j + 1 (high), of
         * q1 sub-blocks 8 + 2j and 9 + 2j (values 128 + 32j..): maddubs pairs lanes in order
         * within each 128-bit half, so a half's 8 int16 lanes take one scale */
        const __m256i c0 = _mm256_setr_epi8(2 * j, -128, 2 * j, -128, 2 * j, -128, 2 * j, -128, 2 * j, -128, 2 * j,
                                            -128, 2 * j, -128, 2 * j, -128, 2 * j + 1, -128, 2 * j + 1, -128,
                                            2 * j + 1, -128, 2 * j + 1, -128, 2 * j + 1, -128, 2 * j + 1, -128,
                                            2 * j + 1, -128, 2 * j + 1, -128);
        const __m256i s0 = _mm256_shuffle_epi8(lo2, c0);
        const __m256i s1 = _mm256_shuffle_epi8(lo2, _mm256_add_epi16(c0, _mm256_set1_epi16(8)));
        const __m256i v0 = _mm256_and_si256(_mm256_srli_epi16(q0, 2 * j), m3);
        const __m256i v1 = _mm256_and_si256(_mm256_srli_epi16(q1, 2 * j), m3);
        for (int t = 0; t < nt; t++) {
            const int8_t *x = xb + t * n;
            is[t] = q8_dot_scaled(is[t], v0, _mm256_loadu_si256((const __m256i *)(x + 32 * j)), s0);
            is[t] = q8_dot_scaled(is[t], v1, _mm256_loadu_si256((const __m256i *)(x + 128 + 32 * j)), s1);
        }
    }
    for (int t = 0; t < nt; t++) ms[t] = _mm256_madd_epi16(hi16, _mm256_loadu_si256((const __m256i *)(xsb + t * (n / 16))));
}

#endif

/* blocks [b, nb) of a row one at a time into acc[0..nt) (kern_q2k_block: ds4's float32 steps) */
KI void KSUF(q2k_blocks)(const uint8_t *row, int64_t b, int64_t nb, int64_t n, const int8_t *xq, const float *xd,
                         const int16_t *xs, float *acc, const int nt) {
    for (; b < nb; b++) {
        const uint8_t *blk = row + 84 * b;
        PF2(blk);
        const float d = KERN_F16(kern_rd16(blk + 80)), dmin = KERN_F16(kern_rd16(blk + 82));
        __m256i is[Q8_NT], ms[Q8_NT];
        KSUF(q2k_block)(blk, xq + 256 * b, xs + 16 * b, n, nt, is, ms);
        for (int t = 0; t < nt; t++) acc[t] += kern_q2k_block(q8_hsum(is[t]), q8_hsum(ms[t]), xd[t * (n / 256) + b], d, dmin);
    }
}

/* One token (decode), two rows side by side, 8 blocks a step, as iq2_rows_t1: the blocks' isum and
 * summs lanes summed across registers (q8_sum8_add / q8_sum8_end) and the 8 blocks'
 * kern_q2k_block terms computed in vector lanes at once (q2k_terms8, the same operations lane by
 * lane), then added in block order on each row's float32 chain; a row's horizontal sums and float64
 * step per block had been a ~40-cycle chain at every block's end */
KI void KSUF(q2k_rows2_t1)(const uint8_t *w, ptrdiff_t stride, int64_t nb, int64_t n, const int8_t *xq,
                           const float *xd, const int16_t *xs, float *out) {
    float a[2] = {0.0f, 0.0f};
    int64_t b = 0;
    for (; b + 8 <= nb; b += 8) {
        const __m256i z = _mm256_setzero_si256();
        __m256i hi[2][4], hm[2][4], pi[2] = {z, z}, pm[2] = {z, z};
        for (int k = 0; k < 8; k++)
#pragma GCC unroll 2
            for (int r = 0; r < 2; r++) {
                const uint8_t *blk = w + r * stride + 84 * (b + k);
                PF2(blk);
                __m256i is, ms;
                KSUF(q2k_block)(blk, xq + 256 * (b + k), xs + 16 * (b + k), n, 1, &is, &ms);
                q8_sum8_add(hi[r], &pi[r], k, is);
                q8_sum8_add(hm[r], &pm[r], k, ms);
            }
        const __m256 dx = _mm256_loadu_ps(xd + b);
#pragma GCC unroll 2
        for (int r = 0; r < 2; r++) {
            const uint8_t *w8 = w + r * stride + 84 * b;
            const __m256 d = _mm256_cvtph_ps(_mm_setr_epi16(
                kern_rd16(w8 + 80), kern_rd16(w8 + 164), kern_rd16(w8 + 248), kern_rd16(w8 + 332), kern_rd16(w8 + 416),
                kern_rd16(w8 + 500), kern_rd16(w8 + 584), kern_rd16(w8 + 668)));
            const __m256 dmin = _mm256_cvtph_ps(_mm_setr_epi16(
                kern_rd16(w8 + 82), kern_rd16(w8 + 166), kern_rd16(w8 + 250), kern_rd16(w8 + 334), kern_rd16(w8 + 418),
                kern_rd16(w8 + 502), kern_rd16(w8 + 586), kern_rd16(w8 + 670)));
            float tv[8];
            _mm256_storeu_ps(tv, q2k_terms8(q8_sum8_end(hi[r]), q8_sum8_end(hm[r]), d, dmin, dx));
            for (int k = 0; k < 8; k++) a[r] += tv[k];
        }
    }
    for (int r = 0; r < 2; r++) {
        KSUF(q2k_blocks)(w + r * stride, b, nb, n, xq, xd, xs, &a[r], 1);
        out[r] = a[r];
    }
}

KI void KSUF(q8_q2_k_row)(const uint8_t *row, int64_t nb, int64_t n, const int8_t *xq, const float *xd,
                          const int16_t *xs, float *out, const int nt) {
    float acc[Q8_NT];
    for (int t = 0; t < nt; t++) acc[t] = 0.0f;
    KSUF(q2k_blocks)(row, 0, nb, n, xq, xd, xs, acc, nt);
    for (int t = 0; t < nt; t++) out[t] = acc[t];
}


/* rows [R0, R1) of a kern_q8_fn (W, stride, n, T, xd, xs, y, ldy in scope): tokens in passes of up
 * to Q8_NT, CALL(k) fills out[0..k) for `row` from the pass's codes xqt (taken from XQ), scales xdt
 * (ABLK values each) and sums of 16 xst.  (The row variable has a name no caller uses: with `r`, a
 * caller's Q8_ROWS(r, ...) declared r = r, uninitialized, and recomputed rows from wherever that
 * pointed -- silently slower, and far slower on short row ranges.) */
#define Q8_ROWS(R0, R1, XQ, ABLK, CALL)                                                                         \
    for (int64_t q8_row_ = (R0); q8_row_ < (R1); q8_row_++) {                                                   \
        const uint8_t *row = W + q8_row_ * stride;                                                               \
        for (int64_t t0 = 0; t0 < T; t0 += Q8_NT) {                                                              \
            const int64_t left = T - t0;                                                                         \
            const int8_t *xqt = (XQ) + t0 * n;                                                                   \
            const float *xdt = xd + t0 * (n / (ABLK));                                                           \
            const int16_t *xst = xs ? xs + t0 * (n / 16) : NULL;                                                 \
            (void)xst;                                                                                           \
            switch (left >= Q8_NT ? Q8_NT : (int)left) {                                                         \
            case 1: CALL(1); break;                                                                              \
            case 2: CALL(2); break;                                                                              \
            case 3: CALL(3); break;                                                                              \
            Q8_MORE_CASES(CALL)                                                                                  \
            default: CALL(Q8_NT); break;                                                                         \
            }                                                                                                    \
            const int nt = left >= Q8_NT ? Q8_NT : (int)left;                                                    \
            for (int t = 0; t < nt; t++) y[(t0 + t) * ldy + q8_row_] = out[t];                                   \
        }                                                                                                        \
    }

#define Q8_KERNEL(fmt, CALL)                                                                                     \
    static void KSUF(q8k_##fmt)(const uint8_t *W, ptrdiff_t stride, int64_t n, int64_t r0, int64_t r1,          \
                                const int8_t *xq, const float *xd, const int16_t *xs, int64_t T, float *y,       \
                                int64_t ldy) {                                                                   \
        const int64_t nb = n / kern_block_elems(KT_##fmt##_ID);                                                  \
        float out[Q8_NT];                                                                                        \
        Q8_ROWS(r0, r1, xq, kern_q8_block(KT_##fmt##_ID), CALL)                                                  \
    }

#if Q8_NT == 8
#define Q8_MORE_CASES(CALL) case 4: CALL(4); break; case 5: CALL(5); break; case 6: CALL(6); break; case 7: CALL(7); break;
#else
#define Q8_MORE_CASES(CALL)
#endif
#define KT_q8_0_ID KT_Q8_0
#define KT_iq2_xxs_ID KT_IQ2_XXS
#define KT_q2_k_ID KT_Q2_K
#define Q8_CALL_Q8_0(k) KSUF(q8_0_row)(row, nb, n, xqt, xdt, out, k)
#define Q8_CALL_IQ2(k) KSUF(q8_iq2_xxs_row)(row, nb, n, xqt, xdt, out, k)
Q8_KERNEL(q8_0, Q8_CALL_Q8_0)
Q8_KERNEL(iq2_xxs, Q8_CALL_IQ2)
#ifndef Q8_HAVE_512
/* AVX2, one token: IQ2_RT rows a pass (iq2_rows_t1), the last row on its own (4 rows measured as
 * fast as 2) */
#define IQ2_RT 2
static void KSUF(q8k_iq2_t1)(const uint8_t *W, ptrdiff_t stride, int64_t n, int64_t r0, int64_t r1, const int8_t *xq,
                             const float *xd, const int16_t *xs, int64_t T, float *y, int64_t ldy) {
    if (T == 1)
        for (; r0 + IQ2_RT <= r1; r0 += IQ2_RT) KSUF(iq2_rows_t1)(W + r0 * stride, stride, n / 256, n, xq, xd, y + r0, IQ2_RT);
    if (r0 < r1) KSUF(q8k_iq2_xxs)(W, stride, n, r0, r1, xq, xd, xs, T, y, ldy);
}
#endif
#define Q8_CALL_Q2K(k) KSUF(q8_q2_k_row)(row, nb, n, xqt, xdt, xst, out, k)
Q8_KERNEL(q2_k, Q8_CALL_Q2K)
/* one token: rows in pairs (q2k_rows2_t1), an odd last row on its own */
static void KSUF(q8k_q2k_t1)(const uint8_t *W, ptrdiff_t stride, int64_t n, int64_t r0, int64_t r1, const int8_t *xq,
                             const float *xd, const int16_t *xs, int64_t T, float *y, int64_t ldy) {
    if (T == 1)
        for (; r0 + 2 <= r1; r0 += 2) KSUF(q2k_rows2_t1)(W + r0 * stride, stride, n / 256, n, xq, xd, xs, y + r0);
    if (r0 < r1) KSUF(q8k_q2_k)(W, stride, n, r0, r1, xq, xd, xs, T, y, ldy);
}
#ifdef Q8_HAVE_512
/* the AVX-512 Q2_K row kernel's code order (kern_isa.q8_arrange): block b's vector j = values
 * 32j..32j+31 then 128 + 32j.. (the halves that shift j of the weight codes pairs) */
static void KSUF(q2k_pair_x)(const int8_t *xq, int64_t n, int64_t T, int8_t *xr) {
    for (int64_t i = 0; i < T * n; i += 256)
        for (int j = 0; j < 4; j++) {
            memcpy(xr + i + 64 * j, xq + i + 32 * j, 32);
            memcpy(xr + i + 64 * j + 32, xq + i + 128 + 32 * j, 32);
        }
}
#endif

/* the quantizers' loops (kern_q8.c has the portable versions; results are identical: the same
 * float32 operations, lane by lane) */
static uint32_t KSUF(q8_maxmag)(const float *x, int n) {
    const __m256i m = _mm256_set1_epi32(0x7FFFFFFF);
    __m256i a = _mm256_setzero_si256();
    int i = 0;
    for (; i + 8 <= n; i += 8) a = _mm256_max_epu32(a, _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(x + i)), m));
    uint32_t l[8], r = 0;
    _mm256_storeu_si256((__m256i *)l, a);
    for (int k = 0; k < 8; k++) r = l[k] > r ? l[k] : r;
    for (; i < n; i++) {
        uint32_t u;
        memcpy(&u, x + i, 4);
        u &= 0x7FFFFFFFu;
        r = u > r ? u : r;
    }
    return r;
}

static void KSUF(q8_codes)(const float *x, int n, float scale, int8_t *q) {
    const __m256 s = _mm256_set1_ps(scale), hi = _mm256_set1_ps(127.0f), lo = _mm256_set1_ps(-127.0f);
    const __m256 mg = _mm256_set1_ps(12582912.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    int i = 0;
    for (; i + 32 <= n; i += 32) {
        __m256i r[4];
        for (int k = 0; k < 4; k++) {
            __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + i + 8 * k), s);
            v = _mm256_and_ps(v, _mm256_cmp_ps(v, v, _CMP_ORD_Q)); /* NaN -> 0 (min/max would keep 127) */
            v = _mm256_max_ps(_mm256_min_ps(v, hi), lo);
            r[k] = _mm256_cvtps_epi32(_mm256_sub_ps(_mm256_add_ps(v, mg), mg)); /* integers: exact */
        }
        /* packs work per 128-bit half: dwords come out as r0lo r1lo r2lo r3lo | r0hi r1hi ... */
        const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(r[0], r[1]), _mm256_packs_epi32(r[2], r[3]));
        _mm256_storeu_si256((__m256i *)(q + i), _mm256_permutevar8x32_epi32(b, order));
    }
    const float magic = 12582912.0f;
    for (; i < n; i++) {
        float v = x[i] * scale;
        v = v == v ? v : 0.0f;
        v = v > 127.0f ? 127.0f : v;
        v = v < -127.0f ? -127.0f : v;
        q[i] = (int8_t)(int)((v + magic) - magic);
    }
}

static void KSUF(fill_q8)(kern_isa *k) {
    k->q8_maxmag = KSUF(q8_maxmag);
    k->q8_codes = KSUF(q8_codes);
    k->q8[KT_Q8_0] = KSUF(q8k_q8_0);
#ifdef Q8_HAVE_512
    k->q8[KT_IQ2_XXS] = KSUF(q8k_iq2_xxs);
#else
    k->q8[KT_IQ2_XXS] = KSUF(q8k_iq2_t1);
#endif
    k->q8[KT_Q2_K] = KSUF(q8k_q2k_t1);
#ifdef Q8_HAVE_512
    k->q8_arrange[KT_Q2_K] = KSUF(q2k_pair_x);
#endif
}
