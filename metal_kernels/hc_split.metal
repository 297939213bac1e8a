// The HC Sinkhorn split (NumpyOps.hc_split), one thread per token. Template N (= 4).
// mix [T, 2N + N*N], scale [3], base [2N + N*N], eps [1], iters [1], dims = (T);
// out: pre [T, N], post [T, N], C [T, N, N].
//   pre = sigmoid(mix[:N] * scale0 + base[:N]) + eps;  post = 2 sigmoid(mix[N:2N] * scale1 + base[N:2N])
//   C = softmax over each row of (mix[2N:] * scale2 + base[2N:]) viewed [N, N], + eps;
//   columns normalised (x / (column sum + eps)), then iters - 1 rounds of rows, then columns.
// Sums run in index order, as NumPy sums 4 values.
const uint t = thread_position_in_grid.x;
if (t >= uint(dims[0])) return;
const uint W = 2 * N + N * N;
auto m = mix + ulong(t) * W;
const float e = eps[0];
for (uint i = 0; i < N; ++i) {
  const float a = m[i] * scale[0] + base[i];
  pre[t * N + i] = 1.0f / (1.0f + metal::exp(-a)) + e;
  const float b = m[N + i] * scale[1] + base[N + i];
  post[t * N + i] = 2.0f * (1.0f / (1.0f + metal::exp(-b)));
}
float c[N * N];
for (uint i = 0; i < N; ++i) {
  float mx = -INFINITY;
  for (uint j = 0; j < N; ++j) {
    c[i * N + j] = m[2 * N + i * N + j] * scale[2] + base[2 * N + i * N + j];
    mx = metal::max(mx, c[i * N + j]);
  }
  float s = 0.0f;
  for (uint j = 0; j < N; ++j) { c[i * N + j] = metal::exp(c[i * N + j] - mx); s += c[i * N + j]; }
  for (uint j = 0; j < N; ++j) c[i * N + j] = c[i * N + j] / s + e;
}
const int rounds = metal::max(int(iters[0]), 1);   // iters <= 1: the column pass only
for (int r = 0; r < rounds; ++r) {
  if (r > 0) {                           // rows (not in the first round: columns come first)
    for (uint i = 0; i < N; ++i) {
      float s = 0.0f;
      for (uint j = 0; j < N; ++j) s += c[i * N + j];
      for (uint j = 0; j < N; ++j) c[i * N + j] = c[i * N + j] / (s + e);
    }
  }
  for (uint j = 0; j < N; ++j) {         // columns
    float s = 0.0f;
    for (uint i = 0; i < N; ++i) s += c[i * N + j];
    for (uint i = 0; i < N; ++i) c[i * N + j] = c[i * N + j] / (s + e);
  }
}
for (uint k = 0; k < N * N; ++k) C[ulong(t) * N * N + k] = c[k];
