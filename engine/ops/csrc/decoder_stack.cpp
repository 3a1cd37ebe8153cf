// A decode step through a stage's decoder layers in one C++ loop, on the CPU in float32: per layer
// the norms, the oneDNN-packed linears (the same mkldnn op engine/ops/cpu_linear.py calls; in
// bfloat16 under --linear-dtype bfloat16), rotary, the KV write and paged decode attention of this
// folder. It is what LlamaModel's Python loop does, without the Python: at batch 1 a step is about
// 600 small calls, and the interpreter's share of them (with its caches cold after each linear has
// streamed its weights through) is 10-20% of the step. Tensor parallelism (collectives between the
// linears) and prefill stay in Python.

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <optional>
#include <string_view>
#include <tuple>
#include <vector>

#include "layer_ops.h"

namespace {

// x W^T + b through the packed weight, in `out` dtype. Under --linear-dtype bfloat16 the weight is
// bfloat16 in a float32 model: rows of another dtype are cast to the weight's, the result to `out`,
// and a float32 bias is added after that cast (in float32: the stack asks for float32 out where there
// is a bias), as engine/ops/cpu_linear.py's `linear` does.
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                         at::ScalarType out) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                         std::string_view, c10::List<std::optional<at::Scalar>>,
                                         std::optional<std::string_view>)>();
  const at::ScalarType dtype = packed.scalar_type();
  const bool bias_inside = bias.has_value() && bias->scalar_type() == dtype && out == dtype;
  at::Tensor y = op.call(x.scalar_type() == dtype ? x : x.to(dtype), packed, bias_inside ? bias : std::nullopt,
                         "none", c10::List<std::optional<at::Scalar>>(), std::nullopt);
  if (out != dtype) y = y.to(out);
  return bias.has_value() && !bias_inside ? y.add_(*bias) : y;
}

// hidden's rows normed into the next linear's input, of `dtype`: in place where hidden is of it
at::Tensor add_rms_norm(const at::Tensor& hidden, const at::Tensor& residual, const at::Tensor& weight, double eps,
                        at::ScalarType dtype) {
  const at::Tensor out =
      hidden.scalar_type() == dtype ? hidden : at::empty(hidden.sizes(), hidden.options().dtype(dtype));
  vsup::add_rms_norm_into(hidden, residual, weight, eps, out);
  return out;
}

std::optional<at::Tensor> nth(const std::vector<at::Tensor>& biases, size_t i) {
  return biases.empty() ? std::nullopt : std::optional<at::Tensor>(biases[i]);
}

// One stage's layers: their weights (the linears' packed), taken once when the model is loaded.
struct DecoderStack : torch::CustomClassHolder {
  std::vector<at::Tensor> input_norm, qkv, qkv_bias, o, o_bias, post_norm, gate_up, down;  // biases: [] or one each
  int64_t num_heads, num_kv_heads, head_dim;
  double eps, scale;

  DecoderStack(std::vector<at::Tensor> input_norm, std::vector<at::Tensor> qkv, std::vector<at::Tensor> qkv_bias,
               std::vector<at::Tensor> o, std::vector<at::Tensor> o_bias, std::vector<at::Tensor> post_norm,
               std::vector<at::Tensor> gate_up, std::vector<at::Tensor> down, int64_t num_heads,
               int64_t num_kv_heads, int64_t head_dim, double eps, double scale)
      : input_norm(std::move(input_norm)), qkv(std::move(qkv)), qkv_bias(std::move(qkv_bias)), o(std::move(o)),
        o_bias(std::move(o_bias)), post_norm(std::move(post_norm)), gate_up(std::move(gate_up)),
        down(std::move(down)), num_heads(num_heads), num_kv_heads(num_kv_heads), head_dim(head_dim), eps(eps),
        scale(scale) {
    const size_t n = this->input_norm.size();
    TORCH_CHECK(n > 0, "at least one layer");
    for (const auto* part : {&this->qkv, &this->o, &this->post_norm, &this->gate_up, &this->down}) {
      TORCH_CHECK(part->size() == n, "one weight of each kind per layer");
    }
    TORCH_CHECK(this->qkv_bias.empty() || this->qkv_bias.size() == n, "no qkv bias, or one per layer");
    TORCH_CHECK(this->o_bias.empty() || this->o_bias.size() == n, "no o_proj bias, or one per layer");
  }

  // hidden [T, hidden], one token per sequence; residual: none before a stage's first layer (the
  // embedding's output becomes it); cos, sin [T, head_dim / 2]. Returns (hidden, residual) after the
  // last layer, as the Python loop does; hidden and residual may be written in place. With bfloat16
  // linears (--linear-dtype bfloat16) the norms write the linears' inputs in bfloat16 and SiLU reads
  // and writes bfloat16, so that only q/k/v (for rotary, the KV cache and attention) and attention's
  // output are cast; the residual stays float32.
  std::tuple<at::Tensor, at::Tensor> forward(at::Tensor hidden, std::optional<at::Tensor> residual_in,
                                             at::Tensor cos, at::Tensor sin, std::vector<at::Tensor> key_caches,
                                             std::vector<at::Tensor> value_caches, at::Tensor slot_mapping,
                                             at::Tensor block_tables, at::Tensor seq_lens) {
    const size_t n = input_norm.size();
    TORCH_CHECK(key_caches.size() == n && value_caches.size() == n, "one key and one value cache per layer");
    TORCH_CHECK(hidden.dim() == 2, "hidden [T, hidden]");
    const int64_t tokens = hidden.size(0), q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
    const at::ScalarType model = hidden.scalar_type(), linear = qkv[0].scalar_type();
    at::Tensor residual = residual_in.has_value() ? *residual_in : at::Tensor();
    for (size_t l = 0; l < n; ++l) {
      if (!residual.defined()) {
        residual = hidden;
        hidden = vsup::rms_norm(hidden, input_norm[l], eps, linear);
      } else {
        hidden = add_rms_norm(hidden, residual, input_norm[l], eps, linear);
      }
      const at::Tensor qkv_out = packed_linear(hidden, qkv[l], nth(qkv_bias, l), model);
      TORCH_CHECK(qkv_out.size(1) == q_size + 2 * kv_size, "qkv width");
      vsup::rotary_(qkv_out.narrow(1, 0, q_size + kv_size).view({tokens, num_heads + num_kv_heads, head_dim}), cos,
                    sin);
      vsup::write_kv(qkv_out.narrow(1, q_size, kv_size).view({tokens, num_kv_heads, head_dim}),
                     qkv_out.narrow(1, q_size + kv_size, kv_size).view({tokens, num_kv_heads, head_dim}),
                     key_caches[l], value_caches[l], slot_mapping);
      at::Tensor attention = at::empty({tokens, num_heads, head_dim}, qkv_out.options());
      vsup::paged_attention_decode(qkv_out.narrow(1, 0, q_size).view({tokens, num_heads, head_dim}), key_caches[l],
                                   value_caches[l], block_tables, seq_lens, scale, attention);
      hidden = packed_linear(attention.view({tokens, q_size}), o[l], nth(o_bias, l), o_bias.empty() ? linear : model);
      hidden = add_rms_norm(hidden, residual, post_norm[l], eps, linear);
      const at::Tensor gate_up_out = packed_linear(hidden, gate_up[l], std::nullopt, linear);
      at::Tensor activation = at::empty({tokens, gate_up_out.size(1) / 2}, gate_up_out.options());
      vsup::silu_and_mul(gate_up_out, activation);
      hidden = packed_linear(activation, down[l], std::nullopt, linear);
    }
    return {hidden.scalar_type() == model ? hidden : hidden.to(model), residual};
  }

  // The same linears on `tokens` rows of zeros, back to back with nothing between: the floor of a
  // decode step that bench/engine_decode.py measures a step against.
  void linears_alone(int64_t tokens) {
    const at::ScalarType linear = qkv[0].scalar_type();
    const at::Tensor x = at::zeros({tokens, input_norm[0].numel()}, input_norm[0].options().dtype(linear));
    const at::Tensor attention = at::zeros({tokens, num_heads * head_dim}, x.options());
    at::Tensor activation;
    for (size_t l = 0; l < input_norm.size(); ++l) {
      packed_linear(x, qkv[l], nth(qkv_bias, l), linear);
      packed_linear(attention, o[l], nth(o_bias, l), linear);
      const at::Tensor gate_up_out = packed_linear(x, gate_up[l], std::nullopt, linear);
      if (!activation.defined()) activation = at::zeros({tokens, gate_up_out.size(1) / 2}, x.options());
      packed_linear(activation, down[l], std::nullopt, linear);
    }
  }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(vsup_cpu, m) {
  m.class_<DecoderStack>("DecoderStack")
      .def(torch::init<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                       std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                       std::vector<at::Tensor>, std::vector<at::Tensor>, int64_t, int64_t, int64_t, double, double>())
      .def("forward", &DecoderStack::forward)
      .def("linears_alone", &DecoderStack::linears_alone);
}
