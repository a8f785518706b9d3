// Q4_1 and int8 linears with integer dot products, for CPU steps (chapter 13).
//
// y = x W^T for x [M, K] fp32 and W as the file ships it: Q4_1 blocks of 32 weights, each
// block 20 bytes (fp16 d, fp16 m, 16 bytes of 4-bit codes q, the low nibbles weights 0-15 and
// the high nibbles 16-31), w = d * q + m; or int8 codes with one fp32 scale per output row.
// The weights are never turned into floats. Instead each row of x is quantized, per block of
// 32, to int8 codes c with a scale s (s = max |x| / 127), as llama.cpp does, and a block's
// dot product becomes
//
//     sum_i w_i x_i  ~  d s * sum_i q_i c_i  +  m * (s * sum_i c_i)
//
// The first sum is integers only (unsigned 4-bit codes times signed 8-bit codes: one
// `maddubs` and one `madd` on AVX2, one `dpbusd` with AVX-512 VNNI); the scales are applied
// once a block, and the minimum's term once a block from the activation block's sum, which is
// computed once per row, not once per output. For int8 weights the signs move onto the
// activations (|w| times sign(w) c), as `maddubs` wants one unsigned operand.
//
// Each weight block is read once for up to four rows of x (a batch's decodes or a
// verification's k + 1 tokens). Threads take ranges of output rows. The AVX2 and the AVX-512
// paths are compiled into one library with per-function target attributes and chosen when
// called, so one build runs on any x86 CPU with AVX2 (and says so where there is none).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace {

constexpr int64_t kBlock = 32;       // weights (and activations) per block
constexpr int64_t kQ4_1Bytes = 20;   // fp16 d, fp16 m, 16 bytes of codes
constexpr int64_t kRowTile = 4;      // rows of x that share one read of a weight block

enum Isa : int64_t { kAuto = 0, kAvx2 = 1, kAvx512Vnni = 2 };

bool has_avx2() { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                         __builtin_cpu_supports("f16c"); }
bool has_avx512_vnni() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}

Isa choose(int64_t asked) {
  TORCH_CHECK(has_avx2(), "the quantized kernel needs AVX2, FMA and F16C; this CPU lacks them");
  if (asked == kAvx2) return kAvx2;
  if (asked == kAvx512Vnni) {
    TORCH_CHECK(has_avx512_vnni(), "AVX-512 VNNI was asked for; this CPU lacks it");
    return kAvx512Vnni;
  }
  TORCH_CHECK(asked == kAuto, "isa must be 0 (auto), 1 (avx2) or 2 (avx512-vnni), got ", asked);
  return has_avx512_vnni() ? kAvx512Vnni : kAvx2;
}

// x's rows as int8 codes per block of 32, each block's scale and scale * sum of its codes.
struct QuantizedActivations {
  std::vector<int8_t> codes;   // [M, K]
  std::vector<float> scales;   // [M, K / 32]
  std::vector<float> sums;     // [M, K / 32]
};

__attribute__((target("avx2,fma,f16c")))
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// One block of 32 floats to codes: scale = max|x| / 127, code = round-to-nearest-even(x *
// (127 / max|x|)), as the Python reference (cpu_quantized.quantize_activations) computes it.
__attribute__((target("avx2,fma,f16c")))
void quantize_block(const float* x, int8_t* codes, float* scale, float* sum) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v[4];
  __m256 top = _mm256_setzero_ps();
  for (int j = 0; j < 4; ++j) {
    v[j] = _mm256_loadu_ps(x + 8 * j);
    top = _mm256_max_ps(top, _mm256_andnot_ps(sign, v[j]));
  }
  __m128 t = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
  t = _mm_max_ps(t, _mm_movehl_ps(t, t));
  t = _mm_max_ss(t, _mm_movehdup_ps(t));
  const float amax = _mm_cvtss_f32(t);
  const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
  const __m256 mul = _mm256_set1_ps(inv);
  __m256i i32[4];
  __m256i total = _mm256_setzero_si256();
  for (int j = 0; j < 4; ++j) {
    i32[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], mul));  // MXCSR: to nearest, ties even
    total = _mm256_add_epi32(total, i32[j]);
  }
  // Pack 4 x 8 int32 to 32 int8 in order (the packs interleave 128-bit lanes; undo that).
  __m256i i16a = _mm256_packs_epi32(i32[0], i32[1]);
  __m256i i16b = _mm256_packs_epi32(i32[2], i32[3]);
  __m256i i8 = _mm256_packs_epi16(i16a, i16b);
  i8 = _mm256_permutevar8x32_epi32(i8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes), i8);
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
  s = _mm_hadd_epi32(s, s);
  s = _mm_hadd_epi32(s, s);
  *scale = amax / 127.0f;
  *sum = *scale * static_cast<float>(_mm_cvtsi128_si32(s));
}

QuantizedActivations quantize(const float* x, int64_t M, int64_t K) {
  const int64_t nb = K / kBlock;
  QuantizedActivations a{std::vector<int8_t>(M * K), std::vector<float>(M * nb),
                         std::vector<float>(M * nb)};
  at::parallel_for(0, M * nb, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      quantize_block(x + i * kBlock, a.codes.data() + i * kBlock, &a.scales[i], &a.sums[i]);
    }
  });
  return a;
}

// -- AVX2 ----------------------------------------------------------------------------------------

// A Q4_1 block's 32 codes as bytes in weight order: low nibbles, then high nibbles.
__attribute__((target("avx2,fma,f16c")))
inline __m256i q4_codes(const uint8_t* block) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 4));
  const __m256i both = _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw);
  return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

__attribute__((target("avx2,fma,f16c")))
inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return _cvtsh_ss(bits);
}

// 8 int32 partial sums of unsigned bytes u times signed bytes s.
__attribute__((target("avx2,fma,f16c")))
inline __m256i dot_u8s8(__m256i u, __m256i s) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

template <int R>
__attribute__((target("avx2,fma,f16c")))
void q4_1_tile_avx2(const QuantizedActivations& a, const uint8_t* w, int64_t nb, int64_t K,
                    int64_t row0, float* out[R]) {
  __m256 acc[R];
  float minimum[R];
  for (int r = 0; r < R; ++r) { acc[r] = _mm256_setzero_ps(); minimum[r] = 0.0f; }
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* block = w + b * kQ4_1Bytes;
    const float d = half_at(block), m = half_at(block + 2);
    const __m256i q = q4_codes(block);
    for (int r = 0; r < R; ++r) {
      const int64_t i = (row0 + r) * nb + b;
      const __m256i c = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(a.codes.data() + (row0 + r) * K + b * kBlock));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8(q, c)),
                               _mm256_set1_ps(d * a.scales[i]), acc[r]);
      minimum[r] += m * a.sums[i];
    }
  }
  for (int r = 0; r < R; ++r) *out[r] = hsum(acc[r]) + minimum[r];
}

template <int R>
__attribute__((target("avx2,fma,f16c")))
void int8_tile_avx2(const QuantizedActivations& a, const int8_t* w, float scale, int64_t nb,
                    int64_t K, int64_t row0, float* out[R]) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + b * kBlock));
    const __m256i magnitude = _mm256_sign_epi8(q, q);
    for (int r = 0; r < R; ++r) {
      const __m256i c = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(a.codes.data() + (row0 + r) * K + b * kBlock));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8(magnitude, _mm256_sign_epi8(c, q))),
                               _mm256_set1_ps(a.scales[(row0 + r) * nb + b]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) *out[r] = scale * hsum(acc[r]);
}

// -- AVX-512 with VNNI: two blocks a step, one dpbusd for each ----------------------------------

#define AVX512 "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c"

__attribute__((target(AVX512)))
inline float hsum512(__m512 v) { return _mm512_reduce_add_ps(v); }

// Two consecutive blocks' scales, the first's in lanes 0-7 and the second's in 8-15.
__attribute__((target(AVX512)))
inline __m512 pair(float first, float second) {
  return _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(first), _mm512_set1_ps(second));
}

template <int R>
__attribute__((target(AVX512)))
void q4_1_tile_avx512(const QuantizedActivations& a, const uint8_t* w, int64_t nb, int64_t K,
                      int64_t row0, float* out[R]) {
  __m512 acc[R];
  __m256 tail[R];
  float minimum[R];
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm512_setzero_ps(); tail[r] = _mm256_setzero_ps(); minimum[r] = 0.0f;
  }
  int64_t b = 0;
  for (; b + 1 < nb; b += 2) {
    const uint8_t* first = w + b * kQ4_1Bytes;
    const uint8_t* second = first + kQ4_1Bytes;
    const float d0 = half_at(first), m0 = half_at(first + 2);
    const float d1 = half_at(second), m1 = half_at(second + 2);
    const __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(q4_codes(first)),
                                         q4_codes(second), 1);
    for (int r = 0; r < R; ++r) {
      const int64_t i = (row0 + r) * nb + b;
      const __m512i c = _mm512_loadu_si512(a.codes.data() + (row0 + r) * K + b * kBlock);
      const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q, c);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot),
                               pair(d0 * a.scales[i], d1 * a.scales[i + 1]), acc[r]);
      minimum[r] += m0 * a.sums[i] + m1 * a.sums[i + 1];
    }
  }
  if (b < nb) {  // an odd number of blocks: the last one 256 bits wide
    const uint8_t* block = w + b * kQ4_1Bytes;
    const float d = half_at(block), m = half_at(block + 2);
    const __m256i q = q4_codes(block);
    for (int r = 0; r < R; ++r) {
      const int64_t i = (row0 + r) * nb + b;
      const __m256i c = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(a.codes.data() + (row0 + r) * K + b * kBlock));
      const __m256i dot = _mm256_dpbusd_epi32(_mm256_setzero_si256(), q, c);
      tail[r] = _mm256_mul_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(d * a.scales[i]));
      minimum[r] += m * a.sums[i];
    }
  }
  for (int r = 0; r < R; ++r) *out[r] = hsum512(acc[r]) + hsum(tail[r]) + minimum[r];
}

template <int R>
__attribute__((target(AVX512)))
void int8_tile_avx512(const QuantizedActivations& a, const int8_t* w, float scale, int64_t nb,
                      int64_t K, int64_t row0, float* out[R]) {
  __m512 acc[R];
  __m256 tail[R];
  for (int r = 0; r < R; ++r) { acc[r] = _mm512_setzero_ps(); tail[r] = _mm256_setzero_ps(); }
  int64_t b = 0;
  for (; b + 1 < nb; b += 2) {
    const __m512i q = _mm512_loadu_si512(w + b * kBlock);
    const __m512i magnitude = _mm512_abs_epi8(q);
    const __mmask64 negative = _mm512_movepi8_mask(q);
    for (int r = 0; r < R; ++r) {
      const int64_t i = (row0 + r) * nb + b;
      const __m512i c = _mm512_loadu_si512(a.codes.data() + (row0 + r) * K + b * kBlock);
      const __m512i signed_c = _mm512_mask_sub_epi8(c, negative, _mm512_setzero_si512(), c);
      const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), magnitude, signed_c);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), pair(a.scales[i], a.scales[i + 1]),
                               acc[r]);
    }
  }
  if (b < nb) {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + b * kBlock));
    const __m256i magnitude = _mm256_sign_epi8(q, q);
    for (int r = 0; r < R; ++r) {
      const int64_t i = (row0 + r) * nb + b;
      const __m256i c = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(a.codes.data() + (row0 + r) * K + b * kBlock));
      const __m256i dot = _mm256_dpbusd_epi32(_mm256_setzero_si256(), magnitude,
                                              _mm256_sign_epi8(c, q));
      tail[r] = _mm256_mul_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(a.scales[i]));
    }
  }
  for (int r = 0; r < R; ++r) *out[r] = scale * (hsum512(acc[r]) + hsum(tail[r]));
}

// -- the ops ---------------------------------------------------------------------------------------

// Calls tile(R, row0, outputs) for each output row n, over rows of x in tiles of up to 4.
template <typename Tile>
void over_outputs(int64_t M, int64_t N, float* y, Tile tile) {
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t row0 = 0; row0 < M; row0 += kRowTile) {
        float* out[kRowTile];
        const int64_t rows = std::min(kRowTile, M - row0);
        for (int64_t r = 0; r < rows; ++r) out[r] = y + (row0 + r) * N + n;
        tile(rows, n, row0, out);
      }
    }
  });
}

#define DISPATCH_ROWS(rows, call) \
  switch (rows) {                 \
    case 1: call(1); break;       \
    case 2: call(2); break;       \
    case 3: call(3); break;       \
    default: call(4); break;      \
  }

void check_x(const at::Tensor& x, int64_t K) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() &&
                  x.device().is_cpu(),
              "x must be a contiguous 2-d fp32 CPU tensor [tokens, in_features]");
  TORCH_CHECK(x.size(1) == K, "x has ", x.size(1), " features; the weight takes ", K);
  TORCH_CHECK(K % kBlock == 0, "in_features must be a multiple of 32, got ", K);
}

at::Tensor q4_1_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t isa) {
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.is_contiguous() &&
                  blocks.size(1) % kQ4_1Bytes == 0,
              "blocks must be contiguous uint8 [out_features, in_features / 32 * 20]");
  const int64_t M = x.size(0), N = blocks.size(0), nb = blocks.size(1) / kQ4_1Bytes;
  const int64_t K = nb * kBlock;
  check_x(x, K);
  const Isa chosen = choose(isa);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const QuantizedActivations a = quantize(x.data_ptr<float>(), M, K);
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  over_outputs(M, N, y.data_ptr<float>(), [&](int64_t rows, int64_t n, int64_t row0,
                                               float** out) {
    const uint8_t* row = w + n * nb * kQ4_1Bytes;
#define Q4(R)                                                                    \
  (chosen == kAvx512Vnni ? q4_1_tile_avx512<R>(a, row, nb, K, row0, out)         \
                         : q4_1_tile_avx2<R>(a, row, nb, K, row0, out))
    DISPATCH_ROWS(rows, Q4)
#undef Q4
  });
  return y;
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                       int64_t isa) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kChar && codes.is_contiguous(),
              "codes must be contiguous int8 [out_features, in_features]");
  TORCH_CHECK(scales.dim() == 1 && scales.scalar_type() == at::kFloat &&
                  scales.size(0) == codes.size(0) && scales.is_contiguous(),
              "scales must be fp32 [out_features]");
  const int64_t M = x.size(0), N = codes.size(0), K = codes.size(1), nb = K / kBlock;
  check_x(x, K);
  const Isa chosen = choose(isa);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const QuantizedActivations a = quantize(x.data_ptr<float>(), M, K);
  const int8_t* w = codes.data_ptr<int8_t>();
  const float* s = scales.data_ptr<float>();
  over_outputs(M, N, y.data_ptr<float>(), [&](int64_t rows, int64_t n, int64_t row0,
                                               float** out) {
    const int8_t* row = w + n * K;
#define I8(R)                                                                    \
  (chosen == kAvx512Vnni ? int8_tile_avx512<R>(a, row, s[n], nb, K, row0, out)   \
                         : int8_tile_avx2<R>(a, row, s[n], nb, K, row0, out))
    DISPATCH_ROWS(rows, I8)
#undef I8
  });
  return y;
}

std::vector<std::string> instruction_sets() {
  std::vector<std::string> sets;
  if (has_avx2()) sets.push_back("avx2");
  if (has_avx512_vnni()) sets.push_back("avx512-vnni");
  return sets;
}

at::Tensor available_isas() {
  // 0: none, 1: AVX2, 2: AVX2 and AVX-512 VNNI (a tensor: ops return tensors).
  return at::scalar_tensor(static_cast<int64_t>(instruction_sets().size()), at::kLong);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(miniinfer, m) {
  m.def("q4_1_linear(Tensor x, Tensor blocks, int isa=0) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor codes, Tensor scales, int isa=0) -> Tensor");
  m.def("quantized_isas() -> Tensor");
}

TORCH_LIBRARY_IMPL(miniinfer, CPU, m) {
  m.impl("q4_1_linear", &q4_1_linear);
  m.impl("int8_linear", &int8_linear);
}

TORCH_LIBRARY_IMPL(miniinfer, CompositeExplicitAutograd, m) {
  m.impl("quantized_isas", &available_isas);
}
