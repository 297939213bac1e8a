/* Integer-activation GEMM for many tokens, AVX2 build (ds4 numerics, prefill); the AVX-512 VNNI
 * build has its own (kern_gemm_body.h), whose layout this one follows at half the width.
 *
 * Without it, an AVX2 machine took prefill's dense Q8_0 matrices through the float kernels (after
 * rounding the activations) and its experts through the row kernels, which decode every weight
 * block again for each pass of 4 tokens.  Here a panel of 16 rows (two halves of 8) is decoded once
 * into int8 codes and repacked so that one ymm holds 4 consecutive codes of each of 8 rows
 * (wq[k/4][row][4]: lanes are rows); a token's 4 codes broadcast to every lane, and maddubs + madd
 * take 32 exact products for 8 rows.
 *
 * maddubs multiplies unsigned by signed bytes and saturates its pair sums to int16, so each format
 * picks the operands that keep the pairs below 2^15:
 *  - IQ2_XXS codes (grid value times sign, |w| <= 43) meet the activation codes offset to unsigned
 *    (x + 128 <= 255: a pair is at most 2 * 255 * 43 = 21930), with 128 * sum(w) of each 32-group
 *    subtracted (precomputed per row at packing: the accumulator's start value);
 *  - Q8_0 codes (-128..127) would saturate against x + 128, so they take the row kernels' sign
 *    move instead: |w| (<= 128) times x with w's sign (activation codes are never -128, see
 *    kern_q8_body.h: <= 2 * 128 * 127 = 32512);
 *  - Q2_K codes times their 4-bit sub-block scale (0..45) are unsigned against the signed codes
 *    (<= 2 * 45 * 127), and the minimums term sum_s m_s * bsum_s takes one madd per two sub-blocks.
 * Integer sums are exact; per block the lane vector of the 8 rows' integers goes into float32 as
 * ds4's CPU path takes it, as the AVX-512 form (times the float32 product of the scales, added in
 * block order: the reference's steps, bit for bit).  A token's sums do not depend on T or on its
 * place in a tile. */

#define G2_TT 2 /* tokens per tile, with 2 x 8 rows: 4 int32 + 4 float accumulators of 16 ymm */

/* a half panel of 8 rows; kp = n rounded up to 32 */
typedef struct {
    uint8_t *wq;  /* [kp/4][8][4] */
    float *sc;    /* per block (Q8_0: 32 codes; Q2_K, IQ2_XXS: 256) and row: [blocks][8], the block's d */
    int32_t *nc;  /* IQ2_XXS: -128 * sum of the group's codes, [n/32][8] */
    int32_t *gs;  /* IQ2_XXS: the integer group scales 2 s + 1, [n/32][8] */
    int32_t *mz;  /* Q2_K: minimums of sub-blocks 2j, 2j+1 as int16 pairs, [n/256][8][8] */
    float *dm;    /* Q2_K: dmin, [n/256][8] */
} g2panel;

static inline int64_t g2_kp(int64_t n) { return (n + 31) & ~(int64_t)31; }
static inline uint8_t *g2_align(uint8_t *p) { return (uint8_t *)(((uintptr_t)p + 63) & ~(uintptr_t)63); }

/* bytes of scratch a thread needs for n inputs: two half panels and the row-major decode buffer */
static int64_t KSUF(gemm_scratch)(int64_t n) {
    const int64_t kp = g2_kp(n);
    const int64_t half = 8 * kp + 64 * (kp / 32) + 2 * 32 * (kp / 32) + 32 * 8 * (kp / 256 + 1) + 64 * (kp / 256 + 1) + 6 * 64;
    return 2 * half + 8 * kp + 128;
}

static void KSUF(gemm_panels)(uint8_t *scratch, int64_t n, g2panel *pa, uint8_t **rm) {
    const int64_t kp = g2_kp(n);
    uint8_t *p = g2_align(scratch);
    for (int h = 0; h < 2; h++) {
        pa[h].wq = p;
        p = g2_align(p + 8 * kp);
        pa[h].sc = (float *)p;
        p = g2_align(p + 64 * (kp / 32));
        pa[h].nc = (int32_t *)p;
        p = g2_align(p + 32 * (kp / 32));
        pa[h].gs = (int32_t *)p;
        p = g2_align(p + 32 * (kp / 32));
        pa[h].mz = (int32_t *)p;
        p = g2_align(p + 32 * 8 * (kp / 256 + 1));
        pa[h].dm = (float *)p;
        p = g2_align(p + 64 * (kp / 256 + 1));
    }
    *rm = p;
}

/* ---- row decoders: codes of one row into rm (n bytes), its scales into column r of the half ---- */

static void KSUF(g2_row_q8_0)(const uint8_t *row, int64_t n, uint8_t *rm, g2panel *P, int r) {
    for (int64_t b = 0; b < n / 32; b++) {
        memcpy(rm + 32 * b, row + 34 * b + 2, 32);
        P->sc[8 * b + r] = KERN_F16(kern_rd16(row + 34 * b));
    }
}

static void KSUF(g2_row_iq2_xxs)(const uint8_t *row, int64_t n, uint8_t *rm, g2panel *P, int r) {
    for (int64_t b = 0; b < n / 256; b++) {
        const uint8_t *blk = row + 66 * b;
        const float d = KERN_F16(kern_rd16(blk));
        for (int g = 0; g < 8; g++) {
            const uint8_t *q = blk + 2 + 8 * g;
            const uint32_t aux = kern_rd32(q + 4);
            __m256i sv; /* the group's grid bytes and sign rows, as the row kernel (kern_q8_body.h) */
            const __m256i gv = KSUF(iq2_group)(q, aux, &sv);
            _mm256_storeu_si256((__m256i *)(rm + 256 * b + 32 * g), _mm256_sign_epi8(gv, sv));
            P->gs[8 * (8 * b + g) + r] = (int32_t)(2 * (aux >> 28) + 1); /* d (0.5 + s) / 4 = (d / 8)(2 s + 1) */
        }
        P->sc[8 * b + r] = d; /* (integer group scales, the block's d, the 1/8 at the end: as AVX-512) */
    }
}

static void KSUF(g2_row_q2_k)(const uint8_t *row, int64_t n, uint8_t *rm, g2panel *P, int r) {
    const __m256i m3 = _mm256_set1_epi8(3);
    for (int64_t b = 0; b < n / 256; b++) {
        const uint8_t *blk = row + 84 * b;
        /* values 128h + 32j + l are (qs[32h + l] >> 2j) & 3 of sub-block 8h + 2j (l < 16) or
         * 8h + 2j + 1: a 128-bit lane's byte table [0, s, 2s, 3s] (3s <= 45: no carries) */
        for (int h = 0; h < 2; h++) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * h));
            for (int j = 0; j < 4; j++) {
                const int s0 = blk[8 * h + 2 * j] & 15, s1 = blk[8 * h + 2 * j + 1] & 15;
                const __m256i tab = _mm256_setr_m128i(_mm_set1_epi32(s0 * 0x03020100), _mm_set1_epi32(s1 * 0x03020100));
                const __m256i c = _mm256_and_si256(_mm256_srli_epi16(q, 2 * j), m3);
                _mm256_storeu_si256((__m256i *)(rm + 256 * b + 128 * h + 32 * j), _mm256_shuffle_epi8(tab, c));
            }
        }
        P->sc[8 * b + r] = KERN_F16(kern_rd16(blk + 80));
        P->dm[8 * b + r] = KERN_F16(kern_rd16(blk + 82));
        for (int j = 0; j < 8; j++)
            P->mz[8 * (8 * b + j) + r] = (int32_t)((uint32_t)(blk[2 * j] >> 4) | ((uint32_t)(blk[2 * j + 1] >> 4) << 16));
    }
}

/* 8 x 8 dword transpose: in[r] = dwords 0..7 of row r -> out[j] = dword j of rows 0..7 */
KI void g2_transpose8(__m256i *v) {
    __m256i t[8], u[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_epi32(v[2 * i], v[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_epi32(v[2 * i], v[2 * i + 1]);
    }
    /* u[4a + b], 128-bit lane L: rows 4a..4a+3 of dword 4L + b */
    for (int a = 0; a < 2; a++) {
        u[4 * a + 0] = _mm256_unpacklo_epi64(t[4 * a], t[4 * a + 2]);
        u[4 * a + 1] = _mm256_unpackhi_epi64(t[4 * a], t[4 * a + 2]);
        u[4 * a + 2] = _mm256_unpacklo_epi64(t[4 * a + 1], t[4 * a + 3]);
        u[4 * a + 3] = _mm256_unpackhi_epi64(t[4 * a + 1], t[4 * a + 3]);
    }
    for (int b = 0; b < 4; b++) {
        v[b] = _mm256_permute2x128_si256(u[b], u[4 + b], 0x20);
        v[4 + b] = _mm256_permute2x128_si256(u[b], u[4 + b], 0x31);
    }
}

typedef void (*g2_row_fn)(const uint8_t *row, int64_t n, uint8_t *rm, g2panel *P, int r);

/* decode rows [r0, r0 + rows) (rows <= 8; the others are zeros) and repack */
static void KSUF(g2_pack)(g2_row_fn dec, int is_signed, const uint8_t *W, ptrdiff_t stride, int64_t n, int64_t r0,
                          int rows, uint8_t *rm, g2panel *P) {
    const int64_t kp = g2_kp(n), ng = n / 32;
    for (int r = 0; r < 8; r++) {
        if (r < rows) {
            dec(W + (r0 + r) * stride, n, rm + r * kp, P, r);
            memset(rm + r * kp + n, 0, (size_t)(kp - n));
        } else {
            memset(rm + r * kp, 0, (size_t)kp);
        }
    }
    if (rows < 8) { /* scales of the missing rows: zero (their outputs are not stored) */
        for (int64_t g = 0; g < ng; g++)
            for (int r = rows; r < 8; r++) P->sc[8 * g + r] = 0.0, P->gs[8 * g + r] = 0;
        for (int64_t b = 0; b < n / 256; b++)
            for (int r = rows; r < 8; r++) {
                P->dm[8 * b + r] = 0.0;
                for (int j = 0; j < 8; j++) P->mz[8 * (8 * b + j) + r] = 0;
            }
    }
    for (int64_t c = 0; c < kp / 32; c++) {
        __m256i v[8];
        for (int r = 0; r < 8; r++) v[r] = _mm256_loadu_si256((const __m256i *)(rm + r * kp + 32 * c));
        g2_transpose8(v);
        for (int j = 0; j < 8; j++) _mm256_store_si256((__m256i *)(P->wq + 32 * (8 * c + j)), v[j]);
    }
    if (is_signed) { /* -128 * the sum of each row's 32 codes of a group: maddubs(1, w) + madd(1) */
        const __m256i ones8 = _mm256_set1_epi8(1), ones16 = _mm256_set1_epi16(1);
        for (int64_t g = 0; g < ng; g++) {
            __m256i s = _mm256_setzero_si256();
            for (int q = 0; q < 8; q++)
                s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, _mm256_load_si256(
                                                                   (const __m256i *)(P->wq + 32 * (8 * g + q)))),
                                                           ones16));
            _mm256_store_si256((__m256i *)(P->nc + 8 * g), _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(s, 7)));
        }
    }
}

KI __m256i g2_bcast(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* f (8 rows of a half panel) + (sc * dx) * (float)a, each step rounded to float32 (ds4's order) */
KI __m256 g2_acc8(__m256 f, __m256i a, const float *sc, __m256 dx) {
    return _mm256_add_ps(f, _mm256_mul_ps(_mm256_mul_ps(_mm256_load_ps(sc), dx), _mm256_cvtepi32_ps(a)));
}

/* a Q2_K block's 8 lanes (kern_q2k_block, lane by lane: q2k_terms8, kern_q8_body.h) */
KI __m256 g2_q2k8(__m256i isum, __m256i summs, const float *d, const float *dmin, __m256 dx) {
    return q2k_terms8(isum, summs, _mm256_load_ps(d), _mm256_load_ps(dmin), dx);
}

/* the 8 results of a half panel for one token: rows past `rows` are not stored */
KI void g2_store(float *y, __m256 f, int rows) {
    if (rows >= 8) {
        _mm256_storeu_ps(y, f);
    } else {
        const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        _mm256_maskstore_ps(y, _mm256_cmpgt_epi32(_mm256_set1_epi32(rows), lane), f);
    }
}

/* 32 products of 8 rows x 4 codes, pair sums exact in int16 (see the top), into int32 lanes */
#define G2_DOT(acc, u, s) _mm256_add_epi32((acc), _mm256_madd_epi16(_mm256_maddubs_epi16((u), (s)), ones16))

/* signed codes (Q8_0, IQ2_XXS): nh half panels of 8 rows x nt tokens.  IQ2_XXS (offset = 1): x =
 * activation codes + 128, unsigned against the signed codes, from the packed correction; Q8_0
 * (offset = 0): x = the signed codes, |w| against x with w's sign.  xd: the activation scales (token
 * t, group g: xd[t * ldd + (g >> dsh)]) */
KI void g2_tile_signed(const g2panel *P, const int nh, const int nt, const int offset, int64_t n, const uint8_t *x,
                       const float *xd, int64_t ldd, int dsh, float *y, int64_t ldy, const int *rows) {
    const __m256i ones16 = _mm256_set1_epi16(1);
    __m256 f[2][G2_TT];
    __m256i acc[2][G2_TT];
    for (int h = 0; h < nh; h++)
        for (int t = 0; t < nt; t++) f[h][t] = _mm256_setzero_ps();
    for (int64_t g = 0; g < n / 32; g++) {
        for (int h = 0; h < nh; h++) {
            const __m256i nc = offset ? _mm256_load_si256((const __m256i *)(P[h].nc + 8 * g)) : _mm256_setzero_si256();
            for (int t = 0; t < nt; t++) acc[h][t] = nc;
        }
        for (int q = 0; q < 8; q++) {
            __m256i w[2], wa[2];
            for (int h = 0; h < nh; h++) {
                w[h] = _mm256_load_si256((const __m256i *)(P[h].wq + 32 * (8 * g + q)));
                if (!offset) wa[h] = _mm256_sign_epi8(w[h], w[h]);
            }
            for (int t = 0; t < nt; t++) {
                const __m256i xb = g2_bcast(x + t * n + 32 * g + 4 * q);
                for (int h = 0; h < nh; h++)
                    acc[h][t] = offset ? G2_DOT(acc[h][t], xb, w[h]) : G2_DOT(acc[h][t], wa[h], _mm256_sign_epi8(xb, w[h]));
            }
        }
        for (int t = 0; t < nt; t++) {
            const __m256 dx = _mm256_set1_ps(xd[t * ldd + (g >> dsh)]);
            for (int h = 0; h < nh; h++) f[h][t] = g2_acc8(f[h][t], acc[h][t], P[h].sc + 8 * g, dx);
        }
    }
    for (int h = 0; h < nh; h++)
        for (int t = 0; t < nt; t++) g2_store(y + t * ldy + 8 * h, f[h][t], rows[h]);
}

/* IQ2_XXS: signed codes against x = activation codes + 128, from the packed correction; a group's
 * exact sum times its integer scale 2 s + 1 adds up in int32 over the block, then one float64
 * multiply-add per block applies d / 8 times the activation scale (as the AVX-512 form) */
KI void g2_tile_iq2(const g2panel *P, const int nh, const int nt, int64_t n, const uint8_t *x, const float *xd,
                    float *y, int64_t ldy, const int *rows) {
    const __m256i ones16 = _mm256_set1_epi16(1);
    __m256 f[2][G2_TT];
    __m256i acc[2][G2_TT], bs[2][G2_TT];
    for (int h = 0; h < nh; h++)
        for (int t = 0; t < nt; t++) f[h][t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < n / 256; b++) {
        for (int h = 0; h < nh; h++)
            for (int t = 0; t < nt; t++) bs[h][t] = _mm256_setzero_si256();
        for (int64_t g = 8 * b; g < 8 * b + 8; g++) {
            for (int h = 0; h < nh; h++) {
                const __m256i nc = _mm256_load_si256((const __m256i *)(P[h].nc + 8 * g));
                for (int t = 0; t < nt; t++) acc[h][t] = nc;
            }
            for (int q = 0; q < 8; q++) {
                __m256i w[2];
                for (int h = 0; h < nh; h++) w[h] = _mm256_load_si256((const __m256i *)(P[h].wq + 32 * (8 * g + q)));
                for (int t = 0; t < nt; t++) {
                    const __m256i xb = g2_bcast(x + t * n + 32 * g + 4 * q);
                    for (int h = 0; h < nh; h++) acc[h][t] = G2_DOT(acc[h][t], xb, w[h]);
                }
            }
            for (int h = 0; h < nh; h++) {
                const __m256i gs = _mm256_load_si256((const __m256i *)(P[h].gs + 8 * g));
                for (int t = 0; t < nt; t++) bs[h][t] = _mm256_add_epi32(bs[h][t], _mm256_mullo_epi32(acc[h][t], gs));
            }
        }
        for (int t = 0; t < nt; t++) {
            const __m256 dx = _mm256_set1_ps(xd[t * (n / 256) + b]);
            for (int h = 0; h < nh; h++) f[h][t] = g2_acc8(f[h][t], bs[h][t], P[h].sc + 8 * b, dx);
        }
    }
    for (int h = 0; h < nh; h++)
        for (int t = 0; t < nt; t++) g2_store(y + t * ldy + 8 * h, _mm256_mul_ps(_mm256_set1_ps(0.125f), f[h][t]), rows[h]);
}

/* Q2_K: codes times sub-block scale (unsigned) x signed activation codes xq; minimums from the
 * int16 sums of 16 codes xs (token t: xs + t * (n / 16)) */
KI void g2_tile_q2_k(const g2panel *P, const int nh, const int nt, int64_t n, const int8_t *xq, const float *xd,
                     const int16_t *xs, float *y, int64_t ldy, const int *rows) {
    const __m256i ones16 = _mm256_set1_epi16(1);
    __m256 f[2][G2_TT];
    __m256i acc[2][G2_TT], is[2][G2_TT];
    for (int h = 0; h < nh; h++)
        for (int t = 0; t < nt; t++) f[h][t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < n / 256; b++) {
        for (int h = 0; h < nh; h++)
            for (int t = 0; t < nt; t++) acc[h][t] = _mm256_setzero_si256();
        for (int q = 0; q < 64; q++) {
            __m256i w[2];
            for (int h = 0; h < nh; h++) w[h] = _mm256_load_si256((const __m256i *)(P[h].wq + 32 * (64 * b + q)));
            for (int t = 0; t < nt; t++) {
                const __m256i xb = g2_bcast(xq + t * n + 256 * b + 4 * q);
                for (int h = 0; h < nh; h++) acc[h][t] = G2_DOT(acc[h][t], w[h], xb);
            }
        }
        for (int h = 0; h < nh; h++)
            for (int t = 0; t < nt; t++) {
                is[h][t] = acc[h][t];
                acc[h][t] = _mm256_setzero_si256();
            }
        for (int j = 0; j < 8; j++) {
            __m256i m[2];
            for (int h = 0; h < nh; h++) m[h] = _mm256_load_si256((const __m256i *)(P[h].mz + 8 * (8 * b + j)));
            for (int t = 0; t < nt; t++) {
                const __m256i bb = g2_bcast(xs + t * (n / 16) + 16 * b + 2 * j);
                for (int h = 0; h < nh; h++) acc[h][t] = _mm256_add_epi32(acc[h][t], _mm256_madd_epi16(m[h], bb));
            }
        }
        for (int t = 0; t < nt; t++) {
            const __m256 dx = _mm256_set1_ps(xd[t * (n / 256) + b]);
            for (int h = 0; h < nh; h++)
                f[h][t] = _mm256_add_ps(f[h][t], g2_q2k8(is[h][t], acc[h][t], P[h].sc + 8 * b, P[h].dm + 8 * b, dx));
        }
    }
    for (int h = 0; h < nh; h++)
        for (int t = 0; t < nt; t++) g2_store(y + t * ldy + 8 * h, f[h][t], rows[h]);
}

#define G2_TILE_CASES(CALL, nh)                                                                                 \
    switch (nt) {                                                                                              \
    case 1: CALL(nh, 1); break;                                                                                \
    default: CALL(nh, 2); break;                                                                               \
    }

/* y[t*ldy + r] = W[r] . x_t, rows r0..r1-1, all T tokens: 16-row panels (the last may be 8 or
 * fewer rows), decoded and packed once, then every token tile over them */
#define G2_KERNEL(fmt, dec, is_signed, TILE)                                                                    \
    static void KSUF(q8g_##fmt)(const uint8_t *W, ptrdiff_t stride, int64_t n, int64_t r0, int64_t r1,          \
                                const int8_t *xq, const uint8_t *xu, const float *xd, const int16_t *xs,         \
                                int64_t T, float *y, int64_t ldy, uint8_t *scratch) {                            \
        (void)xq; (void)xu; (void)xs;                                                                            \
        g2panel P[2];                                                                                            \
        uint8_t *rm;                                                                                             \
        KSUF(gemm_panels)(scratch, n, P, &rm);                                                                   \
        for (int64_t p = r0; p < r1; p += 16) {                                                                  \
            const int64_t left = r1 - p;                                                                         \
            const int nh = left > 8 ? 2 : 1;                                                                     \
            int rows[2] = {0, 0};                                                                                \
            for (int h = 0; h < nh; h++) {                                                                       \
                rows[h] = left - 8 * h >= 8 ? 8 : (int)(left - 8 * h);                                           \
                KSUF(g2_pack)(KSUF(dec), is_signed, W, stride, n, p + 8 * h, rows[h], rm, &P[h]);                \
            }                                                                                                    \
            for (int64_t t0 = 0; t0 < T; t0 += G2_TT) {                                                          \
                const int nt = T - t0 >= G2_TT ? G2_TT : (int)(T - t0);                                          \
                float *yt = y + t0 * ldy + p;                                                                    \
                if (nh == 2) {                                                                                   \
                    G2_TILE_CASES(TILE, 2)                                                                       \
                } else {                                                                                         \
                    G2_TILE_CASES(TILE, 1)                                                                       \
                }                                                                                                \
            }                                                                                                    \
        }                                                                                                        \
    }

#define G2_TILE_Q8_0(nh, nt) g2_tile_signed(P, nh, nt, 0, n, (const uint8_t *)xq + t0 * n, xd + t0 * (n / 32), n / 32, 0, yt, ldy, rows)
#define G2_TILE_IQ2(nh, nt) g2_tile_iq2(P, nh, nt, n, xu + t0 * n, xd + t0 * (n / 256), yt, ldy, rows)
#define G2_TILE_Q2K(nh, nt) g2_tile_q2_k(P, nh, nt, n, xq + t0 * n, xd + t0 * (n / 256), xs + t0 * (n / 16), yt, ldy, rows)
G2_KERNEL(q8_0, g2_row_q8_0, 0, G2_TILE_Q8_0)
G2_KERNEL(iq2_xxs, g2_row_iq2_xxs, 1, G2_TILE_IQ2)
G2_KERNEL(q2_k, g2_row_q2_k, 0, G2_TILE_Q2K)

static void KSUF(fill_gemm)(kern_isa *k) {
    k->q8g[KT_Q8_0] = KSUF(q8g_q8_0);
    k->q8g[KT_IQ2_XXS] = KSUF(q8g_iq2_xxs);
    k->q8g[KT_Q2_K] = KSUF(q8g_q2_k);
    k->q8g_scratch = KSUF(gemm_scratch);
    k->q8g_xu[KT_IQ2_XXS] = 1; /* Q8_0 takes the sign move on xq (see the top) */
    /* where the GEMM form overtakes the row kernels (scripts/bench_kernels.py finds the crossover
     * per format on a machine).  Q8_0 pays a sign move per product here (4 instructions per 32
     * products against 3) and crosses late, but past kernels.Q8_MAX_T (8) tokens the alternative
     * is the float kernels, slower than the GEMM form, so its minimum is the first T they would
     * take */
    k->q8g_min_t[KT_Q8_0] = 9;
    k->q8g_min_t[KT_IQ2_XXS] = 6;
    k->q8g_min_t[KT_Q2_K] = 6;
}
