// The liveness check's view of a process on this host (transport/membership/host_process.hpp),
// on real child processes: one that sleeps, one that spins, one stopped, one gone.

#include "transport/membership/host_process.hpp"

#include <utility> // Boost 1.74's Asio needs <utility> before it on C++20

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <functional>
#include <thread>

#include <sys/wait.h>
#include <unistd.h>

namespace consort::transport::membership {
namespace {

using namespace std::chrono_literals;

/// A child process running `body` (async-signal-safe calls only: it is a fork of a threaded
/// process); killed and reaped at the end.
class child {
public:
  explicit child(void (*body)()) : pid_(::fork()) {
    if (pid_ == 0) {
      body();
      ::_exit(0);
    }
  }
  ~child() { end(); }
  uint32_t pid() const { return static_cast<uint32_t>(pid_); }
  void end() {
    if (pid_ <= 0)
      return;
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }

private:
  pid_t pid_;
};

/// Polls the probe until it says `want`, for at most 10 s (a new child first runs, then sleeps
/// or spins; a kill takes effect when the kernel gets to it).
bool becomes(uint32_t pid, host_process want) {
  const auto until = std::chrono::steady_clock::now() + 10s;
  while (probe_host_process(pid) != want) {
    if (std::chrono::steady_clock::now() >= until)
      return false;
    std::this_thread::yield();
  }
  return true;
}

TEST(HostProcess, TellsASleepingProcessFromASpinningOneAStoppedOneAndOneGone) {
  child sleeper([] {
    for (;;)
      ::pause();
  });
  child spinner([] {
    std::atomic<unsigned long> turns{0};
    for (;;)
      turns.fetch_add(1, std::memory_order_relaxed);
  });
  EXPECT_TRUE(becomes(sleeper.pid(), host_process::asleep));
  // Spinning, it is running or waiting for a CPU: held up, as a starved process is.
  EXPECT_TRUE(becomes(spinner.pid(), host_process::held_up));
  ::kill(static_cast<pid_t>(spinner.pid()), SIGSTOP);
  EXPECT_TRUE(becomes(spinner.pid(), host_process::stopped));
  // Killed and not reaped yet (a zombie), then reaped: gone either way.
  ::kill(static_cast<pid_t>(sleeper.pid()), SIGKILL);
  EXPECT_TRUE(becomes(sleeper.pid(), host_process::gone));
  const auto pid = sleeper.pid();
  sleeper.end();
  EXPECT_EQ(probe_host_process(pid), host_process::gone);
  EXPECT_EQ(probe_host_process(0), host_process::gone);
  EXPECT_STREQ(to_string(host_process::held_up), "held up");
}

TEST(HostProcess, APeerOverLoopbackIsOnThisHostAndAClosedSocketIsNot) {
  boost::asio::io_context io;
  boost::asio::ip::tcp::acceptor acceptor(io, {boost::asio::ip::make_address("127.0.0.1"), 0});
  boost::asio::ip::tcp::socket client(io), server(io);
  client.connect(acceptor.local_endpoint());
  acceptor.accept(server);
  EXPECT_TRUE(peer_on_this_host(client));
  EXPECT_TRUE(peer_on_this_host(server));
  client.close();
  EXPECT_FALSE(peer_on_this_host(client));
}

} // namespace
} // namespace consort::transport::membership
