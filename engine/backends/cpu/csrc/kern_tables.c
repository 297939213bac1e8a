/* Tables for IQ2_XXS and MXFP4, built from the same definitions as engine/gguf/quants.py:
 * _IQ2XXS_GRID_HEX / _IQ2XXS_GRID_MAP (gguf-py's compact iq2xxs_grid), _build_ksigns, and
 * MXFP4_KVALUES.  tests/test_kernels.py checks them against quants.IQ2XXS_GRID_BYTES and
 * quants.KSIGNS_IQ2XS. */
#include "kern.h"

float kern_iq2xxs_gridf[256 * 8] __attribute__((aligned(64)));
uint8_t kern_iq2xxs_grid[256 * 8] __attribute__((aligned(64)));
uint8_t kern_ksigns[128];
float kern_e8m0_tab[256] __attribute__((aligned(64)));
const int8_t kern_mxfp4_kvalues[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* gguf-py IQ2_XXS.grid_hex: every entry is 16 bits of 2-bit indices into (0x08, 0x19, 0x2b),
 * element 0 in the lowest bits, written as hex bytes (two bytes = one entry) */
static const char iq2xxs_grid_hex[] =
    "00000200050008000a00110014002000220028002a0041004400500058006100"
    "6400800082008a00a20001010401100115014001840198010002020222028202"
    "010404041004210424044004420448046004810484049004a404000502050805"
    "200546056905800591050906100640068406a406000805080808140828084108"
    "440850085208880804094009020a140a01100410101021104010601084109010"
    "951000110811201150115a118011241245120014081420142514491480141815"
    "6215001616160118041810184018811800190519a019511a002002200a204420"
    "6120802082202921482100220222012404241024402456240025412564259026"
    "082820289428442a014004401040184021402440404048405640604081408440"
    "9040004120416141804185410142104248425642684200440844204480449944"
    "124524450046014804481048404845480049584961498249454a904a00500850"
    "1150195020508050885004514251a4519152905492540a550156545600581158"
    "195864584059085a046010604060686000615561186260620064056410651265"
    "84654268008002800a8041808280048118814081118201840484108415844084"
    "608400854685948509864086608602880489118a0490109024904090a1901691"
    "8091459200942294449451958198209902a050a085a009a100a218a450a804a9";

static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return c - 'A' + 10;
}

void kern_tables_init(void) {
    static const uint8_t gmap[3] = {0x08, 0x19, 0x2B};
    /* 512 packed bytes; byte k holds 4 grid elements (element 4k..4k+3 of the flat table) */
    for (int k = 0; k < 512; k++) {
        int byte = hexval(iq2xxs_grid_hex[2 * k]) * 16 + hexval(iq2xxs_grid_hex[2 * k + 1]);
        for (int s = 0; s < 4; s++) {
            uint8_t g = gmap[(byte >> (2 * s)) & 3];
            kern_iq2xxs_grid[4 * k + s] = g;
            kern_iq2xxs_gridf[4 * k + s] = (float)g;
        }
    }
    for (int e = 0; e < 256; e++) kern_e8m0_tab[e] = kern_e8m0_half((uint8_t)e);
    for (int i = 0; i < 128; i++) {
        int parity = 0;
        for (int b = 0; b < 7; b++) parity ^= (i >> b) & 1;
        kern_ksigns[i] = (uint8_t)(i | (parity << 7));
    }
    kern_q8_tables_init();
}

int kern_block_elems(int t) {
    switch (t) {
    case KT_F32: case KT_F16: case KT_BF16: return 1;
    case KT_Q8_0: case KT_MXFP4: return 32;
    case KT_Q2_K: case KT_Q4_K: case KT_IQ2_XXS: return 256;
    default: return 0;
    }
}

int kern_block_bytes(int t) {
    switch (t) {
    case KT_F32: return 4;
    case KT_F16: case KT_BF16: return 2;
    case KT_Q8_0: return 34;
    case KT_MXFP4: return 17;
    case KT_Q2_K: return 84;
    case KT_Q4_K: return 144;
    case KT_IQ2_XXS: return 66;
    default: return 0;
    }
}

int64_t kern_aux_len(int t, int64_t n_in) {
    if (t == KT_Q2_K) return n_in / 16;
    if (t == KT_Q4_K) return n_in / 32;
    return 0;
}

void kern_aux_fill(int t, const float *x, int64_t n_in, float *aux) {
    int g = t == KT_Q2_K ? 16 : t == KT_Q4_K ? 32 : 0;
    if (!g) return;
    for (int64_t i = 0; i < n_in / g; i++) {
        float s = 0.0f;
        for (int j = 0; j < g; j++) s += x[i * g + j];
        aux[i] = s;
    }
}
