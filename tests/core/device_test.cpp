#include "support/expect_error.hpp"

#include <consort/device.hpp>

#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

using consort::device_kind;
using consort::device_spec;
using consort::errc;
using consort::parse_device;
using consort::test::fails_with;

TEST(DeviceTest, ParsesEveryAcceptedSpelling) {
  const std::vector<std::pair<std::string, device_spec>> cases = {
      {"CPU:0", {device_kind::cpu, 0}},
      {"cpu:0", {device_kind::cpu, 0}},
      {"CPU:12", {device_kind::cpu, 12}},
      {"GPU:1", {device_kind::gpu, 1}},
      {"gpu:3", {device_kind::gpu, 3}},
      {"/device:GPU:1", {device_kind::gpu, 1}},
      {"/device:cpu:2", {device_kind::cpu, 2}},
      {"/gpu:1", {device_kind::gpu, 1}},
      {"/cpu:0", {device_kind::cpu, 0}},
      {"/job:worker/replica:0/task:1/device:CPU:0", {device_kind::cpu, 0}},
      {"/job:localhost/replica:0/task:0/device:GPU:2", {device_kind::gpu, 2}},
      {"/job:worker/task:1/device:CPU:4", {device_kind::cpu, 4}},
      {"/job:chief/cpu:1", {device_kind::cpu, 1}},
  };
  for (const auto& [name, expected] : cases) {
    SCOPED_TRACE(name);
    EXPECT_EQ(parse_device(name), expected);
  }
}

TEST(DeviceTest, ToStringIsCanonical) {
  EXPECT_EQ((device_spec{device_kind::cpu, 0}).to_string(), "CPU:0");
  EXPECT_EQ((device_spec{device_kind::gpu, 7}).to_string(), "GPU:7");
  EXPECT_EQ(parse_device("/job:worker/replica:0/task:1/device:cpu:3").to_string(), "CPU:3");
  EXPECT_EQ(parse_device("/gpu:1").to_string(), "GPU:1");
}

TEST(DeviceTest, EqualityComparesKindAndIndex) {
  EXPECT_EQ((device_spec{device_kind::cpu, 1}), (device_spec{device_kind::cpu, 1}));
  EXPECT_NE((device_spec{device_kind::cpu, 1}), (device_spec{device_kind::gpu, 1}));
  EXPECT_NE((device_spec{device_kind::cpu, 1}), (device_spec{device_kind::cpu, 2}));
}

TEST(DeviceTest, RejectsAnUnknownKindSayingWhatIsExpected) {
  EXPECT_TRUE(fails_with([] { parse_device("TPU:0"); }, errc::unknown_device,
                         {"\"TPU:0\"", "TPU", "CPU:<i>", "GPU:<i>"}));
}

TEST(DeviceTest, RejectsMalformedNamesQuotingThem) {
  for (std::string bad :
       {"", "CPU", "CPU:", "CPU:-1", "CPU:x", "CPU:1x", "CPU: 1", "CPU:+1", "CPU:0:1", ":0",
        "CPU:99999999999", "/job:worker/replica:0/task:1", "/job:worker/replica:x/device:CPU:0",
        "/job:/device:CPU:0", "/device:TPU:0", "/", "//CPU:0", "device:CPU:0:0"}) {
    SCOPED_TRACE(bad);
    EXPECT_TRUE(fails_with([&] { parse_device(bad); }, errc::unknown_device,
                           {"\"" + bad + "\"", "expected"}));
  }
}

TEST(DeviceTest, NegativeIndexMessageExplainsTheIndexRule) {
  EXPECT_TRUE(fails_with([] { parse_device("CPU:-1"); }, errc::unknown_device,
                         {"\"-1\"", "non-negative integer"}));
}

TEST(DeviceTest, EmptyNameMessageSaysItIsEmpty) {
  EXPECT_TRUE(fails_with([] { parse_device(""); }, errc::unknown_device, {"empty"}));
}
