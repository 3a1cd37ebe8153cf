// The kernels of this folder, for C++ callers (decoder_stack.cpp); Python reaches them as torch.ops.vsup_cpu.

#pragma once

#include <ATen/core/Tensor.h>

namespace vsup {

void add_rms_norm_(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps);
void add_rms_norm_into(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps,
                       const at::Tensor& out);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, at::ScalarType dtype);
void rotary_(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
void silu_and_mul(const at::Tensor& x, const at::Tensor& out);
void paged_attention_decode(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                            const at::Tensor& out, bool vectorized = true);
void write_kv(const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache,
              const at::Tensor& value_cache, const at::Tensor& slot_mapping);

}  // namespace vsup
