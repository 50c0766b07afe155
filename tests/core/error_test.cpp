#include "support/expect_error.hpp"

#include <consort/error.hpp>

#include "core/report.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

using consort::errc;

// Every enumerator with its name, in declaration order. to_string's switch has no default, so
// the build (-Wswitch, -Werror in CI) fails when an enumerator has no name; the tests below fail
// when one is named but missing here.
namespace {
const std::vector<std::pair<errc, std::string>> every_code = {
    {errc::none, "none"},
    {errc::invalid_argument, "invalid_argument"},
    {errc::shape_mismatch, "shape_mismatch"},
    {errc::dtype_mismatch, "dtype_mismatch"},
    {errc::structure_mismatch, "structure_mismatch"},
    {errc::unknown_reduce_op, "unknown_reduce_op"},
    {errc::unknown_device, "unknown_device"},
    {errc::unsupported, "unsupported"},
    {errc::collective_mismatch, "collective_mismatch"},
    {errc::collective_timeout, "collective_timeout"},
    {errc::collective_aborted, "collective_aborted"},
    {errc::step_failed, "step_failed"},
    {errc::step_timeout, "step_timeout"},
    {errc::peer_lost, "peer_lost"},
    {errc::shutdown, "shutdown"},
    {errc::out_of_range, "out_of_range"},
    {errc::wait_timeout, "wait_timeout"},
    {errc::device_error, "device_error"},
    {errc::peer_left, "peer_left"},
    {errc::membership_changed, "membership_changed"},
    {errc::data_loss, "data_loss"},
    {errc::io_error, "io_error"},
};
} // namespace

TEST(ErrorTest, ToStringNamesTheEnumerator) {
  for (const auto& [code, name] : every_code)
    EXPECT_EQ(to_string(code), name);
}

TEST(ErrorTest, EveryValueWithANameIsListedAndTheNamesAreDistinct) {
  // Every one of the 256 values of the underlying type: the named ones are exactly the table's,
  // in order, with no gap (an enumerator added to errc and to_string but not to the table fails).
  std::set<std::string> names;
  size_t named = 0;
  for (int i = 0; i < 256; ++i) {
    std::string name = to_string(static_cast<errc>(i));
    if (name == "unknown_errc")
      continue;
    ASSERT_LT(static_cast<size_t>(i), every_code.size())
        << "errc value " << i << " (" << name << ") is missing from every_code";
    EXPECT_EQ(static_cast<int>(every_code[static_cast<size_t>(i)].first), i) << name;
    names.insert(name);
    ++named;
  }
  EXPECT_EQ(named, every_code.size());
  EXPECT_EQ(names.size(), every_code.size());
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

TEST(ReportOnce, SaysTheCauseOfTheExceptionBeingHandledOnceAndNeverThrows) {
  std::atomic<bool> once{false};
  testing::internal::CaptureStderr();
  for (int i = 0; i < 3; ++i) {
    try {
      throw consort::error(errc::device_error, "cudaEventRecord failed: an illegal address");
    } catch (...) {
      consort::detail::report_once(once, "releasing a GPU block");
    }
  }
  std::string said = testing::internal::GetCapturedStderr();
  EXPECT_EQ(said, "consort: releasing a GPU block: cudaEventRecord failed: an illegal address "
                  "(reported once)\n");
  EXPECT_TRUE(once.load());
}

TEST(ReportOnce, TakesACauseAsTextAndNamesAnUnknownException) {
  std::atomic<bool> first{false}, second{false};
  testing::internal::CaptureStderr();
  consort::detail::report_once(first, "aborting", "ncclSystemError");
  try {
    throw 42;
  } catch (...) {
    consort::detail::report_once(second, "freeing");
  }
  EXPECT_EQ(testing::internal::GetCapturedStderr(),
            "consort: aborting: ncclSystemError (reported once)\n"
            "consort: freeing: an exception that is not a std::exception (reported once)\n");
}
