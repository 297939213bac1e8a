// Indices of the k largest scores of each row, ties to the lowest index, in descending-score order
// (NumpyOps.topk_lowest_index: a stable argsort of -scores, cut to k). scores [T, C] float32,
// dims = (T, C, k), k <= TOPK_MAX; out [T, k] int32. One threadgroup per row:
//  1. radix select on topk_key (4 passes of 8 bits, histograms in threadgroup memory): the k-th
//     largest key thr, and need = how many of the keys equal to thr belong to the top k;
//  2. ordered compaction: keys > thr, and the first `need` keys == thr in index order, go to
//     slots in index order (prefix sums over simdgroups, then over the threadgroup);
//  3. bitonic sort of the <= TOPK_MAX (key, index) pairs: key descending, index ascending.
// Grid (NT, T), threadgroup (NT, 1), NT a multiple of 32, at most 1024.
threadgroup atomic_uint hist[256];
threadgroup uint sh[2];
threadgroup uint sg_gt[32];
threadgroup uint sg_eq[32];
threadgroup uint sel_key[TOPK_MAX];
threadgroup uint sel_idx[TOPK_MAX];
const uint C = uint(dims[1]), k = uint(dims[2]);
const uint row = threadgroup_position_in_grid.y;
const uint tid = thread_index_in_threadgroup, nt = threads_per_threadgroup.x;
const uint sg = simdgroup_index_in_threadgroup, lane = thread_index_in_simdgroup;
auto s = scores + ulong(row) * C;
// 1. radix select
uint prefix = 0, pmask = 0, need = k;
for (int shift = 24; shift >= 0; shift -= 8) {
  for (uint b = tid; b < 256; b += nt) atomic_store_explicit(&hist[b], 0u, memory_order_relaxed);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint c = tid; c < C; c += nt) {
    const uint key = topk_key(s[c]);
    if ((key & pmask) == prefix) atomic_fetch_add_explicit(&hist[(key >> shift) & 255u], 1u, memory_order_relaxed);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (tid == 0) {                       // the digit of the need-th largest among the candidates
    uint above = 0, b = 255;
    for (; b > 0; --b) {
      const uint n = atomic_load_explicit(&hist[b], memory_order_relaxed);
      if (above + n >= need) break;
      above += n;
    }
    sh[0] = prefix | (b << shift);
    sh[1] = need - above;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  prefix = sh[0];
  need = sh[1];
  pmask |= 255u << shift;
  threadgroup_barrier(mem_flags::mem_threadgroup);   // sh and hist are rewritten by the next pass
}
const uint thr = prefix;
// 2. ordered compaction; slot = how many selected elements precede this one in index order
uint gt_base = 0, eq_base = 0;
for (uint c0 = 0; c0 < C; c0 += nt) {
  const uint c = c0 + tid;
  const uint key = c < C ? topk_key(s[c]) : 0u;
  const uint gt = (c < C && key > thr) ? 1u : 0u;
  const uint eq = (c < C && key == thr) ? 1u : 0u;
  const uint gt_ex = simd_prefix_exclusive_sum(gt), eq_ex = simd_prefix_exclusive_sum(eq);
  const uint gt_sum = simd_sum(gt), eq_sum = simd_sum(eq);
  if (lane == 0) { sg_gt[sg] = gt_sum; sg_eq[sg] = eq_sum; }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  uint gt_before = gt_base + gt_ex, eq_before = eq_base + eq_ex;
  for (uint j = 0; j < nt / 32; ++j) {
    if (j < sg) { gt_before += sg_gt[j]; eq_before += sg_eq[j]; }
    gt_base += sg_gt[j];
    eq_base += sg_eq[j];
  }
  if (gt != 0 || (eq != 0 && eq_before < need)) {
    const uint slot = gt_before + metal::min(eq_before, need);
    sel_key[slot] = key;
    sel_idx[slot] = c;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);   // sg_gt / sg_eq are rewritten next chunk
}
// 3. bitonic sort of n2 = next power of two >= k entries; padding sorts last
uint n2 = 1;
while (n2 < k) n2 <<= 1;
for (uint i = k + tid; i < n2; i += nt) { sel_key[i] = 0u; sel_idx[i] = 0xFFFFFFFFu; }
threadgroup_barrier(mem_flags::mem_threadgroup);
for (uint size = 2; size <= n2; size <<= 1) {
  for (uint stride = size >> 1; stride > 0; stride >>= 1) {
    for (uint i = tid; i < n2; i += nt) {
      const uint j = i ^ stride;
      if (j <= i) continue;
      const uint ka = sel_key[i], kb = sel_key[j], ia = sel_idx[i], ib = sel_idx[j];
      const bool b_first = kb > ka || (kb == ka && ib < ia);          // b precedes a
      const bool ascending = (i & size) == 0;
      if (ascending == b_first) {
        sel_key[i] = kb; sel_key[j] = ka; sel_idx[i] = ib; sel_idx[j] = ia;
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
}
for (uint i = tid; i < k; i += nt) out[ulong(row) * k + i] = int(sel_idx[i]);
