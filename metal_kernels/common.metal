// Shared helpers of the MLX backend's Metal kernels: passed as `header=` to mx.fast.metal_kernel
// (and included by the host emulation, tests/metal_emu). Helpers take their pointers as template
// parameters, so one helper serves device, threadgroup and thread memory alike. Kernel bodies
// derive pointers with `auto` for the same reason: MLX passes a small input (under 8 elements) in
// the constant address space and a large one in device, so a body cannot name the space.

// ---- GGUF block formats (layouts: engine/gguf/quants.py) ------------------------------------
// IQ2_XXS, 256 values in 66 bytes: f16 d, then 8 groups of (u8 a0[4], u32 a1); group g holds
// values 32g..32g+31: four runs of 8, run r = grid entry a0[r] with the signs of ksigns((a1 >> 7r) & 127),
// scaled by d * (0.5 + (a1 >> 28)) * 0.25.
// Q2_K, 256 values in 84 bytes: u8 scales[16], u8 qs[64], f16 d, f16 dmin; value 128h + 32j + l is
// (qs[32h + l] >> 2j) & 3, in sub-block (value / 16) with scale byte s: d*(s & 15)*q - dmin*(s >> 4).
// Every product in both decoders is exact in float32 (f16 mantissa x a few small integer bits), so the
// compiler fusing a multiply into an fma cannot change a decoded value: they match NumPy bit for bit.
static constant constexpr const uint QK_K = 256;
static constant constexpr const uint IQ2XXS_BLOCK_BYTES = 66;
static constant constexpr const uint Q2K_BLOCK_BYTES = 84;
static constant constexpr const int KIND_IQ2_XXS = 0;
static constant constexpr const int KIND_Q2_K = 1;

// iq2xxs grid entry i: 8 values, value j = {8, 25, 43}[(entry >> 2j) & 3]
constant uint16_t iq2xxs_grid2[256] = {
    0x0000, 0x0002, 0x0005, 0x0008, 0x000a, 0x0011, 0x0014, 0x0020, 0x0022, 0x0028, 0x002a, 0x0041,
    0x0044, 0x0050, 0x0058, 0x0061, 0x0064, 0x0080, 0x0082, 0x008a, 0x00a2, 0x0101, 0x0104, 0x0110,
    0x0115, 0x0140, 0x0184, 0x0198, 0x0200, 0x0202, 0x0222, 0x0282, 0x0401, 0x0404, 0x0410, 0x0421,
    0x0424, 0x0440, 0x0442, 0x0448, 0x0460, 0x0481, 0x0484, 0x0490, 0x04a4, 0x0500, 0x0502, 0x0508,
    0x0520, 0x0546, 0x0569, 0x0580, 0x0591, 0x0609, 0x0610, 0x0640, 0x0684, 0x06a4, 0x0800, 0x0805,
    0x0808, 0x0814, 0x0828, 0x0841, 0x0844, 0x0850, 0x0852, 0x0888, 0x0904, 0x0940, 0x0a02, 0x0a14,
    0x1001, 0x1004, 0x1010, 0x1021, 0x1040, 0x1060, 0x1084, 0x1090, 0x1095, 0x1100, 0x1108, 0x1120,
    0x1150, 0x115a, 0x1180, 0x1224, 0x1245, 0x1400, 0x1408, 0x1420, 0x1425, 0x1449, 0x1480, 0x1518,
    0x1562, 0x1600, 0x1616, 0x1801, 0x1804, 0x1810, 0x1840, 0x1881, 0x1900, 0x1905, 0x19a0, 0x1a51,
    0x2000, 0x2002, 0x200a, 0x2044, 0x2061, 0x2080, 0x2082, 0x2129, 0x2148, 0x2200, 0x2202, 0x2401,
    0x2404, 0x2410, 0x2440, 0x2456, 0x2500, 0x2541, 0x2564, 0x2690, 0x2808, 0x2820, 0x2894, 0x2a44,
    0x4001, 0x4004, 0x4010, 0x4018, 0x4021, 0x4024, 0x4040, 0x4048, 0x4056, 0x4060, 0x4081, 0x4084,
    0x4090, 0x4100, 0x4120, 0x4161, 0x4180, 0x4185, 0x4201, 0x4210, 0x4248, 0x4256, 0x4268, 0x4400,
    0x4408, 0x4420, 0x4480, 0x4499, 0x4512, 0x4524, 0x4600, 0x4801, 0x4804, 0x4810, 0x4840, 0x4845,
    0x4900, 0x4958, 0x4961, 0x4982, 0x4a45, 0x4a90, 0x5000, 0x5008, 0x5011, 0x5019, 0x5020, 0x5080,
    0x5088, 0x5104, 0x5142, 0x51a4, 0x5291, 0x5490, 0x5492, 0x550a, 0x5601, 0x5654, 0x5800, 0x5811,
    0x5819, 0x5864, 0x5940, 0x5a08, 0x6004, 0x6010, 0x6040, 0x6068, 0x6100, 0x6155, 0x6218, 0x6260,
    0x6400, 0x6405, 0x6510, 0x6512, 0x6584, 0x6842, 0x8000, 0x8002, 0x800a, 0x8041, 0x8082, 0x8104,
    0x8118, 0x8140, 0x8211, 0x8401, 0x8404, 0x8410, 0x8415, 0x8440, 0x8460, 0x8500, 0x8546, 0x8594,
    0x8609, 0x8640, 0x8660, 0x8802, 0x8904, 0x8a11, 0x9004, 0x9010, 0x9024, 0x9040, 0x90a1, 0x9116,
    0x9180, 0x9245, 0x9400, 0x9422, 0x9444, 0x9551, 0x9881, 0x9920, 0xa002, 0xa050, 0xa085, 0xa109,
    0xa200, 0xa418, 0xa850, 0xa904,
};

template <typename P> inline uint ld_u16(P p) { return uint(p[0]) | (uint(p[1]) << 8); }
template <typename P> inline uint ld_u32(P p) { return ld_u16(p) | (ld_u16(p + 2) << 16); }
inline float f16_bits_to_float(uint bits) { return float(as_type<half>(ushort(bits))); }

// values 32u .. 32u+31 (u = group 0..7) of the IQ2_XXS block at blk, into out[0..31]
template <typename P, typename Q> inline void iq2xxs_dequant32(P blk, uint u, Q out) {
  const float d = f16_bits_to_float(ld_u16(blk));
  P g = blk + 2 + 8 * u;
  const uint a1 = ld_u32(g + 4);
  const float db = d * (0.5f + float(a1 >> 28)) * 0.25f;
  for (uint r = 0; r < 4; ++r) {
    const uint entry = iq2xxs_grid2[g[r]];
    uint s = (a1 >> (7 * r)) & 127u;
    s |= (popcount(s) & 1u) << 7;        // ksigns: bit 7 makes the parity even
    for (uint i = 0; i < 8; ++i) {
      const uint c = (entry >> (2 * i)) & 3u;
      const float v = c == 0 ? 8.0f : (c == 1 ? 25.0f : 43.0f);
      out[8 * r + i] = db * (((s >> i) & 1u) ? -v : v);
    }
  }
}

// values 32u .. 32u+31 (u = 0..7) of the Q2_K block at blk, into out[0..31]
template <typename P, typename Q> inline void q2k_dequant32(P blk, uint u, Q out) {
  const float d = f16_bits_to_float(ld_u16(blk + 80));
  const float dmin = f16_bits_to_float(ld_u16(blk + 82));
  P qs = blk + 16 + 32 * (u >> 2);      // h = u / 4: the 32 bytes of this half
  const uint shift = 2 * (u & 3u);        // j = u % 4: which 2-bit field of each byte
  for (uint half_ = 0; half_ < 2; ++half_) {
    const uint sc = blk[2 * u + half_];   // sub-block 2u + half_ of 16 values
    const float dl = d * float(sc & 15u), ml = dmin * float(sc >> 4);
    for (uint l = 0; l < 16; ++l) {
      out[16 * half_ + l] = dl * float((qs[16 * half_ + l] >> shift) & 3u) - ml;
    }
  }
}

template <int KIND> inline constexpr uint block_bytes() { return KIND == KIND_IQ2_XXS ? IQ2XXS_BLOCK_BYTES : Q2K_BLOCK_BYTES; }

template <int KIND, typename P, typename Q> inline void dequant32(P blk, uint u, Q out) {
  if (KIND == KIND_IQ2_XXS) iq2xxs_dequant32(blk, u, out);
  else q2k_dequant32(blk, u, out);
}

// ---- top-k: an order-preserving uint key of a float -------------------------------------------
// larger float -> larger key; -0 counts as +0 and NaN as below -inf (as NumPy's argsort of -x
// places them); bit tests instead of isnan, which a fast math mode may fold away
inline uint topk_key(float v) {
  uint u = as_type<uint>(v);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0u;
  if (u == 0x80000000u) u = 0u;
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
static constant constexpr const uint TOPK_MAX = 1024;
