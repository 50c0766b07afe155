#pragma once

// A small pool of host threads for kernels over large buffers. One core cannot saturate the
// memory bus on this class of machine, and the threads that wait for a collective's result are
// blocked anyway, so large reductions are split into chunks that the calling thread and the
// pool's threads take in turn.

#include <cstddef>
#include <functional>

namespace consort::detail {

/// Runs `fn(i)` for every i in [0, chunks), on the calling thread and up to one pool thread
/// fewer than the CPUs the process may run on (its affinity; started on first use), and returns
/// when all are done. Chunks are handed out dynamically, so a slow thread takes fewer. Calls from
/// several threads at once are served one after another. `fn` must not throw.
///
/// Thread safety: thread-safe.
void parallel_for(size_t chunks, const std::function<void(size_t)>& fn);

/// Number of threads `parallel_for` uses, the caller included.
size_t parallel_threads() noexcept;

} // namespace consort::detail
