// The quantized kernel's inner loops (chapter 13), compiled once per instruction set:
// cpu_quantized.cpp includes this file twice, each time under its ISA's target pragma and in
// its own namespace, with kVnni saying whether the CPU has AVX-512 VNNI's `dpbusd` (one
// instruction for a row of unsigned-by-signed byte products summed in fours) or only AVX2's
// `maddubs` (byte products summed in pairs to int16) then `madd` (int16 pairs to int32).
//
// A tile is NR consecutive output rows (weights) against R rows of x: each weight block is
// loaded once for the R rows and each activation block once for the NR outputs, and the
// R x NR sums are independent, so the FMAs into them do not wait on one another.

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Eight int32 sums of products of unsigned bytes u and signed bytes s (each sum over four
// neighbouring byte pairs). A template, so that the path not taken is never compiled.
template <bool Vnni = kVnni>
inline __m256i dot_u8s8(__m256i u, __m256i s) {
  if constexpr (Vnni) {
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
  } else {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
  }
}

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return _cvtsh_ss(bits);
}

// A Q4_1 block's 32 codes as bytes in weight order: low nibbles (0-15), then high (16-31).
inline __m256i q4_codes(const uint8_t* block) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 4));
  const __m256i both = _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw);
  return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

inline __m256i load32(const int8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

// y[r][j] for rows row0 .. row0 + R of x and output rows n .. n + NR (w: output row n's blocks;
// each next output row `stride` bytes on).
template <int R, int NR>
void q4_1_tile(const QuantizedActivations& a, const uint8_t* w, int64_t stride, int64_t nb,
               int64_t K, int64_t row0, float* y, int64_t ldy) {
  __m256 acc[R][NR];
  float minimum[R][NR];
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < NR; ++j) { acc[r][j] = _mm256_setzero_ps(); minimum[r][j] = 0.0f; }
  }
  for (int64_t b = 0; b < nb; ++b) {
    __m256i q[NR];
    float d[NR], m[NR];
    for (int j = 0; j < NR; ++j) {
      const uint8_t* block = w + j * stride + b * kQ4_1Bytes;
      d[j] = half_at(block);
      m[j] = half_at(block + 2);
      q[j] = q4_codes(block);
    }
    for (int r = 0; r < R; ++r) {
      const int64_t i = (row0 + r) * nb + b;
      const __m256i c = load32(a.codes.data() + (row0 + r) * K + b * kBlock);
      const float s = a.scales[i], sum = a.sums[i];
      for (int j = 0; j < NR; ++j) {
        acc[r][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8(q[j], c)),
                                    _mm256_set1_ps(d[j] * s), acc[r][j]);
        minimum[r][j] += m[j] * sum;
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < NR; ++j) y[r * ldy + j] = hsum(acc[r][j]) + minimum[r][j];
  }
}

// The same for int8 weights (w: output row n's codes, each next row `stride` bytes on).
template <int R, int NR>
void int8_tile(const QuantizedActivations& a, const int8_t* w, int64_t stride,
               const float* scale, int64_t nb, int64_t K, int64_t row0, float* y, int64_t ldy) {
  __m256 acc[R][NR];
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < NR; ++j) acc[r][j] = _mm256_setzero_ps();
  }
  for (int64_t b = 0; b < nb; ++b) {
    __m256i q[NR], magnitude[NR];
    for (int j = 0; j < NR; ++j) {
      q[j] = load32(w + j * stride + b * kBlock);
      magnitude[j] = _mm256_sign_epi8(q[j], q[j]);
    }
    for (int r = 0; r < R; ++r) {
      const __m256i c = load32(a.codes.data() + (row0 + r) * K + b * kBlock);
      const __m256 s = _mm256_set1_ps(a.scales[(row0 + r) * nb + b]);
      for (int j = 0; j < NR; ++j) {
        // |w| times c with w's sign: the unsigned operand maddubs and dpbusd want.
        const __m256i dot = dot_u8s8(magnitude[j], _mm256_sign_epi8(c, q[j]));
        acc[r][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), s, acc[r][j]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < NR; ++j) y[r * ldy + j] = scale[j] * hsum(acc[r][j]);
  }
}

// Output rows n0 .. n1 for every row of x: tiles of 4 outputs (the rest one at a time) by 2
// rows of x (the rest alone).
template <typename Tile4x2, typename Tile4x1, typename Tile1x2, typename Tile1x1>
void tiles(int64_t M, int64_t n0, int64_t n1, Tile4x2 t42, Tile4x1 t41, Tile1x2 t12,
           Tile1x1 t11) {
  for (int64_t n = n0; n < n1;) {
    const bool four = n + 4 <= n1;
    for (int64_t row0 = 0; row0 < M; row0 += 2) {
      const bool two = row0 + 2 <= M;
      if (four) {
        two ? t42(n, row0) : t41(n, row0);
      } else {
        two ? t12(n, row0) : t11(n, row0);
      }
    }
    n += four ? 4 : 1;
  }
}

void q4_1_outputs(const QuantizedActivations& a, const uint8_t* w, int64_t nb, int64_t M,
                  int64_t n0, int64_t n1, float* y, int64_t N) {
  const int64_t stride = nb * kQ4_1Bytes, K = nb * kBlock;
  auto tile = [&](auto r, auto nr) {
    return [&, r, nr](int64_t n, int64_t row0) {
      q4_1_tile<decltype(r)::value, decltype(nr)::value>(a, w + n * stride, stride, nb, K,
                                                         row0, y + row0 * N + n, N);
    };
  };
  using One = std::integral_constant<int, 1>;
  using Two = std::integral_constant<int, 2>;
  using Four = std::integral_constant<int, 4>;
  tiles(M, n0, n1, tile(Two{}, Four{}), tile(One{}, Four{}), tile(Two{}, One{}),
        tile(One{}, One{}));
}

void int8_outputs(const QuantizedActivations& a, const int8_t* w, const float* scales,
                  int64_t K, int64_t M, int64_t n0, int64_t n1, float* y, int64_t N) {
  const int64_t nb = K / kBlock;
  auto tile = [&](auto r, auto nr) {
    return [&, r, nr](int64_t n, int64_t row0) {
      int8_tile<decltype(r)::value, decltype(nr)::value>(a, w + n * K, K, scales + n, nb, K,
                                                         row0, y + row0 * N + n, N);
    };
  };
  using One = std::integral_constant<int, 1>;
  using Two = std::integral_constant<int, 2>;
  using Four = std::integral_constant<int, 4>;
  tiles(M, n0, n1, tile(Two{}, Four{}), tile(One{}, Four{}), tile(Two{}, One{}),
        tile(One{}, One{}));
}
