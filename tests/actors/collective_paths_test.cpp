// The collective paths' set-up that runs without a GPU (actors/collective_paths.hpp): which
// layouts get their NCCL communicators built when the strategy starts. Building them needs a
// GPU; tests/device/gpu_strategy_test.cpp covers that on a GPU machine.

#include "actors/collective_paths.hpp"

#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <vector>

namespace consort::detail {
namespace {

using namespace std::chrono_literals;

TEST(PrepareLocalNccl, OnlyDistinctGpusInLocalOrderAreALayoutForNccl) {
  EXPECT_EQ(local_nccl_gpus({"GPU:0"}), (std::vector<int>{0}));
  EXPECT_EQ(local_nccl_gpus({"GPU:2", "GPU:0", "GPU:1"}), (std::vector<int>{2, 0, 1}));
  EXPECT_EQ(local_nccl_gpus({"gpu:1"}), (std::vector<int>{1}));
  for (const auto& devices : std::vector<std::vector<std::string>>{
           {}, {"CPU:0"}, {"CPU:0", "CPU:1"}, {"GPU:0", "CPU:0"}, {"GPU:0", "GPU:0"}}) {
    EXPECT_TRUE(local_nccl_gpus(devices).empty()) << devices.size() << " replicas";
    collective_board board;
    std::string why;
    EXPECT_FALSE(prepare_local_nccl(board, devices, 100ms, &why)) << devices.size() << " replicas";
    EXPECT_EQ(board.nccl, nullptr);
    EXPECT_EQ(why, "") << "no build is tried for this layout";
  }
}

TEST(PrepareLocalNccl, DistinctGpusThatCannotBeUsedLeaveTheFirstCallToBuildThem) {
  // Without CUDA, and on every machine (no process sees a GPU 900), nothing is built and nothing
  // is thrown: the first collective then tries again and reports why, as before.
  collective_board board;
  std::string why;
  EXPECT_FALSE(prepare_local_nccl(board, {"GPU:900", "GPU:901"}, 100ms, &why));
  EXPECT_EQ(board.nccl, nullptr);
  // The reason the first call will meet too: no such GPU here, or no NCCL in this build.
  EXPECT_TRUE(why.find("GPU:900") != std::string::npos || why.find("no NCCL") != std::string::npos)
      << why;
}

} // namespace
} // namespace consort::detail
