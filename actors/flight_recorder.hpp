#pragma once

// The flight recorder: a ring of the last N collectives of one worker (and its step starts and
// ends, and membership events), kept on every worker by default, so that a hang or a desync can be
// explained after the fact (docs/debugging.md). Each collective gets a job-wide number: the
// cross-worker calls run one at a time on the communicator's step lane, in the same order on every
// worker, so the n-th is the same call everywhere. An entry holds the number, step and sequence,
// the signature (kept compact: kind, op, the first leaf's dtype and up to 4 extents, the leaf
// count and the bytes; text is made only when dumped), the local replica, the enqueue, start and
// end times, the state, and, for a call between workers, which workers' descriptors had arrived.
//
// What it costs a call: one clock read (its end; the start is the call's own reading, which the
// call's deadline counts from too, and its entry time on the system clock derives from it), two
// locks of an uncontended spin lock (three of each for a call of several local replicas, which
// also records when its turn on the lane comes) and a copy into a preallocated entry; nothing is
// allocated and no text is made
// (bench/strategy_collective_bench measures it; bench/README.md, "The flight recorder's cost").
//
// Thread safety: thread-safe; `mu_` guards the ring and the counters. The arrival mask of an entry
// is an atomic that the descriptor exchange sets without the lock.

#include <consort/collective_kind.hpp>
#include <consort/error.hpp>
#include <consort/reduce_op.hpp>
#include <consort/stragglers.hpp>
#include <consort/tensor.hpp>

#include <caf/error.hpp>

#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace consort::transport {
struct call_lateness;
} // namespace consort::transport

namespace consort::detail {

struct call_signature;

/// A lock for short critical sections on a hot path: an uncontended lock is one exchange and an
/// unlock one store (a pthread mutex is two atomic read-modify-writes and two calls). A waiter
/// spins a little, then yields its core, so a long holder (a dump formatting the ring) costs the
/// others no more than a mutex would.
class spin_mutex {
public:
  void lock() noexcept {
    for (int spins = 0; locked_.exchange(true, std::memory_order_acquire);)
      while (locked_.load(std::memory_order_relaxed))
        if (++spins > 64)
          std::this_thread::yield();
  }
  bool try_lock() noexcept { return !locked_.exchange(true, std::memory_order_acquire); }
  void unlock() noexcept { locked_.store(false, std::memory_order_release); }

private:
  std::atomic<bool> locked_{false};
};

/// A collective's signature as the recorder keeps it (no allocation).
struct flight_signature {
  collective_kind kind = collective_kind::all_reduce;
  reduce_op op = reduce_op::sum;
  int64_t axis = 0;
  int root = 0;
  /// The first leaf's dtype, rank and first 4 extents.
  dtype type = dtype::float32;
  uint8_t rank = 0;
  std::array<int64_t, 4> dims{};
  uint32_t leaves = 0;
  uint64_t bytes = 0;

  /// "float32[256]", "float32[2,3] and 2 more leaves (1048 B)".
  std::string text() const;
  /// "all_reduce(SUM)", "all_gather(axis=0)", "broadcast(root=1)".
  std::string op_text() const;
};

/// The signature of a matched call.
flight_signature flight_signature_of(const call_signature& sig);

/// The steady clock and the system clock (ns since the Unix epoch) at one instant, from the given
/// readers. The system clock is read between two steady reads, up to 8 times, and the narrowest
/// bracket kept (its middle against the system reading): a thread descheduled between two plain
/// reads would put every entry time the recorder maps onto the system clock off by that pause.
std::pair<std::chrono::steady_clock::time_point, int64_t>
    clock_pair(std::chrono::steady_clock::time_point (*steady)(), int64_t (*wall)());

/// Where a recorded collective stands.
enum class flight_state : uint8_t { queued, waiting, done, failed };

/// "queued", "waiting", "done", "failed".
const char* state_name(flight_state s) noexcept;

class flight_recorder {
public:
  using clock = std::chrono::steady_clock;

  /// Entries kept when neither the option nor CONSORT_FLIGHT_RECORDER_ENTRIES says otherwise.
  static constexpr int64_t default_entries = 2000;

  /// The entries to keep: `option` when it is 0 or more, else CONSORT_FLIGHT_RECORDER_ENTRIES when
  /// set, else `default_entries`. @throws error(invalid_argument) for a malformed variable or a
  /// value above 10 000 000.
  static size_t entries_for(int64_t option);

  /// A ring of `entries` (0: off, every call below does nothing) for worker `rank` of `names`
  /// (names in rank order, "worker:0", ...; one name for a single worker).
  flight_recorder(size_t entries, int rank, std::vector<std::string> names);
  /// With CONSORT_FLIGHT_RECORDER_DUMP_AT_END=1, first writes the ring to `default_path()` (reason
  /// "end"; a failed write is one line on stderr).
  ~flight_recorder();

  flight_recorder(const flight_recorder&) = delete;
  flight_recorder& operator=(const flight_recorder&) = delete;

  bool enabled() const noexcept { return capacity_ > 0; }
  int rank() const noexcept { return rank_; }
  int workers() const noexcept { return static_cast<int>(names_.size()); }
  const std::string& name() const noexcept { return names_[static_cast<size_t>(rank_)]; }

  /// A recorded collective: its job-wide number (0: not recorded) and its place in the ring.
  struct handle {
    uint64_t number = 0;
    uint32_t slot = 0;
    explicit operator bool() const noexcept { return number != 0; }
  };

  /// A collective is queued (it waits for its turn, or for this worker's replicas) or begins to
  /// wait for the other workers (`state` waiting); it takes the next job-wide number. `enqueued`
  /// left default is now. A waiting collective starts at `started`, or now when it is left
  /// default (a caller that read the clock already passes its reading: the recorder then reads
  /// none).
  handle collective(uint64_t step, uint32_t seq, int replica, const flight_signature& sig,
                    flight_state state, clock::time_point enqueued, clock::time_point started = {});
  /// A queued collective begins to wait for the other workers.
  void started(handle h);
  /// Where the descriptor exchange marks the workers whose part of `h` arrived (bit w: worker w);
  /// null when `h` is not recorded. Valid as long as the recorder lives.
  std::atomic<uint64_t>* arrivals(handle h) noexcept;
  /// Where the descriptor exchange stores who entered `h` last, and by how much; null when `h` is
  /// not recorded. Valid as long as the recorder lives.
  transport::call_lateness* lateness(handle h) noexcept;
  /// `h` ended: done (`code` none) or failed with `code`.
  void ended(handle h, errc code);
  /// `t` on the system clock, in ns since the Unix epoch: the system clock's reading when the
  /// recorder was made, plus the steady clock's advance since (the two advance alike: NTP slews
  /// both; only a step of the system clock, which the steady clock does not take, comes between
  /// them).
  int64_t unix_ns(clock::time_point t) const noexcept { return epoch_unix_ns_ + since_epoch(t); }
  /// The number the next collective will get, minus one (the last one given).
  uint64_t last_number() const;

  /// Step `step` started at `at` (it may be recorded after its collectives: dumps order the
  /// entries by time).
  void step_started(uint64_t step, clock::time_point at);
  void step_ended(uint64_t step, bool ok);
  /// A membership event (a lost worker); it counts as a failure for `dump_on_failure`.
  void note(const std::string& text);

  /// The diagnosis of `h`, which failed with `code` after `timeout`, from this worker's record:
  /// "all_reduce #101 (float32[256]) timed out after 3000 ms: worker:1 never called it; its last
  /// collective was #100 at step 100, 3012 ms ago". Empty when `h` is not recorded.
  std::string explain(handle h, errc code, std::chrono::milliseconds timeout) const;

  /// The last collectives in a paragraph for the user: the last one done, the ones pending or
  /// failed with who they wait for.
  std::string diagnose() const;

  /// The ring as JSON (docs/debugging.md has the fields), in time order (a collective by its
  /// enqueue time).
  std::string to_json(const std::string& reason) const;

  /// Writes `to_json(reason)` to `path` (empty: `default_path()`) and returns the path.
  /// @throws error(invalid_argument) when the recorder is off or the file cannot be written.
  std::string dump(const std::string& path, const std::string& reason) const;

  /// CONSORT_DUMP_DIR (else the working directory) / consort-flight-<name>-<pid>.json.
  std::string default_path() const;

  /// A dump after a failure (a collective timeout, a lost peer): written to `default_path()` when
  /// CONSORT_DUMP_DIR is set and something failed (or a note was made) since the last such dump,
  /// at most once a second after the first four; never throws (a failed write is one line on
  /// stderr).
  void dump_on_failure(const std::string& reason) noexcept;

  /// Dumps every live recorder of the process (SIGUSR1 does this, on a thread of its own).
  static void dump_all(const std::string& reason) noexcept;

  // -- stragglers ---------------------------------------------------------------------------------

  /// A worker that entered the collectives of a step last, by more than `share` of the step's
  /// length over the worker before it, is that step's straggler; one that is it in more than half
  /// of the last `steps` steps is named: once in a line to `log` (set on the chief), and in
  /// `stragglers()` on every worker. The same rule as tools/consort-diagnose --stragglers, live.
  struct straggler_rule {
    double share = 0.05;
    int steps = 20;
  };
  static constexpr int max_straggler_steps = 1000;
  /// The rule of strategy_options::straggler_share and straggler_steps: each when 0 or more,
  /// else CONSORT_STRAGGLER_SHARE / CONSORT_STRAGGLER_STEPS when set, else the defaults above.
  /// @throws error(invalid_argument) for a share outside (0, 1] or a window outside 1 to
  /// `max_straggler_steps`, naming the option or variable that said so.
  static straggler_rule straggler_rule_for(double share, int steps);
  /// The rule from now on (before the first step: the window is not cut to it).
  void set_straggler_rule(straggler_rule rule);
  straggler_rule rule() const;
  void set_straggler_log(std::function<void(const std::string&)> log);
  /// The chief's clock against this worker's (strategy::chief_clock_offset), which the calls
  /// between workers add to their entry times; dumps carry it too, with `delay_ns`, the round
  /// trip it comes from (the offset is within half of it; 0 on the chief).
  void set_chief_offset(int64_t ns, int64_t delay_ns) noexcept {
    chief_offset_ns_.store(ns, std::memory_order_relaxed);
    chief_delay_ns_.store(delay_ns, std::memory_order_relaxed);
  }
  int64_t chief_offset_ns() const noexcept {
    return chief_offset_ns_.load(std::memory_order_relaxed);
  }
  /// Per worker, over the last `rule().steps` steps.
  std::vector<consort::straggler_stat> stragglers() const;

private:
  struct entry;

  /// `epoch`: the steady clock and the system clock (ns since the Unix epoch) at one instant.
  flight_recorder(size_t entries, int rank, std::vector<std::string> names,
                  std::pair<clock::time_point, int64_t> epoch);

  entry& claim(clock::time_point now);
  int64_t since_epoch(clock::time_point t) const noexcept;

  const size_t capacity_;
  const int rank_;
  const std::vector<std::string> names_;
  const clock::time_point epoch_;
  const int64_t epoch_unix_ns_;
  mutable spin_mutex mu_;
  std::unique_ptr<entry[]> ring_; // guarded by mu_ (but for the arrival masks)
  uint64_t written_ = 0;          // guarded by mu_: records ever written
  size_t next_slot_ = 0;          // guarded by mu_: written_ % capacity_
  uint64_t next_number_ = 1;      // guarded by mu_
  /// Failed collectives and notes so far, and when dumps after failures were written (all
  /// guarded by mu_).
  uint64_t failures_ = 0;
  uint64_t dumped_failures_ = 0;
  uint64_t dumps_ = 0;
  clock::time_point last_dump_{};
  /// Stragglers (all guarded by mu_): per step not ended yet, when it started and each worker's
  /// lateness (ns) summed over its collectives; per step ended, its straggler (-1: none), by how
  /// much, and how long the step took; who was named.
  struct step_lateness {
    /// Since the recorder's epoch; a step may have started before the recorder was made.
    int64_t start_ns = std::numeric_limits<int64_t>::min();
    std::vector<int64_t> late_ns;
  };
  struct step_verdict {
    int who = -1;
    int64_t late_ns = 0;
    int64_t length_ns = 0;
  };
  std::map<uint64_t, step_lateness> open_steps_;
  std::atomic<int64_t> chief_offset_ns_{0};
  /// -1: no offset known yet.
  std::atomic<int64_t> chief_delay_ns_{-1};
  step_lateness* current_ = nullptr; // the entry of open_steps_ for current_step_, or null
  uint64_t current_step_ = 0;
  straggler_rule rule_;
  std::deque<step_verdict> verdicts_;
  std::vector<bool> named_;
  std::vector<uint64_t> named_at_; // the step at which each named worker was named
  std::function<void(const std::string&)> straggler_log_;
  void judge_step(uint64_t step, int64_t end_ns); // with mu_ held
};

/// The number of a pending call, its recorder, and how long it may wait, for the code that runs a
/// call between workers and turns its failure into the user's error.
struct recorded_call {
  flight_recorder* recorder = nullptr;
  flight_recorder::handle h;

  /// Marks the call ended: done when `err` is empty, else failed. A failure comes back with the
  /// diagnosis in front of its text, same code (and the ring is dumped when it is a timeout or a
  /// lost peer); an empty `err` comes back empty.
  caf::error finish(const caf::error& err, std::chrono::milliseconds timeout) const;
};

} // namespace consort::detail
