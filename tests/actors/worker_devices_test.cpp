// A worker's default devices (actors/worker_devices.hpp): every branch of the choice, for any
// number of GPUs, without a GPU (the choice is a function of what the process sees).

#include "actors/worker_devices.hpp"

#include "support/expect_error.hpp"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace consort {
namespace {

using detail::default_worker_devices;
using detail::worker_placement;
using test::fails_with;
using strings = std::vector<std::string>;

worker_placement alone() {
  return {};
}
worker_placement sharing(int index, int workers) {
  return {index, workers, false};
}
worker_placement owning(int index, int workers) {
  return {index, workers, true};
}

TEST(WorkerDevicesTest, WithoutAGpuTheWorkerTakesItsCountOfCpuReplicas) {
  EXPECT_EQ(default_worker_devices(0, nullptr, alone()).devices, strings{"CPU:0"});
  EXPECT_EQ(default_worker_devices(0, "", sharing(1, 4)).devices, strings{"CPU:0"});
  EXPECT_EQ(default_worker_devices(0, "3", sharing(2, 4)).devices,
            (strings{"CPU:0", "CPU:1", "CPU:2"}));
  EXPECT_EQ(default_worker_devices(0, "2", alone()).note, "");
}

TEST(WorkerDevicesTest, AWorkerWithItsOwnGpusTakesThemAllOrItsCount) {
  // Alone on its host (TF's MultiWorkerMirroredStrategy: every local GPU), or given its slice by
  // tools/consort-launch (CONSORT_OWN_GPUS) while three others run beside it.
  EXPECT_EQ(default_worker_devices(2, nullptr, alone()).devices, (strings{"GPU:0", "GPU:1"}));
  EXPECT_EQ(default_worker_devices(2, nullptr, owning(3, 4)).devices, (strings{"GPU:0", "GPU:1"}));
  EXPECT_EQ(default_worker_devices(4, "1", owning(1, 2)).devices, strings{"GPU:0"});
  EXPECT_TRUE(fails_with([] { default_worker_devices(1, "2", alone()); }, errc::invalid_argument,
                         {"CONSORT_DEVICES_PER_WORKER asks for 2 replicas and this worker sees 1 "
                          "GPU(s)",
                          "CUDA_VISIBLE_DEVICES=\"\""}));
}

TEST(WorkerDevicesTest, WorkersThatShareTheirHostsGpusTakeTheSliceOfTheirLocalRank) {
  // torchrun / mpirun on an 8-GPU node: every process sees every GPU.
  EXPECT_EQ(default_worker_devices(8, nullptr, sharing(3, 8)).devices, strings{"GPU:3"});
  EXPECT_EQ(default_worker_devices(8, nullptr, sharing(1, 4)).devices, (strings{"GPU:2", "GPU:3"}));
  EXPECT_EQ(default_worker_devices(8, "1", sharing(3, 4)).devices, strings{"GPU:3"});
  EXPECT_EQ(default_worker_devices(8, "2", sharing(3, 4)).devices, (strings{"GPU:6", "GPU:7"}));
  EXPECT_EQ(default_worker_devices(8, "2", sharing(3, 4)).note, "");
}

TEST(WorkerDevicesTest, TooFewSharedGpusForASliceEachGiveCpuReplicasAndSaySo) {
  // Three workers of one host and its one GPU (three TF_CONFIG tasks at 127.0.0.1): NCCL's ranks
  // cannot share a GPU, so CPU replicas, with a line that says why.
  auto choice = default_worker_devices(1, nullptr, sharing(2, 3));
  EXPECT_EQ(choice.devices, strings{"CPU:0"});
  EXPECT_EQ(choice.note,
            "3 workers on this host share its 1 GPU(s), too few for one each: CPU replicas (give "
            "each worker its own GPUs, or name the devices in multi_worker_options::devices)");
  choice = default_worker_devices(4, "3", sharing(0, 2));
  EXPECT_EQ(choice.devices, (strings{"CPU:0", "CPU:1", "CPU:2"}));
  EXPECT_NE(choice.note.find("too few for 3 each"), std::string::npos) << choice.note;
}

TEST(WorkerDevicesTest, AMalformedCountIsRefusedWithWhatIsExpected) {
  for (const char* bad : {"0", "-1", "two", "2x", "1025"})
    EXPECT_TRUE(fails_with([&] { default_worker_devices(0, bad, alone()); }, errc::invalid_argument,
                           {"CONSORT_DEVICES_PER_WORKER is \"" + std::string{bad} + "\"",
                            "expected the number of replicas of each worker, from 1 to 1024"}))
        << bad;
}

} // namespace
} // namespace consort
