#pragma once

// What a worker's flight recorder makes of the workers' arrivals at their collectives over the
// last steps (`strategy::stragglers`, docs/debugging.md "Stragglers").

#include <string>

namespace consort {

/// One worker, over the last `steps` steps (at most `strategy_options::straggler_steps`, 20)
/// that had collectives between workers. A step's straggler is the worker that entered its
/// collectives last, by more than `strategy_options::straggler_share` (5 %) of the step's length
/// after the worker before it (summed over the step's collectives, on the chief's clock); a worker
/// that is it in more than half of the window's steps is named.
struct straggler_stat {
  /// Its task, e.g. "worker:1".
  std::string worker;
  /// Steps of the window in which it was the straggler.
  int last_steps = 0;
  /// Steps in the window.
  int steps = 0;
  /// Over those steps, the mean of how late it entered (ms), and of that as a share of the step.
  double late_ms = 0;
  double share = 0;
  /// Whether it was named a straggler (once named, it stays named).
  bool named = false;
};

} // namespace consort
