// Q4_1 and int8 linears with integer dot products, for CPU steps (chapter 13).
//
// y = x W^T for x [M, K] fp32 and W from the file's Q4_1 blocks (32 weights, fp16 d and m,
// 4-bit codes q, w = d * q + m) or int8 codes with one fp32 scale per output row. The weights
// are never turned into floats. Each row of x is quantized, per block of 32, to int8 codes c
// with a scale s (s = max |x| / 127), as llama.cpp does, and a block's dot product becomes
//
//     sum_i w_i x_i  ~  d s * sum_i q_i c_i  +  m * (s * sum_i c_i)
//
// The first sum is integers only; the scales are applied once a block, and the minimum's term
// once a block from the activation block's sum, computed once per row of x, not per output.
//
// The weights are repacked once, at load, into groups of 8 output rows whose bytes interleave
// (cpu_quantized_tiles.h): the layout the integer instructions want, so that a block's 8 dot
// products take 8 instructions and no horizontal sums. Threads take ranges of groups, one
// parallel region a call. The AVX2 and the AVX-512 VNNI loops are compiled into one library,
// each under its own target, and chosen when called, so one build runs on any x86 CPU with
// AVX2 (and says so where there is none).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <string>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kBlock = 32;              // weights (and activations) per block
constexpr int64_t kGroup = 8;               // output rows interleaved in the packed layout
constexpr int64_t kPackedQ4_1Bytes = 160;   // a group's block: 8 fp16 d, 8 fp16 m, 8 x 16 codes
constexpr int64_t kPackedInt8Bytes = 256;   // a group's block: 8 x 32 int8 codes

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

// x's rows as int8 codes per block of 32, each block's scale and scale * sum of its codes,
// and each row's total of those (the int8 kernel's offset correction).
struct QuantizedActivations {
  std::vector<int8_t> codes;   // [M, K]
  std::vector<float> scales;   // [M, K / 32]
  std::vector<float> sums;     // [M, K / 32]
  std::vector<float> totals;   // [M]
};

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
                         std::vector<float>(M * nb), std::vector<float>(M)};
  at::parallel_for(0, M * nb, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      quantize_block(x + i * kBlock, a.codes.data() + i * kBlock, &a.scales[i], &a.sums[i]);
    }
  });
  for (int64_t r = 0; r < M; ++r) {
    a.totals[r] = std::accumulate(a.sums.begin() + r * nb, a.sums.begin() + (r + 1) * nb, 0.0f);
  }
  return a;
}

// -- the inner loops, once per instruction set -----------------------------------------------------

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
constexpr bool kVnni = false;
#include "cpu_quantized_tiles.h"
}  // namespace avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")
namespace avx512_vnni {
constexpr bool kVnni = true;
#include "cpu_quantized_tiles.h"
}  // namespace avx512_vnni
#pragma GCC pop_options

// -- the ops ---------------------------------------------------------------------------------------

// Threads take ranges of groups: a static split, one parallel region a call.
template <typename Groups>
void over_groups(int64_t groups, Groups run) {
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) { run(begin, end); });
}

void check_x(const at::Tensor& x, int64_t K) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() &&
                  x.device().is_cpu(),
              "x must be a contiguous 2-d fp32 CPU tensor [tokens, in_features]");
  TORCH_CHECK(x.size(1) == K, "x has ", x.size(1), " features; the weight takes ", K);
  TORCH_CHECK(K % kBlock == 0, "in_features must be a multiple of 32, got ", K);
}

void check_packed(const at::Tensor& packed, at::ScalarType dtype, int64_t bytes, int64_t N,
                  const char* what) {
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == dtype && packed.is_contiguous() &&
                  packed.size(2) == bytes,
              what, " must be contiguous [groups of 8 rows, in_features / 32, ", bytes,
              "] as the pack function makes them");
  TORCH_CHECK(N >= 0 && (N + kGroup - 1) / kGroup == packed.size(0), "out_features ", N,
              " does not fill ", packed.size(0), " groups of 8 rows");
}

at::Tensor q4_1_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N, int64_t isa) {
  check_packed(packed, at::kByte, kPackedQ4_1Bytes, N, "packed Q4_1 weights");
  const int64_t M = x.size(0), nb = packed.size(1), K = nb * kBlock;
  check_x(x, K);
  const Isa chosen = choose(isa);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const QuantizedActivations a = quantize(x.data_ptr<float>(), M, K);
  const uint8_t* w = packed.data_ptr<uint8_t>();
  float* out = y.data_ptr<float>();
  over_groups(packed.size(0), [&](int64_t g0, int64_t g1) {
    if (chosen == kAvx512Vnni) {
      avx512_vnni::q4_1_outputs(a, w, nb, M, g0, g1, out, N);
    } else {
      avx2::q4_1_outputs(a, w, nb, M, g0, g1, out, N);
    }
  });
  return y;
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                       int64_t isa) {
  TORCH_CHECK(scales.dim() == 1 && scales.scalar_type() == at::kFloat && scales.is_contiguous(),
              "scales must be fp32 [out_features]");
  const int64_t N = scales.size(0);
  check_packed(packed, at::kChar, kPackedInt8Bytes, N, "packed int8 weights");
  const int64_t M = x.size(0), nb = packed.size(1), K = nb * kBlock;
  check_x(x, K);
  const Isa chosen = choose(isa);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const QuantizedActivations a = quantize(x.data_ptr<float>(), M, K);
  const int8_t* w = packed.data_ptr<int8_t>();
  const float* s = scales.data_ptr<float>();
  float* out = y.data_ptr<float>();
  over_groups(packed.size(0), [&](int64_t g0, int64_t g1) {
    if (chosen == kAvx512Vnni) {
      avx512_vnni::int8_outputs(a, w, s, nb, M, g0, g1, out, N);
    } else {
      avx2::int8_outputs(a, w, s, nb, M, g0, g1, out, N);
    }
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
  m.def("q4_1_linear(Tensor x, Tensor packed, int out_features, int isa=0) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor packed, Tensor scales, int isa=0) -> Tensor");
  m.def("quantized_isas() -> Tensor");
}

TORCH_LIBRARY_IMPL(miniinfer, CPU, m) {
  m.impl("q4_1_linear", &q4_1_linear);
  m.impl("int8_linear", &int8_linear);
}

TORCH_LIBRARY_IMPL(miniinfer, CompositeExplicitAutograd, m) {
  m.impl("quantized_isas", &available_isas);
}
