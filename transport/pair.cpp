#include <consort/transport/pair.hpp>

namespace consort::transport {

caf::error wait_all(const std::vector<operation_ptr>& ops, deadline until) {
  caf::error first;
  for (const auto& op : ops) {
    if (!op)
      continue;
    auto err = op->wait(until);
    if (err && !first)
      first = std::move(err);
  }
  return first;
}

} // namespace consort::transport
