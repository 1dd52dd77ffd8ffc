// Attention for new rows over one sequence's float32 cache, each query row on its own (AVX-512,
// or AVX2 where the extension is built without it), and the two elementwise ops of a layer that
// share its exp (rms_norm_rows, silu_mul):
// RoPE on q and k, k and v stored into the cache, then for every (row, head) softmax(q K / sqrt(d)) V
// over exactly the positions the row may see. One row's result never depends on the other rows
// of the call (the same instructions in the same order), so a k-token verify is bitwise a
// sequence of 1-token decodes, without the per-row SDPA calls that cost ~60 us each. Sums keep that
// order but run several at once (four keys' dots, eight chunks of the output), since one FMA chain
// at a time left the kernel waiting on FMA latency; the rows of a call and the heads sharing a KV
// head pass over it a tile of keys at a time, so the cache is read from memory once per block of
// rows rather than once per row and head, and two heads at a time share each key's and value's
// loads (scores2, mix2).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// keys a unit's heads pass over together: 16 keys' and values' rows (16 KB at head dim 128) stay
// in a core's L1 while each head reads them. 256 (L2-sized) left every head reading the tile from
// L2, which bounded the kernel: 16 took 0.76-0.86x its time on a Zen 4 (contexts 100-1000, 1-8
// rows; BENCHMARKS.md). The sums are the same either way: each still runs over the keys in order.
constexpr int64_t TILE = 16;

// rows a unit takes at most, and the most its rows' scores may take: their scores stay in L2
// while the unit mixes the values. A call's rows are split into blocks of near-equal size (even
// shares for the threads). Measured on a Zen 4 against one row a unit: 16 rows, or no bound on
// the scores, made prompt chunks 5-15% slower and 9 rows of a 0.5B over 2,000 positions 1.5x
// slower; 8 rows within 256 KB kept those within ~10% and the 1.5B's verifies 0.66-0.95x.
constexpr int64_t ROW_BLOCK = 8;
constexpr int64_t SCORE_BYTES = 256 * 1024;

// 2^f for f in [-0.5, 0.5]: degree-6 polynomial, highest power first (relative error ~2e-7)
constexpr float EXP2_POLY[7] = {1.535336188319500e-4f, 1.339887440266574e-3f, 9.618437357674640e-3f,
                                5.550332471162809e-2f, 2.402264791363012e-1f, 6.931472028550421e-1f, 1.0f};

// exp on 8 lanes (both builds: -mavx512f implies AVX2 and FMA), the same method as exp16 below,
// for x in [-87, 88].
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(t, n);
  __m256 p = _mm256_set1_ps(EXP2_POLY[0]);
  for (int i = 1; i < 7; ++i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(EXP2_POLY[i]));
  // 2^n for n in [-126, 127], built in the exponent field
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

#if defined(__AVX512F__)

// exp on 16 lanes: 2^(x log2 e) split into 2^n * 2^f, f in [-0.5, 0.5], a degree-6 polynomial
// for 2^f (relative error ~2e-7, below float32 softmax's own rounding).
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(EXP2_POLY[0]);
  for (int i = 1; i < 7; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP2_POLY[i]));
  return _mm512_scalef_ps(p, n);
}

// the few vector operations the shared steps below are written in
using Vec = __m512;
constexpr int64_t LANES = 16;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec vset1(float x) { return _mm512_set1_ps(x); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(Vec v) { return _mm512_reduce_add_ps(v); }

// score[0..m) <- exp(score - top); returns their sum
inline float exp_sum(float* score, int64_t m, float top) {
  __m512 total = _mm512_setzero_ps();
  int64_t t = 0;
  for (; t + 16 <= m; t += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(score + t), _mm512_set1_ps(top)));
    _mm512_storeu_ps(score + t, e);
    total = _mm512_add_ps(total, e);
  }
  if (t < m) {
    const __mmask16 left = static_cast<__mmask16>((1u << (m - t)) - 1);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(left, score + t), _mm512_set1_ps(top)));
    _mm512_mask_storeu_ps(score + t, left, e);
    total = _mm512_add_ps(total, _mm512_maskz_mov_ps(left, e));
  }
  return _mm512_reduce_add_ps(total);
}

#else  // AVX2 + FMA: the same steps on 8 lanes

using Vec = __m256;
constexpr int64_t LANES = 8;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec vset1(float x) { return _mm256_set1_ps(x); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(Vec v) { return hsum(v); }

inline float exp_sum(float* score, int64_t m, float top) {
  __m256 total = _mm256_setzero_ps();
  int64_t t = 0;
  for (; t + 8 <= m; t += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(score + t), _mm256_set1_ps(top)));
    _mm256_storeu_ps(score + t, e);
    total = _mm256_add_ps(total, e);
  }
  if (t < m) {
    const __m256i left = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(m - t)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_maskload_ps(score + t, left), _mm256_set1_ps(top))),
                                   _mm256_castsi256_ps(left));
    _mm256_maskstore_ps(score + t, left, e);
    total = _mm256_add_ps(total, e);
  }
  return hsum(total);
}

#endif

// dot(a, b) over d floats: one chain, LANES floats a step
inline float dot(const float* a, const float* b, int64_t d) {
  Vec acc = vzero();
  for (int64_t j = 0; j < d; j += LANES) acc = vfma(vload(a + j), vload(b + j), acc);
  return vsum(acc);
}

// dot(q, k[r], d) for four keys, each its own chain in dot's order (bitwise dot's result): four
// chains in flight instead of one.
inline void dot4(const float* q, const float* const* k, int64_t d, float* out) {
  Vec a0 = vzero(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t j = 0; j < d; j += LANES) {
    const Vec x = vload(q + j);
    a0 = vfma(x, vload(k[0] + j), a0);
    a1 = vfma(x, vload(k[1] + j), a1);
    a2 = vfma(x, vload(k[2] + j), a2);
    a3 = vfma(x, vload(k[3] + j), a3);
  }
  out[0] = vsum(a0), out[1] = vsum(a1), out[2] = vsum(a2), out[3] = vsum(a3);
}

// acc[0..LANES C) += sum over t in [t0, t1) of score[t] * v[seen[t]][j0..]: C independent chains,
// each element summed over t in order with one fma a step (a single chain waited ~4 cycles a step).
template <int C>
inline void mix_block(const float* score, const int64_t* seen, int64_t t0, int64_t t1, const float* v, int64_t d,
                      int64_t j0, float* acc) {
  Vec a[C];
  for (int c = 0; c < C; ++c) a[c] = vload(acc + LANES * c);
  for (int64_t t = t0; t < t1; ++t) {
    const Vec w = vset1(score[t]);
    const float* r = v + seen[t] * d + j0;
    for (int c = 0; c < C; ++c) a[c] = vfma(w, vload(r + LANES * c), a[c]);
  }
  for (int c = 0; c < C; ++c) vstore(acc + LANES * c, a[c]);
}

// o[0..d) += sum over t in [t0, t1) of score[t] * v[seen[t]], eight vectors of o at a time, then
// four, then one. Called tile after tile from o = 0, each element's sum runs over t in order.
inline void mix(const float* score, const int64_t* seen, int64_t t0, int64_t t1, const float* v, int64_t d, float* o) {
  int64_t j = 0;
  for (; j + 8 * LANES <= d; j += 8 * LANES) mix_block<8>(score, seen, t0, t1, v, d, j, o + j);
  for (; j + 4 * LANES <= d; j += 4 * LANES) mix_block<4>(score, seen, t0, t1, v, d, j, o + j);
  for (; j < d; j += LANES) mix_block<1>(score, seen, t0, t1, v, d, j, o + j);
}

// mix_block for two heads over the same values: each value vector is loaded once for both (the
// loads, not the FMAs, bounded mix on a Zen 4). Each head's sums are mix_block's, bitwise.
template <int C>
inline void mix_block2(const float* score_a, const float* score_b, const int64_t* seen, int64_t t0, int64_t t1,
                       const float* v, int64_t d, int64_t j0, float* acc_a, float* acc_b) {
  Vec a[C], b[C];
  for (int c = 0; c < C; ++c) a[c] = vload(acc_a + LANES * c), b[c] = vload(acc_b + LANES * c);
  for (int64_t t = t0; t < t1; ++t) {
    const Vec wa = vset1(score_a[t]), wb = vset1(score_b[t]);
    const float* r = v + seen[t] * d + j0;
    for (int c = 0; c < C; ++c) {
      const Vec x = vload(r + LANES * c);
      a[c] = vfma(wa, x, a[c]);
      b[c] = vfma(wb, x, b[c]);
    }
  }
  for (int c = 0; c < C; ++c) vstore(acc_a + LANES * c, a[c]), vstore(acc_b + LANES * c, b[c]);
}

// mix for two heads at once (mix_block2), four vectors of each output at a time: bitwise mix on
// each (every element still sums over t in order from o's value).
inline void mix2(const float* score_a, const float* score_b, const int64_t* seen, int64_t t0, int64_t t1,
                 const float* v, int64_t d, float* o_a, float* o_b) {
  int64_t j = 0;
  for (; j + 4 * LANES <= d; j += 4 * LANES) mix_block2<4>(score_a, score_b, seen, t0, t1, v, d, j, o_a + j, o_b + j);
  for (; j < d; j += LANES) mix_block2<1>(score_a, score_b, seen, t0, t1, v, d, j, o_a + j, o_b + j);
}

// score[t0..t1) <- dot(q, k[seen[t]]) * scale; returns max(top, their max)
inline float scores(const float* q, const float* k, const int64_t* seen, int64_t t0, int64_t t1, int64_t d,
                    float scale, float top, float* score) {
  int64_t t = t0;
  for (; t + 4 <= t1; t += 4) {
    const float* rows[4] = {k + seen[t] * d, k + seen[t + 1] * d, k + seen[t + 2] * d, k + seen[t + 3] * d};
    dot4(q, rows, d, score + t);
    for (int r = 0; r < 4; ++r) score[t + r] *= scale, top = std::max(top, score[t + r]);
  }
  for (; t < t1; ++t) {
    score[t] = dot(q, k + seen[t] * d, d) * scale;
    top = std::max(top, score[t]);
  }
  return top;
}

// scores for two heads over the same keys: each key vector is loaded once for both, four keys
// at a time as in dot4. Each head's scores and top are scores' own, bitwise.
inline void scores2(const float* qa, const float* qb, const float* k, const int64_t* seen, int64_t t0, int64_t t1,
                    int64_t d, float scale, float* top, float* score_a, float* score_b) {
  int64_t t = t0;
  for (; t + 4 <= t1; t += 4) {
    const float* rows[4] = {k + seen[t] * d, k + seen[t + 1] * d, k + seen[t + 2] * d, k + seen[t + 3] * d};
    Vec a[4], b[4];
    for (int r = 0; r < 4; ++r) a[r] = b[r] = vzero();
    for (int64_t j = 0; j < d; j += LANES) {
      const Vec xa = vload(qa + j), xb = vload(qb + j);
      for (int r = 0; r < 4; ++r) {
        const Vec kr = vload(rows[r] + j);
        a[r] = vfma(xa, kr, a[r]);
        b[r] = vfma(xb, kr, b[r]);
      }
    }
    for (int r = 0; r < 4; ++r) {
      score_a[t + r] = vsum(a[r]) * scale, top[0] = std::max(top[0], score_a[t + r]);
      score_b[t + r] = vsum(b[r]) * scale, top[1] = std::max(top[1], score_b[t + r]);
    }
  }
  if (t < t1) {
    top[0] = scores(qa, k, seen, t, t1, d, scale, top[0], score_a);
    top[1] = scores(qb, k, seen, t, t1, d, scale, top[1], score_b);
  }
}

// Into how many shares to split each unit's heads: the fewest that give the threads the shortest
// longest share of the work (each split reads the unit's cache once more). 2 KV heads on 2
// threads: 1; 3 on 2 threads (SmolLM2): 2, six halves, three a thread, not two units against one.
inline int64_t head_split(int64_t units, int64_t group, int64_t threads) {
  int64_t best = 1, rounds = (units + threads - 1) / threads;  // a thread's units, in whole units
  for (int64_t s = 2; s <= group; ++s) {
    const int64_t r = (units * s + threads - 1) / threads;  // a thread's shares, each 1/s of a unit
    if (r * best < rounds * s) best = s, rounds = r;
  }
  return best;
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

// x [n, h] float32, weight [h] float32 -> x / sqrt(mean(x^2) + eps) * weight, row by row (one
// call for what F.rms_norm runs as ~10 ops on CPU).
torch::Tensor rms_norm_rows(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "rms_norm_rows: x must be contiguous float32 [n, h]");
  const int64_t n = x.size(0), h = x.size(1);
  TORCH_CHECK(h % 8 == 0 && weight.scalar_type() == torch::kFloat32 && weight.is_contiguous() && weight.numel() == h,
              "rms_norm_rows: weight must be contiguous float32 [h], h a multiple of 8");
  auto out = torch::empty({n, h}, torch::kFloat32);
  const float* src = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* y = out.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const float* row = src + i * h;
      __m256 acc = _mm256_setzero_ps();
      for (int64_t j = 0; j < h; j += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(row + j), _mm256_loadu_ps(row + j), acc);
      const __m256 inv = _mm256_set1_ps(1.0f / std::sqrt(hsum(acc) / static_cast<float>(h) + static_cast<float>(eps)));
      for (int64_t j = 0; j < h; j += 8)
        _mm256_storeu_ps(y + i * h + j, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(row + j), inv), _mm256_loadu_ps(w + j)));
    }
  });
  return out;
}

// gate_up [n, 2 i] float32 (the fused gate and up projections) -> silu(gate) * up [n, i].
torch::Tensor silu_mul(const torch::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.scalar_type() == torch::kFloat32 && gate_up.is_contiguous() &&
                  gate_up.size(1) % 16 == 0,
              "silu_mul: gate_up must be contiguous float32 [n, 2 i], i a multiple of 8");
  const int64_t n = gate_up.size(0), inner = gate_up.size(1) / 2;
  auto out = torch::empty({n, inner}, torch::kFloat32);
  const float* src = gate_up.data_ptr<float>();
  float* y = out.data_ptr<float>();
  const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
  at::parallel_for(0, n * inner / 8, 256, [&](int64_t lo, int64_t hi) {
    for (int64_t u = lo; u < hi; ++u) {
      const int64_t i = u * 8 / inner, j = u * 8 % inner;
      const __m256 g = _mm256_loadu_ps(src + i * 2 * inner + j), up = _mm256_loadu_ps(src + i * 2 * inner + inner + j);
      const __m256 e = exp8(_mm256_sub_ps(zero, g));  // silu(g) = g / (1 + exp(-g))
      _mm256_storeu_ps(y + i * inner + j, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), up));
    }
  });
  return out;
}

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
  if (n == 0) return out;
  float* y = out.data_ptr<float>();
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const int64_t group = hq / hkv;
  // A unit is a block of rows and the query heads of one KV head (a share of those heads where
  // that evens out the threads' work: head_split). It passes over the keys, then the values, a tile of
  // positions at a time, and every row and head of the unit works on a tile while it sits in L1,
  // so one layer's cache is read from memory once per unit. (A unit per row, or per half of a
  // KV head's heads, read it once per row or per half: 1.2-1.5x the time on a Zen 4 with the
  // cache out of L2, as in a real forward; BENCHMARKS.md.) Each row's sums are unchanged: every
  // dot is its own chain, the max is exact and each output element still sums over the row's
  // positions in order, so where the tiles fall cannot change a row's result.
  const int64_t stride = end + 16;  // between two heads' scores
  const int64_t row_bytes = group * stride * static_cast<int64_t>(sizeof(float));  // a row's scores
  const int64_t fit = std::clamp<int64_t>(SCORE_BYTES / row_bytes, 1, ROW_BLOCK);
  const int64_t blocks = (n + fit - 1) / fit, each = (n + blocks - 1) / blocks;
  const int64_t units = blocks * hkv, split = head_split(units, group, at::get_num_threads());
  const int64_t per = (group + split - 1) / split;
  at::parallel_for(0, units * split, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> score(each * per * stride), top(each * per), inv(each * per);
    std::vector<int64_t> positions(end), seen(masked ? each * end : 0), m(each), cur(each);
    for (int64_t p = 0; p < end; ++p) positions[p] = p;
    std::vector<const int64_t*> row_seen(each);
    for (int64_t u = lo; u < hi; ++u) {
      const int64_t i0 = u / (hkv * split) * each, rows = std::min(n - i0, each), g = u / split % hkv;
      const int64_t h0 = g * group + u % split * per, hn = std::min(per, (g + 1) * group - h0);
      const float* kg = kc + g * cap * d;
      const float* vg = vc + g * cap * d;
      for (int64_t r = 0; r < rows; ++r) {  // the positions row i0 + r sees, in order
        const int64_t i = i0 + r;
        if (!masked) {
          m[r] = start + i + 1, row_seen[r] = positions.data();
          continue;
        }
        int64_t* s = seen.data() + r * end;
        m[r] = 0;
        for (int64_t p = 0; p < end; ++p)
          if (allowed[i * end + p]) s[m[r]++] = p;
        row_seen[r] = s;
      }
      // f(r, t0, t1) for row r's run [t0, t1) of seen positions in each tile, tile after tile
      auto each_run = [&](auto&& f) {
        std::fill(cur.begin(), cur.end(), 0);
        for (int64_t p0 = 0; p0 < end; p0 += TILE)
          for (int64_t r = 0; r < rows; ++r) {
            const int64_t t0 = cur[r];
            while (cur[r] < m[r] && row_seen[r][cur[r]] < p0 + TILE) ++cur[r];
            if (cur[r] > t0) f(r, t0, cur[r]);
          }
      };
      std::fill(top.begin(), top.end(), -INFINITY);
      each_run([&](int64_t r, int64_t t0, int64_t t1) {
        const float* qh = qr + ((i0 + r) * hq + h0) * d;
        float* sr = score.data() + r * per * stride;
        float* tr = top.data() + r * per;
        int64_t h = 0;
        for (; h + 2 <= hn; h += 2)
          scores2(qh + h * d, qh + (h + 1) * d, kg, row_seen[r], t0, t1, d, scale, tr + h, sr + h * stride,
                  sr + (h + 1) * stride);
        for (; h < hn; ++h) tr[h] = scores(qh + h * d, kg, row_seen[r], t0, t1, d, scale, tr[h], sr + h * stride);
      });
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t h = 0; h < hn; ++h)
          inv[r * per + h] = 1.0f / exp_sum(score.data() + (r * per + h) * stride, m[r], top[r * per + h]);
        std::fill(y + ((i0 + r) * hq + h0) * d, y + ((i0 + r) * hq + h0 + hn) * d, 0.0f);
      }
      each_run([&](int64_t r, int64_t t0, int64_t t1) {
        const float* sr = score.data() + r * per * stride;
        float* o = y + ((i0 + r) * hq + h0) * d;
        int64_t h = 0;
        for (; h + 2 <= hn; h += 2)
          mix2(sr + h * stride, sr + (h + 1) * stride, row_seen[r], t0, t1, vg, d, o + h * d, o + (h + 1) * d);
        for (; h < hn; ++h) mix(sr + h * stride, row_seen[r], t0, t1, vg, d, o + h * d);
      });
      for (int64_t r = 0; r < rows; ++r) {
        float* o = y + ((i0 + r) * hq + h0) * d;
        for (int64_t j = 0; j < hn * d; ++j) o[j] *= inv[r * per + j / d];
      }
    }
  });
  return out;
}
