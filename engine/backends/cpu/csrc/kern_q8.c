/* Integer-activation matmuls (ds4 numerics): the activation quantizers and the portable kernels.
 *
 * In ds4 mode the input of a Q8_0-weight matmul is rounded to Q8_0 blocks (32 int8 + a float
 * scale) and the routed experts' input to Q8_K blocks (256 int8 + a float scale), as ds4's quantized
 * dot products do.  Instead of forming those rounded floats and running a float kernel, these
 * kernels keep the activations as integers, and compute what ds4's CPU path computes
 * (engine/model/ds4_matmul.py, the reference, cites ds4.c): per weight block the integer dot of the
 * weight codes with the activation codes (exact in int32), turned into float32 and multiplied by
 * the float32 product of the two scales, the blocks added in float32 in block order:
 *   Q8_0     acc += (d_w * d_x) * (float)dot                      (dot_q8_0_row)
 *   IQ2_XXS  acc += (d_w * d_x) * (float)bsum; y = 0.125f * acc   (ds4_vec_dot_iq2_xxs_q8_K)
 *   Q2_K     acc += (float)((double)isum * (double)(d_x * d) - (double)(((float)summs * d_x) * dmin))
 *            (ds4_vec_dot_q2_K_q8_K as GCC compiles it: one FMA, emulated as the reference does)
 * Every build (this file, kern_q8_body.h, kern_gemm_*.h, kern_iq2_vbmi.h) keeps that order per
 * (row, token), whatever order it takes the integer products in: bit for bit with the reference.
 * The quantizers reproduce engine/model/numerics.py's q8_0_quantize / q8_k_quantize bit for bit (this
 * file is compiled with -ffp-contract=off; rounding is half to even, as np.rint). */
#include <math.h>
#include <string.h>

#include "kern.h"

uint64_t kern_iq2xxs_grid64[256];
uint64_t kern_iq2xxs_sign64[128];
static float f16_tab[65536]; /* every half as float (exact: kern_f16_soft, NaN payloads kept) */

void kern_q8_tables_init(void) {
    for (uint32_t h = 0; h < 65536; h++) f16_tab[h] = kern_f16_soft((uint16_t)h);
    for (int i = 0; i < 256; i++) memcpy(&kern_iq2xxs_grid64[i], kern_iq2xxs_grid + 8 * i, 8);
    for (int i = 0; i < 128; i++) {
        uint64_t v = 0;
        for (int j = 0; j < 8; j++) v |= (uint64_t)((kern_ksigns[i] >> j) & 1 ? 0xFFu : 0x01u) << (8 * j);
        kern_iq2xxs_sign64[i] = v;
    }
}

int kern_q8_block(int type_id) {
    switch (type_id) {
    case KT_Q8_0: return 32;
    case KT_Q2_K: case KT_IQ2_XXS: return 256;
    default: return 0;
    }
}

/* The loops below are written so that the compiler vectorizes them with any instruction set:
 * the block maximum as an integer maximum of the magnitudes' bit patterns (the same order as the
 * magnitudes for every non-NaN float), the codes clamped first and then rounded half to even by
 * adding and subtracting 1.5 * 2^23 (exact for |v| < 2^22: the sum's spacing is 1), which equals
 * numpy's clip(rint(v)) on the clamped range.  The clamp is [-127, 127] and a NaN code is 0, as
 * numerics._codes decides: a normal block never reaches them (its maximum scales to 127); a block
 * whose largest magnitude is below ~3.7e-37 scales by inf (so +-127, and 0 for its zeros), a NaN
 * input gives 0.  Codes are never -128, which the kernels' sign move and x + 128 offset rely on. */
static inline uint32_t mag_bits(float v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    return u & 0x7FFFFFFFu;
}

static uint32_t max_mag_bits_c(const float *x, int n) {
    uint32_t m = 0;
    for (int i = 0; i < n; i++) {
        const uint32_t u = mag_bits(x[i]);
        m = u > m ? u : m;
    }
    return m;
}

static void codes_c(const float *x, int n, float scale, int8_t *q) {
    const float magic = 12582912.0f;
    for (int i = 0; i < n; i++) {
        float v = x[i] * scale;
        v = v == v ? v : 0.0f; /* NaN -> 0 */
        v = v > 127.0f ? 127.0f : v;
        v = v < -127.0f ? -127.0f : v;
        q[i] = (int8_t)(int)((v + magic) - magic);
    }
}

static kern_maxmag_fn max_mag_bits = max_mag_bits_c;
static kern_codes_fn codes = codes_c;

void kern_q8_use(kern_maxmag_fn maxmag, kern_codes_fn c) {
    max_mag_bits = maxmag ? maxmag : max_mag_bits_c;
    codes = c ? c : codes_c;
}

/* numerics.q8_0_quantize: d = amax * fl(1/127); id = 127 / amax; q = rint(x * id) */
void kern_quant_q8_0(const float *x, int64_t n, int8_t *q, float *d) {
    const float inv127 = 1.0f / 127.0f;
    for (int64_t b = 0; b < n / 32; b++) {
        const float *xb = x + 32 * b;
        const float amax = kern_bits_f32(max_mag_bits(xb, 32));
        d[b] = amax * inv127;
        codes(xb, 32, amax != 0.0f ? 127.0f / amax : 0.0f, q + 32 * b);
    }
}

/* numerics.q8_k_quantize: m = the first element of largest |x|; iscale = -127 / m;
 * q = rint(iscale * x); d = m * fl(-1/127); plus the int16 sums of each 16 codes (K-quant minimums) */
void kern_quant_q8_k(const float *x, int64_t n, int8_t *q, float *d, int16_t *bsums) {
    const float minv127 = -1.0f / 127.0f;
    for (int64_t b = 0; b < n / 256; b++) {
        const float *xb = x + 256 * b;
        const uint32_t mb = max_mag_bits(xb, 256);
        float m = 0.0f;
        for (int i = 0; i < 256; i++)
            if (mag_bits(xb[i]) == mb) {
                m = xb[i];
                break;
            }
        int8_t *qb = q + 256 * b;
        if (mb == 0) {          /* all zeros (m is +-0) */
            d[b] = 0.0f;
            memset(qb, 0, 256);
        } else {
            d[b] = m * minv127;
            codes(xb, 256, -127.0f / m, qb);
        }
        for (int s = 0; s < 16; s++) {
            int sum = 0;
            for (int i = 0; i < 16; i++) sum += qb[16 * s + i];
            bsums[16 * b + s] = (int16_t)sum;
        }
    }
}

/* ---- portable kernels: y[t*ldy + r] = W[r] . x_t for rows r0..r1-1 ---- */

static void q8_q8_0_generic(const uint8_t *W, ptrdiff_t stride, int64_t n, int64_t r0, int64_t r1, const int8_t *xq,
                            const float *xd, const int16_t *xs, int64_t T, float *y, int64_t ldy) {
    (void)xs;
    const int64_t nb = n / 32;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = W + r * stride;
        for (int64_t t = 0; t < T; t++) {
            float acc = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                const int8_t *w = (const int8_t *)(row + 34 * b + 2), *xb = xq + t * n + 32 * b;
                int32_t s = 0;
                for (int i = 0; i < 32; i++) s += (int32_t)w[i] * xb[i];
                acc += (kern_f16_soft(kern_rd16(row + 34 * b)) * xd[t * nb + b]) * (float)s;
            }
            y[t * ldy + r] = acc;
        }
    }
}

static void q8_iq2_xxs_generic(const uint8_t *W, ptrdiff_t stride, int64_t n, int64_t r0, int64_t r1,
                               const int8_t *xq, const float *xd, const int16_t *xs, int64_t T, float *y,
                               int64_t ldy) {
    (void)xs;
    const int64_t nb = n / 256;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = W + r * stride;
        for (int64_t t = 0; t < T; t++) {
            float acc = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *blk = row + 66 * b;
                const int8_t *xb = xq + t * n + 256 * b;
                int32_t isum = 0;
                for (int g = 0; g < 8; g++) {
                    const uint32_t a0 = kern_rd32(blk + 2 + 8 * g), a1 = kern_rd32(blk + 6 + 8 * g);
                    int32_t s = 0;
                    for (int l = 0; l < 4; l++) {
                        const uint8_t *gr = kern_iq2xxs_grid + 8 * ((a0 >> (8 * l)) & 255);
                        const uint8_t sg = kern_ksigns[(a1 >> (7 * l)) & 127];
                        for (int j = 0; j < 8; j++) {
                            const int32_t v = (int32_t)gr[j] * xb[32 * g + 8 * l + j];
                            s += (sg >> j) & 1 ? -v : v;
                        }
                    }
                    isum += (int32_t)(2 * (a1 >> 28) + 1) * s;
                }
                acc += (kern_f16_soft(kern_rd16(blk)) * xd[t * nb + b]) * (float)isum;
            }
            y[t * ldy + r] = 0.125f * acc;
        }
    }
}

static void q8_q2_k_generic(const uint8_t *W, ptrdiff_t stride, int64_t n, int64_t r0, int64_t r1, const int8_t *xq,
                            const float *xd, const int16_t *xs, int64_t T, float *y, int64_t ldy) {
    const int64_t nb = n / 256;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = W + r * stride;
        for (int64_t t = 0; t < T; t++) {
            float acc = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *blk = row + 84 * b, *qs = blk + 16;
                const int8_t *xb = xq + t * n + 256 * b;
                const int16_t *bs = xs + t * (n / 16) + 16 * b;
                int32_t isum = 0, msum = 0;
                for (int s = 0; s < 16; s++) msum += (int32_t)(blk[s] >> 4) * bs[s];
                for (int e = 0; e < 256; e++) {
                    const int h = e >> 7, j = (e >> 5) & 3, l = e & 31;
                    const int q = (qs[32 * h + l] >> (2 * j)) & 3;
                    isum += (int32_t)(blk[e >> 4] & 15) * q * xb[e];
                }
                acc += kern_q2k_block(isum, msum, xd[t * nb + b], kern_f16_soft(kern_rd16(blk + 80)),
                                      kern_f16_soft(kern_rd16(blk + 82)));
            }
            y[t * ldy + r] = acc;
        }
    }
}

void kern_fill_q8_generic(kern_isa *k) {
    k->q8[KT_Q8_0] = q8_q8_0_generic;
    k->q8[KT_IQ2_XXS] = q8_iq2_xxs_generic;
    k->q8[KT_Q2_K] = q8_q2_k_generic;
}

/* ds4 numerics' F16 matvec (ds4.c matvec_f16 / dot_f16_row on x86, engine/model/ds4_float.py
 * f16_matvec): y[t*ldy + r] = the float32 sum in index order of fl(f16(w[r][i]) * x[t][i]), each
 * product and partial sum rounded to float32 (this file is compiled with -ffp-contract=off: no
 * FMA).  Rows r0..r1-1, 8 at a time so that 8 independent sums hide the adds' latency; the order
 * within a row is the reference's. */
void kern_f16_seq(const uint16_t *W, ptrdiff_t stride, int64_t n, int64_t r0, int64_t r1, const float *x,
                  int64_t T, float *y, int64_t ldy) {
    for (int64_t t = 0; t < T; t++) {
        const float *xt = x + t * n;
        int64_t r = r0;
        for (; r + 8 <= r1; r += 8) {
            float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
            for (int64_t i = 0; i < n; i++) {
                const float xi = xt[i];
                for (int k = 0; k < 8; k++) acc[k] += f16_tab[W[(r + k) * stride + i]] * xi;
            }
            for (int k = 0; k < 8; k++) y[t * ldy + r + k] = acc[k];
        }
        for (; r < r1; r++) {
            float acc = 0.0f;
            for (int64_t i = 0; i < n; i++) acc += f16_tab[W[r * stride + i]] * xt[i];
            y[t * ldy + r] = acc;
        }
    }
}
