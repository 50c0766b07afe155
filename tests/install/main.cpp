// The consumer check run by tools/check_install.sh: built against consort as a package or as a
// subdirectory (see CMakeLists.txt), it uses the public headers (the generated config.hpp and the
// Asio bridge included) and runs a 2-replica mirrored strategy. It exits 0 only when the results
// are right.

#include <consort/asio.hpp> // needs Boost's headers through consort::consort
#include <consort/config.hpp>
#include <consort/consort.hpp>

#include <boost/asio/use_future.hpp>

#include <chrono>
#include <cstdint>
#include <future>
#include <iostream>
#include <optional>

int main() {
  using namespace std::chrono_literals;
  try {
    consort::mirrored_strategy strategy({"CPU:0", "CPU:1"});
    auto step = [](consort::replica_context& ctx) {
      return consort::tensor::scalar<int32_t>(ctx.replica_id_in_sync_group() + 1);
    };
    // Blocking: 1 + 2.
    auto sum = strategy.reduce("SUM", strategy.run(step), std::nullopt).item<int32_t>();
    // Asynchronous, through an Asio completion token: MEAN of int32 is float64 1.5.
    auto pending = consort::async_get(strategy.run_async(step), boost::asio::use_future);
    if (pending.wait_for(30s) != std::future_status::ready) {
      std::cerr << "consumer: FAILED: the asynchronous step did not finish within 30 s\n";
      return 1;
    }
    auto mean = strategy.reduce("MEAN", pending.get(), std::nullopt);
    bool ok = sum == 3 && mean.dtype() == consort::dtype::float64 && mean.item<double>() == 1.5;
    std::cout << "consumer: consort " << CONSORT_VERSION << ", " << strategy.name() << " with "
              << strategy.num_replicas_in_sync() << " replicas: SUM = " << sum
              << " (expected 3), MEAN = " << mean.to_string() << " (expected float64 1.5) -> "
              << (ok ? "OK" : "FAILED") << '\n';
    return ok ? 0 : 1;
  } catch (const consort::error& e) {
    std::cerr << "consumer: FAILED with consort::error (" << consort::to_string(e.code())
              << "): " << e.what() << '\n';
  }
  return 1;
}
