/* AVX-512 build (F, BW, VL, VNNI + F16C + FMA): V16 is one __m512. */
#include "kern.h"

#if defined(__x86_64__) && defined(__GNUC__)

#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")
#include <immintrin.h>

#define KSUF(name) name##_avx512
#define KERN_F16(h) _cvtsh_ss(h)
/* F16C's vcvtph2ps quiets signaling NaNs; numpy (the reference) keeps them: lanes holding an sNaN
 * get the quiet bit cleared again (rare path) */
static inline void f16_row_f16c(const uint8_t *src, float *dst, int64_t n) {
    const __m256i expm = _mm256_set1_epi16(0x7E00), exps = _mm256_set1_epi16(0x7C00);
    const __m256i payload = _mm256_set1_epi16(0x01FF), zero = _mm256_setzero_si256();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m256i h = _mm256_loadu_si256((const __m256i *)(src + 2 * i));
        __m512 f = _mm512_cvtph_ps(h);
        const __m256i snan = _mm256_andnot_si256(_mm256_cmpeq_epi16(_mm256_and_si256(h, payload), zero),
                                                 _mm256_cmpeq_epi16(_mm256_and_si256(h, expm), exps));
        if (__builtin_expect(!_mm256_testz_si256(snan, snan), 0)) {
            const __m512i q = _mm512_and_si512(_mm512_cvtepi16_epi32(snan), _mm512_set1_epi32(0x00400000));
            f = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(f), q));
        }
        _mm512_storeu_ps(dst + i, f);
    }
    for (; i < n; i++) dst[i] = kern_f16_soft(kern_rd16(src + 2 * i));
}
#define KERN_F16_ROW(src, dst, n) f16_row_f16c((src), (dst), (n))

#include "kern_dequant_body.h"

typedef __m512 V16;
#define KI static inline __attribute__((always_inline))
KI V16 vzero(void) { return _mm512_setzero_ps(); }
KI V16 vset1(float f) { return _mm512_set1_ps(f); }
KI V16 vloadu(const void *p) { return _mm512_loadu_ps(p); }
KI void vstoreu(float *p, V16 v) { _mm512_storeu_ps(p, v); }
KI V16 vfma(V16 a, V16 b, V16 c) { return _mm512_fmadd_ps(a, b, c); }
KI V16 vmul(V16 a, V16 b) { return _mm512_mul_ps(a, b); }
KI V16 vadd(V16 a, V16 b) { return _mm512_add_ps(a, b); }
KI V16 vsub(V16 a, V16 b) { return _mm512_sub_ps(a, b); }
KI float vhsum(V16 v) {
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    q = _mm_add_ss(q, _mm_movehdup_ps(q));
    return _mm_cvtss_f32(q);
}
KI V16 v_i8x16(__m128i b) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)); }
KI V16 v_u8x16(__m128i b) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b)); }
typedef __m512i V16I;
KI V16I vi_u8x16_mem(const void *p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)); }
KI V16I vi_and(V16I v, int m) { return _mm512_and_si512(v, _mm512_set1_epi32(m)); }
#define vi_srli(v, n) _mm512_srli_epi32((v), (n))
KI V16 vi_cvt(V16I v) { return _mm512_cvtepi32_ps(v); }
KI V16 v_f16(const void *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
KI V16 v_bf16(const void *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
KI V16 v_2x8(const float *a, const float *b) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_loadu_pd((const double *)a)),
                                               _mm256_loadu_pd((const double *)b), 1));
}
KI V16 v_flip16(V16 g, const uint8_t *m) {
    const __m512i gi = _mm512_castps_si512(g);
    return _mm512_castsi512_ps(_mm512_mask_xor_epi32(gi, _load_mask16((__mmask16 *)m), gi, _mm512_set1_epi32((int)0x80000000u)));
}

/* register tile: 4 rows x up to 4 tokens = 16 accumulators (of 32 zmm) */
#define PRP 4
#define PTT 4
#define KERN_TILES_DEFINE                                                                       \
    KERN_DEF_TILE(4, 1) KERN_DEF_TILE(4, 2) KERN_DEF_TILE(4, 3) KERN_DEF_TILE(4, 4)             \
    KERN_DEF_TILE(1, 1) KERN_DEF_TILE(1, 2) KERN_DEF_TILE(1, 3) KERN_DEF_TILE(1, 4)
#define KERN_TILE_CALL_FULL(nt, w, ldw, x, ldx, n16, res)                                       \
    switch (nt) {                                                                               \
    case 1: tile_4_1_avx512(w, ldw, x, ldx, n16, res); break;                                   \
    case 2: tile_4_2_avx512(w, ldw, x, ldx, n16, res); break;                                   \
    case 3: tile_4_3_avx512(w, ldw, x, ldx, n16, res); break;                                   \
    default: tile_4_4_avx512(w, ldw, x, ldx, n16, res); break;                                  \
    }
#define KERN_TILE_CALL_ONE(nt, w, ldw, x, ldx, n16, res)                                        \
    switch (nt) {                                                                               \
    case 1: tile_1_1_avx512(w, ldw, x, ldx, n16, res); break;                                   \
    case 2: tile_1_2_avx512(w, ldw, x, ldx, n16, res); break;                                   \
    case 3: tile_1_3_avx512(w, ldw, x, ldx, n16, res); break;                                   \
    default: tile_1_4_avx512(w, ldw, x, ldx, n16, res); break;                                  \
    }

/* small-T kernels: tokens per pass, and the largest T they are used for */
#define MVT_NT 4
#define MVT_T_MAX 3
#define MVT_CASES34(fmt)                                                                        \
    case 3: KSUF(mvt_row_##fmt)(row, n, xt, n, res, 3); break;                                    \
    default: KSUF(mvt_row_##fmt)(row, n, xt, n, res, 4); break;

#include "kern_simd_body.h"

/* u8 x s8 products summed by 4 into int32 lanes: one VNNI vpdpbusd on 256 bits */
#define Q8_DOT_U8S8(acc, u, s) _mm256_dpbusd_epi32((acc), (u), (s))
#define Q8_HAVE_512 1
#define Q8_NT 8
#include "kern_q8_body.h"
#include "kern_gemm_body.h"
#include "kern_iq2_vbmi.h"

void kern_fill_avx512(kern_isa *k) {
    memset(k, 0, sizeof(*k));
    k->name = "avx512";
    fill_dq_avx512(k);
    fill_simd_avx512(k);
    /* F16 weights (the compressors, router and HC of a decode step): 4 tokens take one in-register
     * pass rather than the panel (a batched decode step of 4 streams; one thread, CPU time,
     * 2-core Xeon VM: a 4096 x 1024 matrix 1.97 ms against 3.03, the 4096 x 256 router 0.49
     * against 0.71; docs/perf-h4.md) */
    k->mvt_max[KT_F16] = 4;
    fill_q8_avx512(k);
    fill_gemm_avx512(k);
}

/* the same build with the VBMI + GFNI IQ2_XXS kernels (kern_iq2_vbmi.h) */
void kern_fill_avx512vbmi(kern_isa *k) {
    kern_fill_avx512(k);
    k->name = "avx512vbmi";
    fill_iq2_vbmi(k);
}

#else

void kern_fill_avx512(kern_isa *k) { memset(k, 0, sizeof(*k)); }
void kern_fill_avx512vbmi(kern_isa *k) { memset(k, 0, sizeof(*k)); }

#endif
