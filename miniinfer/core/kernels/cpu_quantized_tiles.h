// The quantized kernel's inner loops, compiled once per instruction set: cpu_quantized.cpp
// includes this file twice, each time under its ISA's target pragma and in its own namespace,
// with kVnni saying whether the CPU has AVX-512 VNNI's `dpbusd` (unsigned-by-signed byte
// products summed in fours, added to an int32 lane) or only AVX2's `maddubs` (byte products
// summed in pairs to int16) then `madd` (int16 pairs to int32).
//
// The weights come repacked (cpu_quantized.py's pack_q4_1 / pack_int8): a group of 8 output
// rows, block by block, with the 8 rows' bytes interleaved 4 at a time. One 32-byte vector then
// holds 4 neighbouring codes of each of the 8 rows, and one broadcast of 4 activation codes
// against it gives each row's partial sum in its own int32 lane: 8 instructions make a block's
// 8 dot products, with no horizontal sums. A group's K bytes sit together in memory, read once
// per call however many rows x has (rows past the first find them in L1).

inline __m256i broadcast4(const int8_t* c) {
  int32_t four;
  std::memcpy(&four, c, 4);
  return _mm256_set1_epi32(four);
}

// The 8 rows' integer dot products over one block: w[j] holds codes 4j .. 4j + 3 of each row
// (unsigned for dpbusd and maddubs), c the block's 32 activation codes.
inline __m256i block_dot(const __m256i w[8], const int8_t* c) {
  if constexpr (kVnni) {
    // Two chains, so that each dpbusd waits on the one before it half as often.
    __m256i even = _mm256_setzero_si256(), odd = _mm256_setzero_si256();
    for (int j = 0; j < 8; j += 2) {
      even = _mm256_dpbusd_epi32(even, w[j], broadcast4(c + 4 * j));
      odd = _mm256_dpbusd_epi32(odd, w[j + 1], broadcast4(c + 4 * j + 4));
    }
    return _mm256_add_epi32(even, odd);
  } else {
    // Q4 codes (0..15) times activation codes (|c| <= 127), pairs summed: at most 3810 an
    // int16, so the 8 chunks' pairs add up in int16 (30480 at most) before one widening.
    __m256i pairs = _mm256_maddubs_epi16(w[0], broadcast4(c));
    for (int j = 1; j < 8; ++j) {
      pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(w[j], broadcast4(c + 4 * j)));
    }
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
  }
}

inline void store_group(float* y, __m256 v, int64_t width) {
  if (width == 8) {
    _mm256_storeu_ps(y, v);
  } else {
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, v);
    std::memcpy(y, lanes, width * sizeof(float));
  }
}

// One group of 8 output rows (`width` of them real) against rows row0 .. row0 + R of x.
// A packed Q4_1 block: the 8 rows' fp16 d, their fp16 m, then 4 vectors of 32 bytes, vector p
// holding each row's code bytes 4p .. 4p + 3 (the file's nibble order: low nibbles weights
// 4p .. 4p + 3, high nibbles 16 + 4p ..), so its low nibbles pair with activation chunk p and
// its high nibbles with chunk p + 4.
template <int R>
void q4_1_group(const QuantizedActivations& a, const uint8_t* group, int64_t nb, int64_t K,
                int64_t row0, float* y, int64_t ldy, int64_t width) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* block = group + b * kPackedQ4_1Bytes;
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block)));
    const __m256 m =
        _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 16)));
    __m256i w[8];
    for (int p = 0; p < 4; ++p) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 32 + 32 * p));
      w[p] = _mm256_and_si256(raw, low);
      w[p + 4] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
    }
    for (int r = 0; r < R; ++r) {
      const int64_t i = (row0 + r) * nb + b;
      const __m256i dot = block_dot(w, a.codes.data() + (row0 + r) * K + b * kBlock);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot),
                               _mm256_mul_ps(d, _mm256_set1_ps(a.scales[i])), acc[r]);
      acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(a.sums[i]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) store_group(y + r * ldy, acc[r], width);
}

// The same for int8 codes with a scale per output row. A packed block: 8 vectors of 32 bytes,
// vector j holding each row's codes 4j .. 4j + 3. dpbusd wants the weights unsigned: w + 128,
// whose extra 128 * sum(c) is the same for every output row and is taken off once per row of x
// (QuantizedActivations::totals). maddubs would overflow int16 on w + 128, so AVX2 moves the
// weights' signs onto the activations instead (|w| times sign(w) c).
template <int R>
void int8_group(const QuantizedActivations& a, const int8_t* group, const float* scale,
                int64_t nb, int64_t K, int64_t row0, float* y, int64_t ldy, int64_t width) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const int8_t* block = group + b * kPackedInt8Bytes;
    __m256i w[8];
    for (int j = 0; j < 8; ++j) {
      w[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 32 * j));
    }
    if constexpr (kVnni) {
      for (int j = 0; j < 8; ++j) w[j] = _mm256_xor_si256(w[j], _mm256_set1_epi8(-128));
      for (int r = 0; r < R; ++r) {
        const __m256i dot = block_dot(w, a.codes.data() + (row0 + r) * K + b * kBlock);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot),
                                 _mm256_set1_ps(a.scales[(row0 + r) * nb + b]), acc[r]);
      }
    } else {
      __m256i magnitude[8];
      for (int j = 0; j < 8; ++j) magnitude[j] = _mm256_sign_epi8(w[j], w[j]);
      for (int r = 0; r < R; ++r) {
        const int8_t* c = a.codes.data() + (row0 + r) * K + b * kBlock;
        // |w| |c| <= 16129, a pair 32258: each pair widened to int32 before it is added.
        __m256i dot = _mm256_setzero_si256();
        for (int j = 0; j < 8; ++j) {
          const __m256i products = _mm256_maddubs_epi16(
              magnitude[j], _mm256_sign_epi8(broadcast4(c + 4 * j), w[j]));
          dot = _mm256_add_epi32(dot, _mm256_madd_epi16(products, _mm256_set1_epi16(1)));
        }
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot),
                                 _mm256_set1_ps(a.scales[(row0 + r) * nb + b]), acc[r]);
      }
    }
  }
  __m256 s;
  if (width == 8) {
    s = _mm256_loadu_ps(scale);
  } else {
    alignas(32) float lanes[8] = {};
    std::memcpy(lanes, scale, width * sizeof(float));
    s = _mm256_load_ps(lanes);
  }
  for (int r = 0; r < R; ++r) {
    __m256 v = acc[r];
    if constexpr (kVnni) v = _mm256_sub_ps(v, _mm256_set1_ps(128.0f * a.totals[row0 + r]));
    store_group(y + r * ldy, _mm256_mul_ps(s, v), width);
  }
}

// Groups g0 .. g1 for every row of x, four rows at a time (the rest together).
template <typename Group>
void over_rows(int64_t M, int64_t g0, int64_t g1, Group group) {
  for (int64_t g = g0; g < g1; ++g) {
    int64_t row0 = 0;
    for (; row0 + 4 <= M; row0 += 4) group(g, row0, std::integral_constant<int, 4>{});
    switch (M - row0) {
      case 3: group(g, row0, std::integral_constant<int, 3>{}); break;
      case 2: group(g, row0, std::integral_constant<int, 2>{}); break;
      case 1: group(g, row0, std::integral_constant<int, 1>{}); break;
      default: break;
    }
  }
}

void q4_1_outputs(const QuantizedActivations& a, const uint8_t* packed, int64_t nb, int64_t M,
                  int64_t g0, int64_t g1, float* y, int64_t N) {
  const int64_t K = nb * kBlock;
  over_rows(M, g0, g1, [&](int64_t g, int64_t row0, auto rows) {
    q4_1_group<decltype(rows)::value>(a, packed + g * nb * kPackedQ4_1Bytes, nb, K, row0,
                                      y + row0 * N + 8 * g, N, std::min<int64_t>(8, N - 8 * g));
  });
}

void int8_outputs(const QuantizedActivations& a, const int8_t* packed, const float* scales,
                  int64_t nb, int64_t M, int64_t g0, int64_t g1, float* y, int64_t N) {
  const int64_t K = nb * kBlock;
  over_rows(M, g0, g1, [&](int64_t g, int64_t row0, auto rows) {
    int8_group<decltype(rows)::value>(a, packed + g * nb * kPackedInt8Bytes, scales + 8 * g, nb,
                                      K, row0, y + row0 * N + 8 * g, N,
                                      std::min<int64_t>(8, N - 8 * g));
  });
}
