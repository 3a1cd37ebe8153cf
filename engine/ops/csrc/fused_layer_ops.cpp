// The small per-layer steps of a decoder on the CPU, each one pass over its rows in place: the
// residual add with the RMS norm after it, the rotary embedding of q and k, and SiLU(gate) * up.
// torch runs each as several ops of a few microseconds apiece, dozens a layer: at decode batch
// sizes that is time the GEMMs around them do not take. Float32, rows on torch's threads; the norms'
// and SiLU's rows may also be bfloat16 (the inputs and outputs of bfloat16 linears under a float32
// model, --linear-dtype bfloat16), converted as they are read and written, the math in float32.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "layer_ops.h"
#include "vec_math.h"

namespace {

// Rows per task: about this many elements each (torch's pointwise ops split at twice that). With
// 16x this grain, a decode batch of 64 ran its SiLU and norms on one thread while the other waited.
constexpr int64_t kGrainElements = 1 << 14;

int64_t grain_rows(int64_t row_elements) {
  return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, row_elements));
}

void check_rows(const at::Tensor& x, const char* what, bool bf16_too = false) {
  TORCH_CHECK(x.scalar_type() == at::kFloat || bf16_too && x.scalar_type() == at::kBFloat16, what,
              bf16_too ? ": float32 or bfloat16 only" : ": float32 only");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, what, ": [rows, size] with contiguous rows");
}

// f(x's first element, out's first element), each a float* or a vsup::BF16*
template <typename F>
void with_rows(const at::Tensor& x, const at::Tensor& out, F&& f) {
  vsup::with_element(x.scalar_type(), [&](auto in_type) {
    vsup::with_element(out.scalar_type(), [&](auto out_type) {
      f(static_cast<const decltype(in_type)*>(x.data_ptr()), static_cast<decltype(out_type)*>(out.data_ptr()));
    });
  });
}

// out = h / rms(h) * weight, one row
template <typename Out>
inline void scale_by_rms(const float* h, Out* out, const float* w, int64_t size, double eps) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < size; ++j) sum += h[j] * h[j];
  const float inv = 1.f / std::sqrt(sum / size + static_cast<float>(eps));
  for (int64_t j = 0; j < size; ++j) out[j] = vsup::narrow<Out>(h[j] * inv * w[j]);
}

}  // namespace

namespace vsup {

// residual += x; out = residual / rms(residual) * weight, rows of [T, hidden]; residual float32, x and
// out float32 or bfloat16, out may be x
void add_rms_norm_into(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps,
                       const at::Tensor& out) {
  check_rows(x, "x", true);
  check_rows(residual, "residual");
  check_rows(out, "out", true);
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous(), "weight: contiguous float32");
  const int64_t rows = x.size(0), size = x.size(1);
  TORCH_CHECK(residual.size(0) == rows && residual.size(1) == size && weight.numel() == size &&
                  out.size(0) == rows && out.size(1) == size,
              "shapes disagree");
  float* rp = residual.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  const int64_t xs = x.stride(0), rs = residual.stride(0), os = out.stride(0);
  with_rows(x, out, [&](const auto* xp, auto* op) {
    at::parallel_for(0, rows, grain_rows(size), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const auto* xi = xp + i * xs;
        float* ri = rp + i * rs;
        for (int64_t j = 0; j < size; ++j) ri[j] += vsup::widen(xi[j]);
        scale_by_rms(ri, op + i * os, w, size, eps);
      }
    });
  });
}

// residual += x; x = residual / rms(residual) * weight, rows of [T, hidden]
void add_rms_norm_(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps) {
  add_rms_norm_into(x, residual, weight, eps, x);
}

// x / rms(x) * weight, rows of [T, hidden] in float32, into a new tensor of `dtype` (float32 or bfloat16):
// the first layer's norm, whose input (the embedding) becomes the residual
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, at::ScalarType dtype) {
  check_rows(x, "x");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.numel() == x.size(1),
              "weight: contiguous float32 [hidden]");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "out: float32 or bfloat16");
  const int64_t rows = x.size(0), size = x.size(1);
  at::Tensor out = at::empty({rows, size}, x.options().dtype(dtype));
  const float* xp = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  const int64_t xs = x.stride(0);
  with_rows(x, out, [&](const auto*, auto* op) {  // (x is float32: checked above)
    at::parallel_for(0, rows, grain_rows(size), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        scale_by_rms(xp + i * xs, op + i * size, w, size, eps);
      }
    });
  });
  return out;
}

// Neox-style rotary embedding in place: x [T, heads, D] (heads contiguous in a row), cos and sin
// [T, D / 2] for each token's position; (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin).
void rotary_(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "float32 only");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "x [T, heads, D] with contiguous heads");
  const int64_t tokens = x.size(0), heads = x.size(1), half = x.size(2) / 2;
  TORCH_CHECK(x.size(2) % 2 == 0, "an even head_dim");
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == tokens && cos.size(1) == half && cos.stride(1) == 1 &&
                  sin.sizes() == cos.sizes() && sin.stride(1) == 1,
              "cos, sin [T, D / 2]");
  float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t xt = x.stride(0), xh = x.stride(1), cs = cos.stride(0), ss = sin.stride(0);
  at::parallel_for(0, tokens, grain_rows(heads * 2 * half), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cp + t * cs;
      const float* s = sp + t * ss;
      for (int64_t h = 0; h < heads; ++h) {
        float* x1 = xp + t * xt + h * xh;
        float* x2 = x1 + half;
        for (int64_t j = 0; j < half; ++j) {
          const float a = x1[j], b = x2[j];
          x1[j] = a * c[j] - b * s[j];
          x2[j] = b * c[j] + a * s[j];
        }
      }
    }
  });
}

// out [T, I] = silu(x[:, :I]) * x[:, I:], for x [T, 2 I] (the fused gate/up projection); each float32 or
// bfloat16
void silu_and_mul(const at::Tensor& x, const at::Tensor& out) {
  check_rows(x, "x", true);
  check_rows(out, "out", true);
  const int64_t rows = x.size(0), size = out.size(1);
  TORCH_CHECK(x.size(1) == 2 * size && out.size(0) == rows, "x [T, 2 I], out [T, I]");
  const int64_t xs = x.stride(0), os = out.stride(0);
  with_rows(x, out, [&](const auto* xp, auto* op) {
    using Out = std::remove_pointer_t<decltype(op)>;
    at::parallel_for(0, rows, grain_rows(size), [&](int64_t begin, int64_t end) {
      std::vector<float> e(size);
      for (int64_t i = begin; i < end; ++i) {
        const auto* __restrict gate = xp + i * xs;
        const auto* __restrict up = gate + size;
        Out* __restrict o = op + i * os;
        // silu(g) = g / (1 + e^-g), from e = e^-|g| so that exp never overflows
        for (int64_t j = 0; j < size; ++j) e[j] = vsup::exp_nonpositive(-std::fabs(vsup::widen(gate[j])));
        for (int64_t j = 0; j < size; ++j) {
          const float g = vsup::widen(gate[j]);
          o[j] = vsup::narrow<Out>((g >= 0.f ? g : g * e[j]) / (1.f + e[j]) * vsup::widen(up[j]));
        }
      }
    });
  });
}

}  // namespace vsup

TORCH_LIBRARY_FRAGMENT(vsup_cpu, m) {
  m.def("add_rms_norm_(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()", &vsup::add_rms_norm_);
  m.def("rotary_(Tensor(a!) x, Tensor cos, Tensor sin) -> ()", &vsup::rotary_);
  m.def("silu_and_mul(Tensor x, Tensor(a!) out) -> ()", &vsup::silu_and_mul);
}
