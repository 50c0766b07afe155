#pragma once

// Test helper: checks that a call throws consort::error with a given code and a message that
// mentions given facts.

#include <consort/error.hpp>

#include <gtest/gtest.h>

#include <exception>
#include <string>
#include <vector>

namespace consort::test {

/// Success when `fn()` throws `consort::error` with `code` and a message containing every one of
/// `fragments`; otherwise a failure that says what happened instead.
template <class F>
::testing::AssertionResult fails_with(F&& fn, errc code,
                                      const std::vector<std::string>& fragments) {
  try {
    fn();
  } catch (const error& e) {
    const std::string message = e.what();
    if (e.code() != code)
      return ::testing::AssertionFailure()
             << "threw errc::" << to_string(e.code()) << " instead of errc::" << to_string(code)
             << ": " << message;
    for (const auto& fragment : fragments)
      if (message.find(fragment) == std::string::npos)
        return ::testing::AssertionFailure()
               << "message \"" << message << "\" does not mention \"" << fragment << "\"";
    return ::testing::AssertionSuccess();
  } catch (const std::exception& e) {
    return ::testing::AssertionFailure() << "threw a non-consort exception: " << e.what();
  }
  return ::testing::AssertionFailure()
         << "did not throw (expected errc::" << to_string(code) << ")";
}

} // namespace consort::test
