#pragma once

// Small helpers shared by the tests that drive strategies through the public API.

#include <consort/dataset.hpp>
#include <consort/error.hpp>
#include <consort/ops.hpp>
#include <consort/strategy.hpp>

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace consort::test {

/// {"CPU:0", ..., "CPU:n-1"}.
inline std::vector<std::string> cpus(int n) {
  std::vector<std::string> out;
  for (int i = 0; i < n; ++i)
    out.push_back("CPU:" + std::to_string(i));
  return out;
}

/// Runs `fn` and returns the consort::error it throws (code `none` when it throws nothing).
template <class F>
error error_of(F&& fn) {
  try {
    fn();
  } catch (const error& e) {
    return e;
  }
  return error(errc::none, "no error");
}

/// Whether the error's message contains `fragment`.
inline bool contains(const error& e, const std::string& fragment) {
  return std::string(e.what()).find(fragment) != std::string::npos;
}

/// Expects `fn` to throw consort::error with `code` and a message containing `fragment`.
template <class F>
void expect_error(errc code, const std::string& fragment, F&& fn) {
  auto e = error_of(std::forward<F>(fn));
  EXPECT_EQ(e.code(), code) << "expected consort::error(" << to_string(code) << "), got "
                            << to_string(e.code()) << ": " << e.what();
  EXPECT_TRUE(contains(e, fragment))
      << "message \"" << e.what() << "\" lacks \"" << fragment << "\"";
}

/// Runs one step per global batch of `dist` that all-reduces the sum of each replica's batch (a
/// 1-D float tensor), and returns the total over the steps: every element once.
inline float sum_over_steps(strategy& s, const distributed_dataset& dist) {
  float total = 0;
  for (per_replica<nest> batch : dist) {
    auto sums = s.run(
        [](replica_context& ctx, const nest& b) {
          return ctx.all_reduce("SUM", reduce_axis(reduce_op::sum, b.as_tensor(), 0));
        },
        batch);
    total += sums[0].item<float>();
  }
  return total;
}

} // namespace consort::test
