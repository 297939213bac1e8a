// out[p, row] = dequant(raw[experts[p], row]) . x[toks[p]]  (decode form: few pairs)
// One simdgroup per (pair, row), reading the row's blocks in place. Template KIND: KIND_IQ2_XXS or
// KIND_Q2_K. dims = (n_out, n_in, row_bytes); n_in is a multiple of 256.
// Grid (32 * R * ceil(n_out / R), P), threadgroup (32 * R, 1): threadgroup (i, p) holds rows
// iR .. iR+R-1 of pair p, one per simdgroup.
const uint n_out = uint(dims[0]), n_in = uint(dims[1]), row_bytes = uint(dims[2]);
const uint p = threadgroup_position_in_grid.y;
const uint rows_per_tg = threads_per_threadgroup.x / 32;
const uint row = threadgroup_position_in_grid.x * rows_per_tg + simdgroup_index_in_threadgroup;
const uint lane = thread_index_in_simdgroup;
if (row >= n_out) return;                 // the whole simdgroup leaves: simd_sum below stays uniform
auto w = raw + (ulong(uint(experts[p])) * n_out + row) * row_bytes;
auto xt = x + ulong(uint(toks[p])) * n_in;
// lane = 8 * b0 + u: group u of blocks b0, b0 + 4, b0 + 8, ... (8 lanes share a block's bytes)
const uint u = lane % 8;
float acc = 0.0f;
float v[32];
for (uint b = lane / 8; b < n_in / QK_K; b += 4) {
  dequant32<KIND>(w + b * block_bytes<KIND>(), u, v);
  auto xb = xt + b * QK_K + 32 * u;
  for (uint i = 0; i < 32; ++i) acc += v[i] * xb[i];
}
acc = simd_sum(acc);
if (lane == 0) out[ulong(p) * n_out + row] = acc;
