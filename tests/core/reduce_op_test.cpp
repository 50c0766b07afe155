#include "support/expect_error.hpp"

#include <consort/reduce_op.hpp>

#include <gtest/gtest.h>

#include <string>

using consort::errc;
using consort::parse_reduce_op;
using consort::reduce_op;
using consort::test::fails_with;

TEST(ReduceOpTest, ToStringUsesTensorFlowSpelling) {
  EXPECT_STREQ(to_string(reduce_op::sum), "SUM");
  EXPECT_STREQ(to_string(reduce_op::mean), "MEAN");
  EXPECT_STREQ(to_string(reduce_op::min), "MIN");
  EXPECT_STREQ(to_string(reduce_op::max), "MAX");
  EXPECT_STREQ(to_string(reduce_op::prod), "PROD");
}

TEST(ReduceOpTest, ParseIsCaseInsensitive) {
  EXPECT_EQ(parse_reduce_op("sum"), reduce_op::sum);
  EXPECT_EQ(parse_reduce_op("Sum"), reduce_op::sum);
  EXPECT_EQ(parse_reduce_op("SUM"), reduce_op::sum);
  EXPECT_EQ(parse_reduce_op("mEaN"), reduce_op::mean);
  EXPECT_EQ(parse_reduce_op("min"), reduce_op::min);
  EXPECT_EQ(parse_reduce_op("Max"), reduce_op::max);
  EXPECT_EQ(parse_reduce_op("prod"), reduce_op::prod);
}

TEST(ReduceOpTest, ParseRoundTripsEveryOp) {
  for (auto op : {reduce_op::sum, reduce_op::mean, reduce_op::min, reduce_op::max, reduce_op::prod})
    EXPECT_EQ(parse_reduce_op(to_string(op)), op);
}

TEST(ReduceOpTest, ParseRejectsAnUnknownNameQuotingItAndListingTheValidNames) {
  EXPECT_TRUE(fails_with([] { parse_reduce_op("avg"); }, errc::unknown_reduce_op,
                         {"\"avg\"", "SUM", "MEAN", "MIN", "MAX", "PROD"}));
}

TEST(ReduceOpTest, ParseRejectsEmptyPaddedAndPrefixNames) {
  for (std::string bad : {"", " sum", "sum ", "su", "summ", "SUM\n"}) {
    SCOPED_TRACE(bad);
    EXPECT_TRUE(
        fails_with([&] { parse_reduce_op(bad); }, errc::unknown_reduce_op, {"\"" + bad + "\""}));
  }
}
