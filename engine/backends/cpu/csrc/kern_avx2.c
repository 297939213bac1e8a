/* AVX2 + FMA + F16C build: V16 is a pair of __m256. */
#include "kern.h"

#if defined(__x86_64__) && defined(__GNUC__)

#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>

#define KSUF(name) name##_avx2
#define KERN_F16(h) _cvtsh_ss(h)
/* F16C's vcvtph2ps quiets signaling NaNs; numpy (the reference) keeps them: lanes holding an sNaN
 * get the quiet bit cleared again (rare path) */
static inline void f16_row_f16c(const uint8_t *src, float *dst, int64_t n) {
    const __m128i expm = _mm_set1_epi16(0x7E00), exps = _mm_set1_epi16(0x7C00);
    const __m128i payload = _mm_set1_epi16(0x01FF), zero = _mm_setzero_si128();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m128i h = _mm_loadu_si128((const __m128i *)(src + 2 * i));
        __m256 f = _mm256_cvtph_ps(h);
        const __m128i snan = _mm_andnot_si128(_mm_cmpeq_epi16(_mm_and_si128(h, payload), zero),
                                              _mm_cmpeq_epi16(_mm_and_si128(h, expm), exps));
        if (__builtin_expect(!_mm_testz_si128(snan, snan), 0)) {
            const __m256i q = _mm256_and_si256(_mm256_cvtepi16_epi32(snan), _mm256_set1_epi32(0x00400000));
            f = _mm256_castsi256_ps(_mm256_xor_si256(_mm256_castps_si256(f), q));
        }
        _mm256_storeu_ps(dst + i, f);
    }
    for (; i < n; i++) dst[i] = kern_f16_soft(kern_rd16(src + 2 * i));
}
#define KERN_F16_ROW(src, dst, n) f16_row_f16c((src), (dst), (n))

#include "kern_dequant_body.h"

typedef struct {
    __m256 a, b;
} V16;
#define KI static inline __attribute__((always_inline))
KI V16 mk(__m256 a, __m256 b) {
    V16 v = {a, b};
    return v;
}
KI V16 vzero(void) { return mk(_mm256_setzero_ps(), _mm256_setzero_ps()); }
KI V16 vset1(float f) { return mk(_mm256_set1_ps(f), _mm256_set1_ps(f)); }
KI V16 vloadu(const void *p) { return mk(_mm256_loadu_ps((const float *)p), _mm256_loadu_ps((const float *)p + 8)); }
KI void vstoreu(float *p, V16 v) {
    _mm256_storeu_ps(p, v.a);
    _mm256_storeu_ps(p + 8, v.b);
}
KI V16 vfma(V16 x, V16 y, V16 z) { return mk(_mm256_fmadd_ps(x.a, y.a, z.a), _mm256_fmadd_ps(x.b, y.b, z.b)); }
KI V16 vmul(V16 x, V16 y) { return mk(_mm256_mul_ps(x.a, y.a), _mm256_mul_ps(x.b, y.b)); }
KI V16 vadd(V16 x, V16 y) { return mk(_mm256_add_ps(x.a, y.a), _mm256_add_ps(x.b, y.b)); }
KI V16 vsub(V16 x, V16 y) { return mk(_mm256_sub_ps(x.a, y.a), _mm256_sub_ps(x.b, y.b)); }
KI float vhsum(V16 v) {
    __m256 h = _mm256_add_ps(v.a, v.b);
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    q = _mm_add_ss(q, _mm_movehdup_ps(q));
    return _mm_cvtss_f32(q);
}
KI V16 v_i8x16(__m128i b) {
    return mk(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8))));
}
KI V16 v_u8x16(__m128i b) {
    return mk(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8))));
}
typedef struct {
    __m256i a, b;
} V16I;
KI V16I vi_u8x16_mem(const void *p) {
    V16I v = {_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)),
              _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)((const uint8_t *)p + 8)))};
    return v;
}
KI V16I vi_and(V16I v, int m) {
    V16I r = {_mm256_and_si256(v.a, _mm256_set1_epi32(m)), _mm256_and_si256(v.b, _mm256_set1_epi32(m))};
    return r;
}
KI V16I vi_srli_(V16I v, int n) {
    V16I r = {_mm256_srli_epi32(v.a, n), _mm256_srli_epi32(v.b, n)};
    return r;
}
#define vi_srli(v, n) vi_srli_((v), (n))
KI V16 vi_cvt(V16I v) { return mk(_mm256_cvtepi32_ps(v.a), _mm256_cvtepi32_ps(v.b)); }
KI V16 v_f16(const void *p) {
    return mk(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)),
              _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint8_t *)p + 16))));
}
KI V16 v_bf16(const void *p) {
    const __m256i a = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
    const __m256i b = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint8_t *)p + 16))), 16);
    return mk(_mm256_castsi256_ps(a), _mm256_castsi256_ps(b));
}
KI V16 v_2x8(const float *a, const float *b) { return mk(_mm256_loadu_ps(a), _mm256_loadu_ps(b)); }
KI __m256 flip8(__m256 g, uint32_t m8) {
    /* bit j of m8 -> bit 31 of lane j */
    const __m256i sh = _mm256_setr_epi32(31, 30, 29, 28, 27, 26, 25, 24);
    const __m256i s = _mm256_and_si256(_mm256_sllv_epi32(_mm256_set1_epi32((int)m8), sh),
                                       _mm256_set1_epi32((int)0x80000000u));
    return _mm256_castsi256_ps(_mm256_xor_si256(_mm256_castps_si256(g), s));
}
KI V16 v_flip16(V16 g, const uint8_t *m) { return mk(flip8(g.a, m[0]), flip8(g.b, m[1])); }

/* register tile: 2 rows x up to 2 tokens = 8 ymm accumulators (of 16) */
#define PRP 2
#define PTT 2
#define KERN_TILES_DEFINE KERN_DEF_TILE(2, 1) KERN_DEF_TILE(2, 2) KERN_DEF_TILE(1, 1) KERN_DEF_TILE(1, 2)
#define KERN_TILE_CALL_FULL(nt, w, ldw, x, ldx, n16, res)                                       \
    switch (nt) {                                                                               \
    case 1: tile_2_1_avx2(w, ldw, x, ldx, n16, res); break;                                     \
    default: tile_2_2_avx2(w, ldw, x, ldx, n16, res); break;                                    \
    }
#define KERN_TILE_CALL_ONE(nt, w, ldw, x, ldx, n16, res)                                        \
    switch (nt) {                                                                               \
    case 1: tile_1_1_avx2(w, ldw, x, ldx, n16, res); break;                                     \
    default: tile_1_2_avx2(w, ldw, x, ldx, n16, res); break;                                    \
    }

/* small-T kernels: tokens per pass, and the largest T they are used for */
#define MVT_NT 2
#define MVT_T_MAX 3
#define MVT_CASES34(fmt)

#include "kern_simd_body.h"

/* u8 x s8 products summed by 4 into int32 lanes: maddubs (pairs, int16; no saturation with these
 * operands: |u| <= 128, |s| <= 127) then madd by 1 */
#define Q8_DOT_U8S8(acc, u, s) _mm256_add_epi32((acc), _mm256_madd_epi16(_mm256_maddubs_epi16((u), (s)), _mm256_set1_epi16(1)))
#include "kern_q8_body.h"
#include "kern_gemm_avx2.h"

void kern_fill_avx2(kern_isa *k) {
    memset(k, 0, sizeof(*k));
    k->name = "avx2";
    fill_dq_avx2(k);
    fill_simd_avx2(k);
    fill_q8_avx2(k);
    fill_gemm_avx2(k);
    /* work-split cost of a Q2_K value (kern_q8_body.h's AVX2 row kernel): about half a Q8_0 one at
     * one token from DRAM, so 2 against Q8_0's 4; IQ2_XXS stays near its default 6 */
    k->q8_cost[KT_Q2_K] = 2;
}

#else

void kern_fill_avx2(kern_isa *k) { memset(k, 0, sizeof(*k)); }

#endif
