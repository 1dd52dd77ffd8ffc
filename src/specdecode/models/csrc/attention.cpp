// Attention for new rows over one sequence's float32 cache, each query row on its own (AVX-512):
// RoPE on q and k, k and v stored into the cache, then for every (row, head) softmax(q K / sqrt(d)) V
// over exactly the positions the row may see. One row's result never depends on the other rows
// of the call (the same instructions in the same order), so a k-token verify is bitwise a
// sequence of 1-token decodes, without the per-row SDPA calls that cost ~60 us each.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// exp on 16 lanes: 2^(x log2 e) split into 2^n * 2^f, f in [-0.5, 0.5], a degree-6 polynomial
// for 2^f (relative error ~2e-7, below float32 softmax's own rounding).
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

inline float dot(const float* a, const float* b, int64_t d) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t j = 0; j < d; j += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + j), _mm512_loadu_ps(b + j), acc);
  return _mm512_reduce_add_ps(acc);
}

// rotate-half RoPE of one head vector: y = x * cos + [-x2, x1] * sin
inline void rope(const float* x, const float* c, const float* s, float* y, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t j = 0; j < half; ++j) {
    y[j] = x[j] * c[j] - x[j + half] * s[j];
    y[j + half] = x[j + half] * c[j + half] + x[j] * s[j + half];
  }
}

}  // namespace

// qkv [n, (hq + 2 hkv) * d] float32 (the projection's rows), cos/sin [n, d], keys/values
// [hkv, capacity, d] float32 (one layer of one sequence's cache), rows written at start..start+n;
// mask [n, start + n] bool or empty (causal). Returns [n, hq * d] float32.
torch::Tensor attend_rows(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                          torch::Tensor keys, torch::Tensor values, int64_t start, const torch::Tensor& mask,
                          int64_t hq, int64_t hkv) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.scalar_type() == torch::kFloat32 && qkv.is_contiguous(),
              "attend_rows: qkv must be contiguous float32 [n, (hq + 2 hkv) * d]");
  TORCH_CHECK(keys.is_contiguous() && values.is_contiguous() && keys.scalar_type() == torch::kFloat32,
              "attend_rows: the cache must be contiguous float32 [hkv, capacity, d]");
  const int64_t n = qkv.size(0), d = keys.size(2), cap = keys.size(1), end = start + n;
  TORCH_CHECK(d % 16 == 0 && qkv.size(1) == (hq + 2 * hkv) * d && keys.size(0) == hkv && hq % hkv == 0,
              "attend_rows: shapes disagree (head dim must be a multiple of 16)");
  TORCH_CHECK(end <= cap, "attend_rows: the cache holds ", cap, " positions, not ", end);
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(0) == n && cos.size(1) == d,
              "attend_rows: cos/sin must be contiguous [n, d]");
  const bool masked = mask.defined() && mask.numel() > 0;
  if (masked) TORCH_CHECK(mask.scalar_type() == torch::kBool && mask.is_contiguous() && mask.numel() == n * end,
                          "attend_rows: mask must be contiguous bool [n, start + n]");
  const float* src = qkv.data_ptr<float>();
  const float* c = cos.data_ptr<float>();
  const float* s = sin.data_ptr<float>();
  float* kc = keys.data_ptr<float>();
  float* vc = values.data_ptr<float>();
  const bool* allowed = masked ? mask.data_ptr<bool>() : nullptr;
  const int64_t width = (hq + 2 * hkv) * d;
  auto q = torch::empty({n, hq, d}, torch::kFloat32);
  float* qr = q.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) {  // store this call's keys and values first: rows see each other
    const float* row = src + i * width;
    for (int64_t h = 0; h < hq; ++h) rope(row + h * d, c + i * d, s + i * d, qr + (i * hq + h) * d, d);
    for (int64_t g = 0; g < hkv; ++g) {
      rope(row + (hq + g) * d, c + i * d, s + i * d, kc + (g * cap + start + i) * d, d);
      std::memcpy(vc + (g * cap + start + i) * d, row + (hq + hkv + g) * d, d * sizeof(float));
    }
  }
  auto out = torch::empty({n, hq * d}, torch::kFloat32);
  float* y = out.data_ptr<float>();
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const int64_t group = hq / hkv;
  at::parallel_for(0, n * hq, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> score(end + 16);
    std::vector<int64_t> seen(end);
    for (int64_t u = lo; u < hi; ++u) {
      const int64_t i = u / hq, h = u % hq, g = h / group;
      const float* qv = qr + u * d;
      const float* kg = kc + g * cap * d;
      const float* vg = vc + g * cap * d;
      int64_t m = 0;  // the positions row i sees, in order
      for (int64_t p = 0; p < end; ++p)
        if (masked ? allowed[i * end + p] : p <= start + i) seen[m++] = p;
      float top = -INFINITY;
      for (int64_t t = 0; t < m; ++t) {
        score[t] = dot(qv, kg + seen[t] * d, d) * scale;
        top = std::max(top, score[t]);
      }
      __m512 total = _mm512_setzero_ps();
      int64_t t = 0;
      for (; t + 16 <= m; t += 16) {
        const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(score.data() + t), _mm512_set1_ps(top)));
        _mm512_storeu_ps(score.data() + t, e);
        total = _mm512_add_ps(total, e);
      }
      if (t < m) {
        const __mmask16 left = static_cast<__mmask16>((1u << (m - t)) - 1);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(left, score.data() + t), _mm512_set1_ps(top)));
        _mm512_mask_storeu_ps(score.data() + t, left, e);
        total = _mm512_add_ps(total, _mm512_maskz_mov_ps(left, e));
      }
      const float inv = 1.0f / _mm512_reduce_add_ps(total);
      float* o = y + i * hq * d + h * d;
      for (int64_t j = 0; j < d; j += 16) {
        __m512 acc = _mm512_setzero_ps();
        for (int64_t t2 = 0; t2 < m; ++t2)
          acc = _mm512_fmadd_ps(_mm512_set1_ps(score[t2]), _mm512_loadu_ps(vg + seen[t2] * d + j), acc);
        _mm512_storeu_ps(o + j, _mm512_mul_ps(acc, _mm512_set1_ps(inv)));
      }
    }
  });
  return out;
}
