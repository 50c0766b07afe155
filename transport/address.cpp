#include "transport/address.hpp"

#include <algorithm>

namespace consort::transport {

std::string split_address(const std::string& text, host_port& out) {
  auto colon = text.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == text.size())
    return "\"" + text + "\" is not host:port";
  out.host = text.substr(0, colon);
  out.port = text.substr(colon + 1);
  if (out.host.size() >= 2 && out.host.front() == '[' && out.host.back() == ']')
    out.host = out.host.substr(1, out.host.size() - 2);
  if (out.port.size() > 5 ||
      !std::all_of(out.port.begin(), out.port.end(), [](char c) { return c >= '0' && c <= '9'; }) ||
      std::stoul(out.port) > 65535)
    return "\"" + text + "\" has no valid port (0-65535)";
  return {};
}

std::string endpoint_text(const boost::asio::ip::tcp::endpoint& ep) {
  auto addr = ep.address();
  auto host = addr.to_string();
  if (addr.is_v6())
    host = "[" + host + "]";
  return host + ":" + std::to_string(ep.port());
}

std::string ms_text(std::chrono::milliseconds ms) {
  return std::to_string(ms.count()) + " ms";
}

} // namespace consort::transport
