#pragma once

// Faults and clock steps of a membership service, for tests (private to the library and its
// tests; the installed header has none of them).

#include "transport/membership/host_process.hpp"

#include <consort/transport/membership.hpp>

#include <cstdint>
#include <functional>

namespace consort::transport::membership {

class service_test_access {
public:
  /// Simulates a partition: from now on `s` sends nothing (no heartbeats), ignores every message
  /// it receives, and reports nothing, without closing its sockets. A suspended service cannot
  /// leave: `leave` and the destructor send no Leave and wait for nothing (its sockets close as a
  /// stopped process's do when it is killed).
  static void suspend(service& s);

  /// Runs the deadline checks now on the I/O thread (sending the heartbeats that are due) and
  /// returns once they ran, or at once when the service is stopped. The service runs them itself
  /// at least every 50 ms; a test that moves `options::clock` calls this after each move so that
  /// what the move made due happens before it goes on.
  static void check_deadlines(service& s);

  /// Simulates `kill -9`: closes every socket at once without Leave. The service reports nothing
  /// afterwards; a pending `rendezvous` fails with `shutdown`.
  static void crash(service& s);

  /// Replaces how `s` reads the state of a silent peer's process on this host (the default reads
  /// /proc: host_process.hpp). Call before the service's peers can fall silent.
  static void set_host_probe(service& s, std::function<host_process(uint32_t pid)> probe);
};

} // namespace consort::transport::membership
