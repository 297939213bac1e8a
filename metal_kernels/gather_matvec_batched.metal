// out[p, row] = dequant(raw[experts[p], row]) . x[toks[p]]  (batched form, prefill)
// perm: pair indices sorted by expert; chunks [n_chunks, 2] = (start, count) in perm, count <= 8,
// all of one expert (engine/backends/mlx/metal.py: batch_plan). Threadgroup (i, c) takes rows
// 16i .. 16i+15 of that expert and the chunk's pairs: per block of 256 inputs it dequantizes the
// 16 x 256 tile once into threadgroup memory and uses it for every pair of the chunk.
// Template KIND as in the decode form; dims = (n_out, n_in, row_bytes).
// Grid (128 * ceil(n_out / 16), n_chunks), threadgroup (128, 1): thread = (row of tile, pair).
constexpr const uint TR = 16, TP = 8, LD = QK_K + 1;   // LD: row stride; +1 spreads banks
threadgroup float wt[TR * LD];
threadgroup float xt[TP * LD];
const uint n_out = uint(dims[0]), n_in = uint(dims[1]), row_bytes = uint(dims[2]);
const uint tid = thread_index_in_threadgroup;
const uint c = threadgroup_position_in_grid.y;
const uint r0 = threadgroup_position_in_grid.x * TR;
const uint start = uint(chunks[2 * c]), count = uint(chunks[2 * c + 1]);
const uint e = uint(experts[perm[start]]);
const uint my_r = tid / TP, my_p = tid % TP;
const bool active = r0 + my_r < n_out && my_p < count;
float acc = 0.0f;
for (uint b = 0; b < n_in / QK_K; ++b) {
  {  // dequantize: 16 rows x 8 groups of 32 = one group per thread
    const uint rr = tid / 8, u = tid % 8;
    if (r0 + rr < n_out) {
      auto blk = raw + (ulong(e) * n_out + r0 + rr) * row_bytes + b * block_bytes<KIND>();
      dequant32<KIND>(blk, u, &wt[rr * LD + 32 * u]);
    }
  }
  for (uint i = tid; i < TP * QK_K; i += 128) {
    const uint pp = i / QK_K, k = i % QK_K;
    xt[pp * LD + k] = pp < count ? x[ulong(uint(toks[perm[start + pp]])) * n_in + b * QK_K + k] : 0.0f;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (active) {
    for (uint k = 0; k < QK_K; ++k) acc += wt[my_r * LD + k] * xt[my_p * LD + k];
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);   // the next block overwrites the tiles
}
if (active) out[ulong(uint(perm[start + my_p])) * n_out + r0 + my_r] = acc;
