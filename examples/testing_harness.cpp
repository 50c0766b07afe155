// testing_harness: how a service tests its own use of consort with consort::testing, a cluster
// of workers in one process over a simulated network (docs/testing.md). The "service" here is a
// training step that averages every replica's gradient across workers; its tests check what a
// user of the service sees when one replica's step fails, when a worker dies in the middle of a
// run, and when a peer goes silent until a deadline passes. The 30 s deadline passes in
// simulated time: the whole program takes a fraction of a second (it says how long on stderr).
//
// Usage:
//   ./build/examples/testing_harness
//
// Expected output:
//   healthy: 3 workers x 2 replicas averaged the gradient to 3.5 on every worker
//   failing replica: worker 1 failed with step_failed: <...>bad batch on replica 3<...>
//   failing replica: worker 0 failed with collective_aborted: <...>replica 3 failed the step<...>
//   failing replica: no worker hangs
//   killed worker: worker 0 failed with peer_lost naming worker:2
//   killed worker: worker 1 failed with peer_lost naming worker:2
//   killed worker: no message left worker 2 after it died
//   silent peer: worker 0 still waits after 29 s of simulated time
//   silent peer: worker 0 failed with collective_timeout after 31 s of simulated time

#include <consort/consort.hpp>
#include <consort/testing.hpp>

#include <chrono>
#include <iostream>
#include <stdexcept>
#include <string>

using namespace consort;
using namespace std::chrono_literals;

namespace {

/// The service under test: one training step whose gradient (here: replica id + 1, or a throw
/// for a bad batch) is averaged over every replica of every worker.
auto gradient_step(int bad_replica = -1) {
  return [bad_replica](replica_context& ctx) {
    const int id = ctx.replica_id_in_sync_group();
    if (id == bad_replica)
      throw std::runtime_error("bad batch on replica " + std::to_string(id));
    return ctx.all_reduce("MEAN", tensor::scalar<float>(static_cast<float>(id + 1)));
  };
}

/// "step_failed: ..." for a failed future, "ok" otherwise (the future has ended).
template <class Future>
std::string outcome(Future& f) {
  try {
    f.get();
    return "ok";
  } catch (const error& e) {
    return std::string{to_string(e.code())} + ": " + e.what();
  }
}

template <class Future>
std::string code_of(Future& f) {
  auto text = outcome(f);
  return text.substr(0, text.find(':'));
}

} // namespace

int main() {
  // 1. The healthy path: every worker gets the mean of 1..6.
  {
    testing::cluster c({.workers = 3, .replicas_per_worker = 2, .seed = 1});
    auto runs = c.run_all(gradient_step());
    bool all = true;
    for (auto& f : runs) {
      auto result = f.get();
      for (const auto& v : result.values())
        all = all && v.item<float>() == 3.5f;
    }
    std::cout << "healthy: 3 workers x 2 replicas averaged the gradient to "
              << (all ? "3.5 on every worker" : "a WRONG value") << std::endl;
  }

  // 2. One replica's step throws: its worker reports the step's error, and tells the other
  //    worker, whose all-reduce fails at once with collective_aborted naming the cause.
  {
    testing::cluster_options opts;
    opts.workers = 2;
    opts.replicas_per_worker = 2;
    opts.strategy.collective_timeout = 30s;
    testing::cluster c(opts);
    auto runs = c.run_all(gradient_step(3));
    std::cout << "failing replica: worker 1 failed with " << outcome(runs[1]) << std::endl;
    bool ended = runs[0].wait_for(10s);
    std::cout << "failing replica: worker 0 failed with " << (ended ? outcome(runs[0]) : "-")
              << std::endl;
    std::cout << "failing replica: " << (ended ? "no worker hangs" : "worker 0 HANGS") << std::endl;
  }

  // 3. A worker dies while the others are in an all-reduce.
  {
    testing::cluster c({.workers = 3, .replicas_per_worker = 1, .seed = 3});
    auto f0 = c.strategy(0).run_async(gradient_step());
    auto f1 = c.strategy(1).run_async(gradient_step());
    const auto before = c.messages().size();
    c.kill(2);
    for (auto* f : {&f0, &f1}) {
      auto text = outcome(*f);
      std::cout << "killed worker: worker " << (f == &f0 ? 0 : 1) << " failed with "
                << text.substr(0, text.find(':'))
                << (text.find("worker:2") != std::string::npos ? " naming worker:2"
                                                               : " NOT naming worker:2")
                << std::endl;
    }
    bool quiet = true;
    auto log = c.messages();
    for (size_t i = before; i < log.size(); ++i)
      quiet = quiet && !(log[i].from == 2 && log[i].what == testing::fate::delivered);
    std::cout << "killed worker: "
              << (quiet ? "no message left worker 2 after it died" : "worker 2 SENT after death")
              << std::endl;
  }

  // 4. A peer goes silent (its messages are lost, its connection stays up): the caller's
  //    collective deadline, 30 s, passes in simulated time.
  {
    testing::cluster_options opts;
    opts.workers = 2;
    opts.strategy.collective_timeout = 30s;
    opts.peer_timeout = 1h; // heartbeats still flow: only the data is lost
    testing::cluster c(opts);
    c.on_message([](const testing::message& m) {
      return m.from == 1 ? testing::verdict::drop() : testing::verdict::deliver();
    });
    const auto started = std::chrono::steady_clock::now();
    auto f0 = c.strategy(0).run_async(gradient_step());
    auto f1 = c.strategy(1).run_async(gradient_step());
    // The deadline counts from when worker 0's collective begins: wait until it waits.
    if (!c.wait_blocked(0))
      std::cout << "silent peer: worker 0 NEVER WAITED" << std::endl;
    c.advance(29s);
    std::cout << "silent peer: worker 0 "
              << (f0.wait_for(50ms) ? "ENDED EARLY" : "still waits after 29 s of simulated time")
              << std::endl;
    c.advance(2s);
    std::cout << "silent peer: worker 0 failed with " << code_of(f0)
              << " after 31 s of simulated time" << std::endl;
    f1.wait_for(10s);
    // The wall time this took (milliseconds, as no clock was waited on) goes to stderr: it
    // depends on the machine's load, and the expected output above holds only what cannot.
    std::cerr << "silent peer: 31 s of simulated time took "
              << std::chrono::duration_cast<std::chrono::milliseconds>(
                     std::chrono::steady_clock::now() - started)
                     .count()
              << " ms of wall time" << std::endl;
  }
  return 0;
}
