/* Integer-activation GEMM for many tokens (AVX-512 VNNI build only; ds4 numerics, prefill).
 *
 * The row kernels of kern_q8_body.h decode a weight block in registers and multiply it into up to
 * 8 tokens, with the block's scales applied per dot product; past a few tokens the decoding and the
 * per-block scale work cost more than the products.  Here a panel of 16 rows is decoded once into
 * int8 codes and repacked so that one zmm holds 4 consecutive codes of each of the 16 rows
 * (wq[k/4][row][4]: lanes are rows).  A token's 4 codes broadcast to all lanes, and one vpdpbusd
 * then takes 64 exact products for 16 rows: the scales, which are per row, become lane vectors
 * applied once per 32 codes (once per 256 for Q2_K).
 *
 * vpdpbusd multiplies unsigned by signed bytes:
 *  - Q8_0 and IQ2_XXS codes are signed (IQ2_XXS: grid value times sign, |w| <= 43): the activation
 *    codes are offset to unsigned (x + 128: they are never -128) and 128 * sum(w) of each 32-group
 *    is subtracted (precomputed per row at packing, the accumulator's start value);
 *  - Q2_K codes times their 4-bit sub-block scale (0..45) are unsigned: the activation codes stay
 *    signed, and the minimums term sum_s m_s * bsum_s takes one vpdpwssd per two sub-blocks.
 * Integer sums are exact; per block (Q8_0: 32 codes; IQ2_XXS, Q2_K: 256) the lane vector of the
 * 16 rows' integers goes into float32 as ds4's CPU path takes it (kern_q8.c): times the float32
 * product of the row scale and the activation scale, added to a float32 accumulator, the blocks in
 * order -- the reference's steps, bit for bit, lane by lane (engine/model/ds4_matmul.py).  A
 * token's sums do not depend on T or on its place in a tile. */

#define G_TT 4 /* tokens per tile (and 2 x 16 rows): 8 int32 + 8 float accumulators */

/* panel of 16 rows; kp = n rounded up to 64 */
typedef struct {
    uint8_t *wq;   /* [kp/4][16][4] */
    float *sc;     /* per block (Q8_0: 32 codes; Q2_K, IQ2_XXS: 256) and row: [blocks][16], the block's d */
    int32_t *nc;   /* signed codes: -128 * sum of the group's codes, [n/32][16] */
    int32_t *gs;   /* IQ2_XXS: the integer group scales 2 s + 1, [n/32][16] */
    int32_t *mz;   /* Q2_K: minimums of sub-blocks 2j, 2j+1 as int16 pairs, [n/256][8][16] */
    float *dm;     /* Q2_K: dmin, [n/256][16] */
} gpanel;

static inline int64_t g_kp(int64_t n) { return (n + 63) & ~(int64_t)63; }

/* bytes of scratch a thread needs for n inputs: two panels and the row-major decode buffer */
static int64_t KSUF(gemm_scratch)(int64_t n) {
    const int64_t kp = g_kp(n);
    const int64_t panel = 16 * kp + 128 * (kp / 32) + 2 * 64 * (kp / 32) + 64 * 8 * (kp / 256 + 1) + 128 * (kp / 256 + 1) + 6 * 64;
    return 2 * panel + 16 * kp + 128;
}

static inline uint8_t *g_align(uint8_t *p) { return (uint8_t *)(((uintptr_t)p + 63) & ~(uintptr_t)63); }

static void KSUF(gemm_panels)(uint8_t *scratch, int64_t n, gpanel *pa, uint8_t **rm) {
    const int64_t kp = g_kp(n);
    uint8_t *p = g_align(scratch);
    for (int h = 0; h < 2; h++) {
        pa[h].wq = p;
        p = g_align(p + 16 * kp);
        pa[h].sc = (float *)p;
        p = g_align(p + 128 * (kp / 32));
        pa[h].nc = (int32_t *)p;
        p = g_align(p + 64 * (kp / 32));
        pa[h].gs = (int32_t *)p;
        p = g_align(p + 64 * (kp / 32));
        pa[h].mz = (int32_t *)p;
        p = g_align(p + 64 * 8 * (kp / 256 + 1));
        pa[h].dm = (float *)p;
        p = g_align(p + 128 * (kp / 256 + 1));
    }
    *rm = p;
}

/* ---- row decoders: codes of one row into rm (n bytes), its scales into column r of the panel ---- */

static void KSUF(g_row_q8_0)(const uint8_t *row, int64_t n, uint8_t *rm, gpanel *P, int r) {
    for (int64_t b = 0; b < n / 32; b++) {
        PF1(row + 34 * b); /* (the rows stream from L3 or DRAM: without it the copy waited on its loads) */
        memcpy(rm + 32 * b, row + 34 * b + 2, 32);
        P->sc[16 * b + r] = KERN_F16(kern_rd16(row + 34 * b));
    }
}

/* an IQ2_XXS block's scales into column r: the dequantizer's d * (0.5 + s) * 0.25 of group g is
 * (d / 8) * (2 s + 1), as ds4's dot product takes it: the 8 group scales go in as integers (2 s + 1,
 * applied to the group's exact sum in int32), the block's d with the activation scale per block,
 * and the 1/8 once at the end (g_tile_iq2) */
KI void KSUF(g_iq2_scales)(const uint8_t *blk, float d, gpanel *P, int64_t b, int r) {
    for (int g = 0; g < 8; g++) P->gs[16 * (8 * b + g) + r] = (int32_t)(2 * (kern_rd32(blk + 2 + 8 * g + 4) >> 28) + 1);
    P->sc[16 * b + r] = d;
}

static void KSUF(g_row_iq2_xxs)(const uint8_t *row, int64_t n, uint8_t *rm, gpanel *P, int r) {
    const __m512i zero = _mm512_setzero_si512();
    for (int64_t b = 0; b < n / 256; b++) {
        const uint8_t *blk = row + 66 * b;
        const float d = KERN_F16(kern_rd16(blk));
        __m256i a0, a1;
        long long sgq[4];
        _mm256_storeu_si256((__m256i *)sgq, KSUF(iq2xxs_signs)(blk + 2, &a0, &a1));
        for (int p = 0; p < 4; p++) {
            __mmask64 neg;
            const __m512i gv = KSUF(iq2_pair)(blk + 2, sgq, p, &neg);
            _mm512_storeu_si512((void *)(rm + 256 * b + 64 * p), _mm512_mask_sub_epi8(gv, neg, zero, gv));
        }
        KSUF(g_iq2_scales)(blk, d, P, b, r);
    }
}

static void KSUF(g_row_q2_k)(const uint8_t *row, int64_t n, uint8_t *rm, gpanel *P, int r) {
    const __m512i m3 = _mm512_set1_epi8(3);
    /* 128-bit lane k of shift j holds sub-block {2j, 2j + 1, 8 + 2j, 9 + 2j}[k] (values 32j.. in
     * the low 256 bits, 128 + 32j.. in the high): its byte table [0, s, 2s, 3s] at dword 0 */
    const __m512i lane_sb[4] = {_mm512_set_epi32(0, 0, 0, 9, 0, 0, 0, 8, 0, 0, 0, 1, 0, 0, 0, 0),
                                _mm512_set_epi32(0, 0, 0, 11, 0, 0, 0, 10, 0, 0, 0, 3, 0, 0, 0, 2),
                                _mm512_set_epi32(0, 0, 0, 13, 0, 0, 0, 12, 0, 0, 0, 5, 0, 0, 0, 4),
                                _mm512_set_epi32(0, 0, 0, 15, 0, 0, 0, 14, 0, 0, 0, 7, 0, 0, 0, 6)};
    for (int64_t b = 0; b < n / 256; b++) {
        const uint8_t *blk = row + 84 * b;
        PF2(blk); /* (a panel's rows stream from L3: the first load of a block waited a fifth of the time) */
        /* q * s for q = 0..3 as the bytes of s * 0x03020100 (3s <= 45: no carries), per sub-block */
        const __m512i tabs = _mm512_mullo_epi32(
            _mm512_cvtepu8_epi32(_mm_and_si128(_mm_loadu_si128((const __m128i *)blk), _mm_set1_epi8(15))),
            _mm512_set1_epi32(0x03020100));
        const __m512i q = _mm512_loadu_si512((const void *)(blk + 16));
        for (int j = 0; j < 4; j++) {
            const __m512i w = _mm512_shuffle_epi8(_mm512_permutexvar_epi32(lane_sb[j], tabs),
                                                  _mm512_and_si512(_mm512_srli_epi16(q, 2 * j), m3));
            _mm256_storeu_si256((__m256i *)(rm + 256 * b + 32 * j), _mm512_castsi512_si256(w));
            _mm256_storeu_si256((__m256i *)(rm + 256 * b + 128 + 32 * j), _mm512_extracti64x4_epi64(w, 1));
        }
        P->sc[16 * b + r] = KERN_F16(kern_rd16(blk + 80));
        P->dm[16 * b + r] = KERN_F16(kern_rd16(blk + 82));
        for (int j = 0; j < 8; j++)
            P->mz[16 * (8 * b + j) + r] = (int32_t)((uint32_t)(blk[2 * j] >> 4) | ((uint32_t)(blk[2 * j + 1] >> 4) << 16));
    }
}

/* 16 x 16 dword transpose: in[r] = dwords 0..15 of row r -> out[j] = dword j of rows 0..15 */
KI void g_transpose16(__m512i *v) {
    __m512i t[16], u[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]);
    }
    /* u[4a + b], 128-bit lane L: rows 4a..4a+3 of dword 4L + b */
    for (int a = 0; a < 4; a++) {
        u[4 * a + 0] = _mm512_unpacklo_epi64(t[4 * a], t[4 * a + 2]);
        u[4 * a + 1] = _mm512_unpackhi_epi64(t[4 * a], t[4 * a + 2]);
        u[4 * a + 2] = _mm512_unpacklo_epi64(t[4 * a + 1], t[4 * a + 3]);
        u[4 * a + 3] = _mm512_unpackhi_epi64(t[4 * a + 1], t[4 * a + 3]);
    }
    for (int b = 0; b < 4; b++) {
        const __m512i e0 = _mm512_shuffle_i32x4(u[b], u[4 + b], 0x88), o0 = _mm512_shuffle_i32x4(u[b], u[4 + b], 0xDD);
        const __m512i e1 = _mm512_shuffle_i32x4(u[8 + b], u[12 + b], 0x88), o1 = _mm512_shuffle_i32x4(u[8 + b], u[12 + b], 0xDD);
        v[b] = _mm512_shuffle_i32x4(e0, e1, 0x88);
        v[8 + b] = _mm512_shuffle_i32x4(e0, e1, 0xDD);
        v[4 + b] = _mm512_shuffle_i32x4(o0, o1, 0x88);
        v[12 + b] = _mm512_shuffle_i32x4(o0, o1, 0xDD);
    }
}

/* a packed panel's missing rows' scales (zero: their outputs are not stored) and, for signed codes,
 * each group's -128 * sum of its codes (any order of a group's 32 codes in wq[8g..8g+7] sums the same) */
static void KSUF(g_pack_tail)(int64_t n, int rows, int is_signed, gpanel *P) {
    const int64_t ng = n / 32;
    if (rows < 16) {
        for (int64_t g = 0; g < ng; g++)
            for (int r = rows; r < 16; r++) P->sc[16 * g + r] = 0.0f, P->gs[16 * g + r] = 0;
        for (int64_t b = 0; b < n / 256; b++)
            for (int r = rows; r < 16; r++) {
                P->dm[16 * b + r] = 0.0f;
                for (int j = 0; j < 8; j++) P->mz[16 * (8 * b + j) + r] = 0;
            }
    }
    if (is_signed) {
        const __m512i ones = _mm512_set1_epi8(1);
        for (int64_t g = 0; g < ng; g++) {
            __m512i s = _mm512_setzero_si512();
            for (int q = 0; q < 8; q++)
                s = _mm512_dpbusd_epi32(s, ones, _mm512_load_si512((const void *)(P->wq + 64 * (8 * g + q))));
            _mm512_store_si512((void *)(P->nc + 16 * g), _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(s, 7)));
        }
    }
}

typedef void (*g_row_fn)(const uint8_t *row, int64_t n, uint8_t *rm, gpanel *P, int r);

/* decode rows [r0, r0 + rows) (rows <= 16; the others are zeros) and repack */
static void KSUF(g_pack)(g_row_fn dec, int is_signed, const uint8_t *W, ptrdiff_t stride, int64_t n, int64_t r0,
                         int rows, uint8_t *rm, gpanel *P) {
    const int64_t kp = g_kp(n);
    for (int r = 0; r < 16; r++) {
        if (r < rows) {
            dec(W + (r0 + r) * stride, n, rm + r * kp, P, r);
            memset(rm + r * kp + n, 0, (size_t)(kp - n));
        } else {
            memset(rm + r * kp, 0, (size_t)kp);
        }
    }
    for (int64_t c = 0; c < kp / 64; c++) {
        __m512i v[16];
        for (int r = 0; r < 16; r++) v[r] = _mm512_loadu_si512((const void *)(rm + r * kp + 64 * c));
        g_transpose16(v);
        for (int j = 0; j < 16; j++) _mm512_store_si512((void *)(P->wq + 64 * (16 * c + j)), v[j]);
    }
    KSUF(g_pack_tail)(n, rows, is_signed, P);
}

/* f (16 rows of a panel) + (sc * dx) * (float)a: a block's 16 integers (int32 lanes) times the
 * rows' scales sc times the token's scale dx, each step rounded to float32 (ds4's order) */
KI __m512 g_acc16(__m512 f, __m512i a, const float *sc, __m512 dx) {
    return _mm512_add_ps(f, _mm512_mul_ps(_mm512_mul_ps(_mm512_load_ps(sc), dx), _mm512_cvtepi32_ps(a)));
}

/* a Q2_K block's 16 lanes (kern_q2k_block, lane by lane): (float)((double)isum * (double)(dx * d)
 * - (double)(((float)summs * dx) * dmin)).  q2k_terms8 (kern_q8_body.h, the AVX2 GEMM form's and
 * one-token rows') is the same per lane, but two of them here made the Q2_K GEMM form 1.06-1.08x
 * slower at 12-32 tokens (Zen 4): the 512-bit form stays */
KI __m512 g_q2k16(__m512i isum, __m512i summs, const float *d, const float *dmin, __m512 dx) {
    const __m512 dall = _mm512_mul_ps(dx, _mm512_load_ps(d));
    const __m512 mins = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(summs), dx), _mm512_load_ps(dmin));
    __m256 h[2];
    for (int k = 0; k < 2; k++) {
        const __m512d i = _mm512_cvtepi32_pd(k ? _mm512_extracti64x4_epi64(isum, 1) : _mm512_castsi512_si256(isum));
        const __m512d da = _mm512_cvtps_pd(k ? _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(dall), 1))
                                             : _mm512_castps512_ps256(dall));
        const __m512d mi = _mm512_cvtps_pd(k ? _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(mins), 1))
                                             : _mm512_castps512_ps256(mins));
        h[k] = _mm512_cvtpd_ps(_mm512_sub_pd(_mm512_mul_pd(i, da), mi));
    }
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(h[0])), _mm256_castps_pd(h[1]), 1));
}

/* the 16 rows' results, rows outside mask m not stored */
KI void g_store16(float *y, __m512 f, __mmask16 m) { _mm512_mask_storeu_ps(y, m, f); }

KI __m512i g_bcast(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* group g's exact integer dots of signed codes (Q8_0, IQ2_XXS): acc[h][t] = the panel's -128 * sum(w)
 * correction (nc) + sum (x + 128) * w over the group's 32 values, for nh panels x nt tokens */
KI void g_group_dots(const gpanel *P, const int nh, const int nt, int64_t n, const uint8_t *xu, int64_t g,
                     __m512i acc[2][G_TT]) {
    for (int h = 0; h < nh; h++) {
        const __m512i nc = _mm512_load_si512((const void *)(P[h].nc + 16 * g));
        for (int t = 0; t < nt; t++) acc[h][t] = nc;
    }
    for (int q = 0; q < 8; q++) {
        __m512i w[2];
        for (int h = 0; h < nh; h++) w[h] = _mm512_load_si512((const void *)(P[h].wq + 64 * (8 * g + q)));
        for (int t = 0; t < nt; t++) {
            const __m512i xb = g_bcast(xu + t * n + 32 * g + 4 * q);
            for (int h = 0; h < nh; h++) acc[h][t] = _mm512_dpbusd_epi32(acc[h][t], xb, w[h]);
        }
    }
}

/* signed codes (Q8_0, IQ2_XXS): nh panels of 16 rows x nt tokens; xu = activation codes + 128 (n
 * apart), xd their scales (token t, group g: xd[t * ldd + (g >> dsh)]) */
KI void g_tile_signed(const gpanel *P, const int nh, const int nt, int64_t n, const uint8_t *xu, const float *xd,
                      int64_t ldd, int dsh, float *y, int64_t ldy, const __mmask16 *mk) {
    __m512 f[2][G_TT];
    __m512i acc[2][G_TT];
    for (int h = 0; h < nh; h++)
        for (int t = 0; t < nt; t++) f[h][t] = _mm512_setzero_ps();
    for (int64_t g = 0; g < n / 32; g++) {
        g_group_dots(P, nh, nt, n, xu, g, acc);
        for (int t = 0; t < nt; t++) {
            const __m512 dx = _mm512_set1_ps(xd[t * ldd + (g >> dsh)]);
            for (int h = 0; h < nh; h++) f[h][t] = g_acc16(f[h][t], acc[h][t], P[h].sc + 16 * g, dx);
        }
    }
    for (int h = 0; h < nh; h++)
        for (int t = 0; t < nt; t++) g_store16(y + t * ldy + 16 * h, f[h][t], mk[h]);
}

/* IQ2_XXS: signed codes against xu = activation codes + 128 (n apart); a group's exact sum times its
 * integer scale 2 s + 1 adds up in int32 over the block's 8 groups (|sum| <= 8 * 31 * 32 * 43 * 127
 * < 2^31), then one float64 multiply-add per block applies d / 8 times the activation scale (token
 * t, block b: xd[t * (n / 256) + b]) */
KI void g_tile_iq2(const gpanel *P, const int nh, const int nt, int64_t n, const uint8_t *xu, const float *xd,
                   float *y, int64_t ldy, const __mmask16 *mk) {
    __m512 f[2][G_TT];
    __m512i acc[2][G_TT], bs[2][G_TT];
    for (int h = 0; h < nh; h++)
        for (int t = 0; t < nt; t++) f[h][t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < n / 256; b++) {
        for (int h = 0; h < nh; h++)
            for (int t = 0; t < nt; t++) bs[h][t] = _mm512_setzero_si512();
        for (int64_t g = 8 * b; g < 8 * b + 8; g++) {
            g_group_dots(P, nh, nt, n, xu, g, acc);
            for (int h = 0; h < nh; h++) {
                const __m512i gs = _mm512_load_si512((const void *)(P[h].gs + 16 * g));
                for (int t = 0; t < nt; t++) bs[h][t] = _mm512_add_epi32(bs[h][t], _mm512_mullo_epi32(acc[h][t], gs));
            }
        }
        for (int t = 0; t < nt; t++) {
            const __m512 dx = _mm512_set1_ps(xd[t * (n / 256) + b]);
            for (int h = 0; h < nh; h++) f[h][t] = g_acc16(f[h][t], bs[h][t], P[h].sc + 16 * b, dx);
        }
    }
    for (int h = 0; h < nh; h++)
        for (int t = 0; t < nt; t++) g_store16(y + t * ldy + 16 * h, _mm512_mul_ps(_mm512_set1_ps(0.125f), f[h][t]), mk[h]);
}

/* Q2_K: codes times sub-block scale (unsigned) x signed activation codes xq; minimums from the
 * int16 sums of 16 codes xs (token t: xs + t * (n / 16)) */
KI void g_tile_q2_k(const gpanel *P, const int nh, const int nt, int64_t n, const int8_t *xq, const float *xd,
                    const int16_t *xs, float *y, int64_t ldy, const __mmask16 *mk) {
    __m512 f[2][G_TT];
    __m512i acc[2][G_TT], is[2][G_TT];
    for (int h = 0; h < nh; h++)
        for (int t = 0; t < nt; t++) f[h][t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < n / 256; b++) {
        for (int h = 0; h < nh; h++)
            for (int t = 0; t < nt; t++) acc[h][t] = _mm512_setzero_si512();
        for (int q = 0; q < 64; q++) {
            __m512i w[2];
            for (int h = 0; h < nh; h++) w[h] = _mm512_load_si512((const void *)(P[h].wq + 64 * (64 * b + q)));
            for (int t = 0; t < nt; t++) {
                const __m512i xb = g_bcast(xq + t * n + 256 * b + 4 * q);
                for (int h = 0; h < nh; h++) acc[h][t] = _mm512_dpbusd_epi32(acc[h][t], w[h], xb);
            }
        }
        for (int h = 0; h < nh; h++)
            for (int t = 0; t < nt; t++) {
                is[h][t] = acc[h][t];
                acc[h][t] = _mm512_setzero_si512();
            }
        for (int j = 0; j < 8; j++) {
            __m512i m[2];
            for (int h = 0; h < nh; h++) m[h] = _mm512_load_si512((const void *)(P[h].mz + 16 * (8 * b + j)));
            for (int t = 0; t < nt; t++) {
                const __m512i bb = g_bcast(xs + t * (n / 16) + 16 * b + 2 * j);
                for (int h = 0; h < nh; h++) acc[h][t] = _mm512_dpwssd_epi32(acc[h][t], m[h], bb);
            }
        }
        for (int t = 0; t < nt; t++) {
            const __m512 dx = _mm512_set1_ps(xd[t * (n / 256) + b]);
            for (int h = 0; h < nh; h++)
                f[h][t] = _mm512_add_ps(f[h][t], g_q2k16(is[h][t], acc[h][t], P[h].sc + 16 * b, P[h].dm + 16 * b, dx));
        }
    }
    for (int h = 0; h < nh; h++)
        for (int t = 0; t < nt; t++) g_store16(y + t * ldy + 16 * h, f[h][t], mk[h]);
}

#define G_TILE_CASES(CALL, nh)                                                                                  \
    switch (nt) {                                                                                              \
    case 1: CALL(nh, 1); break;                                                                                \
    case 2: CALL(nh, 2); break;                                                                                \
    case 3: CALL(nh, 3); break;                                                                                \
    default: CALL(nh, 4); break;                                                                               \
    }

/* y[t*ldy + r] = W[r] . x_t, rows r0..r1-1, all T tokens: 32-row panels (the last may be 16 or
 * fewer rows), decoded and packed once, then every token tile over them */
#define G_KERNEL(fmt, PACK, TILE)                                                                     \
    static void KSUF(q8g_##fmt)(const uint8_t *W, ptrdiff_t stride, int64_t n, int64_t r0, int64_t r1,          \
                                const int8_t *xq, const uint8_t *xu, const float *xd, const int16_t *xs,         \
                                int64_t T, float *y, int64_t ldy, uint8_t *scratch) {                            \
        (void)xq; (void)xu; (void)xs;                                                                            \
        gpanel P[2];                                                                                             \
        uint8_t *rm;                                                                                             \
        KSUF(gemm_panels)(scratch, n, P, &rm);                                                                   \
        for (int64_t p = r0; p < r1; p += 32) {                                                                  \
            const int64_t left = r1 - p;                                                                         \
            const int nh = left > 16 ? 2 : 1;                                                                    \
            __mmask16 mk[2] = {0, 0};                                                                            \
            for (int h = 0; h < nh; h++) {                                                                       \
                const int64_t rows = left - 16 * h >= 16 ? 16 : left - 16 * h;                                   \
                mk[h] = (__mmask16)((1u << rows) - 1u);                                                          \
                PACK;                                                                                            \
            }                                                                                                    \
            for (int64_t t0 = 0; t0 < T; t0 += G_TT) {                                                           \
                const int nt = T - t0 >= G_TT ? G_TT : (int)(T - t0);                                            \
                float *yt = y + t0 * ldy + p;                                                                    \
                if (nh == 2) {                                                                                   \
                    G_TILE_CASES(TILE, 2)                                                                        \
                } else {                                                                                         \
                    G_TILE_CASES(TILE, 1)                                                                        \
                }                                                                                                \
            }                                                                                                    \
        }                                                                                                        \
    }

#define G_TILE_Q8_0(nh, nt) g_tile_signed(P, nh, nt, n, xu + t0 * n, xd + t0 * (n / 32), n / 32, 0, yt, ldy, mk)
#define G_TILE_IQ2(nh, nt) g_tile_iq2(P, nh, nt, n, xu + t0 * n, xd + t0 * (n / 256), yt, ldy, mk)
#define G_TILE_Q2K(nh, nt) g_tile_q2_k(P, nh, nt, n, xq + t0 * n, xd + t0 * (n / 256), xs + t0 * (n / 16), yt, ldy, mk)
/* PACK: decode rows p + 16 h .. (rows of them) into panel P[h] */
#define G_PACK_ROWS(dec, is_signed) KSUF(g_pack)(KSUF(dec), is_signed, W, stride, n, p + 16 * h, (int)rows, rm, &P[h])
G_KERNEL(q8_0, G_PACK_ROWS(g_row_q8_0, 1), G_TILE_Q8_0)
G_KERNEL(iq2_xxs, G_PACK_ROWS(g_row_iq2_xxs, 1), G_TILE_IQ2)
G_KERNEL(q2_k, G_PACK_ROWS(g_row_q2_k, 0), G_TILE_Q2K)

static void KSUF(fill_gemm)(kern_isa *k) {
    k->q8g[KT_Q8_0] = KSUF(q8g_q8_0);
    k->q8g[KT_IQ2_XXS] = KSUF(q8g_iq2_xxs);
    k->q8g[KT_Q2_K] = KSUF(q8g_q2_k);
    k->q8g_scratch = KSUF(gemm_scratch);
    k->q8g_xu[KT_Q8_0] = k->q8g_xu[KT_IQ2_XXS] = 1; /* signed codes against x + 128 */
    /* where the GEMM form overtakes the row kernels (2-core Zen 4, 2 threads, 64 experts / a dense
     * 4096 x 8192 matrix, best of 6-8: the row kernels / GEMM time ratio was 1.11 / 1.14 / 1.22 at
     * T = 6 / 7 / 8 for IQ2_XXS, 0.95 / 0.97 / 1.13 at T = 6 / 7 / 8 for Q2_K (its row kernel keeps
     * both sums in vector lanes), 0.79 / 1.26 at T = 6 / 8 for Q8_0; kern_iq2_vbmi.h moves IQ2_XXS) */
    k->q8g_min_t[KT_Q8_0] = 8;
    k->q8g_min_t[KT_IQ2_XXS] = 6;
    k->q8g_min_t[KT_Q2_K] = 8;
}
