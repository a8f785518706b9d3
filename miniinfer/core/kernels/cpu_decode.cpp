// Paged attention for a CPU step's tokens, reading K/V in place from the pool (chapter 11).
//
// Each token attends causally to its own request's positions 0 .. position, found through its
// block table, over the flat pool [slots, kv_heads, dim] (this layer's K from row k_base, its
// V from v_base). The step's tokens are shared out over ATen's threads by their contexts'
// lengths. A token reads each slot of its context whole (every kv head's row lies next to the
// others) once for the scores and once for the values, so a context costs one pass over its K
// and one over its V, in blocks the hardware can stream, with the next block prefetched.
// Scores and the softmax are fp32 whatever the pool holds, as in the reference. Both passes
// keep four independent sums in flight (four positions' scores, four vectors of a head's
// output), so that the FMAs do not wait on each other: on a Zen 3 (AVX2) these two changes
// took a 32-token decode layer from 1.72 to 1.22 ms (contexts 50-380, median of 15
// interleaved rounds). The vector width is whatever at::vec has for the ISA this was compiled
// for (cpu_decode.py passes inductor's choice of flags).
//
// A prompt chunk's tokens (one request's consecutive positions) share their context, and one
// token at a time each reads it again. In fp32 they go a tile at a time instead (attend_tile):
// a few tokens with the heads of one kv head, against their request's K transposed once per
// call, so that every K or V vector loaded serves all the tile's rows and no score needs a
// horizontal sum. On the Zen 3, one layer of SmolLM2 (9 heads, 3 kv heads, median of 30): a
// 256-token chunk took 0.96 ms in tiles against 1.35 as an SDPA over its K/V, a 512-token
// chunk at position 1536 19.1 against 20.6 ms (one token at a time, measured before: 1.46 and
// 31.8 ms).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <functional>
#include <memory>
#include <type_traits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;

// `n` values from `src` as floats: fp32 is read in place, other dtypes converted into `buf`.
template <typename T>
inline const float* as_float(const T* src, float* buf, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else {
    for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<float>(src[i]);
    return buf;
  }
}

inline void prefetch(const void* start, int64_t bytes) {
  const char* p = static_cast<const char*>(start);
  for (int64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(p + offset);
}

// The softmax's numerators, in place over `n` scores (each exp(score - max)); returns 1 / their
// sum, for the caller to scale by where it is cheapest.
inline float exp_in_place(float* s, int64_t n) {
  const float top = at::vec::reduce_all<float>(
      [](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, s, n);
  at::vec::map([top](Vec x) { return (x - Vec(top)).exp_u20(); }, s, s, n);
  return 1.f / at::vec::reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, s, n);
}

// The most query rows a tile holds: with two vectors of positions (or of a head's dims) per
// row, 7 rows keep 14 sums and 2 loaded vectors in AVX2's 16 registers.
constexpr int64_t kMaxTileRows = 7;

// The shortest run of tokens that goes in tiles; shorter runs go one token at a time, with the
// arithmetic of a decode. A verification step's k + 1 tokens are such a run: each then attends
// bit for bit as it would have as a decode (the tiles sum a score in another order), so a draft
// is kept exactly where the step without drafts would have chosen it (chapter 14). That matters
// most where activations are rounded to int8 after attention (chapter 13's kernel): a last-bit
// difference there moves a code. A run this short shares too little of its context to gain from
// a tile. Keep it above config.py's MAX_DRAFT_TOKENS + 1 (a test checks it).
constexpr int64_t kMinTileTokens = 16;

// A tile: `ROWS` query rows (up to `tile_tokens` consecutive tokens of one request, each with
// the `group` heads that share kv head `kv_head`) against the request's K, transposed once per
// call into `kt` ([block][dim][block_size]: positions along the vector lanes, NV vectors a
// block), and its V, read in place. A score is a sum over the head's dims of a broadcast query
// value times a vector of positions, so no score needs a horizontal sum, and every K or V vector
// loaded serves all the tile's rows (per token, each served one).
template <int ROWS, int NV>
void attend_tile(const float* const* query_rows, const int64_t* row_context, int64_t context,
                 const float* kt, const float* v_rows, const int32_t* table, int64_t block_size,
                 int64_t slot_stride, int64_t dim, float* const* weights, float* const* out_rows) {
  constexpr int64_t W = Vec::size();
  const int64_t blocks = (context + block_size - 1) / block_size;
  // Pass 1: every row's score of every position of the tile's widest context.
  for (int64_t b = 0; b < blocks; ++b) {
    const float* kb = kt + b * dim * block_size;
    Vec sum[ROWS][NV];
    for (int r = 0; r < ROWS; ++r)
      for (int v = 0; v < NV; ++v) sum[r][v] = Vec(0.f);
    for (int64_t d = 0; d < dim; ++d) {
      Vec k[NV];
      for (int v = 0; v < NV; ++v) k[v] = Vec::loadu(kb + d * block_size + v * W);
      for (int r = 0; r < ROWS; ++r) {
        const Vec q(query_rows[r][d]);
        for (int v = 0; v < NV; ++v) sum[r][v] = at::vec::fmadd(q, k[v], sum[r][v]);
      }
    }
    for (int r = 0; r < ROWS; ++r)
      for (int v = 0; v < NV; ++v) sum[r][v].store(weights[r] + b * block_size + v * W);
  }
  // Each row's softmax over its own context; the positions past it weigh nothing.
  for (int r = 0; r < ROWS; ++r) {
    float* s = weights[r];
    const int64_t n = row_context[r];
    const float inv_sum = exp_in_place(s, n);
    at::vec::map([inv_sum](Vec x) { return x * Vec(inv_sum); }, s, s, n);
    std::fill(s + n, s + context, 0.f);
  }
  // Pass 2: two vectors of every row's output at a time, summed over the whole context.
  for (int64_t d = 0; d < dim; d += 2 * W) {
    Vec sum[ROWS][2];
    for (int r = 0; r < ROWS; ++r) sum[r][0] = sum[r][1] = Vec(0.f);
    for (int64_t b = 0; b < blocks; ++b) {
      // A block's slots lie one after another: one table lookup a block. (A lookup a position
      // took 1.24x as long for a step's eight 62-token chunks on an AVX-512 Xeon, 1.7x for a
      // 512-token prompt.)
      const float* vb = v_rows + static_cast<int64_t>(table[b]) * block_size * slot_stride + d;
      const int64_t first = b * block_size, n = std::min(block_size, context - first);
      for (int64_t j = 0; j < n; ++j) {
        const float* vj = vb + j * slot_stride;
        const Vec v0 = Vec::loadu(vj), v1 = Vec::loadu(vj + W);
        for (int r = 0; r < ROWS; ++r) {
          const Vec w(weights[r][first + j]);
          sum[r][0] = at::vec::fmadd(w, v0, sum[r][0]);
          sum[r][1] = at::vec::fmadd(w, v1, sum[r][1]);
        }
      }
    }
    for (int r = 0; r < ROWS; ++r) {
      sum[r][0].store(out_rows[r] + d);
      sum[r][1].store(out_rows[r] + d + W);
    }
  }
}

using TileFn = void (*)(const float* const*, const int64_t*, int64_t, const float*, const float*,
                        const int32_t*, int64_t, int64_t, int64_t, float* const*, float* const*);

template <int NV>
TileFn tile_fn(int64_t rows) {
  switch (rows) {
    case 1: return attend_tile<1, NV>;
    case 2: return attend_tile<2, NV>;
    case 3: return attend_tile<3, NV>;
    case 4: return attend_tile<4, NV>;
    case 5: return attend_tile<5, NV>;
    case 6: return attend_tile<6, NV>;
    case 7: return attend_tile<7, NV>;
    default: return nullptr;
  }
}

// The tile function for this step's shapes, or nullptr where tokens go one at a time: other
// dtypes than fp32 (the tile reads V in place), a group of more heads than a tile holds, a block
// that is not one or two vectors of positions, a head that is not pairs of vectors.
TileFn pick_tile(bool fp32, int64_t group, int64_t block_size, int64_t dim, int64_t* tile_tokens) {
  const int64_t W = Vec::size();
  if (!fp32 || group > kMaxTileRows || dim % (2 * W) != 0) return nullptr;
  *tile_tokens = std::max<int64_t>(1, 6 / group);
  const int64_t rows = *tile_tokens * group;
  if (block_size == W) return tile_fn<1>(rows);
  if (block_size == 2 * W) return tile_fn<2>(rows);
  return nullptr;
}

template <typename T>
void attend(const at::Tensor& q, const at::Tensor& pool, int64_t k_base, int64_t v_base,
            int64_t block_size, const at::Tensor& tables, const at::Tensor& positions,
            float scale, at::Tensor& out) {
  const int64_t tokens = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t group = heads / pool.size(1), width = tables.size(1);
  const int64_t slot_stride = pool.size(1) * dim;  // elements from one slot to the next
  // q's strides, read once here: Tensor::stride() is a call, and made for every element of
  // the queries below it took a third of a step's prompt-chunk attention on an AVX-512 Xeon.
  const int64_t q_token_stride = q.stride(0), q_head_stride = q.stride(1);
  const int64_t block_bytes = block_size * slot_stride * static_cast<int64_t>(sizeof(T));
  const T* q_ptr = q.data_ptr<T>();
  const T* pool_ptr = pool.data_ptr<T>();
  const int32_t* table_ptr = tables.data_ptr<int32_t>();
  const int64_t* position_ptr = positions.data_ptr<int64_t>();
  T* out_ptr = out.data_ptr<T>();
  // A token sees at most its table's blocks (a padding token's position may lie past them).
  auto context_of = [&](int64_t t) { return std::min(position_ptr[t] + 1, width * block_size); };
  int64_t max_context = 1;
  for (int64_t t = 0; t < tokens; ++t) max_context = std::max(max_context, context_of(t));
  // Consecutive tokens of one request (a prompt chunk: the same table, positions running on)
  // attend a tile at a time where the shapes allow (pick_tile); the others one token at a time.
  int64_t tile_tokens = 1;
  const TileFn tile = pick_tile(std::is_same_v<T, float>, group, block_size, dim, &tile_tokens);
  const int64_t kv_heads = pool.size(1), group_rows = tile_tokens * group;
  // A piece of work: one token's heads head_begin .. head_end, or one tile's one kv head. `kt`
  // is where its request's transposed K begins (tiles only), `cost` about how many vector
  // FMAs it takes.
  struct Work { int64_t token, tokens, kv_head, kt, blocks, cost, head_begin, head_end; };
  struct Run { int64_t token, tokens, blocks, kt; };
  std::vector<Work> work;
  std::vector<Run> runs;
  int64_t kt_size = 0;
  for (int64_t t = 0; t < tokens;) {
    int64_t end = t + 1;
    while (tile != nullptr && end < tokens && position_ptr[end] == position_ptr[end - 1] + 1 &&
           std::equal(table_ptr + end * width, table_ptr + (end + 1) * width, table_ptr + t * width))
      ++end;
    if (end - t < kMinTileTokens) {
      for (int64_t u = t; u < end; ++u) {
        if (tokens < at::get_num_threads()) {
          // Fewer tokens than threads (a batch-1 decode): a token's kv heads go apart, so
          // that every thread has some of its work.
          for (int64_t g = 0; g < kv_heads; ++g)
            work.push_back({u, 1, -1, 0, 0, context_of(u) * group, g * group, (g + 1) * group});
        } else {
          work.push_back({u, 1, -1, 0, 0, context_of(u) * heads, 0, heads});
        }
      }
    } else {
      const int64_t blocks = (context_of(end - 1) + block_size - 1) / block_size;
      runs.push_back({t, end - t, blocks, kt_size});
      for (int64_t first = t; first < end; first += tile_tokens)
        for (int64_t g = 0; g < kv_heads; ++g)
          // A tile's vector FMAs serve all its rows: about half a token's cost per row.
          work.push_back({first, std::min(tile_tokens, end - first), g, kt_size, blocks,
                          context_of(std::min(first + tile_tokens, end) - 1) * group_rows / 2,
                          0, 0});
      kt_size += kv_heads * blocks * dim * block_size;
    }
    t = end;
  }
  // Each run's K, transposed once for all its tiles: [kv_head][block][dim][block_size].
  // Every entry is written below: no zero fill first (a long prompt's is megabytes a layer).
  std::unique_ptr<float[]> kt(new float[kt_size]);
  for (const Run& run : runs) {
    const int32_t* table = table_ptr + run.token * width;
    at::parallel_for(0, run.blocks, 1, [&](int64_t b_begin, int64_t b_end) {
      for (int64_t b = b_begin; b < b_end; ++b)
        for (int64_t g = 0; g < kv_heads; ++g) {
          const T* k = pool_ptr + (k_base + static_cast<int64_t>(table[b]) * block_size) *
                                      slot_stride + g * dim;
          float* to = kt.get() + run.kt + (g * run.blocks + b) * dim * block_size;
          for (int64_t j = 0; j < block_size; ++j)
            for (int64_t d = 0; d < dim; ++d)
              to[d * block_size + j] = static_cast<float>(k[j * slot_stride + d]);
        }
    });
  }
  // Work is spread by its cost, not its count: contexts differ by several times within a step,
  // and equal token counts per thread left one thread with twice the other's work. Each of
  // the pieces gets the work whose cumulative cost falls into its share.
  const int64_t items = static_cast<int64_t>(work.size());
  std::vector<int64_t> cumulative(items + 1, 0);
  for (int64_t i = 0; i < items; ++i) cumulative[i + 1] = cumulative[i] + work[i].cost;
  // About 32 positions' worth a piece at least: below that, waking a thread costs more.
  const int64_t pieces = std::max<int64_t>(1, std::min({static_cast<int64_t>(
      at::get_num_threads()), items, cumulative[items] / (32 * heads)}));
  at::parallel_for(0, pieces, 1, [&](int64_t piece_begin, int64_t piece_end) {
    auto first_item = [&](int64_t piece) {
      const int64_t share = cumulative[items] * piece / pieces;
      return static_cast<int64_t>(std::lower_bound(cumulative.begin(), cumulative.end(), share)
                                  - cumulative.begin());
    };
    const int64_t begin = first_item(piece_begin), end = first_item(piece_end);
    std::vector<float> scores(heads * max_context), query(heads * dim), acc(heads * dim),
        inv_sum(heads), converted(block_size * slot_stride),
        tile_query(kMaxTileRows * dim), tile_out(kMaxTileRows * dim),
        tile_weights(kMaxTileRows * (max_context + 2 * block_size));
    for (int64_t i = begin; i < end; ++i) {
      const Work& item = work[i];
      if (item.kv_head >= 0) {
        // Rows: each token of the tile with each head of the group (a short tile's last token
        // fills the rows left over; they are computed and not written).
        const float* query_rows[kMaxTileRows];
        float* weight_rows[kMaxTileRows];
        float* out_rows[kMaxTileRows];
        int64_t row_context[kMaxTileRows];
        for (int64_t r = 0; r < group_rows; ++r) {
          const int64_t t = item.token + std::min(r / group, item.tokens - 1);
          const int64_t head = item.kv_head * group + r % group;
          float* qr = tile_query.data() + r * dim;
          for (int64_t d = 0; d < dim; ++d)
            qr[d] =
                static_cast<float>(q_ptr[t * q_token_stride + head * q_head_stride + d]) * scale;
          query_rows[r] = qr;
          weight_rows[r] = tile_weights.data() + r * (max_context + 2 * block_size);
          out_rows[r] = tile_out.data() + r * dim;
          row_context[r] = context_of(t);
        }
        const float* kt_rows = kt.get() + item.kt + item.kv_head * item.blocks * dim * block_size;
        tile(query_rows, row_context, context_of(item.token + item.tokens - 1), kt_rows,
             reinterpret_cast<const float*>(pool_ptr) + v_base * slot_stride + item.kv_head * dim,
             table_ptr + item.token * width, block_size, slot_stride, dim, weight_rows, out_rows);
        for (int64_t r = 0; r < item.tokens * group; ++r) {
          const int64_t t = item.token + r / group, head = item.kv_head * group + r % group;
          for (int64_t d = 0; d < dim; ++d)
            out_ptr[(t * heads + head) * dim + d] = static_cast<T>(out_rows[r][d]);
        }
        continue;
      }
      const int64_t t = item.token, head_begin = item.head_begin, head_end = item.head_end;
      const int64_t context = context_of(t), blocks = (context + block_size - 1) / block_size;
      const int32_t* table = table_ptr + t * width;
      auto block_start = [&](int64_t base, int64_t b) {
        return pool_ptr + (base + static_cast<int64_t>(table[b]) * block_size) * slot_stride;
      };
      for (int64_t head = head_begin; head < head_end; ++head)
        for (int64_t d = 0; d < dim; ++d)
          query[head * dim + d] =
              static_cast<float>(q_ptr[t * q_token_stride + head * q_head_stride + d]) * scale;
      // Pass 1: every head's score of every position.
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t first = b * block_size, n = std::min(block_size, context - first);
        if (b + 1 < blocks) prefetch(block_start(k_base, b + 1), block_bytes);
        const float* k_rows = as_float(block_start(k_base, b), converted.data(), n * slot_stride);
        // Four positions at a time per head: four independent sums (an FMA waits on the
        // one before it in its own sum only), each vector of the query loaded once for four.
        for (int64_t head = head_begin; head < head_end; ++head) {
          const float* qh = query.data() + head * dim;
          const float* k = k_rows + (head / group) * dim;
          float* s = scores.data() + head * max_context + first;
          int64_t j = 0;
          for (; j + 4 <= n; j += 4) {
            const float *k0 = k + j * slot_stride, *k1 = k0 + slot_stride,
                        *k2 = k1 + slot_stride, *k3 = k2 + slot_stride;
            Vec s0(0.f), s1(0.f), s2(0.f), s3(0.f);
            for (int64_t d = 0; d < dim; d += Vec::size()) {
              const Vec qd = Vec::loadu(qh + d);
              s0 = at::vec::fmadd(qd, Vec::loadu(k0 + d), s0);
              s1 = at::vec::fmadd(qd, Vec::loadu(k1 + d), s1);
              s2 = at::vec::fmadd(qd, Vec::loadu(k2 + d), s2);
              s3 = at::vec::fmadd(qd, Vec::loadu(k3 + d), s3);
            }
            s[j] = at::vec::vec_reduce_all<float>(std::plus<Vec>(), s0);
            s[j + 1] = at::vec::vec_reduce_all<float>(std::plus<Vec>(), s1);
            s[j + 2] = at::vec::vec_reduce_all<float>(std::plus<Vec>(), s2);
            s[j + 3] = at::vec::vec_reduce_all<float>(std::plus<Vec>(), s3);
          }
          for (; j < n; ++j) {
            const float* kj = k + j * slot_stride;
            Vec sum(0.f);
            for (int64_t d = 0; d < dim; d += Vec::size())
              sum = at::vec::fmadd(Vec::loadu(qh + d), Vec::loadu(kj + d), sum);
            s[j] = at::vec::vec_reduce_all<float>(std::plus<Vec>(), sum);
          }
        }
      }
      // Each head's softmax, in place; the division waits for the output.
      for (int64_t head = head_begin; head < head_end; ++head)
        inv_sum[head] = exp_in_place(scores.data() + head * max_context, context);
      // Pass 2: each head's weighted sum of its kv head's values, a block at a time, the
      // running sum of each vector of the head's output held in a register over the block.
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t first = b * block_size, n = std::min(block_size, context - first);
        if (b + 1 < blocks) prefetch(block_start(v_base, b + 1), block_bytes);
        const float* v_rows = as_float(block_start(v_base, b), converted.data(), n * slot_stride);
        for (int64_t head = head_begin; head < head_end; ++head) {
          const float* w = scores.data() + head * max_context + first;
          const float* v = v_rows + (head / group) * dim;
          float* a = acc.data() + head * dim;
          // Four vectors of the output at a time: four independent running sums.
          int64_t d = 0;
          for (; d + 4 * Vec::size() <= dim; d += 4 * Vec::size()) {
            constexpr int64_t W = Vec::size();
            Vec t0 = Vec::loadu(a + d), t1 = Vec::loadu(a + d + W), t2 = Vec::loadu(a + d + 2 * W),
                t3 = Vec::loadu(a + d + 3 * W);
            for (int64_t j = 0; j < n; ++j) {
              const Vec wj(w[j]);
              const float* vj = v + j * slot_stride + d;
              t0 = at::vec::fmadd(wj, Vec::loadu(vj), t0);
              t1 = at::vec::fmadd(wj, Vec::loadu(vj + W), t1);
              t2 = at::vec::fmadd(wj, Vec::loadu(vj + 2 * W), t2);
              t3 = at::vec::fmadd(wj, Vec::loadu(vj + 3 * W), t3);
            }
            t0.store(a + d);
            t1.store(a + d + W);
            t2.store(a + d + 2 * W);
            t3.store(a + d + 3 * W);
          }
          for (; d < dim; d += Vec::size()) {
            Vec total = Vec::loadu(a + d);
            for (int64_t j = 0; j < n; ++j)
              total = at::vec::fmadd(Vec(w[j]), Vec::loadu(v + j * slot_stride + d), total);
            total.store(a + d);
          }
        }
      }
      for (int64_t head = head_begin; head < head_end; ++head)
        for (int64_t d = 0; d < dim; ++d)
          out_ptr[(t * heads + head) * dim + d] =
              static_cast<T>(acc[head * dim + d] * inv_sum[head]);
    }
  });
}

at::Tensor paged_token_attention(const at::Tensor& q, const at::Tensor& pool, int64_t k_base,
                                 int64_t v_base, int64_t block_size, const at::Tensor& tables,
                                 const at::Tensor& positions, double scale) {
  TORCH_CHECK(q.dim() == 3 && pool.dim() == 3 && q.size(2) == pool.size(2),
              "paged_token_attention: q [tokens, heads, dim] and pool [slots, kv_heads, dim]");
  TORCH_CHECK(q.size(1) % pool.size(1) == 0, "paged_token_attention: heads (", q.size(1),
              ") must be a multiple of kv heads (", pool.size(1), ")");
  TORCH_CHECK(q.size(2) % Vec::size() == 0, "paged_token_attention: head dim ", q.size(2),
              " is not a multiple of the vector width ", Vec::size());
  TORCH_CHECK(q.scalar_type() == pool.scalar_type() && pool.is_contiguous(),
              "paged_token_attention: a contiguous pool of q's dtype");
  TORCH_CHECK(tables.scalar_type() == at::kInt && positions.scalar_type() == at::kLong &&
                  tables.size(0) == q.size(0) && positions.size(0) == q.size(0),
              "paged_token_attention: int32 tables [tokens, W] and int64 positions [tokens]");
  // q may be a view (the step's projections, split): any strides but unit ones along a head.
  const at::Tensor query = q.stride(2) == 1 ? q : q.contiguous(), table = tables.contiguous(),
                   position = positions.contiguous();
  at::Tensor out = at::empty(q.sizes(), q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(),
                                  "paged_token_attention", [&] {
    attend<scalar_t>(query, pool, k_base, v_base, block_size, table, position,
                     static_cast<float>(scale), out);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(miniinfer, m) {
  m.def("paged_token_attention(Tensor q, Tensor pool, int k_base, int v_base, int block_size, "
        "Tensor tables, Tensor positions, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(miniinfer, CPU, m) {
  m.impl("paged_token_attention", &paged_token_attention);
}
