#pragma once

// float16 / bfloat16 tensors in tests: made from floats (each rounded once to the 16-bit type)
// and read back as floats.

#include <consort/tensor.hpp>

#include <vector>

namespace consort::test {

/// A 1-D tensor of H (float16_t or bfloat16_t) holding each of `values` rounded to H.
template <class H>
tensor half_tensor(const std::vector<float>& values) {
  std::vector<H> v;
  v.reserve(values.size());
  for (float x : values)
    v.push_back(H(x));
  return tensor::from<H>(v);
}

/// The elements of a tensor of H, as floats (exact).
template <class H>
std::vector<float> floats_of(const tensor& t) {
  std::vector<float> out;
  for (auto h : t.to_vector<H>())
    out.push_back(static_cast<float>(h));
  return out;
}

} // namespace consort::test
