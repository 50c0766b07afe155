#pragma once

// A GoogleTest fixture that runs CAF's deterministic test scheduler: actors only run when the
// test calls `run()`, and timeouts fire only when it calls `trigger_timeouts()`, so actor tests
// never sleep (actor-framework@0.17.6: libcaf_test/caf/test/dsl.hpp, test_coordinator_fixture).

#include "actors/protocol.hpp"

#include <caf/all.hpp>
#include <caf/scheduler/test_coordinator.hpp>

#include <gtest/gtest.h>

#include <memory>

namespace consort::test {

class test_coordinator_fixture : public ::testing::Test {
protected:
  test_coordinator_fixture() {
    configure_actor_system(cfg_);
    cfg_.set("scheduler.policy", caf::atom("testing"));
    cfg_.set("logger.file-verbosity", caf::atom("quiet"));
    sys_ = std::make_unique<caf::actor_system>(cfg_);
    sched_ = &dynamic_cast<caf::scheduler::test_coordinator&>(sys_->scheduler());
  }

  ~test_coordinator_fixture() override {
    // Without draining, ~actor_system() blocks forever on actors that still have work.
    do {
      sched_->run();
    } while (sched_->trigger_timeouts() > 0);
  }

  /// Runs every actor until no messages are left.
  void run() { sched_->run(); }

  /// Fires every pending timeout (delayed messages, request deadlines), then runs.
  void fire_timeouts() {
    sched_->trigger_timeouts();
    sched_->run();
  }

  caf::actor_system& sys() { return *sys_; }

  caf::actor_system_config cfg_;
  std::unique_ptr<caf::actor_system> sys_;
  caf::scheduler::test_coordinator* sched_ = nullptr;
};

} // namespace consort::test
