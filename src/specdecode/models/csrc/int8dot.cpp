// Integer-dot matmuls for quantized weights on x86 (what llama.cpp's CPU path does, in a layout
// made for several rows at once): activations are rounded to int8 in groups of 32 along the
// input (one fp32 scale per row and group), multiplied with 4- or 8-bit weights exactly in
// integers, and scaled to fp32 once per group. Two instruction sets, chosen when the extension
// is built for the machine (models/int8dot.py):
// - AVX-512 VNNI: vpdpbusd, 64 multiply-adds per instruction into int32.
// - AVX2: vpmaddubsw (u8 x s8 pairs into int16) and vpmaddwd into int32. No sum can saturate:
//   a 4-bit weight times an int8 is at most 15 * 127, so a group's 16 products per int16 lane
//   stay under 2^15; 8-bit weights go through their absolute value with the sign moved onto the
//   activation (at most 2 * 128 * 127 per pair), as llama.cpp does.
// The integer sums are exact and the float steps after them are the same instructions in the
// same order on both, so both sets give bitwise the same output.
//
// Contract (tested against a plain reference in tests/models/test_int8dot.py):
// - Each output row depends only on its own input row: rows are quantized separately, every
//   row's sums run in the same order whatever the number of rows or threads (threads split the
//   output columns), so 1-token decode is bitwise equal to a k-token verify.
// - Weights come packed by `pack_u4` / `pack_u8` below into tiles of output columns: 32 for u4
//   (two 16-column halves side by side, so each broadcast activation feeds two multiplies and
//   the weights stay one stream), 16 for u8.
//
// Layout, group by group (G = in / 32 groups):
//   u4: per group, for each 16-column half: [256 bytes of nibbles][16 bf16 scales d][16 bf16
//       zeros z], w = (q - 8) * d + z. Byte 4j + b of 64-byte chunk c holds column j's q at
//       input 8c + b (low nibble) and at 8c + 4 + b (high nibble): one chunk unpacks to two
//       multiply operands.
//   u8: [512 bytes: q + 128 as u8, byte 4j + b of chunk c = column j at input 4c + b]; one fp32
//       scale per column in a separate vector, w = q * s.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define SPECDECODE_AVX512 1
#else
#define SPECDECODE_AVX512 0
#endif

namespace {

constexpr int GROUP = 32;
constexpr int TILE = 16;     // columns per 512-bit accumulator
constexpr int U4_TILE = 32;  // columns per u4 tile: two halves
constexpr int U4_GROUP_BYTES = 256 + 64;  // one half's group
constexpr int U8_GROUP_BYTES = 512;
constexpr int MAX_BLOCK = 8;  // most rows sharing one pass over a tile (accumulators stay in registers)
// Software prefetch this many groups ahead of the one being multiplied. The hardware prefetcher
// stops at every 4 KiB page and, with 8 rows computing on each line, falls behind: on a 2-core
// Xeon (AVX-512) a 1-token forward of the Qwen 1.5B took 45 ms with it against 50, a 9-token one
// 77 against 84 (2-4 KB ahead all within 2%; BENCHMARKS.md).
constexpr int PREFETCH_GROUPS = 4;

struct QuantRows {
  // Activations rounded per (row, group): xq int8 [m, k], dx fp32 [m, g] (the scale),
  // xs int32 [m, g] (the sum of the group's xq), sx fp32 [m, g] (dx * xs).
  torch::Tensor xq, dx, xs, sx;
};

#if SPECDECODE_AVX512

// One group of 32 activations rounded to int8 at q; returns the group's absmax and sum of q.
inline void round_group(const float* p, int8_t* q, float* amax, int32_t* sum) {
  const __m512 sign = _mm512_set1_ps(-0.0f);
  const __m512 a = _mm512_loadu_ps(p), b = _mm512_loadu_ps(p + 16);
  *amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, a), _mm512_andnot_ps(sign, b)));
  const __m512 inv = _mm512_set1_ps(*amax > 0.0f ? 127.0f / *amax : 0.0f);
  const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inv));  // round to nearest even
  const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inv));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(qa));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtsepi32_epi8(qb));
  *sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
}

inline __m512 load_bf16(const uint8_t* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

inline __m512i bcast32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// One u4 tile (two 16-column halves) for MB rows: each broadcast activation feeds both halves.
template <int MB>
void u4_tile(const uint8_t* w, int64_t groups, const int8_t* xq, const float* dx, const float* sx, int64_t k,
             float* out, int64_t n) {
  constexpr int NT = 2;
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[NT][MB];
  for (int j = 0; j < NT; ++j)
    for (int r = 0; r < MB; ++r) acc[j][r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g, w += NT * U4_GROUP_BYTES) {
    for (int line = 0; line < NT * U4_GROUP_BYTES; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(w + PREFETCH_GROUPS * NT * U4_GROUP_BYTES + line), _MM_HINT_T0);
    __m512i isum[NT][MB];
    for (int j = 0; j < NT; ++j)
      for (int r = 0; r < MB; ++r) isum[j][r] = _mm512_setzero_si512();
    for (int c = 0; c < 4; ++c) {
      __m512i lo[NT], hi[NT];
      for (int j = 0; j < NT; ++j) {
        const __m512i packed = _mm512_loadu_si512(w + j * U4_GROUP_BYTES + c * 64);
        lo[j] = _mm512_and_si512(packed, low);
        hi[j] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low);
      }
      for (int r = 0; r < MB; ++r) {
        const int8_t* a = xq + r * k + g * GROUP + c * 8;
        const __m512i first = bcast32(a), second = bcast32(a + 4);
        for (int j = 0; j < NT; ++j) {
          isum[j][r] = _mm512_dpbusd_epi32(isum[j][r], lo[j], first);
          isum[j][r] = _mm512_dpbusd_epi32(isum[j][r], hi[j], second);
        }
      }
    }
    for (int j = 0; j < NT; ++j) {
      const uint8_t* sc = w + j * U4_GROUP_BYTES + 256;
      const __m512 d = load_bf16(sc);
      const __m512 offset = _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), d, load_bf16(sc + 32));  // z - 8 d
      for (int r = 0; r < MB; ++r) {
        const int64_t at = r * groups + g;
        // sum_j w_j x_j = d * dx * sum q xq + (z - 8 d) * dx * sum xq, in this order for every row
        const __m512 scaled = _mm512_mul_ps(d, _mm512_set1_ps(dx[at]));
        acc[j][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[j][r]), scaled, acc[j][r]);
        acc[j][r] = _mm512_fmadd_ps(offset, _mm512_set1_ps(sx[at]), acc[j][r]);
      }
    }
  }
  for (int j = 0; j < NT; ++j)
    for (int r = 0; r < MB; ++r) _mm512_storeu_ps(out + r * n + j * TILE, acc[j][r]);
}

template <int MB>
void u8_tile(const uint8_t* w, int64_t groups, const int8_t* xq, const float* dx, const int32_t* xs,
             const float* scale, int64_t k, float* out, int64_t n) {
  __m512 acc[MB];
  for (int r = 0; r < MB; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g, w += U8_GROUP_BYTES) {
    for (int line = 0; line < U8_GROUP_BYTES; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(w + PREFETCH_GROUPS * U8_GROUP_BYTES + line), _MM_HINT_T0);
    __m512i isum[MB];
    for (int r = 0; r < MB; ++r) isum[r] = _mm512_setzero_si512();
    for (int c = 0; c < 8; ++c) {
      const __m512i q = _mm512_loadu_si512(w + c * 64);
      for (int r = 0; r < MB; ++r) isum[r] = _mm512_dpbusd_epi32(isum[r], q, bcast32(xq + r * k + g * GROUP + c * 4));
    }
    for (int r = 0; r < MB; ++r) {
      const int64_t at = r * groups + g;
      // the weights were stored as q + 128: take 128 * sum x back out, exactly, in int32
      const __m512i centred = _mm512_sub_epi32(isum[r], _mm512_set1_epi32(xs[at] * 128));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(centred), _mm512_set1_ps(dx[at]), acc[r]);
    }
  }
  const __m512 s = _mm512_loadu_ps(scale);
  for (int r = 0; r < MB; ++r) _mm512_storeu_ps(out + r * n, _mm512_mul_ps(acc[r], s));
}

#else  // AVX2

inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

inline int32_t hsum8(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

inline void round_group(const float* p, int8_t* q, float* amax, int32_t* sum) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undo the packs' lane interleave
  __m256 v[4];
  __m256 top = _mm256_setzero_ps();
  for (int t = 0; t < 4; ++t) {
    v[t] = _mm256_loadu_ps(p + 8 * t);
    top = _mm256_max_ps(top, _mm256_andnot_ps(sign, v[t]));
  }
  *amax = hmax8(top);
  const __m256 inv = _mm256_set1_ps(*amax > 0.0f ? 127.0f / *amax : 0.0f);
  __m256i r[4];
  for (int t = 0; t < 4; ++t) r[t] = _mm256_cvtps_epi32(_mm256_mul_ps(v[t], inv));  // nearest even
  const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(r[0], r[1]), _mm256_packs_epi32(r[2], r[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_permutevar8x32_epi32(packed, order));
  *sum = hsum8(_mm256_add_epi32(_mm256_add_epi32(r[0], r[1]), _mm256_add_epi32(r[2], r[3])));
}


inline __m256 load_bf16(const uint8_t* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline __m256i bcast32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// One u4 tile (32 columns: four 8-column registers) for MB rows, in one pass over its bytes in
// memory order (what the hardware prefetcher streams best): group by group, half by half, each
// half's int16 sums folded into the float accumulators before the next (16 registers hold
// MB x 2 sums, the unpacked weights and the broadcasts). A group's 8 products per int16 lane
// pair stay below 2^15 (see the top), so they add in int16 and widen once per group.
template <int MB>
void u4_tile(const uint8_t* w, int64_t groups, const int8_t* xq, const float* dx, const float* sx, int64_t k,
             float* out, int64_t n) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[MB][4];
  for (int r = 0; r < MB; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    for (int half = 0; half < 2; ++half, w += U4_GROUP_BYTES) {
      for (int line = 0; line < U4_GROUP_BYTES; line += 64)  // a few groups ahead: more reads in flight
        _mm_prefetch(reinterpret_cast<const char*>(w + PREFETCH_GROUPS * 2 * U4_GROUP_BYTES + line), _MM_HINT_T0);
      __m256i isum[MB][2];
      for (int r = 0; r < MB; ++r) isum[r][0] = isum[r][1] = _mm256_setzero_si256();
      for (int c = 0; c < 4; ++c) {
        __m256i lo[2], hi[2];
        for (int h = 0; h < 2; ++h) {
          const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + c * 64 + h * 32));
          lo[h] = _mm256_and_si256(packed, low);
          hi[h] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
        }
        for (int r = 0; r < MB; ++r) {
          const int8_t* a = xq + r * k + g * GROUP + c * 8;
          const __m256i first = bcast32(a), second = bcast32(a + 4);
          for (int h = 0; h < 2; ++h) {
            isum[r][h] = _mm256_add_epi16(isum[r][h], _mm256_maddubs_epi16(lo[h], first));
            isum[r][h] = _mm256_add_epi16(isum[r][h], _mm256_maddubs_epi16(hi[h], second));
          }
        }
      }
      for (int h = 0; h < 2; ++h) {
        const __m256 d = load_bf16(w + 256 + h * 16);
        const __m256 offset = _mm256_fnmadd_ps(_mm256_set1_ps(8.0f), d, load_bf16(w + 288 + h * 16));  // z - 8 d
        for (int r = 0; r < MB; ++r) {
          const int64_t at = r * groups + g;
          const __m256 scaled = _mm256_mul_ps(d, _mm256_set1_ps(dx[at]));
          const __m256i total = _mm256_madd_epi16(isum[r][h], ones);
          __m256& sum = acc[r][2 * half + h];
          sum = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), scaled, sum);
          sum = _mm256_fmadd_ps(offset, _mm256_set1_ps(sx[at]), sum);
        }
      }
    }
  }
  for (int r = 0; r < MB; ++r)
    for (int j = 0; j < 4; ++j) _mm256_storeu_ps(out + r * n + j * 8, acc[r][j]);
}

template <int MB>
void u8_tile(const uint8_t* w, int64_t groups, const int8_t* xq, const float* dx, const int32_t* xs,
             const float* scale, int64_t k, float* out, int64_t n) {
  (void)xs;  // the sums below are of q itself, not q + 128
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[MB][2];
  for (int r = 0; r < MB; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g, w += U8_GROUP_BYTES) {
    __m256i isum[MB][2];
    for (int r = 0; r < MB; ++r) isum[r][0] = isum[r][1] = _mm256_setzero_si256();
    for (int c = 0; c < 8; ++c) {
      __m256i q[2], mag[2];
      for (int h = 0; h < 2; ++h) {
        q[h] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + c * 64 + h * 32)), flip);
        mag[h] = _mm256_abs_epi8(q[h]);
      }
      for (int r = 0; r < MB; ++r) {
        const __m256i a = bcast32(xq + r * k + g * GROUP + c * 4);
        for (int h = 0; h < 2; ++h) {
          const __m256i pairs = _mm256_maddubs_epi16(mag[h], _mm256_sign_epi8(a, q[h]));
          isum[r][h] = _mm256_add_epi32(isum[r][h], _mm256_madd_epi16(pairs, ones));
        }
      }
    }
    for (int r = 0; r < MB; ++r) {
      const __m256 dr = _mm256_set1_ps(dx[r * groups + g]);
      for (int h = 0; h < 2; ++h) acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r][h]), dr, acc[r][h]);
    }
  }
  for (int h = 0; h < 2; ++h) {
    const __m256 s = _mm256_loadu_ps(scale + h * 8);
    for (int r = 0; r < MB; ++r) _mm256_storeu_ps(out + r * n + h * 8, _mm256_mul_ps(acc[r][h], s));
  }
}

#endif

QuantRows quantize_rows(const torch::Tensor& x) {
  const int64_t m = x.size(0), k = x.size(1), g = k / GROUP;
  auto xq = torch::empty({m, k}, torch::kInt8);
  auto dx = torch::empty({m, g}, torch::kFloat32);
  auto xs = torch::empty({m, g}, torch::kInt32);
  auto sx = torch::empty({m, g}, torch::kFloat32);
  const float* src = x.data_ptr<float>();
  int8_t* q = xq.data_ptr<int8_t>();
  float* d = dx.data_ptr<float>();
  int32_t* s = xs.data_ptr<int32_t>();
  float* ds = sx.data_ptr<float>();
  for (int64_t i = 0; i < m * g; ++i) {
    float amax;
    round_group(src + i * GROUP, q + i * GROUP, &amax, s + i);
    d[i] = amax / 127.0f;
    ds[i] = d[i] * static_cast<float>(s[i]);
  }
  return {xq, dx, xs, sx};
}

using TileFn = void (*)(const uint8_t*, int64_t, const int8_t*, const float*, const int32_t*, const float*,
                        int64_t, float*, int64_t);

using U4Fn = void (*)(const uint8_t*, int64_t, const int8_t*, const float*, const float*, int64_t, float*, int64_t);

template <int MB>
struct U4 {
  static constexpr U4Fn fn = &u4_tile<MB>;
};
template <int MB>
struct U8 {
  static constexpr TileFn fn = &u8_tile<MB>;
};

template <template <int> class F, typename Fn = TileFn>
Fn pick(int mb) {
  switch (mb) {
    case 1: return F<1>::fn;
    case 2: return F<2>::fn;
    case 3: return F<3>::fn;
    case 4: return F<4>::fn;
    case 5: return F<5>::fn;
    case 6: return F<6>::fn;
    case 7: return F<7>::fn;
    default: return F<8>::fn;
  }
}

void check_input(const torch::Tensor& x, int64_t k) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "int8dot: x must be a contiguous float32 [rows, in] tensor");
  TORCH_CHECK(x.size(1) == k && k % GROUP == 0, "int8dot: x has ", x.size(1), " inputs, the matrix ", k);
}

// x [m, k] fp32 by a packed [n, k] matrix -> [m, n] fp32. `tile_bytes` is one tile's size.
torch::Tensor run(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& extra, int64_t n,
                  int64_t k, bool u4, int64_t block) {
  check_input(x, k);
  TORCH_CHECK(block >= 1 && block <= MAX_BLOCK, "int8dot: block must be 1..", MAX_BLOCK);
  const int64_t width = u4 ? U4_TILE : TILE;
  TORCH_CHECK(n % width == 0, "int8dot: out must be a multiple of ", width);
  const int64_t m = x.size(0), groups = k / GROUP;
  const int64_t tile_bytes = groups * (u4 ? 2 * U4_GROUP_BYTES : U8_GROUP_BYTES);
  TORCH_CHECK(packed.numel() == (n / width) * tile_bytes, "int8dot: packed matrix has the wrong size");
  QuantRows a = quantize_rows(x);
  auto out = torch::empty({m, n}, torch::kFloat32);
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const int8_t* xq = a.xq.data_ptr<int8_t>();
  const float* dx = a.dx.data_ptr<float>();
  const int32_t* xs = a.xs.data_ptr<int32_t>();
  const float* sx = a.sx.data_ptr<float>();
  const float* scale = u4 ? nullptr : extra.data_ptr<float>();
  float* y = out.data_ptr<float>();
  at::parallel_for(0, n / width, 8, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      for (int64_t r0 = 0; r0 < m; r0 += block) {
        const int mb = static_cast<int>(std::min<int64_t>(block, m - r0));
        const int8_t* xr = xq + r0 * k;
        const float* dr = dx + r0 * groups;
        const int32_t* sr = xs + r0 * groups;
        float* yr = y + r0 * n + t * width;
        if (u4) {
          pick<U4, U4Fn>(mb)(w + t * tile_bytes, groups, xr, dr, sx + r0 * groups, k, yr, n);
        } else {
          pick<U8>(mb)(w + t * tile_bytes, groups, xr, dr, sr, scale + t * TILE, k, yr, n);
        }
      }
    }
  });
  return out;
}

torch::Tensor u4_mm(const torch::Tensor& x, const torch::Tensor& packed, int64_t n, int64_t k, int64_t block) {
  return run(x, packed, torch::Tensor(), n, k, true, block);
}

torch::Tensor u8_mm(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scale, int64_t n,
                    int64_t k, int64_t block) {
  TORCH_CHECK(scale.scalar_type() == torch::kFloat32 && scale.numel() == n, "int8dot: scale must be float32 [out]");
  return run(x, packed, scale, n, k, false, block);
}

// q uint8 0..15 [n, k], d and z bf16 [n, k / 32] -> the u4 tiles (uint8, flat).
torch::Tensor pack_u4(const torch::Tensor& q, const torch::Tensor& d, const torch::Tensor& z) {
  const int64_t n = q.size(0), k = q.size(1), groups = k / GROUP;
  TORCH_CHECK(n % U4_TILE == 0 && k % GROUP == 0, "int8dot: u4 needs out % 32 == 0 and in % 32 == 0");
  auto qc = q.contiguous();
  auto dc = d.contiguous().view(torch::kInt16), zc = z.contiguous().view(torch::kInt16);
  auto out = torch::empty({(n / TILE) * groups * U4_GROUP_BYTES}, torch::kUInt8);
  const uint8_t* src = qc.data_ptr<uint8_t>();
  const int16_t* ds = dc.data_ptr<int16_t>();
  const int16_t* zs = zc.data_ptr<int16_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, n / TILE, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {  // a 16-column half: tile t / 2, half t % 2
      for (int64_t g = 0; g < groups; ++g) {
        uint8_t* p = dst + (((t / 2) * groups + g) * 2 + t % 2) * U4_GROUP_BYTES;
        for (int c = 0; c < 4; ++c)
          for (int j = 0; j < TILE; ++j)
            for (int b = 0; b < 4; ++b) {
              const uint8_t* row = src + (t * TILE + j) * k + g * GROUP + c * 8;
              p[c * 64 + 4 * j + b] = static_cast<uint8_t>((row[b] & 0x0F) | ((row[b + 4] & 0x0F) << 4));
            }
        int16_t* dp = reinterpret_cast<int16_t*>(p + 256);
        int16_t* zp = reinterpret_cast<int16_t*>(p + 288);
        for (int j = 0; j < TILE; ++j) {
          dp[j] = ds[(t * TILE + j) * groups + g];
          zp[j] = zs[(t * TILE + j) * groups + g];
        }
      }
    }
  });
  return out;
}

// q int8 [n, k] -> the u8 tiles (q + 128, uint8, flat).
torch::Tensor pack_u8(const torch::Tensor& q) {
  const int64_t n = q.size(0), k = q.size(1), groups = k / GROUP;
  TORCH_CHECK(n % TILE == 0 && k % GROUP == 0, "int8dot: u8 needs out % 16 == 0 and in % 32 == 0");
  auto qc = q.contiguous();
  auto out = torch::empty({(n / TILE) * groups * U8_GROUP_BYTES}, torch::kUInt8);
  const int8_t* src = qc.data_ptr<int8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, n / TILE, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t)
      for (int64_t g = 0; g < groups; ++g) {
        uint8_t* p = dst + (t * groups + g) * U8_GROUP_BYTES;
        for (int c = 0; c < 8; ++c)
          for (int j = 0; j < TILE; ++j)
            for (int b = 0; b < 4; ++b)
              p[c * 64 + 4 * j + b] = static_cast<uint8_t>(src[(t * TILE + j) * k + g * GROUP + c * 4 + b] + 128);
      }
  });
  return out;
}

std::vector<torch::Tensor> quantize_activations(const torch::Tensor& x) {
  check_input(x, x.size(1));
  QuantRows a = quantize_rows(x);
  return {a.xq, a.dx, a.xs};
}

}  // namespace

// for csrc/layers.cpp
torch::Tensor int8dot_u4_mm(const torch::Tensor& x, const torch::Tensor& packed, int64_t n, int64_t k, int64_t block) {
  return u4_mm(x, packed, n, k, block);
}
torch::Tensor int8dot_u8_mm(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scale, int64_t n,
                            int64_t k, int64_t block) {
  return u8_mm(x, packed, scale, n, k, block);
}

// csrc/layers.cpp
void register_layer_stack(py::module& m);

// csrc/attention.cpp
torch::Tensor attend_rows(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                          torch::Tensor keys, torch::Tensor values, int64_t start, const torch::Tensor& mask,
                          int64_t hq, int64_t hkv);
torch::Tensor rms_norm_rows(const torch::Tensor& x, const torch::Tensor& weight, double eps);
torch::Tensor silu_mul(const torch::Tensor& gate_up);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("u4_mm", &u4_mm, "x fp32 [m, k] by packed 4-bit weights [n, k] -> fp32 [m, n]");
  m.def("u8_mm", &u8_mm, "x fp32 [m, k] by packed 8-bit weights [n, k] and their scales -> fp32 [m, n]");
  m.def("pack_u4", &pack_u4, "4-bit weights, scales and zeros -> u4 tiles");
  m.def("pack_u8", &pack_u8, "int8 weights -> u8 tiles");
  m.def("attend_rows", &attend_rows, "RoPE, cache write and row-by-row attention over one sequence's cache");
  m.def("rms_norm_rows", &rms_norm_rows, "x / sqrt(mean(x^2) + eps) * weight, row by row");
  m.def("silu_mul", &silu_mul, "gate_up [n, 2 i] -> silu(gate) * up [n, i]");
  m.def("quantize_activations", &quantize_activations, "x fp32 [m, k] -> (xq int8, dx fp32, xs int32)");
  register_layer_stack(m);
}
