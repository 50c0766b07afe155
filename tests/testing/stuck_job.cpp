// stuck_job: a job whose worker STUCK stops calling collectives after N of them, for the
// flight recorder's end-to-end test under tools/consort-launch (tests/testing/CMakeLists.txt).
//
// Usage: tools/consort-launch -n 3 --dump-dir DIR -- stuck_job N STUCK
//
// Every worker runs N steps of one all-reduce; then worker STUCK hangs (it waits, at most 60 s,
// without calling anything, as a worker stuck in its own code would), and every other worker's
// next all-reduce times out after 3000 ms. A waiting worker prints the error it caught and exits
// 1; the launcher then asks the stuck worker for its dump (SIGUSR1) and prints its diagnosis.
//
// Expected output (times vary):
//   [worker:0] all_reduce #101 (float32[256], all_reduce(SUM) call #0 of step 100) timed out after
//   3000 ms: worker:1 never called it; its last collective was #100 at step 99, 3004 ms ago. ...
//   diagnosis: worker:1 is behind: it never called collective #101 ...

#include <consort/consort.hpp>

#include <chrono>
#include <cstdlib>
#include <iostream>
#include <thread>

int main(int argc, char** argv) {
  using namespace std::chrono_literals;
  if (argc != 3) {
    std::cerr << "usage: stuck_job N STUCK" << std::endl;
    return 2;
  }
  const int steps = std::atoi(argv[1]);
  const int stuck = std::atoi(argv[2]);
  consort::strategy_options opts;
  opts.collective_timeout = 3s;
  consort::multi_worker_mirrored_strategy s(opts);
  auto step = [](consort::replica_context& ctx) {
    return ctx.all_reduce("SUM", consort::tensor::zeros(consort::dtype::float32, {256}));
  };
  for (int i = 0; i < steps; ++i)
    s.run(step);
  if (s.worker_rank() == stuck) {
    // Hung in its own code: the launcher stops it once the others have failed.
    std::this_thread::sleep_for(60s);
    return 0;
  }
  try {
    s.run(step);
  } catch (const consort::error& e) {
    std::cout << e.what() << std::endl;
    return 1;
  }
  std::cout << "the collective after worker " << stuck << " stopped did not fail" << std::endl;
  return 0;
}
