#pragma once

// A TCP port on 127.0.0.1 that was free a moment ago (the kernel's choice for an ephemeral bind),
// for tests that run two workers of a multi_worker_mirrored_strategy in one process.

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <utility> // Boost 1.74's Asio needs <utility> before it on C++20

namespace consort::test {

inline int free_port() {
  boost::asio::io_context io;
  boost::asio::ip::tcp::acceptor acceptor(
      io, boost::asio::ip::tcp::endpoint(boost::asio::ip::make_address("127.0.0.1"), 0));
  return acceptor.local_endpoint().port();
}

} // namespace consort::test
