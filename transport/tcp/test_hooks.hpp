#pragma once

// Hooks for tests that make a race of the TCP transport deterministic (private to the library
// and its tests; a production context has none).

#include <consort/transport/tcp.hpp>

#include <functional>

namespace consort::transport::tcp {

struct test_hooks {
  /// Called before each read from the socket of `peer` (on whichever thread reads it; it may
  /// block, e.g. to play a slow receiver, which holds up that thread).
  std::function<void(int peer)> before_read;
  /// Called by `close` once every goodbye is written and this side is half-closed.
  std::function<void()> after_goodbye;
  /// Called on the context's poller thread for each readiness event of `peer`'s socket (the
  /// poller was woken for it; see pair.hpp `reading_here`).
  std::function<void(int peer)> on_readiness;
};

/// `listen(opts)` with `hooks` installed.
caf::expected<std::shared_ptr<context>> listen(const mesh_options& opts, test_hooks hooks);

} // namespace consort::transport::tcp
