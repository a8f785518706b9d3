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
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <functional>
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

template <typename T>
void attend(const at::Tensor& q, const at::Tensor& pool, int64_t k_base, int64_t v_base,
            int64_t block_size, const at::Tensor& tables, const at::Tensor& positions,
            float scale, at::Tensor& out) {
  const int64_t tokens = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t group = heads / pool.size(1), width = tables.size(1);
  const int64_t slot_stride = pool.size(1) * dim;  // elements from one slot to the next
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
  // Work is spread by positions, not tokens: contexts differ by several times within a step,
  // and equal token counts per thread left one thread with twice the other's work. Each of
  // the pieces gets the tokens whose cumulative positions fall into its share.
  std::vector<int64_t> cumulative(tokens + 1, 0);
  for (int64_t t = 0; t < tokens; ++t) cumulative[t + 1] = cumulative[t] + context_of(t);
  // About 64 positions a piece at least: below that, waking a thread costs more than the work.
  const int64_t pieces = std::max<int64_t>(
      1, std::min({static_cast<int64_t>(at::get_num_threads()), tokens, cumulative[tokens] / 64}));
  at::parallel_for(0, pieces, 1, [&](int64_t piece_begin, int64_t piece_end) {
    auto first_token = [&](int64_t piece) {
      const int64_t share = cumulative[tokens] * piece / pieces;
      return static_cast<int64_t>(std::lower_bound(cumulative.begin(), cumulative.end(), share)
                                  - cumulative.begin());
    };
    const int64_t begin = first_token(piece_begin), end = first_token(piece_end);
    std::vector<float> scores(heads * max_context), query(heads * dim), acc(heads * dim),
        inv_sum(heads), converted(block_size * slot_stride);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t context = context_of(t), blocks = (context + block_size - 1) / block_size;
      const int32_t* table = table_ptr + t * width;
      auto block_start = [&](int64_t base, int64_t b) {
        return pool_ptr + (base + static_cast<int64_t>(table[b]) * block_size) * slot_stride;
      };
      for (int64_t head = 0; head < heads; ++head)
        for (int64_t d = 0; d < dim; ++d)
          query[head * dim + d] =
              static_cast<float>(q_ptr[t * q.stride(0) + head * q.stride(1) + d]) * scale;
      // Pass 1: every head's score of every position.
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t first = b * block_size, n = std::min(block_size, context - first);
        if (b + 1 < blocks) prefetch(block_start(k_base, b + 1), block_bytes);
        const float* k_rows = as_float(block_start(k_base, b), converted.data(), n * slot_stride);
        // Four positions at a time per head: four independent sums (an FMA waits on the
        // one before it in its own sum only), each vector of the query loaded once for four.
        for (int64_t head = 0; head < heads; ++head) {
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
      for (int64_t head = 0; head < heads; ++head) {
        float* s = scores.data() + head * max_context;
        const float top = at::vec::reduce_all<float>(
            [](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, s, context);
        at::vec::map([top](Vec x) { return (x - Vec(top)).exp_u20(); }, s, s, context);
        inv_sum[head] = 1.f / at::vec::reduce_all<float>(
            [](Vec& x, Vec& y) { return x + y; }, s, context);
      }
      // Pass 2: each head's weighted sum of its kv head's values, a block at a time, the
      // running sum of each vector of the head's output held in a register over the block.
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t first = b * block_size, n = std::min(block_size, context - first);
        if (b + 1 < blocks) prefetch(block_start(v_base, b + 1), block_bytes);
        const float* v_rows = as_float(block_start(v_base, b), converted.data(), n * slot_stride);
        for (int64_t head = 0; head < heads; ++head) {
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
      for (int64_t head = 0; head < heads; ++head)
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
