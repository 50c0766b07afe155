#pragma once

// Which tf.distribute context the calling thread is in. A replica's thread is in *replica context*
// while it runs a step function, and in *cross-replica context* again while it runs the function
// of a `replica_context::merge_call`; every other thread is in cross-replica context. The public
// API checks it where tf.distribute does: Strategy.run, reduce, gather and
// experimental_local_results need cross-replica context, and a replica's collectives may not be
// called from inside merge_call's function (its peers wait in merge_call, not in the collective).

#include <cstdint>

namespace consort::detail {

enum class context_kind : uint8_t { cross_replica, replica, merge };

/// The calling thread's context, and the replica and step it belongs to (replica and merge only).
struct thread_context {
  context_kind kind = context_kind::cross_replica;
  int replica_id = -1;
  uint64_t step = 0;
};

/// The calling thread's context.
const thread_context& current_context() noexcept;

/// Sets the calling thread's context for the scope's lifetime and restores the previous one.
class context_scope {
public:
  explicit context_scope(thread_context ctx) noexcept;
  ~context_scope();
  context_scope(const context_scope&) = delete;
  context_scope& operator=(const context_scope&) = delete;

private:
  thread_context previous_;
};

/// @throws error(invalid_argument) naming `call` (e.g. "strategy.reduce") when the calling thread
/// is in replica context.
void require_cross_replica_context(const char* call);

/// @throws error(invalid_argument) naming `call` (e.g. "replica_context::all_reduce") when the
/// calling thread runs a merge_call's function.
void require_not_in_merge(const char* call);

} // namespace consort::detail
