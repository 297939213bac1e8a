/* ds4 CPU kernels: shared declarations.
 *
 * Block layouts and dequantization formulas are those of engine/gguf/quants.py (gguf-py 0.19.0,
 * model.md section 5); the dequantizers here reproduce its float32 roundings exactly, so this
 * code must be compiled with -ffp-contract=off (no silent a*b+c fusion).  The matmul kernels use
 * explicit FMA intrinsics where they want fused products.
 *
 * Three builds of the same kernels exist: generic C (any machine), AVX2+FMA+F16C and AVX-512
 * (F/BW/VL/VNNI + F16C + FMA), the last also as "avx512vbmi" with its IQ2_XXS kernels replaced
 * (kern_iq2_vbmi.h); the module init picks one at run time with __builtin_cpu_supports.
 */
#ifndef DS4_KERN_H
#define DS4_KERN_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* ggml type ids (engine/gguf/quants.py) */
enum {
    KT_F32 = 0,
    KT_F16 = 1,
    KT_Q8_0 = 8,
    KT_Q2_K = 10,
    KT_Q4_K = 12,
    KT_IQ2_XXS = 16,
    KT_BF16 = 30,
    KT_MXFP4 = 39,
    KT_MAX = 40
};

/* values and bytes per block; 0 = unsupported type */
int kern_block_elems(int type_id);
int kern_block_bytes(int type_id);

/* ---- tables (kern_tables.c, built by kern_tables_init from the quants.py definitions) ---- */

/* iq2xxs_grid as floats: [256][8], 64-byte aligned */
extern float kern_iq2xxs_gridf[256 * 8];
/* iq2xxs_grid bytes: [256][8] (each 8, 25 or 43) */
extern uint8_t kern_iq2xxs_grid[256 * 8];
/* ksigns_iq2xs: i with bit 7 set so the byte has even parity */
extern uint8_t kern_ksigns[128];
/* E8M0 byte -> 2^(e-128) as float (kern_e8m0_half), by byte */
extern float kern_e8m0_tab[256];
/* MXFP4 E2M1 values doubled, by nibble */
extern const int8_t kern_mxfp4_kvalues[16];
void kern_tables_init(void);

/* ---- scalar helpers (exact) ---- */

static inline uint16_t kern_rd16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

static inline uint32_t kern_rd32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

static inline float kern_bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* IEEE half -> float, exact (subnormals, inf; NaN keeps its payload and quiet bit, as numpy) */
static inline float kern_f16_soft(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1Fu;
    uint32_t man = h & 0x3FFu;
    uint32_t bits;
    if (exp == 0x1F) {
        bits = sign | 0x7F800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112u) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else {
        /* subnormal: value man * 2^-24, normalize */
        int e = -1;
        do {
            man <<= 1;
            e++;
        } while (!(man & 0x400u));
        man &= 0x3FFu;
        bits = sign | ((uint32_t)(112 - e) << 23) | (man << 13);
    }
    return kern_bits_f32(bits);
}

/* E8M0 byte -> float 2^(e-128) (ggml_e8m0_to_fp32_half), exact incl. e < 2 */
static inline float kern_e8m0_half(uint8_t e) {
    uint32_t bits = e < 2 ? (0x00200000u << e) : ((uint32_t)(e - 1) << 23);
    return kern_bits_f32(bits);
}

/* a Q2_K block's term of ds4_vec_dot_q2_K_q8_K (integer sums isum, summs; activation scale dx;
 * the block's d, dmin): fma((float)isum, dx * d, -(((float)summs * dx) * dmin)), the FMA as the
 * reference (engine/model/ds4_matmul.py) takes it: an exact float64 product minus the float32
 * minimum term, rounded to float32.  |isum|, |summs| < 2^24: their float conversions are exact. */
static inline float kern_q2k_block(int32_t isum, int32_t summs, float dx, float d, float dmin) {
    const float dall = dx * d, mins = ((float)summs * dx) * dmin;
    return (float)((double)isum * (double)dall - (double)mins);
}

/* ---- kernel tables per instruction set ---- */

/* decode one row of n_elems values (whole blocks) from src into dst (float32) */
typedef void (*kern_dq_fn)(const uint8_t *src, float *dst, int64_t n_elems);

/* y[r] = W[r] . x for rows r0..r1-1 (T = 1); aux = per-call data derived from x (x sums) */
typedef void (*kern_mv1_fn)(const uint8_t *W, ptrdiff_t stride, int64_t n_in, int64_t r0, int64_t r1,
                            const float *x, const float *aux, float *y);

/* y[t*ldy + r] = W[r] . x[t] for rows r0..r1-1 and all T tokens over n_in values (x rows ldx
 * apart: a column block of a wider x when the caller splits n_in), decoding the rows with dq a
 * panel at a time into wbuf (kern_panel_scratch_d(unit, n_in) doubles, 64-byte aligned) and summing
 * in float64. mode 0: y = the sum rounded to float32; column blocks keep float64 partial sums in
 * yacc (laid out as y): mode 1 (first block) yacc = sum, 2 yacc += sum, 3 (last) y = yacc + sum */
typedef void (*kern_panel_fn)(kern_dq_fn dq, const uint8_t *W, ptrdiff_t stride, int64_t n_in, int64_t r0,
                              int64_t r1, const float *x, int64_t ldx, int64_t T, float *y, int64_t ldy,
                              double *wbuf, double *yacc, int mode);

/* y[t*ldy + r] = W[r] . x[t] for rows r0..r1-1 and all T tokens, decoding in registers (small T) */
typedef void (*kern_mvt_fn)(const uint8_t *W, ptrdiff_t stride, int64_t n_in, int64_t r0, int64_t r1,
                            const float *x, int64_t T, float *y, int64_t ldy);

/* integer activations (ds4 numerics, kern_q8.c): y[t*ldy + r] = W[r] . x_t for rows r0..r1-1 and
 * all T tokens, x_t given as int8 codes xq[t*n ..] with one float scale per activation block
 * (xd[t*(n/bs) ..], bs = kern_q8_block(type)) and, for K-quant weights, int16 sums of every 16
 * codes (xs[t*(n/16) ..]) */
typedef void (*kern_q8_fn)(const uint8_t *W, ptrdiff_t stride, int64_t n, int64_t r0, int64_t r1,
                           const int8_t *xq, const float *xd, const int16_t *xs, int64_t T, float *y, int64_t ldy);

/* a row kernel that reads the activation codes in an order of its own (kern_isa.q8_arrange): the
 * batch arranges each job's codes (T rows of n) once into out, and the kernel gets those as xq */
typedef void (*kern_arrange_fn)(const int8_t *xq, int64_t n, int64_t T, int8_t *out);

/* the quantizers' two loops, per instruction set (identical results; set by kern_q8_use):
 * the largest magnitude's bit pattern, and the clamped, rounded codes of x * scale */
typedef uint32_t (*kern_maxmag_fn)(const float *x, int n);
typedef void (*kern_codes_fn)(const float *x, int n, float scale, int8_t *q);

/* integer-activation GEMM (many tokens, kern_gemm_body.h / kern_gemm_avx2.h): as kern_q8_fn, plus
 * a second copy of the activation codes where kern_isa.q8g_xu says the form reads one (xu: xq + 128,
 * or the codes in the form's own order where kern_isa.q8g_arrange writes it, kern_iq2_vbmi.h) and a
 * per-thread scratch of q8g_scratch(n) bytes */
typedef void (*kern_q8g_fn)(const uint8_t *W, ptrdiff_t stride, int64_t n, int64_t r0, int64_t r1, const int8_t *xq,
                            const uint8_t *xu, const float *xd, const int16_t *xs, int64_t T, float *y, int64_t ldy,
                            uint8_t *scratch);
typedef int64_t (*kern_scratch_fn)(int64_t n);

/* attention of one query over n attended keys (rows of D floats at keys[k]), heads h0..h1-1 (any
 * number), in float64 with one rounding of the output: q [H, D] (not scaled: the scores are
 * (q . key) * scale, as the reference's), sinks [H] (the sink logit enters the denominator only),
 * out [H, D]; sbuf: KERN_ATTN_SBUF(h1 - h0, n, D) doubles of scratch. The keys are taken
 * KERN_ATTN_KC at a time by every head in turn. */
#define KERN_ATTN_KC 64
#define KERN_ATTN_SBUF(nh, n, D) ((((nh) + 3) / 4 * 4) * ((n) + 2 * (D) + 1) + 8)
typedef void (*kern_attn_fn)(const float *q, int64_t D, int64_t h0, int64_t h1, const float *const *keys, int64_t n,
                             const float *sinks, double scale, float *out, double *sbuf);

typedef struct {
    const char *name;
    int panel_rows; /* the row unit of the panel kernel's register tile */
    kern_dq_fn dq[KT_MAX];
    kern_mv1_fn mv1[KT_MAX]; /* NULL: use the panel path for T = 1 too */
    kern_mvt_fn mvt[KT_MAX]; /* small T; NULL: panel path */
    int mvt_max[KT_MAX];     /* mvt for 2 <= T <= mvt_max (run-time adjustable: set_mvt_max) */
    kern_panel_fn panel;
    kern_attn_fn attn;       /* one query's attention (kern_simd_body.h); NULL: none */
    kern_q8_fn q8[KT_MAX];   /* NULL: no integer-activation kernel for this weight type */
    kern_arrange_fn q8_arrange[KT_MAX]; /* NULL: q8 reads the codes in their natural order */
    kern_q8g_fn q8g[KT_MAX]; /* NULL: no GEMM form; else used for T >= q8g_min_t (run-time adjustable) */
    int q8g_min_t[KT_MAX];
    int q8g_xu[KT_MAX];      /* the GEMM form reads xu (signed weight codes against x + 128); else xq only */
    kern_arrange_fn q8g_arrange[KT_MAX]; /* where q8g_xu: writes xu in the form's own order (NULL: x + 128 in order) */
    int q8_cost[KT_MAX];     /* relative cost of a weight value for the work split; 0: the default */
    kern_scratch_fn q8g_scratch;
    kern_maxmag_fn q8_maxmag; /* the quantizers' loops (NULL: portable C) */
    kern_codes_fn q8_codes;
} kern_isa;

/* rows decoded per panel (a multiple of unit): about 256 KiB of floats, so the panel stays in L2
 * while every token tile runs over it */
static inline int64_t kern_ldw(int64_t n_in) { return (n_in + 15) & ~(int64_t)15; }
static inline int64_t kern_panel_rows(int unit, int64_t n_in) {
    int64_t pr = (int64_t)(256 * 1024 / 4) / kern_ldw(n_in > 0 ? n_in : 1);
    if (pr > 64) pr = 64;
    pr -= pr % unit;
    return pr < unit ? unit : pr;
}
/* the float64 panel: rows of ldw doubles (256 KiB of them), and its scratch in doubles: the panel
 * plus one decoded float row */
static inline int64_t kern_panel_rows_d(int unit, int64_t n_in) { return kern_panel_rows(unit, 2 * n_in); }
static inline int64_t kern_panel_scratch_d(int unit, int64_t n_in) {
    return kern_panel_rows_d(unit, n_in) * kern_ldw(n_in) + kern_ldw(n_in) / 2 + 8;
}

/* kern_q8.c: activation block size of a weight type's integer kernel (Q8_0: 32, Q8_K: 256; 0 =
 * none), the exact quantizers, tables, and the portable kernels */
int kern_q8_block(int type_id);
void kern_quant_q8_0(const float *x, int64_t n, int8_t *q, float *d);
void kern_quant_q8_k(const float *x, int64_t n, int8_t *q, float *d, int16_t *bsums);
extern uint64_t kern_iq2xxs_grid64[256]; /* grid rows as 8 bytes */
extern uint64_t kern_iq2xxs_sign64[128]; /* IQ2_XXS sign fields as 8 bytes of +1 / -1 (ksigns' bit j -> byte j) */
void kern_q8_tables_init(void);
void kern_q8_use(kern_maxmag_fn maxmag, kern_codes_fn codes);
void kern_fill_q8_generic(kern_isa *k);
/* ds4 numerics' F16 matvec, float32 sums in index order (kern_q8.c); W rows `stride` halves apart */
void kern_f16_seq(const uint16_t *W, ptrdiff_t stride, int64_t n, int64_t r0, int64_t r1, const float *x,
                  int64_t T, float *y, int64_t ldy);

void kern_fill_generic(kern_isa *k);
void kern_fill_avx2(kern_isa *k);
void kern_fill_avx512(kern_isa *k);
void kern_fill_avx512vbmi(kern_isa *k); /* avx512 + VBMI/GFNI IQ2_XXS kernels */

/* x sums needed by the T = 1 kernels: Q2_K sums of 16 values, Q4_K sums of 32 (NULL: none) */
int64_t kern_aux_len(int type_id, int64_t n_in);
void kern_aux_fill(int type_id, const float *x, int64_t n_in, float *aux);

#endif
