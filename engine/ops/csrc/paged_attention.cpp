// The paged KV cache on the CPU: new tokens' K/V written to their slots, and decode attention that
// reads the blocks in place (no gather).
//
// Caches are [num_blocks, block_size, num_kv_heads, head_dim], float32, contiguous; query is
// [num_seqs, num_heads, head_dim] with unit stride in its last dim (a view of the fused qkv output
// is fine). One task is one (sequence, KV head) with every query head that shares it (GQA), so each
// K and V row is read once per group: scores for all its tokens, their softmax, then the weighted
// sum of V. A sequence of length 0 gives zeros. Tasks run on torch's intra-op threads.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "layer_ops.h"
#include "vec_math.h"

namespace {

constexpr int64_t kSerialWork = 1 << 17;  // multiply-adds of q.k below which one thread does it all
inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

}  // namespace

namespace vsup {

void paged_attention_decode(const at::Tensor& query, const at::Tensor& key_cache,
                            const at::Tensor& value_cache, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, double scale, const at::Tensor& out) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4, "query [S, H, D], caches [N, B, Hkv, D]");
  TORCH_CHECK(query.scalar_type() == at::kFloat && key_cache.scalar_type() == at::kFloat &&
                  value_cache.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat,
              "float32 only");
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
  const float* k_ptr = key_cache.data_ptr<float>();
  const float* v_ptr = value_cache.data_ptr<float>();
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
  at::parallel_for(0, num_tasks, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc(span_heads * head_dim);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t seq = task / splits, first_kv = (task % splits) * span, len = lens[seq];
      const int32_t* table = tables + seq * max_blocks;
      const float* q = q_ptr + seq * q_seq + first_kv * group * q_head;
      float* o = o_ptr + (seq * num_heads + first_kv * group) * head_dim;
      if (len == 0) {
        std::fill(o, o + span_heads * head_dim, 0.f);
        continue;
      }
      const int64_t offset = first_kv * head_dim;  // of the task's first KV head in a token's row
      scores.resize(span_heads * len);
      for (int64_t t = 0; t < len; ++t) {
        const float* k = k_ptr + table[t / block_size] * block_stride + (t % block_size) * token_stride + offset;
        for (int64_t h = 0; h < span_heads; ++h) {
          scores[h * len + t] = dot(q + h * q_head, k + (h / group) * head_dim, head_dim) * scale_f;
        }
      }
      for (int64_t h = 0; h < span_heads; ++h) {
        float* row = scores.data() + h * len;
        const float top = *std::max_element(row, row + len);
        for (int64_t t = 0; t < len; ++t) row[t] = vsup::exp_nonpositive(row[t] - top);
        float sum = 0.f;
        for (int64_t t = 0; t < len; ++t) sum += row[t];
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < len; ++t) row[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < len; ++t) {
        const float* v = v_ptr + table[t / block_size] * block_stride + (t % block_size) * token_stride + offset;
        for (int64_t h = 0; h < span_heads; ++h) {
          const float p = scores[h * len + t];
          const float* vh = v + (h / group) * head_dim;
          float* a = acc.data() + h * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) a[d] += p * vh[d];
        }
      }
      std::copy(acc.begin(), acc.end(), o);
    }
  });
}

// key, value [T, Hkv, D] (rows may be strided, each row's heads contiguous) into the caches' flat
// slots slot_mapping[t]: one row copy each, where index_copy_ goes element by element.
void write_kv(const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache,
              const at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.scalar_type() == at::kFloat && value.scalar_type() == at::kFloat &&
                  key_cache.scalar_type() == at::kFloat && value_cache.scalar_type() == at::kFloat,
              "float32 only");
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
  float* kc = key_cache.data_ptr<float>();
  float* vc = value_cache.data_ptr<float>();
  for (int64_t t = 0; t < num_tokens; ++t) {
    std::memcpy(kc + slots[t] * row, k + t * key.stride(0), row * sizeof(float));
    std::memcpy(vc + slots[t] * row, v + t * value.stride(0), row * sizeof(float));
  }
}

}  // namespace vsup

TORCH_LIBRARY(vsup_cpu, m) {
  m.def("paged_attention_decode(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
        "Tensor seq_lens, float scale, Tensor(a!) out) -> ()",
        &vsup::paged_attention_decode);
  m.def("write_kv(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor slot_mapping) -> ()",
        &vsup::write_kv);
}
