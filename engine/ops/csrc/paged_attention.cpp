// The paged KV cache on the CPU: new tokens' K/V written to their slots, and decode attention that
// reads the blocks in place (no gather).
//
// Caches are [num_blocks, block_size, num_kv_heads, head_dim], contiguous, float32 or bfloat16 (read
// widened to float32, written rounded to nearest even: --kv-cache-dtype bfloat16; the query's dots with
// a bfloat16 K take the query rounded to bfloat16 too, with avx512_bf16 the CPU's own bfloat16 dots); query is
// [num_seqs, num_heads, head_dim], float32, with unit stride in its last dim (a view of the fused
// qkv output is fine). One task is one (sequence, KV head) with every query head that shares it
// (GQA), so each K and V row is read once per group: scores for all its tokens, their softmax, then
// the weighted sum of V. A sequence of length 0 gives zeros. Tasks run on torch's intra-op threads. With AVX-512
// and a head_dim of 64 or 128, the dots and the weighted sum have kernels of their own (below).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "layer_ops.h"
#include "vec_math.h"

namespace {

constexpr int64_t kSerialWork = 1 << 17;  // multiply-adds of q.k below which one thread does it all
constexpr int64_t kWriteGrain = 8;         // new K/V rows below which one thread writes them all
// A query element as the dots over a cache of T take it: over a bfloat16 cache rounded to bfloat16 (to
// nearest even), so that every path computes what scores_bf16_dot does, products of bfloat16 numbers
// (exact in float32) summed in float32.
inline float query_for(float x, float) { return x; }
inline float query_for(float x, vsup::BF16) { return vsup::widen(vsup::narrow<vsup::BF16>(x)); }

template <typename T>
inline float dot(const float* __restrict a, const T* __restrict b, int64_t n) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += query_for(a[i], T{}) * vsup::widen(b[i]);
  return sum;
}

// One task's view of a sequence: token t's K (V) row of the task's first KV head starts at
// keys + rows[t] (values + rows[t]); KV head j of the task is j * head_dim further on. T: the
// caches' element, float or vsup::BF16.
template <typename T>
struct Context {
  const T* keys;
  const T* values;
  const int64_t* rows;
  int64_t len, heads, group, head_dim;  // heads: the task's query heads, `group` to a KV head
};

// scores[h * len + t] = scale * (q_h . k_t), one dot at a time.
template <typename T>
void scores_any(const Context<T>& c, const float* q, int64_t q_head, float scale, float* scores) {
  for (int64_t t = 0; t < c.len; ++t) {
    const T* k = c.keys + c.rows[t];
    for (int64_t h = 0; h < c.heads; ++h) {
      scores[h * c.len + t] = dot(q + h * q_head, k + (h / c.group) * c.head_dim, c.head_dim) * scale;
    }
  }
}

// out[h] = sum over t of scores[h * len + t] * v_t, head by head.
template <typename T>
void values_any(const Context<T>& c, const float* scores, float* out) {
  std::fill(out, out + c.heads * c.head_dim, 0.f);
  for (int64_t t = 0; t < c.len; ++t) {
    const T* v = c.values + c.rows[t];
    for (int64_t h = 0; h < c.heads; ++h) {
      const float p = scores[h * c.len + t];
      const T* vh = v + (h / c.group) * c.head_dim;
      float* a = out + h * c.head_dim;
      for (int64_t d = 0; d < c.head_dim; ++d) a[d] += p * vsup::widen(vh[d]);
    }
  }
}

#if defined(__AVX512F__)
// 16 elements from p, as float32 (bfloat16 is float32's upper half)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const vsup::BF16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// query_for, 16 at a time: to nearest even by adding 0x7fff plus the kept part's lowest bit, then
// dropping the low 16 bits
inline __m512 query16(const float* p, float) { return _mm512_loadu_ps(p); }
inline __m512 query16(const float* p, vsup::BF16) {
  const __m512i u = _mm512_castps_si512(_mm512_loadu_ps(p));
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i up = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd));
  return _mm512_castsi512_ps(_mm512_and_si512(up, _mm512_set1_epi32(static_cast<int32_t>(0xffff0000u))));
}

// Lane i of the result is the sum of v[i]'s 16 lanes: the 16 horizontal sums in 4 rounds of
// shuffles and adds, each round halving the vectors (a dot's own horizontal sum is a chain of
// dependent adds; 16 of them were most of the time of a decode step's attention).
inline __m512 sums_of(__m512 (&v)[16]) {
  __m512 w[8], z[4], u[2];
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane: v[2i] in elements 0 and 2, v[2i+1] in 1 and 3
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: v[4i] .. v[4i+3] in elements 0 .. 3
    z[i] = _mm512_add_ps(_mm512_shuffle_ps(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  }
  for (int i = 0; i < 2; ++i) {  // 128-bit lanes: z[2i]'s halves, then z[2i+1]'s
    u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(z[2 * i], z[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(z[2 * i], z[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  }
  return _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// Rows sit block by block wherever the allocator put them, where the hardware's prefetcher does not
// follow: ask for the 16 tokens after t0's keys, and t0's n tokens' values for later.
template <typename T>
inline void prefetch_rows(const Context<T>& c, int64_t t0, int n) {
  const int64_t width = c.heads / c.group * c.head_dim;  // elements of a token's row that the task reads
  constexpr int64_t line = 64 / sizeof(T);                // elements of a cache line
  for (int64_t t = t0; t < t0 + n; ++t) {
    for (int64_t f = 0; f < width; f += line) {
      if (t + 16 < c.len) _mm_prefetch(reinterpret_cast<const char*>(c.keys + c.rows[t + 16] + f), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(c.values + c.rows[t] + f), _MM_HINT_T1);
    }
  }
}

// scores_any for head_dim = 16 C: 16 tokens at a time per head, their dots as 16 independent
// vectors of partial sums, summed across lanes together.
template <int C, typename T>
void scores_avx512(const Context<T>& c, const float* q, int64_t q_head, float scale, float* scores) {
  const __m512 scale_v = _mm512_set1_ps(scale);
  for (int64_t t0 = 0; t0 < c.len; t0 += 16) {
    const int n = static_cast<int>(std::min<int64_t>(16, c.len - t0));
    prefetch_rows(c, t0, n);
    for (int64_t h = 0; h < c.heads; ++h) {
      __m512 qv[C], acc[16];
      for (int i = 0; i < C; ++i) qv[i] = query16(q + h * q_head + 16 * i, T{});
      const T* k = c.keys + (h / c.group) * c.head_dim;
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j) {
        acc[j] = _mm512_setzero_ps();
        if (j < n) {
          const T* row = k + c.rows[t0 + j];
          for (int i = 0; i < C; ++i) acc[j] = _mm512_fmadd_ps(qv[i], load16(row + 16 * i), acc[j]);
        }
      }
      _mm512_mask_storeu_ps(scores + h * c.len + t0, static_cast<__mmask16>((1u << n) - 1),
                            _mm512_mul_ps(sums_of(acc), scale_v));
    }
  }
}

#if defined(__AVX512BF16__)
// scores_avx512 over a bfloat16 cache with the CPU's bfloat16 dot product (vdpbf16ps): a K row is taken
// as it is stored, 32 elements an instruction, against the query rounded to bfloat16 (to nearest even);
// the products are exact in float32 and summed in it. Widening K instead costs two more instructions a
// 16 elements, for each query head that reads the row: three times the work of these dots.
template <int C>
void scores_bf16_dot(const Context<vsup::BF16>& c, const float* q, int64_t q_head, float scale, float* scores) {
  static_assert(C % 2 == 0, "pairs of 16 elements");
  const __m512 scale_v = _mm512_set1_ps(scale);
  for (int64_t t0 = 0; t0 < c.len; t0 += 16) {
    const int n = static_cast<int>(std::min<int64_t>(16, c.len - t0));
    prefetch_rows(c, t0, n);
    for (int64_t h = 0; h < c.heads; ++h) {
      __m512bh qv[C / 2];  // elements 32 i .. 32 i + 31 of the query head, in bfloat16, in a K row's order
      for (int i = 0; i < C / 2; ++i) {
        const float* qi = q + h * q_head + 32 * i;
        qv[i] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(qi + 16), _mm512_loadu_ps(qi));
      }
      const vsup::BF16* k = c.keys + (h / c.group) * c.head_dim;
      __m512 acc[16];
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j) {
        acc[j] = _mm512_setzero_ps();
        if (j < n) {
          const vsup::BF16* row = k + c.rows[t0 + j];
          for (int i = 0; i < C / 2; ++i) {
            acc[j] = _mm512_dpbf16_ps(acc[j], qv[i], (__m512bh)_mm512_loadu_si512(row + 32 * i));
          }
        }
      }
      _mm512_mask_storeu_ps(scores + h * c.len + t0, static_cast<__mmask16>((1u << n) - 1),
                            _mm512_mul_ps(sums_of(acc), scale_v));
    }
  }
}
#endif

// values_any for head_dim = 16 C: a head's sum stays in registers, two tokens at a time.
template <int C, typename T>
void values_avx512(const Context<T>& c, const float* scores, float* out) {
  for (int64_t h = 0; h < c.heads; ++h) {
    const float* p = scores + h * c.len;
    const T* v = c.values + (h / c.group) * c.head_dim;
    __m512 a[C], b[C];
    for (int i = 0; i < C; ++i) a[i] = b[i] = _mm512_setzero_ps();
    int64_t t = 0;
    for (; t + 1 < c.len; t += 2) {
      const T *r0 = v + c.rows[t], *r1 = v + c.rows[t + 1];
      const __m512 p0 = _mm512_set1_ps(p[t]), p1 = _mm512_set1_ps(p[t + 1]);
      for (int i = 0; i < C; ++i) {
        a[i] = _mm512_fmadd_ps(p0, load16(r0 + 16 * i), a[i]);
        b[i] = _mm512_fmadd_ps(p1, load16(r1 + 16 * i), b[i]);
      }
    }
    if (t < c.len) {
      const __m512 p0 = _mm512_set1_ps(p[t]);
      for (int i = 0; i < C; ++i) a[i] = _mm512_fmadd_ps(p0, load16(v + c.rows[t] + 16 * i), a[i]);
    }
    for (int i = 0; i < C; ++i) _mm512_storeu_ps(out + h * c.head_dim + 16 * i, _mm512_add_ps(a[i], b[i]));
  }
}
#endif

template <typename T>
using Scores = void (*)(const Context<T>&, const float*, int64_t, float, float*);
template <typename T>
using Values = void (*)(const Context<T>&, const float*, float*);

// The kernels for this head_dim: with AVX-512, 64 and 128 (the usual ones) have their own, unless
// `vectorized` is false (what a CPU without AVX-512 runs: the tests and bench/paged_attention.py).
template <typename T>
std::pair<Scores<T>, Values<T>> kernels_for([[maybe_unused]] int64_t head_dim, [[maybe_unused]] bool vectorized) {
#if defined(__AVX512F__)
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, vsup::BF16>) {
    if (vectorized && head_dim == 64) return {scores_bf16_dot<4>, values_avx512<4, T>};
    if (vectorized && head_dim == 128) return {scores_bf16_dot<8>, values_avx512<8, T>};
  }
#endif
  if (vectorized && head_dim == 64) return {scores_avx512<4, T>, values_avx512<4, T>};
  if (vectorized && head_dim == 128) return {scores_avx512<8, T>, values_avx512<8, T>};
#endif
  return {scores_any<T>, values_any<T>};
}

bool is_cache_dtype(at::ScalarType dtype) { return dtype == at::kFloat || dtype == at::kBFloat16; }

}  // namespace

namespace vsup {

void paged_attention_decode(const at::Tensor& query, const at::Tensor& key_cache,
                            const at::Tensor& value_cache, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, double scale, const at::Tensor& out, bool vectorized) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4, "query [S, H, D], caches [N, B, Hkv, D]");
  TORCH_CHECK(query.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat, "float32 query and out");
  TORCH_CHECK(is_cache_dtype(key_cache.scalar_type()) && value_cache.scalar_type() == key_cache.scalar_type(),
              "caches: both float32 or both bfloat16");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous() && out.is_contiguous(),
              "caches and out must be contiguous");
  TORCH_CHECK(query.stride(2) == 1, "query's last dim must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous(), "int32 block tables");
  TORCH_CHECK(seq_lens.scalar_type() == at::kLong && seq_lens.is_contiguous(), "int64 seq_lens");
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == head_dim && num_heads % num_kv_heads == 0, "head shapes disagree");
  TORCH_CHECK(out.size(0) == num_seqs && out.size(1) == num_heads && out.size(2) == head_dim, "out shape");
  TORCH_CHECK(block_tables.size(0) == num_seqs && seq_lens.size(0) == num_seqs, "one row per sequence");
  const float scale_f = static_cast<float>(scale);
  const int64_t group = num_heads / num_kv_heads, max_blocks = block_tables.size(1);
  const int64_t q_seq = query.stride(0), q_head = query.stride(1);
  const int64_t token_stride = num_kv_heads * head_dim, block_stride = block_size * token_stride;
  const float* q_ptr = query.data_ptr<float>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  float* o_ptr = out.data_ptr<float>();
  for (int64_t s = 0; s < num_seqs; ++s) {
    TORCH_CHECK(lens[s] >= 0 && lens[s] <= max_blocks * block_size, "seq_len past its block table");
  }

  // A task reads whole K/V rows of a sequence (contiguous memory); few sequences split by KV head.
  // Little work in all (a short context, one sequence) stays on the calling thread.
  const int64_t splits = num_seqs >= 2 * at::get_num_threads() ? 1 : num_kv_heads;
  const int64_t span = num_kv_heads / splits, span_heads = span * group, num_tasks = num_seqs * splits;
  int64_t total_len = 0;
  for (int64_t s = 0; s < num_seqs; ++s) total_len += lens[s];
  const int64_t grain = total_len * num_heads * head_dim < kSerialWork ? std::max<int64_t>(num_tasks, 1) : 1;
  const auto attend = [&](auto element) {  // element: a T{} of the caches
    using T = decltype(element);
    const T* k_ptr = static_cast<const T*>(key_cache.data_ptr());
    const T* v_ptr = static_cast<const T*>(value_cache.data_ptr());
    const auto [scores_of, values_of] = kernels_for<T>(head_dim, vectorized);
    at::parallel_for(0, num_tasks, grain, [&](int64_t begin, int64_t end) {
      std::vector<float> scores;
      std::vector<int64_t> rows;
      for (int64_t task = begin; task < end; ++task) {
        const int64_t seq = task / splits, first_kv = (task % splits) * span, len = lens[seq];
        const int32_t* table = tables + seq * max_blocks;
        const float* q = q_ptr + seq * q_seq + first_kv * group * q_head;
        float* o = o_ptr + (seq * num_heads + first_kv * group) * head_dim;
        if (len == 0) {
          std::fill(o, o + span_heads * head_dim, 0.f);
          continue;
        }
        rows.resize(len);  // each token's row in the caches, block by block (no division per token)
        for (int64_t t = 0; t < len; t += block_size) {
          const int64_t block = table[t / block_size] * block_stride + first_kv * head_dim;
          for (int64_t i = 0; i < std::min(block_size, len - t); ++i) rows[t + i] = block + i * token_stride;
        }
        const Context<T> context{k_ptr, v_ptr, rows.data(), len, span_heads, group, head_dim};
        scores.resize(span_heads * len);
        scores_of(context, q, q_head, scale_f, scores.data());
        for (int64_t h = 0; h < span_heads; ++h) {
          float* row = scores.data() + h * len;
          const float top = *std::max_element(row, row + len);
          for (int64_t t = 0; t < len; ++t) row[t] = vsup::exp_nonpositive(row[t] - top);
          float sum = 0.f;
          for (int64_t t = 0; t < len; ++t) sum += row[t];
          const float inv = 1.f / sum;
          for (int64_t t = 0; t < len; ++t) row[t] *= inv;
        }
        values_of(context, scores.data(), o);
      }
    });
  };
  vsup::with_element(key_cache.scalar_type(), attend);
}

// key, value [T, Hkv, D] in float32 (rows may be strided, each row's heads contiguous) into the
// caches' flat slots slot_mapping[t]: one row copy each, where index_copy_ goes element by element
// (into bfloat16 caches, each element rounded).
void write_kv(const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache,
              const at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.scalar_type() == at::kFloat && value.scalar_type() == at::kFloat, "float32 key and value");
  TORCH_CHECK(is_cache_dtype(key_cache.scalar_type()) && value_cache.scalar_type() == key_cache.scalar_type(),
              "caches: both float32 or both bfloat16");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(), "int64 slot_mapping");
  const int64_t num_tokens = key.size(0), row = key_cache.size(2) * key_cache.size(3);
  const int64_t num_slots = key_cache.size(0) * key_cache.size(1);
  for (const at::Tensor* x : {&key, &value}) {
    TORCH_CHECK(x->dim() == 3 && x->size(0) == num_tokens && x->size(1) * x->size(2) == row &&
                    x->stride(2) == 1 && x->stride(1) == x->size(2),
                "key/value [T, Hkv, D] with each row contiguous");
  }
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t) TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot out of range");
  const float* k = key.data_ptr<float>();
  const float* v = value.data_ptr<float>();
  const auto write = [&](auto element) {  // element: a T{} of the caches
    using T = decltype(element);
    T* kc = static_cast<T*>(key_cache.data_ptr());
    T* vc = static_cast<T*>(value_cache.data_ptr());
    const auto copy = [row](T* to, const float* from) {
      if constexpr (std::is_same_v<T, float>) {
        std::memcpy(to, from, row * sizeof(float));
      } else {
        for (int64_t i = 0; i < row; ++i) to[i] = vsup::narrow<T>(from[i]);
      }
    };
    // The slots are cold (a decode step's new rows land in blocks no one has read lately), so a copy
    // waits on its destination's lines: both threads copy, each asking ahead for its next row's lines.
    at::parallel_for(0, num_tokens, kWriteGrain, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        if (t + 1 < end) {
          for (int64_t f = 0; f < row; f += 64 / sizeof(T)) {
            __builtin_prefetch(kc + slots[t + 1] * row + f, 1);
            __builtin_prefetch(vc + slots[t + 1] * row + f, 1);
          }
        }
        copy(kc + slots[t] * row, k + t * key.stride(0));
        copy(vc + slots[t] * row, v + t * value.stride(0));
      }
    });
  };
  vsup::with_element(key_cache.scalar_type(), write);
}

}  // namespace vsup

TORCH_LIBRARY(vsup_cpu, m) {
  m.def("paged_attention_decode(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
        "Tensor seq_lens, float scale, Tensor(a!) out, bool vectorized=True) -> ()",
        &vsup::paged_attention_decode);
  m.def("write_kv(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor slot_mapping) -> ()",
        &vsup::write_kv);
}
