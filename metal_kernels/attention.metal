// Softmax attention with per-head sinks, K = V (NumpyOps.attention with one key segment).
// q [T, H, D]; keys [K, D] shared by all queries, or [T, K, D] per query (dims[4] = 1);
// mask [T, K] uint8 (nonzero = attend); sinks [H]; scale [1]; dims = (T, H, D, K, per_query).
// D is a multiple of 32, at most 512. out [T, H, D]:
//   s_k = scale q.k_k over the attended keys; out = sum_k e^(s_k - M) k_k / (sum_k e^(s_k - M) + e^(sink - M))
// One threadgroup per (t, h): its simdgroups take keys k = sg, sg + S, ... with an online softmax
// (lane holds dims lane, lane + 32, ...), then the S partial results merge through threadgroup memory.
// Grid (32 S, T H), threadgroup (32 S, 1), S <= 8.
constexpr const uint DMAX = 512, SMAX = 8;
threadgroup float part_m[SMAX];
threadgroup float part_l[SMAX];
threadgroup float part_o[SMAX * DMAX];
const uint H = uint(dims[1]), D = uint(dims[2]), K = uint(dims[3]);
const uint th = threadgroup_position_in_grid.y, t = th / H, h = th % H;
const uint sg = simdgroup_index_in_threadgroup, lane = thread_index_in_simdgroup;
const uint n_sg = threads_per_threadgroup.x / 32;
const uint nd = D / 32;
auto qt = q + ulong(th) * D;
auto kt = keys + (dims[4] != 0 ? ulong(t) * K * D : ulong(0));
auto mt = mask + ulong(t) * K;
float qv[DMAX / 32], o[DMAX / 32], kv[DMAX / 32];
for (uint i = 0; i < nd; ++i) { qv[i] = qt[lane + 32 * i]; o[i] = 0.0f; }
float m = -INFINITY, l = 0.0f;
for (uint k = sg; k < K; k += n_sg) {
  if (mt[k] == 0) continue;             // same k on every lane: the simdgroup stays together
  float dot = 0.0f;
  for (uint i = 0; i < nd; ++i) { kv[i] = kt[ulong(k) * D + lane + 32 * i]; dot += qv[i] * kv[i]; }
  const float s = simd_sum(dot) * scale[0];
  const float m_new = metal::max(m, s);
  const float a = metal::exp(m - m_new), pk = metal::exp(s - m_new);   // m = -inf at first: a = 0
  l = l * a + pk;
  for (uint i = 0; i < nd; ++i) o[i] = o[i] * a + pk * kv[i];
  m = m_new;
}
if (lane == 0) { part_m[sg] = m; part_l[sg] = l; }
for (uint i = 0; i < nd; ++i) part_o[sg * DMAX + lane + 32 * i] = o[i];
threadgroup_barrier(mem_flags::mem_threadgroup);
// merge: the sink joins the maximum and the denominator only (a simdgroup without keys has m = -inf)
const float sink = sinks[h];
float M = sink;
for (uint s = 0; s < n_sg; ++s) M = metal::max(M, part_m[s]);
float den = metal::exp(sink - M);
for (uint s = 0; s < n_sg; ++s) den += part_l[s] * metal::exp(part_m[s] - M);
for (uint d = thread_index_in_threadgroup; d < D; d += threads_per_threadgroup.x) {
  float acc = 0.0f;
  for (uint s = 0; s < n_sg; ++s) acc += part_o[s * DMAX + d] * metal::exp(part_m[s] - M);
  out[ulong(th) * D + d] = acc / den;
}
