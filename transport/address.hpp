#pragma once

// "host:port" text and Asio endpoints, shared by the TCP transport (transport/tcp) and the
// membership service (transport/membership). Internal to the library.

#include <utility> // Boost 1.74's Asio needs <utility> before it on C++20

#include <boost/asio/ip/tcp.hpp>

#include <chrono>
#include <string>

namespace consort::transport {

struct host_port {
  std::string host;
  std::string port;
};

/// Splits "host:port" or "[v6 address]:port" (brackets removed); returns why not on failure.
std::string split_address(const std::string& text, host_port& out);

/// "1.2.3.4:5" or "[::1]:5".
std::string endpoint_text(const boost::asio::ip::tcp::endpoint& ep);

/// "250 ms".
std::string ms_text(std::chrono::milliseconds ms);

} // namespace consort::transport
