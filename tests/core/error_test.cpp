#include "support/expect_error.hpp"

#include <consort/error.hpp>

#include <gtest/gtest.h>

#include <set>
#include <stdexcept>
#include <string>

using consort::errc;

TEST(ErrorTest, ToStringNamesTheEnumerator) {
  EXPECT_STREQ(to_string(errc::none), "none");
  EXPECT_STREQ(to_string(errc::invalid_argument), "invalid_argument");
  EXPECT_STREQ(to_string(errc::shape_mismatch), "shape_mismatch");
  EXPECT_STREQ(to_string(errc::dtype_mismatch), "dtype_mismatch");
  EXPECT_STREQ(to_string(errc::structure_mismatch), "structure_mismatch");
  EXPECT_STREQ(to_string(errc::unknown_reduce_op), "unknown_reduce_op");
  EXPECT_STREQ(to_string(errc::unknown_device), "unknown_device");
  EXPECT_STREQ(to_string(errc::unsupported), "unsupported");
  EXPECT_STREQ(to_string(errc::collective_mismatch), "collective_mismatch");
  EXPECT_STREQ(to_string(errc::collective_timeout), "collective_timeout");
  EXPECT_STREQ(to_string(errc::collective_aborted), "collective_aborted");
  EXPECT_STREQ(to_string(errc::step_failed), "step_failed");
  EXPECT_STREQ(to_string(errc::step_timeout), "step_timeout");
  EXPECT_STREQ(to_string(errc::peer_lost), "peer_lost");
  EXPECT_STREQ(to_string(errc::shutdown), "shutdown");
  EXPECT_STREQ(to_string(errc::out_of_range), "out_of_range");
  EXPECT_STREQ(to_string(errc::wait_timeout), "wait_timeout");
  EXPECT_STREQ(to_string(errc::device_error), "device_error");
}

TEST(ErrorTest, EveryCodeHasADistinctName) {
  std::set<std::string> names;
  for (int i = 0; i <= static_cast<int>(errc::device_error); ++i)
    names.insert(to_string(static_cast<errc>(i)));
  EXPECT_EQ(names.size(), static_cast<size_t>(errc::device_error) + 1);
  EXPECT_EQ(names.count("unknown_errc"), 0u);
}

TEST(ErrorTest, ToStringOfAValueOutsideTheEnumIsUnknown) {
  EXPECT_STREQ(to_string(static_cast<errc>(200)), "unknown_errc");
}

TEST(ErrorTest, ThrowErrorCarriesCodeAndMessage) {
  EXPECT_TRUE(
      consort::test::fails_with([] { consort::throw_error(errc::peer_lost, "worker 3 is gone"); },
                                errc::peer_lost, {"worker 3 is gone"}));
}

TEST(ErrorTest, ErrorIsCatchableAsRuntimeError) {
  try {
    consort::throw_error(errc::shutdown, "stopped");
    FAIL() << "throw_error returned";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "stopped");
  }
}

TEST(ErrorTest, CodeIsKeptByCopies) {
  consort::error e{errc::step_timeout, "slow"};
  consort::error copy = e;
  EXPECT_EQ(copy.code(), errc::step_timeout);
  EXPECT_STREQ(copy.what(), "slow");
}
