// The host kernels' thread pool (device/parallel.hpp): every chunk runs exactly once, and the pool
// is as large as the CPUs the process may run on, not the machine's: a worker that the launcher
// binds to one core (tools/consort-launch --bind) gets no second thread to fight over it. CTest
// also runs the second test under `taskset -c 0` (core.parallel_threads_follow_affinity).

#include "device/parallel.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <cstddef>
#include <vector>

#include <sched.h>

namespace {

TEST(ParallelFor, RunsEveryChunkExactlyOnce) {
  constexpr size_t chunks = 1000;
  std::vector<std::atomic<int>> runs(chunks);
  consort::detail::parallel_for(chunks, [&](size_t i) { runs[i].fetch_add(1); });
  for (size_t i = 0; i < chunks; ++i)
    ASSERT_EQ(runs[i].load(), 1) << "chunk " << i;
}

TEST(ParallelFor, UsesAsManyThreadsAsTheProcessMayRunOnCpus) {
  cpu_set_t set;
  CPU_ZERO(&set);
  ASSERT_EQ(::sched_getaffinity(0, sizeof(set), &set), 0);
  EXPECT_EQ(consort::detail::parallel_threads(), static_cast<size_t>(CPU_COUNT(&set)));
}

} // namespace
