/* IQ2_XXS decoded with byte permutes (AVX-512 VBMI + GFNI: Ice Lake, Zen 4 and later), included by
 * kern_avx512.c after kern_q8_body.h and kern_gemm_body.h; its functions carry their own target.
 *
 * The plain AVX-512 kernels compose a group pair's 64 grid bytes from 8 row loads and inserts
 * (about 7-10 cycles on Zen 4 out of 13 a pair).  Here the grid rows never leave registers:
 *  - every grid row is 8 coordinates in {0x08, 0x19, 0x2B}, i.e. 16 bits of 2-bit codes; the low
 *    and high code bytes of all 256 rows are two 256-byte tables, and one block's 32 indices go
 *    through both at once (2 vpermi2b per 128 entries, a blend on the index's top bit);
 *  - one gf2p8affineqb maps a 2-bit code c to its value: with b0, b1 the bits of c (never both
 *    set), 8 + 17 c + (c > 1) is bit0 = b0 ^ b1, bit1 = b1, bit4 = b0, bit5 = b1, plus the constant
 *    0x08 -- linear over GF(2); its matrix can take the two bits from any place in the byte;
 *  - the 7-bit sign fields go through the 128-entry kern_ksigns table with one vpermi2b.
 * The row kernels (decode, T <= a few tokens) and the GEMM form's panels (g_pack_iq2v) never spread
 * an index's codes to its 8 value bytes: they keep the values in code-byte order (iq2v_rows: vector j holds code j of every low and high code
 * byte), with the sign masks transposed out of the sign bytes, the group scales applied once per
 * block, and the activations arranged to match once a job (iq2v_reorder, as kern_isa.q8_arrange);
 * at one token two rows are packed per block (iq2v_rows2).  Both the packed rows and the
 * code-byte order raised the decode read rate from DRAM (scripts/bench_kernels.py measures it).
 * Sums are exact integers per block; each block's goes into float32 as in the plain kernel (times
 * the float32 product of the scales, added in block order: ds4's order, kern_q8.c). */

#define IQ2V_T __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,gfni,avx2,fma,f16c")))
#define IQ2V_I IQ2V_T static inline __attribute__((always_inline))

/* tables, built once by iq2v_init (module init, one thread) */
static uint8_t iq2v_lo[256] __attribute__((aligned(64))); /* codes of coordinates 0..3 of each grid row */
static uint8_t iq2v_hi[256] __attribute__((aligned(64))); /* 4..7 */
static uint8_t iq2v_sf[64] __attribute__((aligned(64)));    /* multishift: byte 8g + l <- sign field l of group g */
/* two rows' blocks packed into one vector (iq2v_rows2): index bytes, aux words */
static uint8_t iq2v_ci[64] __attribute__((aligned(64)));  /* byte 4g + l <- index (g, l) of row A; 32 + 4g + l of B */
static uint8_t iq2v_ca[64] __attribute__((aligned(64)));  /* dword g <- aux word g of row A; dword 8 + g of B */

static void iq2v_init_rows(void);
static void iq2v_init_reorder(void);
static void iq2v_init_gemm(void);

static void iq2v_init(void) {
    for (int i = 0; i < 256; i++) {
        unsigned code = 0;
        for (int j = 0; j < 8; j++) {
            const uint8_t v = kern_iq2xxs_grid[8 * i + j];
            code |= (unsigned)(v == 0x08 ? 0 : v == 0x19 ? 1 : 2) << (2 * j);
        }
        iq2v_lo[i] = (uint8_t)code;
        iq2v_hi[i] = (uint8_t)(code >> 8);
    }
    /* a block's 64 bytes after its scale: group g = bytes 8g..8g+7, indices at 8g + l (l < 4), then
     * the aux word (4 sign fields of 7 bits, the scale in the top 4 bits) */
    for (int a = 0; a < 8; a++)
        for (int b = 0; b < 8; b++) iq2v_sf[8 * a + b] = (uint8_t)(b < 4 ? 32 + 7 * b : 0);
    for (int r = 0; r < 2; r++)
        for (int g = 0; g < 8; g++)
            for (int l = 0; l < 4; l++) {
                iq2v_ci[32 * r + 4 * g + l] = (uint8_t)(64 * r + 8 * g + l);
                iq2v_ca[32 * r + 4 * g + l] = (uint8_t)(64 * r + 8 * g + 4 + l);
            }
    iq2v_init_rows();
    iq2v_init_reorder();
    iq2v_init_gemm();
}

/* a block's code bytes: lc / hc byte 8g + l = low / high codes of index (g, l); ks byte 8g + l =
 * its 8 sign bits.  The other bytes hold junk from the aux words (never selected). */
IQ2V_I void iq2v_block(const __m512i q, __m512i *lc, __m512i *hc, __m512i *ks) {
    const __mmask64 top = _mm512_movepi8_mask(q);
    const __m512i *L = (const __m512i *)iq2v_lo, *H = (const __m512i *)iq2v_hi;
    /* the sign fields' table: kern_ksigns (7-bit field -> 8 sign bits, even parity) */
    const __m512i S0 = _mm512_loadu_si512((const void *)kern_ksigns), S1 = _mm512_loadu_si512((const void *)(kern_ksigns + 64));
    *lc = _mm512_mask_blend_epi8(top, _mm512_permutex2var_epi8(L[0], q, L[1]), _mm512_permutex2var_epi8(L[2], q, L[3]));
    *hc = _mm512_mask_blend_epi8(top, _mm512_permutex2var_epi8(H[0], q, H[1]), _mm512_permutex2var_epi8(H[2], q, H[3]));
    *ks = _mm512_permutex2var_epi8(S0, _mm512_multishift_epi64_epi8(_mm512_load_si512(iq2v_sf), q), S1);
}

/* The row kernels' order of a block's 256 values (the activations are arranged to match once a
 * job, iq2v_reorder): 4 vectors j of 64 bytes, byte p < 32 = coordinate j of index p, byte
 * 32 + p = coordinate 4 + j of index p, indices in group order (index (g, l) = 4 g + l).  A byte of
 * low (high) codes holds the 2-bit codes of coordinates 0..3 (4..7) of its index, so one
 * gf2p8affineqb per vector picks code j of every byte and maps it to its value (a matrix per j):
 * no byte spreading before it.  The signs come out of the same order with one more
 * gf2p8affineqb, used as an 8 x 8 bit transpose: with the unit vectors as data and a qword of 8
 * indices' sign bytes as the matrix, output byte k holds coordinate k's signs of those 8 indices,
 * and a byte permute turns them into each vector's 64-bit mask.  The group of byte p is (p % 32) / 4:
 * dword m of a vpdpbusd sums group m % 8, where the group scales apply. */
static uint8_t iq2v_l1[64] __attribute__((aligned(64))); /* one row: byte p <- low (p < 32) / high codes of index p % 32 */
static uint8_t iq2v_l2[2][64] __attribute__((aligned(64))); /* two packed rows: row r's LH bytes */
static uint8_t iq2v_kc[64] __attribute__((aligned(64))); /* one row: sign bytes compacted, qword q = indices 8q + 7 .. 8q */
static uint8_t iq2v_mk[64] __attribute__((aligned(64))); /* qword 4 r + j <- row r's mask bytes of vector j */
static uint8_t iq2v_s2[64] __attribute__((aligned(64))); /* two rows: multishift, byte 8m + 7 - b <- field of index 8m + b */

static void iq2v_init_rows(void) {
    for (int p = 0; p < 64; p++) {
        const int i = p % 32, hi = p >= 32;
        iq2v_l1[p] = (uint8_t)(64 * hi + 8 * (i / 4) + i % 4);
        for (int r = 0; r < 2; r++) iq2v_l2[r][p] = (uint8_t)(64 * hi + 32 * r + i);
    }
    for (int q = 0; q < 8; q++)
        for (int i = 0; i < 8; i++) {
            const int x = 8 * q + i, g = (x % 32) / 4, l = x % 4;   /* index x of the block (q < 4) */
            iq2v_kc[8 * q + 7 - i] = (uint8_t)(8 * g + l);
            /* packed aux qword m = groups 2m, 2m + 1: index 8m + b has its field at 7 (b % 4) + 32 (b / 4) */
            iq2v_s2[8 * q + 7 - i] = (uint8_t)(7 * (i % 4) + 32 * (i / 4));
        }
    for (int r = 0; r < 2; r++)
        for (int j = 0; j < 4; j++)
            for (int q = 0; q < 8; q++)
                iq2v_mk[8 * (4 * r + j) + q] = (uint8_t)(32 * r + 8 * (q % 4) + j + 4 * (q / 4));
}

/* gf2p8affineqb matrix of vector j: code bits 2j, 2j + 1 -> the value 8 + 17 c + (c > 1) (with the
 * constant 0x08): output bit 0 = b0 ^ b1, bit 1 = b1, bit 4 = b0, bit 5 = b1 (the row of output bit
 * i is byte 7 - i) */
IQ2V_I __m512i iq2v_map(int j) {
    const unsigned long long b0 = 1ULL << (2 * j), b1 = 2ULL << (2 * j);
    return _mm512_set1_epi64((long long)(((b0 | b1) << 56) | (b1 << 48) | (b0 << 24) | (b1 << 16)));
}

/* the 4 sign masks of a row's block from its 32 sign bytes: ks qword q = indices 8q + 7 .. 8q
 * (byte 8q + 7 - i = index 8q + i); neg[j] = mask of vector j */
IQ2V_I void iq2v_masks(__m512i ks, unsigned long long *neg) {
    const __m512i unit = _mm512_set1_epi64((long long)0x8040201008040201ULL);
    _mm512_storeu_si512((void *)neg, _mm512_permutexvar_epi8(_mm512_load_si512(iq2v_mk),
                                                             _mm512_gf2p8affine_epi64_epi8(unit, ks, 0)));
}

/* the sum of a vector's two 256-bit halves, int32 lanes (the two dwords of each group) */
IQ2V_I __m256i iq2v_half8(__m512i v) { return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1)); }

/* out[t] = row . x_t for nt tokens; xr = the arranged activation codes (iq2v_reorder), n apart */
IQ2V_I void iq2v_rows(const uint8_t *W, int64_t nb, int64_t n, const int8_t *xr, const float *xd, float *out,
                      const int nt) {
    float acc[Q8_NT];
    for (int t = 0; t < nt; t++) acc[t] = 0.0f;
    const __m512i zero = _mm512_setzero_si512();
    const __m512i *L = (const __m512i *)iq2v_lo, *H = (const __m512i *)iq2v_hi;
    const __m512i S0 = _mm512_loadu_si512((const void *)kern_ksigns), S1 = _mm512_loadu_si512((const void *)(kern_ksigns + 64));
    /* dword m (group m % 8) <- the scale 2 s + 1 of group m % 8, from dword 2 (m % 8) + 1 (its aux word) */
    const __m512i sidx = _mm512_set_epi32(15, 13, 11, 9, 7, 5, 3, 1, 15, 13, 11, 9, 7, 5, 3, 1);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = W + 66 * b;
        PF2(blk);
        const float d = KERN_F16(kern_rd16(blk));
        const __m512i q = _mm512_loadu_si512((const void *)(blk + 2));
        const __mmask64 top = _mm512_movepi8_mask(q);
        const __m512i lc = _mm512_mask_blend_epi8(top, _mm512_permutex2var_epi8(L[0], q, L[1]), _mm512_permutex2var_epi8(L[2], q, L[3]));
        const __m512i hc = _mm512_mask_blend_epi8(top, _mm512_permutex2var_epi8(H[0], q, H[1]), _mm512_permutex2var_epi8(H[2], q, H[3]));
        const __m512i lh = _mm512_permutex2var_epi8(lc, _mm512_load_si512(iq2v_l1), hc);
        const __m512i ks = _mm512_permutex2var_epi8(S0, _mm512_multishift_epi64_epi8(_mm512_load_si512(iq2v_sf), q), S1);
        unsigned long long neg[8];
        iq2v_masks(_mm512_permutexvar_epi8(_mm512_load_si512(iq2v_kc), ks), neg);
        const __m512i ls = _mm512_permutexvar_epi32(
            sidx, _mm512_add_epi32(_mm512_slli_epi32(_mm512_srli_epi32(q, 28), 1), _mm512_set1_epi32(1)));
        __m512i is[Q8_NT];
        for (int t = 0; t < nt; t++) is[t] = zero;
        for (int j = 0; j < 4; j++) {
            const __m512i gv = _mm512_gf2p8affine_epi64_epi8(lh, iq2v_map(j), 0x08);
            const __mmask64 m = _cvtu64_mask64(neg[j]);
            for (int t = 0; t < nt; t++) {
                const __m512i xv = _mm512_loadu_si512((const void *)(xr + t * n + 256 * b + 64 * j));
                is[t] = _mm512_dpbusd_epi32(is[t], gv, _mm512_mask_sub_epi8(xv, m, zero, xv));
            }
        }
        /* |lane| <= 16 * 43 * 127 before the scale (<= 31), so the two lanes of a group (m, m + 8)
         * add exactly in int32 (iq2v_half8) */
        for (int t = 0; t < nt; t++)
            acc[t] += (d * xd[t * (n / 256) + b]) * (float)q8_hsum(iq2v_half8(_mm512_mullo_epi32(is[t], ls)));
    }
    for (int t = 0; t < nt; t++) out[t] = 0.125f * acc[t];
}

/* Decode (one token), two rows A and B (A + stride): row . x for both, bit for bit as iq2v_rows.
 * On Intel a 512-bit loop issues vector uops to two ports only (p0, p5), and a one-row block set-up
 * spends half its lanes on junk (the aux words go through the code tables, the index bytes through
 * the sign path).  Here the two rows' blocks are packed first -- their 32 + 32 index bytes into one
 * vector, their 8 + 8 aux words into another -- so each table lookup and the sign transpose serve
 * both rows (by count ~27 vector uops a block-row, against ~42 for the one-row set-up of the earlier order).
 * The group scales go in as integers and the block's as one float64 multiply-add, as in iq2v_rows:
 * the same integers in the same lanes and the same float64 sums. */
IQ2V_I void iq2v_rows2(const uint8_t *W, ptrdiff_t stride, int64_t nb, const int8_t *xr, const float *xd,
                       float *out) {
    const __m512i zero = _mm512_setzero_si512();
    const __m512i *L = (const __m512i *)iq2v_lo, *H = (const __m512i *)iq2v_hi;
    const __m512i L0 = L[0], L1 = L[1], L2 = L[2], L3 = L[3], H0 = H[0], H1 = H[1], H2 = H[2], H3 = H[3];
    const __m512i S0 = _mm512_loadu_si512((const void *)kern_ksigns), S1 = _mm512_loadu_si512((const void *)(kern_ksigns + 64));
    const __m512i ci = _mm512_load_si512(iq2v_ci), ca = _mm512_load_si512(iq2v_ca);
    const __m512i l2a = _mm512_load_si512(iq2v_l2[0]), l2b = _mm512_load_si512(iq2v_l2[1]);
    const __m512i s2 = _mm512_load_si512(iq2v_s2);
    const __m512i map[4] = {iq2v_map(0), iq2v_map(1), iq2v_map(2), iq2v_map(3)};
    /* dword m (group m % 8) <- packed dword m % 8 (row A) or 8 + m % 8 (row B) */
    const __m512i la = _mm512_set_epi32(7, 6, 5, 4, 3, 2, 1, 0, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i lb = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 15, 14, 13, 12, 11, 10, 9, 8);
    float acc0 = 0.0f, acc1 = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *ba = W + 66 * b, *bb = W + stride + 66 * b;
        PF2(ba);
        PF2(bb);
        const float da = KERN_F16(kern_rd16(ba)) * xd[b], db = KERN_F16(kern_rd16(bb)) * xd[b];
        const __m512i qa = _mm512_loadu_si512((const void *)(ba + 2)), qb = _mm512_loadu_si512((const void *)(bb + 2));
        const __m512i idx = _mm512_permutex2var_epi8(qa, ci, qb);
        const __m512i aux = _mm512_permutex2var_epi8(qa, ca, qb);
        const __mmask64 top = _mm512_movepi8_mask(idx);
        const __m512i lc = _mm512_mask_blend_epi8(top, _mm512_permutex2var_epi8(L0, idx, L1), _mm512_permutex2var_epi8(L2, idx, L3));
        const __m512i hc = _mm512_mask_blend_epi8(top, _mm512_permutex2var_epi8(H0, idx, H1), _mm512_permutex2var_epi8(H2, idx, H3));
        const __m512i lha = _mm512_permutex2var_epi8(lc, l2a, hc), lhb = _mm512_permutex2var_epi8(lc, l2b, hc);
        unsigned long long neg[8]; /* row r, vector j: qword 4 r + j */
        iq2v_masks(_mm512_permutex2var_epi8(S0, _mm512_multishift_epi64_epi8(s2, aux), S1), neg);
        const __m512i ls = _mm512_add_epi32(_mm512_slli_epi32(_mm512_srli_epi32(aux, 28), 1), _mm512_set1_epi32(1));
        __m512i ia = zero, ib = zero;
        for (int j = 0; j < 4; j++) {
            const __m512i xv = _mm512_loadu_si512((const void *)(xr + 256 * b + 64 * j));
            const __m512i ga = _mm512_gf2p8affine_epi64_epi8(lha, map[j], 0x08);
            const __m512i gb = _mm512_gf2p8affine_epi64_epi8(lhb, map[j], 0x08);
            ia = _mm512_dpbusd_epi32(ia, ga, _mm512_mask_sub_epi8(xv, _cvtu64_mask64(neg[j]), zero, xv));
            ib = _mm512_dpbusd_epi32(ib, gb, _mm512_mask_sub_epi8(xv, _cvtu64_mask64(neg[4 + j]), zero, xv));
        }
        acc0 += da * (float)q8_hsum(iq2v_half8(_mm512_mullo_epi32(ia, _mm512_permutexvar_epi32(la, ls))));
        acc1 += db * (float)q8_hsum(iq2v_half8(_mm512_mullo_epi32(ib, _mm512_permutexvar_epi32(lb, ls))));
    }
    out[0] = 0.125f * acc0;
    out[1] = 0.125f * acc1;
}

/* activation codes in the row kernels' order: block b's vector j, byte p <- value 32 g + 8 l + c of
 * index p % 32 = (g, l), coordinate c = j (p < 32) or 4 + j: two vpermi2b over the block's halves
 * and a blend on g >= 4 (byte p % 32 >= 16) per vector */
static uint8_t iq2v_xo[4][64] __attribute__((aligned(64)));

static void iq2v_init_reorder(void) {
    for (int j = 0; j < 4; j++)
        for (int p = 0; p < 64; p++) {
            const int i = p % 32;
            iq2v_xo[j][p] = (uint8_t)((32 * (i / 4) + 8 * (i % 4) + j + 4 * (p / 32)) % 128);
        }
}

IQ2V_T static void iq2v_reorder(const int8_t *xq, int64_t n, int64_t T, int8_t *xr) {
    const __mmask64 upper = 0xFFFF0000FFFF0000ULL; /* bytes whose value lies in the block's second half */
    for (int64_t o = 0; o < T * n; o += 256) {
        const __m512i z0 = _mm512_loadu_si512((const void *)(xq + o)), z1 = _mm512_loadu_si512((const void *)(xq + o + 64));
        const __m512i z2 = _mm512_loadu_si512((const void *)(xq + o + 128)), z3 = _mm512_loadu_si512((const void *)(xq + o + 192));
        for (int j = 0; j < 4; j++) {
            const __m512i c = _mm512_load_si512(iq2v_xo[j]);
            _mm512_storeu_si512((void *)(xr + o + 64 * j),
                                _mm512_mask_blend_epi8(upper, _mm512_permutex2var_epi8(z0, c, z1), _mm512_permutex2var_epi8(z2, c, z3)));
        }
    }
}

#define IQ2V_CALL(k) iq2v_rows(row, nb, n, xqt, xdt, out, k)
/* kern_q8_fn: xq in iq2v_reorder's order (kern_isa.q8_arrange) */
IQ2V_T static void iq2v_q8k(const uint8_t *W, ptrdiff_t stride, int64_t n, int64_t r0, int64_t r1, const int8_t *xq,
                            const float *xd, const int16_t *xs, int64_t T, float *y, int64_t ldy) {
    const int64_t nb = n / 256;
    float out[Q8_NT];
    int64_t r = r0;
    if (T == 1) /* decode: rows in pairs */
        for (; r + 2 <= r1; r += 2) {
            iq2v_rows2(W + r * stride, stride, nb, xq, xd, out);
            y[r] = out[0];
            y[r + 1] = out[1];
        }
    Q8_ROWS(r, r1, xq, 256, IQ2V_CALL)
}

/* GEMM panels in the row kernels' code-byte order.  A group's 32 products may be taken in any
 * order as long as the activations follow the weights, so the panel keeps what one
 * gf2p8affineqb per vector gives (iq2v_rows' vector j) and the activations are arranged to match
 * once a job (iq2v_gemm_arrange): no per-index byte spreading (a vpermi2b and a vpmultishiftqb per
 * 64 values) and no row-major buffer between the decode and the transpose.  Dword d of vector j
 * holds coordinate c = j + 4 (d / 8) of the 4 indices of group g = d % 8, so every dword stays in
 * one group: it goes to panel slot 8 g + s, s = 2 j + d / 8, of its block; within the group, byte
 * l of slot s is value 8 l + c.
 * vpdpbusd wants one unsigned side: here the weights, w + 64 (|w| <= 43; the affine map's constant
 * 0x48 adds the 64, as no grid value has bit 6), against the signed activation codes; the extra
 * 64 * sum(x) of a group comes off per token from the Q8_K block sums the batch has anyway (xs, 16
 * values each), so no per-row code sums are packed.  The group sums are the same exact integers as
 * the value-order form's, and the group scales and float64 multiply-adds the same: bit for bit. */
static uint8_t iq2v_gx[64] __attribute__((aligned(64))); /* byte 32 h + 4 s + l <- 32 h + 8 l + s / 2 + 4 (s % 2) */
/* byte p < 32 <- the sign byte of index p (iq2v_block's ks), 32 + 4 g + l <- byte l of group g's aux word (the block's) */
static uint8_t iq2v_sb[64] __attribute__((aligned(64)));

static void iq2v_init_gemm(void) {
    for (int i = 0; i < 64; i++) {
        const int s = (i % 32) / 4, l = i % 4;
        iq2v_gx[i] = (uint8_t)(32 * (i / 32) + 8 * l + s / 2 + 4 * (s % 2));
        iq2v_sb[i] = (uint8_t)(i < 32 ? 8 * (i / 4) + i % 4 : 64 + 8 * ((i - 32) / 4) + 4 + i % 4);
    }
}

/* kern_isa.q8g_arrange: xu = the (signed) codes in the panel's order */
IQ2V_T static void iq2v_gemm_arrange(const int8_t *xq, int64_t n, int64_t T, int8_t *xu) {
    const __m512i c = _mm512_load_si512(iq2v_gx);
    for (int64_t o = 0; o < T * n; o += 64) /* (n is a multiple of 256) */
        _mm512_storeu_si512((void *)(xu + o), _mm512_permutexvar_epi8(c, _mm512_loadu_si512((const void *)(xq + o))));
}

/* G_KERNEL's PACK: rows r0 .. r0 + rows - 1 (rows <= 16; the others zeros) into panel P, block by
 * block.  gf2p8affineqb maps every byte on its own, so the 16 rows' code bytes lh (iq2v_rows') are
 * transposed once to 16 dwords of 16 rows, and each of the 4 maps then gives 16 panel slots: one
 * transpose a block-row instead of one per vector.  The sign bytes go through the same transpose
 * (sb dword g = the sign bytes of group g's indices): a byte of vector j tests bit j (first half)
 * or 4 + j (second half) of its index's; sb's other half carries the aux words (dword 8 + g), so
 * the group scales come out as lane vectors too. */
IQ2V_T static void g_pack_iq2v(const uint8_t *W, ptrdiff_t stride, int64_t n, int64_t r0, int rows, gpanel *P) {
    const __m512i zero = _mm512_setzero_si512(), c128 = _mm512_set1_epi8((char)0x80), one = _mm512_set1_epi32(1);
    const __m512i map[4] = {iq2v_map(0), iq2v_map(1), iq2v_map(2), iq2v_map(3)};
    const __m512i l1 = _mm512_load_si512(iq2v_l1), sbc = _mm512_load_si512(iq2v_sb);
    for (int64_t b = 0; b < n / 256; b++) {
        __m512i lh[16], sb[16];
        for (int r = 0; r < 16; r++) {
            if (r >= rows) {
                lh[r] = sb[r] = zero;
                P->sc[16 * b + r] = 0.0f; /* (missing rows' outputs are not stored) */
                continue;
            }
            const uint8_t *blk = W + (r0 + r) * stride + 66 * b;
            /* the same block of the next panel's row: 16 rows read block by block are 16 streams
             * the hardware prefetchers lose (the load took over half the time from L3) */
            PF2(blk + 16 * stride - KERN_PF);
            __m512i lc, hc, ks;
            const __m512i q = _mm512_loadu_si512((const void *)(blk + 2));
            iq2v_block(q, &lc, &hc, &ks);
            lh[r] = _mm512_permutex2var_epi8(lc, l1, hc);
            sb[r] = _mm512_permutex2var_epi8(ks, sbc, q);
            P->sc[16 * b + r] = KERN_F16(kern_rd16(blk)); /* d (the 1/8 at the end: see g_tile_iq2) */
        }
        g_transpose16(lh);
        g_transpose16(sb);
        for (int g = 0; g < 8; g++)
            _mm512_store_si512((void *)(P->gs + 16 * (8 * b + g)),
                               _mm512_add_epi32(_mm512_slli_epi32(_mm512_srli_epi32(sb[8 + g], 28), 1), one));
        uint8_t *wq = P->wq + 64 * 64 * b;
        for (int j = 0; j < 4; j++)
            for (int d = 0; d < 16; d++) {
                const __m512i u = _mm512_gf2p8affine_epi64_epi8(lh[d], map[j], 0x48); /* |w| + 64 */
                const __mmask64 neg = _mm512_test_epi8_mask(sb[d % 8], _mm512_set1_epi8((char)(1 << (j + 4 * (d / 8)))));
                _mm512_store_si512((void *)(wq + 64 * (8 * (d % 8) + 2 * j + d / 8)), _mm512_mask_sub_epi8(u, neg, c128, u)); /* w + 64 */
            }
    }
}

/* as g_tile_iq2, with unsigned weights (w + 64) against signed codes xa (n apart, the panel's order)
 * and -64 * sum(x) of each group from the block sums xs (token t: xs + t * (n / 16)) */
KI void g_tile_iq2u(const gpanel *P, const int nh, const int nt, int64_t n, const uint8_t *xa, const float *xd,
                    const int16_t *xs, float *y, int64_t ldy, const __mmask16 *mk) {
    __m512 f[2][G_TT];
    __m512i acc[2][G_TT], bs[2][G_TT];
    for (int h = 0; h < nh; h++)
        for (int t = 0; t < nt; t++) f[h][t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < n / 256; b++) {
        for (int h = 0; h < nh; h++)
            for (int t = 0; t < nt; t++) bs[h][t] = _mm512_setzero_si512();
        for (int64_t g = 8 * b; g < 8 * b + 8; g++) {
            for (int t = 0; t < nt; t++) {
                const int16_t *s = xs + t * (n / 16) + 2 * g;
                const __m512i c = _mm512_set1_epi32(-64 * ((int32_t)s[0] + (int32_t)s[1]));
                for (int h = 0; h < nh; h++) acc[h][t] = c;
            }
            for (int q = 0; q < 8; q++) {
                __m512i w[2];
                for (int h = 0; h < nh; h++) w[h] = _mm512_load_si512((const void *)(P[h].wq + 64 * (8 * g + q)));
                for (int t = 0; t < nt; t++) {
                    const __m512i xb = g_bcast(xa + t * n + 32 * g + 4 * q);
                    for (int h = 0; h < nh; h++) acc[h][t] = _mm512_dpbusd_epi32(acc[h][t], w[h], xb);
                }
            }
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

#define G_TILE_IQ2U(nh, nt) g_tile_iq2u(P, nh, nt, n, xu + t0 * n, xd + t0 * (n / 256), xs + t0 * (n / 16), yt, ldy, mk)
G_KERNEL(iq2_xxs_vbmi, g_pack_iq2v(W, stride, n, p + 16 * h, (int)rows, &P[h]), G_TILE_IQ2U)

/* Q2_K GEMM panels (this build: vpermb) in the AVX-512 row kernel's pair order (q2k_pair_x, the
 * activations' arrangement here too): slot 16 j + d of a block = dword d of the block's 64 code
 * bytes shifted right by 2 j, i.e. values 32 j + 4 d .. (d < 8) or 128 + 32 j + 4 (d - 8) .. --
 * sub-block 8 (d / 8) + 2 j + (d % 8) / 4.  The 16 rows' code bytes are transposed once a block
 * (to 16 dwords of 16 rows), so a slot is a shift, a mask and one vpermb through a 64-byte table of
 * that sub-block: dword r = row r's [0, s, 2 s, 3 s] (the byte index 4 r + code).  The 16 rows'
 * scales and minimums go through the same transpose (dword k of a row: sub-block k's table; minimum
 * pairs as in g_row_q2_k).  The value-order form decoded a row into a buffer, then transposed 4
 * dwords of codes per value byte; the integer block sums are the same (any order within a block),
 * the minimums and float64 multiply-adds untouched: bit for bit. */
IQ2V_T static void g_pack_q2kv(const uint8_t *W, ptrdiff_t stride, int64_t n, int64_t r0, int rows, gpanel *P) {
    const __m512i zero = _mm512_setzero_si512(), m3 = _mm512_set1_epi8(3), m15 = _mm512_set1_epi32(15);
    const __m512i tabm = _mm512_set1_epi32(0x03020100);
    const __m512i lane4 = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                             _mm512_set1_epi32(0x04040404)); /* byte i <- 4 (i / 4) */
    for (int64_t b = 0; b < n / 256; b++) {
        __m512i qs[16], tb[16], mn[16];
        for (int r = 0; r < 16; r++) {
            if (r >= rows) {
                qs[r] = tb[r] = mn[r] = zero;
                P->sc[16 * b + r] = P->dm[16 * b + r] = 0.0f; /* (missing rows' outputs are not stored) */
                continue;
            }
            const uint8_t *blk = W + (r0 + r) * stride + 84 * b;
            PF2(blk + 16 * stride - KERN_PF); /* the next panel's block (see g_pack_iq2v) */
            const __m128i sb = _mm_loadu_si128((const __m128i *)blk);
            tb[r] = _mm512_mullo_epi32(_mm512_and_si512(_mm512_cvtepu8_epi32(sb), m15), tabm);
            mn[r] = _mm512_zextsi256_si512(_mm256_srli_epi16(_mm256_cvtepu8_epi16(sb), 4));
            qs[r] = _mm512_loadu_si512((const void *)(blk + 16));
            P->sc[16 * b + r] = KERN_F16(kern_rd16(blk + 80));
            P->dm[16 * b + r] = KERN_F16(kern_rd16(blk + 82));
        }
        g_transpose16(qs);
        g_transpose16(tb);
        g_transpose16(mn);
        for (int j = 0; j < 8; j++) _mm512_store_si512((void *)(P->mz + 16 * (8 * b + j)), mn[j]);
        uint8_t *wq = P->wq + 64 * 64 * b;
        for (int j = 0; j < 4; j++)
            for (int d = 0; d < 16; d++) {
                /* (code & 3) | 4 r: the ternary logic's 0xEA is (A & B) | C */
                const __m512i idx = _mm512_ternarylogic_epi32(_mm512_srli_epi16(qs[d], 2 * j), m3, lane4, 0xEA);
                _mm512_store_si512((void *)(wq + 64 * (16 * j + d)),
                                   _mm512_permutexvar_epi8(idx, tb[8 * (d / 8) + 2 * j + (d % 8) / 4]));
            }
    }
}

#define G_TILE_Q2KV(nh, nt) g_tile_q2_k(P, nh, nt, n, (const int8_t *)xu + t0 * n, xd + t0 * (n / 256), xs + t0 * (n / 16), yt, ldy, mk)
G_KERNEL(q2_k_vbmi, g_pack_q2kv(W, stride, n, p + 16 * h, (int)rows, &P[h]), G_TILE_Q2KV)

/* the avx512 build with these IQ2_XXS kernels */
static void fill_iq2_vbmi(kern_isa *k) {
    iq2v_init();
    k->q8[KT_IQ2_XXS] = iq2v_q8k;
    k->q8_arrange[KT_IQ2_XXS] = iq2v_reorder;
    k->q8g[KT_IQ2_XXS] = KSUF(q8g_iq2_xxs_vbmi);
    k->q8g_arrange[KT_IQ2_XXS] = iq2v_gemm_arrange;
    k->q8g[KT_Q2_K] = KSUF(q8g_q2_k_vbmi);
    k->q8g_xu[KT_Q2_K] = 1; /* its own copy of the codes, in the row kernel's order */
    k->q8g_arrange[KT_Q2_K] = KSUF(q2k_pair_x);
    /* the crossover to the GEMM form: with the code-byte-order panels the GEMM costs a product of
     * 2048 x 4096 about what the row kernel does at 3 tokens and 14 % less at 4 (one thread, weights
     * from L3, Xeon with AVX-512 VBMI: scripts/bench_expert_forms.py; it was 9 tokens on a 2-thread
     * Zen 4 with the value-order panels) */
    k->q8g_min_t[KT_IQ2_XXS] = 4;
    /* Q2_K likewise (4096 x 2048: the GEMM form ties the row kernel at 3 tokens, is 20 % cheaper
     * at 4; the value-order panels needed 6-8) */
    k->q8g_min_t[KT_Q2_K] = 4;
    /* the work split's relative costs of a value (Q8_0: the default 4), measured on a decode step's
     * two mixed calls (a layer's 12 routed gate/up matrices with the shared expert's 2, then 6 down
     * matrices with the shared down; 6 layers cycled from DRAM, 2 threads, Sapphire Rapids):
     * - IQ2_XXS: with iq2v_rows2 a value decodes in about half the time a Q8_0 value streams in on
     *   one thread: 2 (3 gave the streaming thread too little work);
     * - Q2_K: 2 (the default 3 overweights it with these kernels) */
    k->q8_cost[KT_IQ2_XXS] = 2;
    k->q8_cost[KT_Q2_K] = 2;
}
