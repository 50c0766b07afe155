// The flight recorder's lock (actors/flight_recorder.hpp): mutual exclusion, under TSan too
// (tools/sanitize.sh runs this suite there), and try_lock's answer while it is held.

#include "actors/flight_recorder.hpp"

#include <gtest/gtest.h>

#include <mutex>
#include <thread>

namespace consort::detail {
namespace {

TEST(SpinMutex, TwoThreadsNeverHoldItAtOnce) {
  spin_mutex mu;
  long counter = 0; // not atomic: the lock alone orders the writes
  constexpr int per_thread = 100'000;
  auto add = [&] {
    for (int i = 0; i < per_thread; ++i) {
      std::lock_guard<spin_mutex> guard{mu};
      ++counter;
    }
  };
  std::thread other{add};
  add();
  other.join();
  EXPECT_EQ(counter, 2L * per_thread);
}

TEST(SpinMutex, TryLockFailsWhileItIsHeldAndSucceedsOnceItIsFree) {
  spin_mutex mu;
  ASSERT_TRUE(mu.try_lock());
  bool taken = true;
  std::thread other{[&] {
    taken = mu.try_lock();
  }};
  other.join();
  EXPECT_FALSE(taken);
  mu.unlock();
  EXPECT_TRUE(mu.try_lock());
  mu.unlock();
}

} // namespace
} // namespace consort::detail
