// Small math that vectorizes, shared by the kernels of this folder.

#pragma once

#include <c10/core/ScalarType.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>

namespace vsup {

// exp(x) for x <= 0 (scores minus their maximum), within about 2 ulp: exp(x) = 2^n e^r with
// n = round(x / ln 2), |r| <= ln 2 / 2, e^r by its Taylor series to r^7. Unlike std::exp it
// vectorizes: the softmax of a long context would otherwise spend more time in exp than in the dots.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.f);  // below this 2^n is no longer a normal float; e^-87 is 0 to a softmax
  const float n = std::floor(x * 1.44269504f + 0.5f);
  const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
  float p = 1.f / 5040;
  p = p * r + 1.f / 720;
  p = p * r + 1.f / 120;
  p = p * r + 1.f / 24;
  p = p * r + 1.f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  return p * std::bit_cast<float>((static_cast<int32_t>(n) + 127) << 23);  // 2^n
}

// bfloat16 is float32's upper half: widening is exact, narrowing rounds to nearest even (as torch
// does; a NaN stays a NaN). Kernels whose rows may be either take `float` or `BF16` element pointers.
using BF16 = uint16_t;

inline float widen(float x) { return x; }
inline float widen(BF16 x) { return std::bit_cast<float>(static_cast<uint32_t>(x) << 16); }

// f(T{}) with T the element type of rows of `dtype`: float, or BF16 for bfloat16
template <typename F>
void with_element(c10::ScalarType dtype, F&& f) {
  if (dtype == c10::kBFloat16) {
    f(BF16{});
  } else {
    f(float{});
  }
}

template <typename T>
inline T narrow(float x);
template <>
inline float narrow<float>(float x) {
  return x;
}
template <>
inline BF16 narrow<BF16>(float x) {
  const uint32_t u = std::bit_cast<uint32_t>(x);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return static_cast<BF16>((u & 0x7fffffffu) > 0x7f800000u ? (u >> 16) | 0x40u : rounded);
}

}  // namespace vsup
