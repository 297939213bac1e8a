// Softmax attention with per-head sinks, K = V, over any number of key segments (the raw window,
// the compressed rows, the indexer's picks read in place), NumpyOps.attention. A block of 1 to 16
// warps per (token, head) (blockDim.x = 32 * warps: 128 serves prefill, where T * H blocks fill
// the device; a decode step's few (token, head)s want 512); lane l holds dims l, l + 32, ...
// (D <= 512: at most 16 a lane, in registers).
// attn_segment: the warps share out the segment's keys, each keeps an online softmax (running
// max m, sum l, weighted sum acc), and the warps' partial states merge through shared memory into the
// (token, head)'s state in global memory (read unless first). attn_finish divides by the sum plus
// the sink's share: out = acc / (l + exp(sink - m)), computed against max(m, sink) so neither a
// large sink nor a query with no visible key overflows (no key: out = 0).
#include "common.cuh"

namespace {
constexpr int MAXW = 16, MAXD = 16;      // warps a block; dims per lane: D / 32 <= 16
}

extern "C" __global__ void __launch_bounds__(512) attn_segment(
    const float* __restrict__ q, const float* __restrict__ keys, const unsigned char* __restrict__ mask,
    const int* __restrict__ idx, float* __restrict__ m_state, float* __restrict__ l_state,
    float* __restrict__ acc_state, int T, int H, int D, int K, int mode, float scale, int first) {
  __shared__ float sm_m[MAXW], sm_l[MAXW];
  __shared__ float sm_acc[MAXW][MAXD * 32];
  const int th = blockIdx.x;
  const int WARPS = (int)(blockDim.x >> 5);
  if (th >= T * H || WARPS < 1 || WARPS > MAXW || (blockDim.x & 31)) return;
  const int t = th / H;
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  const int nd = D / 32;
  const float* qv = q + (long long)th * D;
  float qr[MAXD], acc[MAXD];
#pragma unroll
  for (int j = 0; j < MAXD; ++j) { qr[j] = j < nd ? qv[lane + 32 * j] : 0.0f; acc[j] = 0.0f; }
  float m = -INFINITY, l = 0.0f;
  for (int k = w; k < K; k += WARPS) {
    if (!mask[(long long)t * K + k]) continue;         // (the same for every lane of the warp)
    const long long row = mode == 0 ? k : (mode == 1 ? (long long)t * K + k : (long long)idx[(long long)t * K + k]);
    const float* kv = keys + row * D;
    float s = 0.0f;
#pragma unroll
    for (int j = 0; j < MAXD; ++j) if (j < nd) s += qr[j] * kv[lane + 32 * j];
    s = ds4::warp_sum(s) * scale;
    const float mn = fmaxf(m, s);
    const float corr = expf(m - mn), p = expf(s - mn);  // m = -inf the first time: corr = 0
    l = l * corr + p;
#pragma unroll
    for (int j = 0; j < MAXD; ++j) if (j < nd) acc[j] = acc[j] * corr + p * kv[lane + 32 * j];
    m = mn;
  }
  if (lane == 0) { sm_m[w] = m; sm_l[w] = l; }
#pragma unroll
  for (int j = 0; j < MAXD; ++j) if (j < nd) sm_acc[w][lane + 32 * j] = acc[j];
  __syncthreads();
  // merge: the previous state (unless first) and the warps', against their common max
  const long long st = (long long)th;
  float M = -INFINITY;
  const float m_prev = first ? -INFINITY : m_state[st];
  M = fmaxf(M, m_prev);
  for (int i = 0; i < WARPS; ++i) M = fmaxf(M, sm_m[i]);
  float L = 0.0f;
  for (int i = 0; i < WARPS; ++i) L += sm_m[i] == -INFINITY ? 0.0f : sm_l[i] * expf(sm_m[i] - M);
  const float f_prev = m_prev == -INFINITY ? 0.0f : expf(m_prev - M);
  if (!first) L += l_state[st] * f_prev;
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float a = first ? 0.0f : acc_state[st * D + d] * f_prev;
    for (int i = 0; i < WARPS; ++i) if (sm_m[i] != -INFINITY) a += sm_acc[i][d] * expf(sm_m[i] - M);
    acc_state[st * D + d] = a;
  }
  __syncthreads();                       // every thread has read m_state / l_state before they change
  if (threadIdx.x == 0) { m_state[st] = M; l_state[st] = L; }
}

extern "C" __global__ void __launch_bounds__(128) attn_finish(
    const float* __restrict__ m_state, const float* __restrict__ l_state, const float* __restrict__ acc_state,
    const float* __restrict__ sinks, float* __restrict__ out, int T, int H, int D) {
  const int th = blockIdx.x;
  if (th >= T * H) return;
  const float m = m_state[th], sink = sinks[th % H];
  const float M = fmaxf(m, sink);
  const float f = m == -INFINITY ? 0.0f : expf(m - M);
  const float den = l_state[th] * f + expf(sink - M);
  for (int d = threadIdx.x; d < D; d += blockDim.x) out[(long long)th * D + d] = acc_state[(long long)th * D + d] * f / den;
}
