#pragma once

// Wall-clock upper bounds in tests that scale with the tier they run in.
//
// A test that checks "it returned at once, not at the deadline" needs an upper bound on wall
// time. Under ASan and TSan with 3 test jobs on 2 cores, work runs 5-20x slower than in the plain
// build, so a bound that is generous there (1 s) can fail for no bug. tools/sanitize.sh sets
// CONSORT_TEST_TIME_SCALE (10); `scaled(d)` is d times that factor (1 when it is unset). Write a
// bound as `deadline + scaled(margin)` where the deadline itself is what is being tested. In the
// plain tier a bound keeps its full meaning ("well before the 10 s deadline"); in the sanitizer
// tiers a scaled bound may reach the deadline it guards, and then it still catches a wait that
// never ends, not one that ended at the deadline: the plain tier, which runs every test, holds
// that line.

#include <chrono>
#include <cstdlib>

namespace consort::test {

/// CONSORT_TEST_TIME_SCALE when it is a number from 1 to 100, else 1.
inline double time_scale() {
  static const double scale = [] {
    const char* text = std::getenv("CONSORT_TEST_TIME_SCALE");
    if (text == nullptr || *text == '\0')
      return 1.0;
    char* end = nullptr;
    double v = std::strtod(text, &end);
    return (*end == '\0' && v >= 1 && v <= 100) ? v : 1.0;
  }();
  return scale;
}

/// `d` times the tier's factor, as a steady_clock duration.
template <class Rep, class Period>
std::chrono::steady_clock::duration scaled(std::chrono::duration<Rep, Period> d) {
  return std::chrono::duration_cast<std::chrono::steady_clock::duration>(
      std::chrono::duration<double, std::nano>(d) * time_scale());
}

} // namespace consort::test
