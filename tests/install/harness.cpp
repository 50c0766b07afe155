// The consumer check of consort::testing (tools/check_install.sh): a service's test written
// against the installed <consort/testing.hpp>: two workers all-reduce, then one is killed and the
// other's next collective fails with peer_lost naming it. Exits 0 only when both hold.

#include <consort/consort.hpp>
#include <consort/testing.hpp>

#include <chrono>
#include <iostream>
#include <string>

int main() {
  using namespace std::chrono_literals;
  try {
    consort::testing::cluster c({.workers = 2, .replicas_per_worker = 2, .seed = 1});
    auto step = [](consort::replica_context& ctx) {
      return ctx.all_reduce("SUM", consort::tensor::scalar<float>(1.0f));
    };
    auto runs = c.run_all(step);
    for (auto& f : runs) {
      auto result = f.get();
      for (const auto& v : result.values())
        if (v.item<float>() != 4.0f) {
          std::cerr << "harness: FAILED: the sum is " << v.item<float>() << ", expected 4\n";
          return 1;
        }
    }
    c.kill(1);
    auto after = c.strategy(0).run_async(step);
    if (!after.wait_for(30s)) {
      std::cerr << "harness: FAILED: the collective after the kill did not end within 30 s\n";
      return 1;
    }
    try {
      after.get();
      std::cerr << "harness: FAILED: the collective after the kill succeeded\n";
      return 1;
    } catch (const consort::error& e) {
      if (e.code() != consort::errc::peer_lost ||
          std::string{e.what()}.find("worker:1") == std::string::npos) {
        std::cerr << "harness: FAILED: expected peer_lost naming worker:1, got "
                  << consort::to_string(e.code()) << ": " << e.what() << "\n";
        return 1;
      }
    }
    std::cout << "harness: 2 workers summed 4; after killing worker 1, worker 0 got peer_lost"
              << std::endl;
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "harness: FAILED: " << e.what() << "\n";
    return 1;
  }
}
