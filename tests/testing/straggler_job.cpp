// straggler_job: a job whose worker SLOW computes PERCENT % longer than the others in every step,
// for the flight recorder's straggler and clock tests under tools/consort-launch
// (tests/testing/straggler_test.sh).
//
// Usage: CONSORT_DUMP_DIR=DIR straggler_job STEPS WORK_MS SLOW PERCENT
//
// Every worker runs STEPS steps; a step computes for WORK_MS ms (SLOW: WORK_MS * (1 + PERCENT /
// 100)), then makes two all-reduces of float32[256]. Each worker then writes its flight recorder
// to DIR (strategy.dump_flight_recorder). SLOW -1 is an even run.
//
// The computation is a sleep: it stands for the step's work, it waits for nothing (on a 2-core
// machine a busy loop in three processes would take the cores the transport needs).

#include <consort/consort.hpp>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <thread>

int main(int argc, char** argv) {
  using namespace std::chrono_literals;
  if (argc != 5) {
    std::cerr << "usage: straggler_job STEPS WORK_MS SLOW PERCENT" << std::endl;
    return 2;
  }
  const int steps = std::atoi(argv[1]);
  const double work_ms = std::atof(argv[2]);
  const int slow = std::atoi(argv[3]);
  const double percent = std::atof(argv[4]);
  consort::strategy_options opts;
  opts.collective_timeout = 30s;
  consort::multi_worker_mirrored_strategy s(opts);
  const double mine = s.worker_rank() == slow ? work_ms * (1 + percent / 100) : work_ms;
  const auto work = std::chrono::duration_cast<std::chrono::microseconds>(
      std::chrono::duration<double, std::milli>(mine));
  auto step = [work](consort::replica_context& ctx) {
    std::this_thread::sleep_for(work);
    auto x = ctx.all_reduce("SUM", consort::tensor::zeros(consort::dtype::float32, {256}));
    return ctx.all_reduce("SUM", x);
  };
  for (int i = 0; i < steps; ++i)
    s.run(step);
  // What this worker's recorder made of the last steps, live (strategy::stragglers).
  for (const auto& st : s.stragglers())
    std::printf("worker %d: straggler metric: %s last in %d of %d steps, %.2f ms late (%.0f %% of "
                "a step)%s\n",
                s.worker_rank(), st.worker.c_str(), st.last_steps, st.steps, st.late_ms,
                st.share * 100, st.named ? ", named" : "");
  // The chief's clock against this worker's, from the membership heartbeats: one host, so the
  // truth is 0, and the estimate must be within half its round trip's delay of it.
  const auto clock = s.chief_clock_offset();
  std::printf("worker %d: chief clock offset: %s, %lld ns, delay %lld ns, %llu round trips%s\n",
              s.worker_rank(), clock.known ? "known" : "unknown",
              static_cast<long long>(clock.offset_ns), static_cast<long long>(clock.delay_ns),
              static_cast<unsigned long long>(clock.samples),
              clock.known && std::llabs(clock.offset_ns) <= clock.delay_ns / 2 + 1000
                  ? " (within half the delay of 0)"
                  : "");
  std::fflush(stdout);
  std::cout << "worker " << s.worker_rank() << ": " << steps << " steps of "
            << static_cast<double>(work.count()) / 1000 << " ms; flight recorder written to "
            << s.dump_flight_recorder() << std::endl;
  return 0;
}
