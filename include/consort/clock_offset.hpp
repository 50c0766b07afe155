#pragma once

// How far the chief's wall clock is from a worker's (docs/debugging.md, "One timeline for the
// whole job").

#include <cstdint>

namespace consort {

/// The chief's wall clock against this process's, from the membership's round trips (the view
/// echoes the worker's Join, and every heartbeat of the chief echoes the worker's last one; NTP's
/// rule: of the last 16 round trips, the one of the least delay). Add `offset_ns` to a time of this
/// process's system clock to put it on the chief's.
struct clock_offset {
  /// Whether a round trip completed yet (the chief, and a lone worker, know theirs: 0).
  bool known = false;
  /// The chief's wall clock minus this process's, in ns.
  int64_t offset_ns = 0;
  /// The round trip the estimate comes from, less the time the chief held it (ns): the estimate
  /// is within half of it of the truth.
  int64_t delay_ns = 0;
  /// Round trips measured so far.
  uint64_t samples = 0;
};

} // namespace consort
