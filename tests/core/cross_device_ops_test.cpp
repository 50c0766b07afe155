#include "support/expect_error.hpp"

#include <consort/config.hpp>
#include <consort/cross_device_ops.hpp>

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

using consort::cross_device_ops;
using consort::errc;
using consort::per_replica;
using consort::reduce_op;
using consort::reduction_to_one_device;
using consort::tensor;
using consort::test::fails_with;

namespace {

per_replica<tensor> values(std::vector<std::vector<float>> components) {
  std::vector<tensor> out;
  for (auto& c : components)
    out.push_back(tensor::from<float>(c));
  return per_replica<tensor>{std::move(out)};
}

} // namespace

TEST(CrossDeviceOpsTest, ReducePlacesOneResultOnEveryDestination) {
  reduction_to_one_device ops;
  auto out = ops.reduce(reduce_op::sum, values({{1, 2}, {3, 4}, {5, 6}}), {"CPU:0", "cpu:1"});
  ASSERT_EQ(out.size(), 2u);
  EXPECT_EQ(out[0], tensor::from<float>({9, 12}));
  EXPECT_EQ(out[0].device(), "CPU:0");
  EXPECT_EQ(out[1].device(), "CPU:1");
  // Host memory is shared, so the result is computed once.
  EXPECT_TRUE(out[0].shares_storage_with(out[1]));
}

TEST(CrossDeviceOpsTest, ReduceAcceptsOpNames) {
  const cross_device_ops& ops = reduction_to_one_device{};
  auto out = ops.reduce("mean", values({{1}, {2}}), {"/job:worker/replica:0/task:0/device:CPU:0"});
  EXPECT_EQ(out[0].item<float>(), 1.5f);
  EXPECT_EQ(out[0].device(), "CPU:0");
  EXPECT_TRUE(fails_with([&] { ops.reduce("average", values({{1}}), {"CPU:0"}); },
                         errc::unknown_reduce_op, {"\"average\"", "SUM"}));
}

TEST(CrossDeviceOpsTest, ReduceRejectsBadDestinations) {
  reduction_to_one_device ops;
  auto v = values({{1}});
  EXPECT_TRUE(fails_with([&] { ops.reduce(reduce_op::sum, v, {}); }, errc::invalid_argument,
                         {"at least one destination"}));
#if CONSORT_WITH_CUDA
  // No machine has 1000 GPUs: the error names the device and how many GPUs there are.
  EXPECT_TRUE(fails_with(
      [&] {
        ops.reduce(reduce_op::sum, v, {"CPU:0", "GPU:999"});
      },
      errc::unknown_device, {"GPU:999", "GPU"}));
#else
  EXPECT_TRUE(fails_with(
      [&] {
        ops.reduce(reduce_op::sum, v, {"CPU:0", "GPU:0"});
      },
      errc::unsupported, {"GPU:0", "CUDA"}));
#endif
  EXPECT_TRUE(fails_with([&] { ops.reduce(reduce_op::sum, v, {"TPU:0"}); }, errc::unknown_device,
                         {"TPU:0"}));
}

TEST(CrossDeviceOpsTest, ReduceRejectsBadValuesNamingTheReplica) {
  reduction_to_one_device ops;
  EXPECT_TRUE(fails_with(
      [&] {
        ops.reduce(reduce_op::sum, values({{1, 2}, {1}}), {"CPU:0"});
      },
      errc::shape_mismatch, {"replica 1", "[1]", "[2]"}));
  EXPECT_TRUE(fails_with([&] { ops.reduce(reduce_op::sum, per_replica<tensor>{}, {"CPU:0"}); },
                         errc::invalid_argument, {"at least one"}));
}

TEST(CrossDeviceOpsTest, BatchReduceReducesEachPair) {
  reduction_to_one_device ops;
  auto out = ops.batch_reduce(reduce_op::max, {{values({{1, 5}, {3, 2}}), {"CPU:0"}},
                                               {values({{7}, {4}}), {"CPU:0", "CPU:1"}}});
  ASSERT_EQ(out.size(), 2u);
  EXPECT_EQ(out[0][0], tensor::from<float>({3, 5}));
  ASSERT_EQ(out[1].size(), 2u);
  EXPECT_EQ(out[1][1].item<float>(), 7.f);
  EXPECT_EQ(out[1][1].device(), "CPU:1");
}

TEST(CrossDeviceOpsTest, BatchReduceNamesThePairThatFails) {
  reduction_to_one_device ops;
  EXPECT_TRUE(fails_with(
      [&] {
        ops.batch_reduce(reduce_op::sum, {{values({{1}}), {"CPU:0"}}, {values({{1}}), {}}});
      },
      errc::invalid_argument, {"pair 1", "destination"}));
}

TEST(CrossDeviceOpsTest, BroadcastSharesTheValueWithEveryDestination) {
  std::unique_ptr<cross_device_ops> ops = std::make_unique<reduction_to_one_device>();
  auto value = tensor::from<float>({1, 2});
  auto out = ops->broadcast(value, {"CPU:0", "CPU:2"});
  ASSERT_EQ(out.size(), 2u);
  EXPECT_TRUE(out[0].shares_storage_with(value));
  EXPECT_TRUE(out[1].shares_storage_with(value));
  EXPECT_EQ(out[1].device(), "CPU:2");
}

TEST(CrossDeviceOpsTest, BroadcastRejectsBadDestinationsAndInvalidValues) {
  reduction_to_one_device ops;
  auto value = tensor::from<float>({1});
  EXPECT_TRUE(fails_with([&] { ops.broadcast(value, {}); }, errc::invalid_argument,
                         {"at least one destination"}));
#if CONSORT_WITH_CUDA
  EXPECT_TRUE(
      fails_with([&] { ops.broadcast(value, {"GPU:999"}); }, errc::unknown_device, {"GPU:999"}));
#else
  EXPECT_TRUE(fails_with([&] { ops.broadcast(value, {"GPU:1"}); }, errc::unsupported, {"GPU:1"}));
#endif
  EXPECT_TRUE(fails_with([&] { ops.broadcast(tensor{}, {"CPU:0"}); }, errc::invalid_argument,
                         {"default-constructed"}));
}
