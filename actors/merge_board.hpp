#pragma once

// The rendezvous behind replica_context::merge_call (tf.distribute's ReplicaContext.merge_call):
// every local replica of a step brings its arguments; the last one to arrive runs the merge
// function once, on its own thread, with every replica's arguments; each replica returns its part
// of the result. One board per step (step_join owns it); merge calls are matched by their order
// of call within the step, as collectives are.

#include <consort/error.hpp>
#include <consort/nest.hpp>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <typeinfo>
#include <vector>

namespace consort::detail {

/// Thread safety: thread-safe.
class merge_board {
public:
  /// Runs the merge function: gets every local replica's arguments (in local order; one nest per
  /// argument), returns one result per local replica. May throw.
  using runner = std::function<std::vector<nest>(const std::vector<std::vector<nest>>& args)>;

  merge_board(uint64_t step, std::vector<int> replica_ids);

  /// Local replica `index`'s merge call `seq` (0, 1, ... within the step): waits for every local
  /// replica's call `seq`; the last to arrive calls `run` (theirs; the others' are never called)
  /// and every caller returns its own component. `signature` tells merge calls apart (the merge
  /// function's type): two replicas that bring different ones fail with
  /// error(collective_mismatch) naming both.
  /// @throws error(collective_timeout) when a peer has not called by `timeout` (counted from this
  ///         call; the peers' deadlines run from theirs), error(collective_aborted) when a peer
  ///         finished or failed its step without making the call, and the merge function's own
  ///         error (its code kept; a std::exception becomes step_failed) on every replica;
  ///         error(step_timeout) on a replica that waited `run_timeout` for a merge function that
  ///         has not returned (counted from its start; the step deadline: the function is user
  ///         code, bounded by nothing else).
  nest call(size_t index, uint32_t seq, std::vector<nest> args, const std::type_info& signature,
            const runner& run, std::chrono::milliseconds timeout,
            std::chrono::milliseconds run_timeout);

  /// Local replica `index` finished its step after `calls` merge calls (`failure`: empty when it
  /// returned normally, else why it failed): every merge call it never made fails at once with
  /// error(collective_aborted) on the replicas waiting in it.
  void finished(size_t index, uint32_t calls, const std::string& failure);

private:
  struct slot {
    std::vector<std::vector<nest>> args;
    std::vector<bool> arrived;
    size_t count = 0;
    const std::type_info* signature = nullptr;
    size_t signature_of = 0; ///< the local index that brought `signature`
    bool running = false;
    size_t runner_index = 0;
    std::chrono::steady_clock::time_point run_started;
    bool done = false;
    std::vector<nest> results;
    /// Set when the call failed for every replica: code and message.
    std::optional<std::pair<errc, std::string>> failure;
  };

  std::string where(uint32_t seq) const;
  /// Fails `s` for every replica (unless it is done or failed already) and wakes the waiters.
  void fail_locked(slot& s, errc code, std::string message);
  /// Fails `s` when a replica that has not brought its call finished its step already.
  void check_finished_locked(uint32_t seq, slot& s);

  uint64_t step_;
  std::vector<int> replica_ids_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<uint32_t, slot> slots_;
  /// Per local replica: -1 while it runs its step, else the merge calls it made.
  std::vector<int64_t> finished_calls_;
  std::vector<std::string> finish_failures_;
};

} // namespace consort::detail
