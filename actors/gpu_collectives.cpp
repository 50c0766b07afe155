#include "actors/gpu_collectives.hpp"

#include <consort/config.hpp>
#include <consort/error.hpp>
#include <consort/ops.hpp>

#include "core/report.hpp"
#include "device/gpu.hpp"

#if CONSORT_WITH_CUDA
#include "device/cuda/nccl.hpp"
#include "device/cuda/runtime.hpp"
#endif

#include <algorithm>
#include <atomic>
#include <optional>
#include <set>
#include <thread>
#include <utility>

namespace consort::detail {

// -- replica_queue -------------------------------------------------------------------------------

namespace {

using clock = queued_work::clock;

std::string ms_text(clock::duration d) {
  return std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(d).count()) + " ms";
}

/// Polls `work` until it has finished (and check() found no failure), or expires it at its
/// deadline: its timeout after the stream was seen to reach it, and never later than its timeout
/// plus `backlog` after it was queued. The first rounds only yield (NCCL's small calls finish in
/// microseconds), then sleeps grow from 16 us to 1 ms, so that a long wait costs no core.
void wait_for(queued_work& work, std::chrono::milliseconds backlog) {
  const auto latest = work.issued() + work.timeout() + backlog;
  std::optional<clock::time_point> reached;
  int yields = 0;
  auto sleep = std::chrono::microseconds{16};
  for (;;) {
    // Asked after finishing as well: an asynchronous NCCL error, or an abort after a failure
    // elsewhere, also ends the work on the GPU, with a result that must not be used.
    const bool done = work.finished();
    work.check();
    if (done)
      return;
    const auto now = clock::now();
    if (!reached && work.started())
      reached = now;
    const auto deadline = reached ? std::min(*reached + work.timeout(), latest) : latest;
    if (now >= deadline) {
      if (reached && *reached + work.timeout() <= latest)
        work.expire(work.what() + " did not finish within " + ms_text(work.timeout()) +
                    " of the GPU reaching it; the NCCL communicators were aborted");
      work.expire(
          work.what() + " did not finish within " + ms_text(now - work.issued()) +
          " of being queued (its timeout " + ms_text(work.timeout()) + " plus " + ms_text(backlog) +
          " for the GPU work queued before it" +
          (reached ? std::string{} : ", which had not finished: the GPU never reached the call") +
          "); the NCCL communicators were aborted");
    }
    if (yields < 64) {
      ++yields;
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(
          std::min(sleep, std::chrono::duration_cast<std::chrono::microseconds>(deadline - now) +
                              std::chrono::microseconds{1}));
      sleep = std::min(sleep * 2, std::chrono::microseconds{1000});
    }
  }
}

} // namespace

void replica_queue::add(std::unique_ptr<queued_work> work) {
  std::lock_guard lock(mutex_);
  works_.push_back(std::move(work));
}

size_t replica_queue::size() const {
  std::lock_guard lock(mutex_);
  return works_.size();
}

void replica_queue::clear_failure() {
  std::lock_guard lock(mutex_);
  failure_.reset();
}

void replica_queue::settle() {
  std::lock_guard turn(turn_);
  for (;;) {
    queued_work* work = nullptr;
    {
      std::lock_guard lock(mutex_);
      if (failure_)
        throw *failure_;
      if (works_.empty())
        return;
      // Only the thread holding turn_ removes works, so the front stays put while it waits.
      work = works_.front().get();
    }
    std::vector<std::unique_ptr<queued_work>> gone;
    try {
      wait_for(*work, backlog_);
    } catch (const error& e) {
      {
        // The rest shares the failure (its communicators were aborted): dropped, not waited for.
        std::lock_guard lock(mutex_);
        failure_.emplace(e);
        gone.swap(works_);
      }
      throw;
    }
    std::lock_guard lock(mutex_);
    gone.push_back(std::move(works_.front()));
    works_.erase(works_.begin());
  }
}

void replica_queue::make_ready(std::chrono::steady_clock::time_point deadline,
                               const std::string& what) {
  settle();
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - clock::now());
  gpu::synchronize_stream(stream(), device_, std::max(left, std::chrono::milliseconds{1}), what);
}

namespace {

/// True when every leaf of every replica is on that replica's own GPU (the device of its queue),
/// the GPUs are distinct and no leaf is bool.
bool on_own_gpus(const std::vector<std::vector<tensor>>& leaves,
                 const std::vector<std::shared_ptr<replica_queue>>& queues) {
  if (leaves.empty() || leaves.size() != queues.size())
    return false;
  std::set<int> seen;
  for (size_t r = 0; r < leaves.size(); ++r) {
    if (!queues[r] || leaves[r].empty() || !seen.insert(queues[r]->device()).second)
      return false;
    for (const auto& t : leaves[r])
      if (!t.on_gpu() || gpu::index_of(t.device()) != queues[r]->device() ||
          t.dtype() == dtype::boolean)
        return false;
  }
  return true;
}

} // namespace

bool local_nccl::eligible(collective_kind kind, reduce_op op, int64_t axis,
                          const std::vector<std::vector<tensor>>& leaves,
                          const std::vector<std::shared_ptr<replica_queue>>& queues,
                          bool across_workers) {
  if (!gpu::built() || !on_own_gpus(leaves, queues))
    return false;
  if (across_workers && kind == collective_kind::all_gather)
    return false;
  if (kind == collective_kind::all_reduce && op == reduce_op::mean)
    for (const auto& replica : leaves)
      for (const auto& t : replica)
        if (!is_floating(t.dtype()))
          return false;
  return kind != collective_kind::all_gather || axis == 0;
}

#if CONSORT_WITH_CUDA

namespace {

/// One generation of communicators (one per local GPU, in local order) and what the work queued
/// on them shares: whether they failed, and why. Owned by local_nccl and by every work still
/// queued on them, so that the communicators outlive the operations that use them.
struct comm_set {
  /// NCCL's rule, one thread at a time per communicator: held to issue, poll and abort.
  std::mutex mutex;
  std::vector<cuda::nccl::communicator> comms;
  std::vector<int> devices;
  /// The first failure; every later use throws it.
  std::optional<error> failure;
  /// Completion events ready for reuse, per rank (events belong to their rank's GPU).
  std::vector<std::vector<cudaEvent_t>> spare_events;

  comm_set(std::vector<cuda::nccl::communicator> made, std::vector<int> gpus)
      : comms(std::move(made)), devices(std::move(gpus)), spare_events(devices.size()) {}

  comm_set(const comm_set&) = delete;
  comm_set& operator=(const comm_set&) = delete;

  ~comm_set() {
    for (auto& events : spare_events)
      for (auto e : events)
        (void)cudaEventDestroy(e);
  }

  /// Aborts every communicator (the GPU kernels of their operations stop, so the streams drain)
  /// and records why, unless an earlier failure was recorded. @pre mutex is held.
  void fail_locked(errc code, const std::string& message) noexcept {
    try {
      if (!failure)
        failure.emplace(code, message);
    } catch (...) { // out of memory: the abort below still happens, and the cause is said once
      static std::atomic<bool> reported{false};
      detail::report_once(reported, "recording why GPU collectives failed (they are aborted)",
                          message.c_str());
    }
    for (auto& c : comms)
      c.abort();
  }

  /// Throws the recorded failure; failing that, asks NCCL whether a communicator failed
  /// asynchronously, and then records it (aborting the others) and throws it. @pre mutex is held.
  void check_locked(const std::string& what) {
    if (!failure) {
      for (auto& c : comms) {
        try {
          c.check();
        } catch (const error& e) {
          fail_locked(e.code(), what + " on NCCL: " + e.what());
          break;
        }
      }
    }
    if (failure)
      throw *failure;
  }

  /// An event of rank `rank`'s GPU for marking the end of a call. @pre mutex is held.
  cudaEvent_t take_event(size_t rank) {
    auto& spare = spare_events[rank];
    if (!spare.empty()) {
      auto e = spare.back();
      spare.pop_back();
      return e;
    }
    cuda::device_guard guard(devices[rank]);
    cudaEvent_t e = nullptr;
    cuda::check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreateWithFlags",
                devices[rank]);
    return e;
  }

  /// @pre mutex is held.
  void give_event(size_t rank, cudaEvent_t e) noexcept {
    try {
      spare_events[rank].push_back(e);
    } catch (...) {
      (void)cudaEventDestroy(e);
    }
  }
};

/// One replica's part of an NCCL call: started when the event recorded before it on the
/// replica's stream has fired, done when the one after it has, failed when its communicators
/// failed.
class nccl_work final : public queued_work {
public:
  nccl_work(std::shared_ptr<comm_set> set, size_t rank, cudaEvent_t start, cudaEvent_t done,
            std::string what, std::chrono::milliseconds timeout)
      : queued_work(std::move(what), timeout), set_(std::move(set)), rank_(rank), start_(start),
        done_(done) {}

  nccl_work(const nccl_work&) = delete;
  nccl_work& operator=(const nccl_work&) = delete;

  ~nccl_work() override {
    // Recording an event again later is allowed even if this record has not fired (the work was
    // abandoned after a failure): the new record replaces it.
    std::lock_guard lock(set_->mutex);
    set_->give_event(rank_, start_);
    set_->give_event(rank_, done_);
  }

  bool started() override { return fired(start_); }

  bool finished() override { return fired(done_); }

  void check() override {
    std::lock_guard lock(set_->mutex);
    set_->check_locked(what());
  }

  [[noreturn]] void expire(const std::string& message) override {
    std::lock_guard lock(set_->mutex);
    set_->fail_locked(errc::collective_timeout, message);
    throw *set_->failure;
  }

private:
  /// Whether `e` has fired. @throws error(device_error), after failing the set, when the stream
  /// failed.
  bool fired(cudaEvent_t e) {
    const auto status = cudaEventQuery(e);
    if (status == cudaSuccess)
      return true;
    (void)cudaGetLastError(); // cudaErrorNotReady, or the failure reported below
    if (status == cudaErrorNotReady)
      return false;
    std::lock_guard lock(set_->mutex);
    set_->fail_locked(
        errc::device_error,
        what() + " on NCCL: the stream of GPU:" + std::to_string(set_->devices[rank_]) +
            " failed: " + cudaGetErrorString(status) + " (" + cudaGetErrorName(status) + ")");
    throw *set_->failure;
  }

  std::shared_ptr<comm_set> set_;
  size_t rank_ = 0;
  cudaEvent_t start_ = nullptr;
  cudaEvent_t done_ = nullptr;
};

/// Serialises building communicators and issuing NCCL operations in this process.
std::mutex& issue_mutex() {
  static std::mutex m;
  return m;
}

} // namespace

struct local_nccl::impl {
  std::shared_ptr<comm_set> set;
  /// Whether a communicator was ever built (or tried): only the first may use spec.first_id,
  /// because an id serves one communicator. Every worker builds at the same calls (the rebuild
  /// flag of the descriptor round), so every worker decides alike.
  bool built_before = false;

  bool usable(const std::vector<int>& wanted) const {
    if (!set || set->devices != wanted)
      return false;
    std::lock_guard lock(set->mutex);
    return !set->failure;
  }

  /// The communicators for `wanted`, made (or remade after a failure) when needed. The previous
  /// generation lives on while work queued on it is unsettled.
  void ensure(const std::vector<int>& wanted, std::chrono::milliseconds timeout,
              const group_spec& spec) {
    if (usable(wanted) && !spec.rebuild)
      return;
    // The previous generation is not aborted here: work still queued on it (a healthy set
    // replaced because another worker's failed) finishes or expires on its own, and the set goes
    // when its last work is settled.
    set.reset();
    cuda::nccl::unique_id id;
    const int nranks = spec.nranks > 0 ? spec.nranks : static_cast<int>(wanted.size());
    const bool first = !std::exchange(built_before, true);
    if (spec.share && first && !spec.first_id.empty()) {
      // The chief's id from the membership view, which every worker received.
      id = cuda::nccl::unique_id::from_bytes(spec.first_id);
    } else if (spec.share) {
      // Worker 0 (whose first replica is rank 0) makes the id; every worker gets its bytes.
      std::vector<uint8_t> bytes(cuda::nccl::unique_id::byte_count, 0);
      if (spec.first_rank == 0)
        bytes = cuda::nccl::unique_id::make().to_bytes();
      spec.share(bytes);
      id = cuda::nccl::unique_id::from_bytes(bytes);
    } else {
      id = cuda::nccl::unique_id::make();
    }
    set = std::make_shared<comm_set>(
        cuda::nccl::init_group(id, nranks, spec.first_rank, wanted, timeout), wanted);
  }
};

std::vector<uint8_t> make_nccl_unique_id() {
  return cuda::nccl::unique_id::make().to_bytes();
}

local_nccl::local_nccl() : impl_(std::make_unique<impl>()) {}

local_nccl::~local_nccl() = default;

bool local_nccl::needs_build(const std::vector<int>& devices) const {
  return !impl_->usable(devices);
}

void local_nccl::prepare(const std::vector<int>& devices, std::chrono::milliseconds timeout) {
  std::lock_guard issuing(issue_mutex());
  impl_->ensure(devices, timeout, group_spec{});
}

std::vector<std::vector<tensor>> local_nccl::run(
    collective_kind kind, reduce_op op, int root, const std::vector<std::vector<tensor>>& leaves,
    const std::vector<std::shared_ptr<replica_queue>>& queues, std::chrono::milliseconds timeout,
    const std::string& what, const group_spec& spec) {
  const size_t n = leaves.size();
  const size_t count = leaves.front().size();
  std::vector<int> devices;
  for (const auto& q : queues)
    devices.push_back(q->device());
  auto& im = *impl_;
  // Issued from a replica's thread (the one whose call completed the slot): that thread's current
  // device is its own again when this returns, whatever the other ranks' calls set meanwhile.
  struct keep_current_device {
    int device = -1;
    keep_current_device() {
      if (cudaGetDevice(&device) != cudaSuccess) {
        device = -1;
        (void)cudaGetLastError();
      }
    }
    ~keep_current_device() {
      int now = -1;
      if (device >= 0 && (cudaGetDevice(&now) != cudaSuccess || now != device) &&
          cudaSetDevice(device) != cudaSuccess)
        (void)cudaGetLastError();
    }
    keep_current_device(const keep_current_device&) = delete;
    keep_current_device& operator=(const keep_current_device&) = delete;
  } const keep;
  // NCCL: operations on independent communicators of the same GPU must not be issued from several
  // threads at once. Replica threads, the collective actor and the step lane (and other
  // strategies) may hold communicators of the same GPUs; they build and issue one at a time.
  std::lock_guard issuing(issue_mutex());
  try {
    im.ensure(devices, timeout, spec);
  } catch (const error& e) {
    throw_error(e.code(), what + " on NCCL: " + e.what());
  }
  const auto set = im.set;
  // Outputs first (allocation may fail cleanly before NCCL sees anything).
  std::vector<std::vector<tensor>> out(n);
  for (size_t r = 0; r < n; ++r) {
    for (size_t i = 0; i < count; ++i) {
      const auto& in = leaves[r][i];
      auto shape = in.shape();
      if (kind == collective_kind::all_gather) {
        int64_t total = 0;
        for (size_t q = 0; q < n; ++q)
          total += leaves[q][i].shape().front();
        shape.front() = total;
      }
      out[r].push_back(tensor::empty(in.dtype(), shape, in.device()));
    }
  }
  std::unique_lock lock(set->mutex);
  // Events first: failing to make one is no failure of the communicators (they stay healthy).
  std::vector<cudaEvent_t> starts(n, nullptr);
  std::vector<cudaEvent_t> dones(n, nullptr);
  auto give_back = [&] {
    for (size_t r = 0; r < n; ++r) {
      if (starts[r] != nullptr)
        set->give_event(r, starts[r]);
      if (dones[r] != nullptr)
        set->give_event(r, dones[r]);
    }
  };
  try {
    for (size_t r = 0; r < n; ++r) {
      starts[r] = set->take_event(r);
      dones[r] = set->take_event(r);
    }
  } catch (const error& e) {
    give_back();
    throw_error(e.code(), what + " on NCCL: " + e.what());
  }
  try {
    set->check_locked(what);
    // Marks where each stream reaches the call: its deadline counts from there, not from the
    // GPU work queued before it.
    for (size_t r = 0; r < n; ++r)
      cuda::check(cudaEventRecord(starts[r], static_cast<cudaStream_t>(queues[r]->stream())),
                  "cudaEventRecord", devices[r]);
    {
      cuda::nccl::group group;
      for (size_t i = 0; i < count; ++i) {
        std::vector<size_t> counts;
        if (kind == collective_kind::all_gather)
          for (size_t q = 0; q < n; ++q)
            counts.push_back(static_cast<size_t>(leaves[q][i].num_elements()));
        for (size_t r = 0; r < n; ++r) {
          const auto& in = leaves[r][i];
          auto& comm = set->comms[r];
          // The replica's own stream: NCCL starts after the work that made the input, and the
          // replica's next work starts after NCCL, with no host waiting in between.
          auto s = static_cast<cudaStream_t>(queues[r]->stream());
          void* dst = out[r][i].raw_mutable_data();
          const auto elements = static_cast<size_t>(in.num_elements());
          switch (kind) {
          case collective_kind::all_reduce:
            comm.all_reduce(in.raw_data(), dst, elements, in.dtype(), op, s);
            break;
          case collective_kind::all_gather:
            comm.all_gather_ragged(in.raw_data(), counts, dst, in.dtype(), s);
            break;
          case collective_kind::broadcast:
            comm.broadcast(in.raw_data(), dst, elements, in.dtype(), root, s);
            break;
          }
        }
      }
      group.end();
    }
    for (size_t r = 0; r < n; ++r)
      cuda::check(cudaEventRecord(dones[r], static_cast<cudaStream_t>(queues[r]->stream())),
                  "cudaEventRecord", devices[r]);
  } catch (const std::exception& e) {
    // Aborted communicators are rebuilt by the next call; say which call failed.
    const auto code = dynamic_cast<const error*>(&e) != nullptr
                          ? static_cast<const error&>(e).code()
                          : errc::device_error;
    // A failure recorded before this call (check_locked threw it) keeps its own text.
    std::optional<error> earlier = set->failure;
    set->fail_locked(code, what + " on NCCL: " + e.what());
    give_back();
    lock.unlock();
    // The outputs may be released now, even if an aborted operation still writes them: device
    // memory is reused only after every replica stream of its GPU has passed its release
    // (gpu::release), and NCCL's work was queued on those streams.
    if (earlier)
      throw *earlier;
    throw_error(code, what + " on NCCL: " + e.what());
  }
  lock.unlock();
  for (size_t r = 0; r < n; ++r)
    queues[r]->add(std::make_unique<nccl_work>(set, r, starts[r], dones[r], what, timeout));
  return out;
}

#else // !CONSORT_WITH_CUDA

struct local_nccl::impl {};

std::vector<uint8_t> make_nccl_unique_id() {
  throw_error(errc::unsupported, "an NCCL unique id: this build of consort has no NCCL");
}

local_nccl::local_nccl() = default;

local_nccl::~local_nccl() = default;

bool local_nccl::needs_build(const std::vector<int>&) const {
  return true;
}

void local_nccl::prepare(const std::vector<int>&, std::chrono::milliseconds) {
  throw_error(errc::unsupported, "NCCL communicators: this build of consort has no NCCL");
}

std::vector<std::vector<tensor>> local_nccl::run(collective_kind, reduce_op, int,
                                                 const std::vector<std::vector<tensor>>&,
                                                 const std::vector<std::shared_ptr<replica_queue>>&,
                                                 std::chrono::milliseconds, const std::string& what,
                                                 const group_spec&) {
  throw_error(errc::unsupported, what + ": this build of consort has no NCCL");
}

#endif

} // namespace consort::detail
