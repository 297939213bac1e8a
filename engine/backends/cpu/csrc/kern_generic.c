/* Generic C build of the kernels: any compiler, any machine.  The matmul decodes one row at a
 * time into the scratch buffer and takes its dot product with every token (8 partial sums). */
#include "kern.h"

#define KSUF(name) name##_generic
#define KERN_F16(h) kern_f16_soft(h)
#define KERN_F16_ROW(src, dst, n)                                                            \
    do {                                                                                     \
        for (int64_t i_ = 0; i_ < (n); i_++) (dst)[i_] = kern_f16_soft(kern_rd16((src) + 2 * i_)); \
    } while (0)

#include "kern_dequant_body.h"

/* float64 sums of the exact float32 weights and activations, rounded once (kern_panel_fn) */
static void panel_generic(kern_dq_fn dq, const uint8_t *W, ptrdiff_t stride, int64_t n_in, int64_t r0, int64_t r1,
                          const float *x, int64_t ldx, int64_t T, float *y, int64_t ldy, double *wbuf, double *yacc,
                          int mode) {
    float *row = (float *)wbuf;
    for (int64_t r = r0; r < r1; r++) {
        dq(W + r * stride, row, n_in);
        for (int64_t t = 0; t < T; t++) {
            const float *xt = x + t * ldx;
            double s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            int64_t k = 0;
            for (; k + 8 <= n_in; k += 8)
                for (int j = 0; j < 8; j++) s[j] += (double)row[k + j] * xt[k + j];
            double tot = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
            for (; k < n_in; k++) tot += (double)row[k] * xt[k];
            const int64_t o = t * ldy + r;
            if (mode == 0)
                y[o] = (float)tot;
            else if (mode == 1)
                yacc[o] = tot;
            else if (mode == 2)
                yacc[o] += tot;
            else
                y[o] = (float)(yacc[o] + tot);
        }
    }
}

void kern_fill_generic(kern_isa *k) {
    memset(k, 0, sizeof(*k));
    k->name = "generic";
    k->panel_rows = 1;
    fill_dq_generic(k);
    k->panel = panel_generic;
    kern_fill_q8_generic(k);
}
