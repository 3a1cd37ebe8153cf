// The small per-layer steps of a decoder on the CPU, each one pass over its rows in place: the
// residual add with the RMS norm after it, the rotary embedding of q and k, and SiLU(gate) * up.
// torch runs each as several ops of a few microseconds apiece, dozens a layer: at decode batch
// sizes that is time the GEMMs around them do not take. Float32; rows on torch's threads.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>

#include "layer_ops.h"
#include "vec_math.h"

namespace {

// Rows per task: about this many elements each. torch's pointwise ops split at 32768; these stay
// on the calling thread up to 8x that, which covers decode batches: a parallel region saves
// microseconds there, and when other work shares the cores it can cost a whole time slice.
constexpr int64_t kGrainElements = 1 << 18;

int64_t grain_rows(int64_t row_elements) {
  return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, row_elements));
}

void check_rows(const at::Tensor& x, const char* what) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, what, ": float32 only");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, what, ": [rows, size] with contiguous rows");
}

// out = h / rms(h) * weight, one row
inline void scale_by_rms(const float* h, float* out, const float* w, int64_t size, double eps) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < size; ++j) sum += h[j] * h[j];
  const float inv = 1.f / std::sqrt(sum / size + static_cast<float>(eps));
  for (int64_t j = 0; j < size; ++j) out[j] = h[j] * inv * w[j];
}

}  // namespace

namespace vsup {

// residual += x; x = residual / rms(residual) * weight, rows of [T, hidden]
void add_rms_norm_(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous(), "weight: contiguous float32");
  const int64_t rows = x.size(0), size = x.size(1);
  TORCH_CHECK(residual.size(0) == rows && residual.size(1) == size && weight.numel() == size, "shapes disagree");
  float* xp = x.data_ptr<float>();
  float* rp = residual.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  const int64_t xs = x.stride(0), rs = residual.stride(0);
  at::parallel_for(0, rows, grain_rows(size), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* xi = xp + i * xs;
      float* ri = rp + i * rs;
      for (int64_t j = 0; j < size; ++j) ri[j] += xi[j];
      scale_by_rms(ri, xi, w, size, eps);
    }
  });
}

// x / rms(x) * weight, rows of [T, hidden], into a new tensor: the first layer's norm, whose input
// (the embedding) becomes the residual
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.numel() == x.size(1),
              "weight: contiguous float32 [hidden]");
  const int64_t rows = x.size(0), size = x.size(1);
  at::Tensor out = at::empty({rows, size}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  const int64_t xs = x.stride(0);
  at::parallel_for(0, rows, grain_rows(size), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      scale_by_rms(xp + i * xs, op + i * size, w, size, eps);
    }
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

// out [T, I] = silu(x[:, :I]) * x[:, I:], for x [T, 2 I] (the fused gate/up projection)
void silu_and_mul(const at::Tensor& x, const at::Tensor& out) {
  check_rows(x, "x");
  check_rows(out, "out");
  const int64_t rows = x.size(0), size = out.size(1);
  TORCH_CHECK(x.size(1) == 2 * size && out.size(0) == rows, "x [T, 2 I], out [T, I]");
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs = x.stride(0), os = out.stride(0);
  at::parallel_for(0, rows, grain_rows(size), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* __restrict gate = xp + i * xs;
      const float* __restrict up = gate + size;
      float* __restrict o = op + i * os;
      // silu(g) = g / (1 + e^-g), from e = e^-|g| so that exp never overflows
      for (int64_t j = 0; j < size; ++j) o[j] = vsup::exp_nonpositive(-std::fabs(gate[j]));
      for (int64_t j = 0; j < size; ++j) {
        const float g = gate[j], e = o[j];
        o[j] = (g >= 0.f ? g : g * e) / (1.f + e) * up[j];
      }
    }
  });
}

}  // namespace vsup

TORCH_LIBRARY_FRAGMENT(vsup_cpu, m) {
  m.def("add_rms_norm_(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()", &vsup::add_rms_norm_);
  m.def("rotary_(Tensor(a!) x, Tensor cos, Tensor sin) -> ()", &vsup::rotary_);
  m.def("silu_and_mul(Tensor x, Tensor(a!) out) -> ()", &vsup::silu_and_mul);
}
