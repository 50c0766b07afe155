#pragma once

// Test helpers for the transport tests: readable checks of caf::error results, a capture of log
// lines that tests wait on (with a deadline, never a sleep), and a plain TCP socket that plays a
// broken, hostile or hand-made peer (every read has a deadline), and a TCP group in one process.

#include "transport/tcp/test_hooks.hpp"

#include <consort/error.hpp>
#include <consort/transport/tcp.hpp>

#include <caf/atom.hpp>
#include <caf/error.hpp>
#include <caf/message.hpp>

#include <utility> // Boost 1.74's Asio needs <utility> before it on C++20

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/write.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include <poll.h>
#include <sys/socket.h>

namespace consort::test {

// -- errors --------------------------------------------------------------------------------------

/// "errc::<code>: <message>" of a consort error, for failure messages.
inline std::string text_of(const caf::error& err) {
  if (!err)
    return "no error";
  std::string out;
  if (err.category() == caf::atom("consort"))
    out = std::string("errc::") + to_string(static_cast<errc>(err.code()));
  else
    out = "a non-consort error";
  const auto& ctx = err.context();
  if (ctx.size() == 1 && ctx.match_element<std::string>(0))
    out += ": " + ctx.get_as<std::string>(0);
  return out;
}

/// Success when `err` has `code` and its message mentions every fragment.
inline ::testing::AssertionResult has_error(const caf::error& err, errc code,
                                            const std::vector<std::string>& fragments) {
  if (!err)
    return ::testing::AssertionFailure() << "no error (expected errc::" << to_string(code) << ")";
  auto text = text_of(err);
  if (err.category() != caf::atom("consort") || static_cast<errc>(err.code()) != code)
    return ::testing::AssertionFailure()
           << "expected errc::" << to_string(code) << ", got " << text;
  for (const auto& fragment : fragments)
    if (text.find(fragment) == std::string::npos)
      return ::testing::AssertionFailure()
             << "\"" << text << "\" does not mention \"" << fragment << "\"";
  return ::testing::AssertionSuccess();
}

// -- logs --------------------------------------------------------------------------------------

/// Collects log lines; must outlive the services that write to it.
class log_capture {
public:
  std::function<void(const std::string&)> sink() {
    return [this](const std::string& line) {
      std::lock_guard lock(mu_);
      lines_.push_back(line);
      cv_.notify_all();
    };
  }

  /// Whether a line that mentions every fragment arrives within `timeout`.
  bool wait_for(const std::vector<std::string>& fragments,
                std::chrono::milliseconds timeout = std::chrono::seconds(10)) {
    std::unique_lock lock(mu_);
    return cv_.wait_for(lock, timeout, [&] {
      return std::any_of(lines_.begin(), lines_.end(), [&](const std::string& line) {
        return std::all_of(fragments.begin(), fragments.end(),
                           [&](const std::string& f) { return line.find(f) != std::string::npos; });
      });
    });
  }

  std::string all() {
    std::lock_guard lock(mu_);
    std::string out;
    for (const auto& line : lines_)
      out += line + "\n";
    return out;
  }

private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::string> lines_;
};

// -- a raw peer ----------------------------------------------------------------------------------

/// A plain blocking socket connected to `host:port`, for tests that speak a protocol by hand.
class raw_socket {
public:
  raw_socket(const std::string& host, uint16_t port) : socket_(io_) {
    socket_.connect({boost::asio::ip::make_address(host), port});
  }

  /// Connects to "host:port".
  explicit raw_socket(const std::string& address)
      : raw_socket(address.substr(0, address.rfind(':')),
                   static_cast<uint16_t>(std::stoi(address.substr(address.rfind(':') + 1)))) {}

  uint16_t local_port() const { return socket_.local_endpoint().port(); }

  void write(std::span<const std::byte> data) {
    boost::asio::write(socket_, boost::asio::buffer(data.data(), data.size()));
  }

  /// A 32-bit little-endian integer (a length prefix).
  void write_u32(uint32_t v) {
    std::byte b[4];
    for (int i = 0; i < 4; ++i)
      b[i] = static_cast<std::byte>((v >> (8 * i)) & 0xff);
    write(b);
  }

  /// Fills `out`; false when the peer closes first or `timeout` passes.
  bool read_exact(std::span<std::byte> out,
                  std::chrono::milliseconds timeout = std::chrono::seconds(10)) {
    auto until = std::chrono::steady_clock::now() + timeout;
    std::size_t got = 0;
    while (got < out.size()) {
      auto left = remaining(until);
      if (left.count() <= 0)
        return false;
      pollfd p{socket_.native_handle(), POLLIN, 0};
      if (::poll(&p, 1, static_cast<int>(left.count())) <= 0)
        continue;
      auto n = ::recv(socket_.native_handle(), out.data() + got, out.size() - got, 0);
      if (n <= 0)
        return false;
      got += static_cast<std::size_t>(n);
    }
    return true;
  }

  /// Whether the other end closes the connection within `timeout` (reading and dropping data).
  bool closed_by_peer(std::chrono::milliseconds timeout = std::chrono::seconds(10)) {
    auto until = std::chrono::steady_clock::now() + timeout;
    std::byte buf[4096];
    for (;;) {
      auto left = remaining(until);
      if (left.count() <= 0)
        return false;
      pollfd p{socket_.native_handle(), POLLIN, 0};
      if (::poll(&p, 1, static_cast<int>(left.count())) <= 0)
        continue;
      auto n = ::recv(socket_.native_handle(), buf, sizeof buf, 0);
      if (n <= 0)
        return true; // end of file or reset
    }
  }

  /// Ends the sending direction (the peer reads end of file); reading goes on.
  void shutdown_write() { ::shutdown(socket_.native_handle(), SHUT_WR); }

  void close() {
    boost::system::error_code ignored;
    socket_.close(ignored);
  }

private:
  static std::chrono::milliseconds remaining(std::chrono::steady_clock::time_point until) {
    return std::chrono::duration_cast<std::chrono::milliseconds>(until -
                                                                 std::chrono::steady_clock::now());
  }

  boost::asio::io_context io_;
  boost::asio::ip::tcp::socket socket_;
};

// -- a TCP group in one process ------------------------------------------------------------------

/// Sets a rank's mesh options before it listens.
using mesh_tweak = std::function<void(int rank, transport::tcp::mesh_options&)>;
/// Sets a rank's test hooks (transport/tcp/test_hooks.hpp) before it listens.
using hooks_tweak = std::function<void(int rank, transport::tcp::test_hooks&)>;

/// A group of `n` connected TCP contexts on ephemeral loopback ports (listen, then connect in
/// parallel); a failed rank is a test failure and leaves an empty vector.
inline std::vector<std::shared_ptr<transport::tcp::context>>
make_tcp_mesh(int n, const mesh_tweak& tweak = {}, const hooks_tweak& hook = {}) {
  using namespace std::chrono_literals;
  std::vector<std::shared_ptr<transport::tcp::context>> ctxs(static_cast<std::size_t>(n));
  std::vector<std::string> addresses(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r) {
    transport::tcp::mesh_options opts;
    opts.rank = r;
    opts.size = n;
    opts.listen_address = "127.0.0.1:0";
    opts.group_id = 11;
    opts.connect_timeout = 20s;
    if (tweak)
      tweak(r, opts);
    transport::tcp::test_hooks hooks;
    if (hook)
      hook(r, hooks);
    auto ctx = transport::tcp::listen(opts, std::move(hooks));
    if (!ctx) {
      ADD_FAILURE() << "listen of rank " << r << ": " << text_of(ctx.error());
      return {};
    }
    ctxs[static_cast<std::size_t>(r)] = *ctx;
    addresses[static_cast<std::size_t>(r)] = (*ctx)->listen_address();
  }
  std::vector<std::future<caf::error>> joins;
  for (int r = 0; r < n; ++r)
    joins.push_back(std::async(std::launch::async, [&, r] {
      return ctxs[static_cast<std::size_t>(r)]->connect(addresses);
    }));
  for (int r = 0; r < n; ++r) {
    auto err = joins[static_cast<std::size_t>(r)].get();
    EXPECT_FALSE(err) << "rank " << r << ": " << text_of(err);
  }
  return ctxs;
}

} // namespace consort::test
