/* Row dequantizers, plain C written for the auto-vectorizer.  Included once per instruction set
 * (kern_generic.c, kern_avx2.c, kern_avx512.c) with KSUF(name) giving the per-build name and
 * KERN_F16(h) / KERN_F16_ROW(src, dst, n) the half -> float conversions of that build.
 *
 * Every value is computed with the float32 operations, in the order, of engine/gguf/quants.py (which
 * is bit-exact with gguf-py); the file must be compiled with -ffp-contract=off. */

typedef uint32_t kern_u32a __attribute__((may_alias));

static void KSUF(dq_f32)(const uint8_t *src, float *dst, int64_t n) {
    memcpy(dst, src, (size_t)n * 4);
}

static void KSUF(dq_f16)(const uint8_t *src, float *dst, int64_t n) {
    KERN_F16_ROW(src, dst, n);
}

static void KSUF(dq_bf16)(const uint8_t *src, float *dst, int64_t n) {
    kern_u32a *o = (kern_u32a *)dst;
    for (int64_t i = 0; i < n; i++) o[i] = (uint32_t)kern_rd16(src + 2 * i) << 16;
}

static void KSUF(dq_q8_0)(const uint8_t *src, float *dst, int64_t n) {
    for (int64_t b = 0; b < n / 32; b++) {
        const uint8_t *blk = src + 34 * b;
        if (!(b & 1)) __builtin_prefetch(blk + 2048);
        const float d = KERN_F16(kern_rd16(blk));
        const int8_t *q = (const int8_t *)(blk + 2);
        float *o = dst + 32 * b;
        for (int i = 0; i < 32; i++) o[i] = (float)q[i] * d;
    }
}

static void KSUF(dq_q2_k)(const uint8_t *src, float *dst, int64_t n) {
    for (int64_t b = 0; b < n / 256; b++) {
        const uint8_t *blk = src + 84 * b;
        const float d = KERN_F16(kern_rd16(blk + 80));
        const float dmin = KERN_F16(kern_rd16(blk + 82));
        float dl[16], ml[16];
        for (int s = 0; s < 16; s++) {
            dl[s] = d * (float)(blk[s] & 15);
            ml[s] = dmin * (float)(blk[s] >> 4);
        }
        float *o = dst + 256 * b;
        for (int h = 0; h < 2; h++) {
            for (int j = 0; j < 4; j++) {
                for (int half = 0; half < 2; half++) {
                    const int s = 8 * h + 2 * j + half;
                    const float a = dl[s], m = ml[s];
                    const uint8_t *q = blk + 16 + 32 * h + 16 * half;
                    float *oo = o + 128 * h + 32 * j + 16 * half;
                    for (int l = 0; l < 16; l++) oo[l] = a * (float)((q[l] >> (2 * j)) & 3) - m;
                }
            }
        }
    }
}

static inline void kern_q4_k_scale_min(const uint8_t *S, uint8_t sc[8], uint8_t mn[8]) {
    for (int j = 0; j < 4; j++) {
        sc[j] = S[j] & 63;
        mn[j] = S[j + 4] & 63;
        sc[j + 4] = (uint8_t)((S[j + 8] & 15) | ((S[j] >> 6) << 4));
        mn[j + 4] = (uint8_t)((S[j + 8] >> 4) | ((S[j + 4] >> 6) << 4));
    }
}

static void KSUF(dq_q4_k)(const uint8_t *src, float *dst, int64_t n) {
    for (int64_t b = 0; b < n / 256; b++) {
        const uint8_t *blk = src + 144 * b;
        const float d = KERN_F16(kern_rd16(blk));
        const float dmin = KERN_F16(kern_rd16(blk + 2));
        uint8_t sc[8], mn[8];
        kern_q4_k_scale_min(blk + 4, sc, mn);
        float *o = dst + 256 * b;
        for (int p = 0; p < 4; p++) {
            const uint8_t *q = blk + 16 + 32 * p;
            const float a0 = d * (float)sc[2 * p], m0 = dmin * (float)mn[2 * p];
            const float a1 = d * (float)sc[2 * p + 1], m1 = dmin * (float)mn[2 * p + 1];
            float *oo = o + 64 * p;
            for (int l = 0; l < 32; l++) oo[l] = a0 * (float)(q[l] & 15) - m0;
            for (int l = 0; l < 32; l++) oo[32 + l] = a1 * (float)(q[l] >> 4) - m1;
        }
    }
}

static void KSUF(dq_iq2_xxs)(const uint8_t *src, float *dst, int64_t n) {
    for (int64_t b = 0; b < n / 256; b++) {
        const uint8_t *blk = src + 66 * b;
        const float d = KERN_F16(kern_rd16(blk));
        float *o = dst + 256 * b;
        for (int ib = 0; ib < 8; ib++) {
            const uint8_t *g8 = blk + 2 + 8 * ib;
            const uint32_t a1 = kern_rd32(g8 + 4);
            /* gguf: db = f32(d) * (0.5f + f32(a1 >> 28)) * 0.25f; y = db * (+-grid) */
            const float db = d * (0.5f + (float)(a1 >> 28)) * 0.25f;
            for (int l = 0; l < 4; l++) {
                const float *g = kern_iq2xxs_gridf + 8 * g8[l];
                const uint32_t signs = kern_ksigns[(a1 >> (7 * l)) & 127];
                float *oo = o + 32 * ib + 8 * l;
                for (int j = 0; j < 8; j++) {
                    uint32_t gb;
                    memcpy(&gb, &g[j], 4);
                    gb ^= ((signs >> j) & 1u) << 31;
                    oo[j] = db * kern_bits_f32(gb);
                }
            }
        }
    }
}

static void KSUF(dq_mxfp4)(const uint8_t *src, float *dst, int64_t n) {
    for (int64_t b = 0; b < n / 32; b++) {
        const uint8_t *blk = src + 17 * b;
        const float d = kern_e8m0_half(blk[0]);
        const uint8_t *q = blk + 1;
        float *o = dst + 32 * b;
        for (int j = 0; j < 16; j++) o[j] = d * (float)kern_mxfp4_kvalues[q[j] & 15];
        for (int j = 0; j < 16; j++) o[16 + j] = d * (float)kern_mxfp4_kvalues[q[j] >> 4];
    }
}

static void KSUF(fill_dq)(kern_isa *k) {
    k->dq[KT_F32] = KSUF(dq_f32);
    k->dq[KT_F16] = KSUF(dq_f16);
    k->dq[KT_BF16] = KSUF(dq_bf16);
    k->dq[KT_Q8_0] = KSUF(dq_q8_0);
    k->dq[KT_Q2_K] = KSUF(dq_q2_k);
    k->dq[KT_Q4_K] = KSUF(dq_q4_k);
    k->dq[KT_IQ2_XXS] = KSUF(dq_iq2_xxs);
    k->dq[KT_MXFP4] = KSUF(dq_mxfp4);
}
