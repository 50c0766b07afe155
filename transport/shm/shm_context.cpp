// The shared-memory transport (see include/consort/transport/shm.hpp for its contract).
//
// Layout of the segment (all offsets page-aligned):
//   header | one rank_block per rank | one ring_control per ordered pair | the rings' bytes
// A ring from rank s to rank r is written only by s (under s's out lock of that peer) and read
// only by r (under r's in lock of that peer): single producer, single consumer, with `head`
// (bytes written) and `tail` (bytes read) as the only shared words. A rank's doorbell is a futex
// word in its block; peers ring it after they wrote to it or freed space for it.

#include <consort/caf_error.hpp>
#include <consort/error.hpp>
#include <consort/transport/shm.hpp>

#include "../auth.hpp"
#include "device/host_memory.hpp"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstring>
#include <deque>
#include <fstream>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>

#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace consort::transport::shm {

namespace {

constexpr uint64_t segment_magic = 0x31'74'72'6f'73'6e'6f'63; // "consort1"
constexpr std::size_t page = 4096;
constexpr std::size_t min_ring_bytes = 4096;
constexpr std::size_t reason_bytes = 192;
/// The largest message a frame may announce (as the TCP transport's default).
constexpr uint64_t max_message_bytes = uint64_t{1} << 30;
/// Tags of `connect`'s exchange over the bootstrap context.
constexpr uint64_t tag_name = 0x5348'4d00'0000'0000;
constexpr uint64_t tag_mapped = tag_name + 1;
constexpr uint64_t tag_go = tag_name + 2;

inline void cpu_relax() noexcept {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

std::string errno_text(int err) {
  return std::string{std::strerror(err)} + " (errno " + std::to_string(err) + ")";
}

// -- the segment ----------------------------------------------------------------------------------

enum rank_state : uint32_t { live = 0, aborted = 1, gone = 2 };

/// One rank's part of the segment. The doorbell has its own cache line.
struct rank_block {
  alignas(64) std::atomic<uint32_t> bell;
  std::atomic<uint32_t> sleepers;
  alignas(64) std::atomic<uint32_t> state;
  std::atomic<int32_t> pid;
  /// The process's start time (field 22 of /proc/<pid>/stat), so that a reused pid is not taken
  /// for the rank's process.
  std::atomic<uint64_t> start_time;
  /// The errc and the reason of an abort, written before `state` becomes `aborted`.
  int32_t code;
  char reason[reason_bytes];
};

struct ring_control {
  alignas(64) std::atomic<uint64_t> head; // bytes written, by the producer
  /// Set by the producer when a send waits for space: the consumer rings its doorbell after it
  /// read (only then: a doorbell rung for every message wakes a thread for nothing).
  std::atomic<uint32_t> wants_space;
  alignas(64) std::atomic<uint64_t> tail; // bytes read, by the consumer
};

struct segment_header {
  std::atomic<uint64_t> magic; // stored last by the creator
  uint32_t ranks;
  uint32_t reserved;
  uint64_t ring_bytes;
  uint64_t total_bytes;
};

static_assert(std::atomic<uint64_t>::is_always_lock_free &&
                  std::atomic<uint32_t>::is_always_lock_free,
              "the segment's words must be lock-free to be shared between processes");

std::size_t round_up(std::size_t n, std::size_t to) {
  return (n + to - 1) / to * to;
}

/// Where everything lives in a segment of `ranks` ranks.
struct layout {
  std::size_t blocks;   // offset of the rank blocks
  std::size_t controls; // offset of the ring controls
  std::size_t rings;    // offset of the rings' bytes
  std::size_t total;

  layout(int ranks, std::size_t ring_bytes) {
    const auto n = static_cast<std::size_t>(ranks);
    const std::size_t pairs = n * (n - 1);
    blocks = page;
    controls = blocks + round_up(n * sizeof(rank_block), page);
    rings = controls + round_up(std::max<std::size_t>(pairs, 1) * sizeof(ring_control), page);
    total = rings + pairs * ring_bytes;
  }
};

/// One mapping of a segment.
class segment {
public:
  segment(void* base, std::size_t bytes, int ranks, std::size_t ring_bytes)
      : base_(static_cast<std::byte*>(base)), bytes_(bytes), ranks_(ranks), ring_bytes_(ring_bytes),
        layout_(ranks, ring_bytes) {}
  ~segment() { munmap(base_, bytes_); }
  segment(const segment&) = delete;
  segment& operator=(const segment&) = delete;

  segment_header& header() { return *reinterpret_cast<segment_header*>(base_); }
  rank_block& block(int rank) {
    return reinterpret_cast<rank_block*>(base_ + layout_.blocks)[rank];
  }
  /// The index of the ring from `from` to `to`.
  std::size_t ring_index(int from, int to) const {
    return static_cast<std::size_t>(from) * static_cast<std::size_t>(ranks_ - 1) +
           static_cast<std::size_t>(to < from ? to : to - 1);
  }
  ring_control& control(int from, int to) {
    return reinterpret_cast<ring_control*>(base_ + layout_.controls)[ring_index(from, to)];
  }
  std::byte* ring(int from, int to) {
    return base_ + layout_.rings + ring_index(from, to) * ring_bytes_;
  }
  int ranks() const { return ranks_; }
  std::size_t ring_bytes() const { return ring_bytes_; }

private:
  std::byte* base_;
  std::size_t bytes_;
  int ranks_;
  std::size_t ring_bytes_;
  layout layout_;
};

using segment_ptr = std::shared_ptr<segment>;

caf::error check_options(const options& opts, int size) {
  if (size < 1)
    return make_caf_error(errc::invalid_argument,
                          "shm transport: a group needs at least 1 rank; got " +
                              std::to_string(size));
  const auto r = opts.ring_bytes;
  if (r < min_ring_bytes || (r & (r - 1)) != 0)
    return make_caf_error(errc::invalid_argument,
                          "shm transport: options.ring_bytes must be a power of two of at least " +
                              std::to_string(min_ring_bytes) + "; got " + std::to_string(r));
  if (opts.liveness_interval.count() <= 0)
    return make_caf_error(errc::invalid_argument,
                          "shm transport: options.liveness_interval must be positive; got " +
                              std::to_string(opts.liveness_interval.count()) + " ms");
  return {};
}

/// Creates, sizes (reserving the memory, so that a full /dev/shm is an error here and not a
/// SIGBUS later) and maps segment `name` with mode 0600, and initializes its header.
caf::expected<segment_ptr> create_segment(const std::string& name, int ranks,
                                          std::size_t ring_bytes) {
  layout l(ranks, ring_bytes);
  int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0 && errno == EEXIST) {
    // A segment of a crashed run with the same name (names carry a fresh nonce: unlikely).
    shm_unlink(name.c_str());
    fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  }
  if (fd < 0)
    return make_caf_error(errc::peer_lost, "shm transport: cannot create shared memory \"" + name +
                                               "\": " + errno_text(errno));
  auto fail = [&](const std::string& what, int err) {
    close(fd);
    shm_unlink(name.c_str());
    return make_caf_error(errc::peer_lost, "shm transport: " + what + " of " +
                                               std::to_string(l.total) + " bytes for \"" + name +
                                               "\" failed: " + errno_text(err));
  };
  if (int err = posix_fallocate(fd, 0, static_cast<off_t>(l.total)); err != 0)
    return fail("reserving /dev/shm space", err);
  void* base = mmap(nullptr, l.total, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  if (base == MAP_FAILED)
    return fail("mapping", errno);
  close(fd);
  auto seg = std::make_shared<segment>(base, l.total, ranks, ring_bytes);
  // The memory is zero (a fresh file): every block is live, every ring empty.
  auto& h = seg->header();
  h.ranks = static_cast<uint32_t>(ranks);
  h.ring_bytes = ring_bytes;
  h.total_bytes = l.total;
  h.magic.store(segment_magic, std::memory_order_release);
  return seg;
}

/// Opens and maps segment `name`, checking that it is what the creator said.
caf::expected<segment_ptr> open_segment(const std::string& name, int ranks,
                                        std::size_t ring_bytes) {
  layout l(ranks, ring_bytes);
  int fd = shm_open(name.c_str(), O_RDWR, 0600);
  if (fd < 0)
    return make_caf_error(errc::peer_lost, "shm transport: cannot open shared memory \"" + name +
                                               "\": " + errno_text(errno) +
                                               " (are all ranks on one host?)");
  struct stat st {};
  if (fstat(fd, &st) != 0 || static_cast<std::size_t>(st.st_size) != l.total) {
    close(fd);
    return make_caf_error(errc::peer_lost, "shm transport: shared memory \"" + name + "\" has " +
                                               std::to_string(st.st_size) + " bytes; expected " +
                                               std::to_string(l.total));
  }
  void* base = mmap(nullptr, l.total, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  int err = errno;
  close(fd);
  if (base == MAP_FAILED)
    return make_caf_error(errc::peer_lost,
                          "shm transport: mapping \"" + name + "\" failed: " + errno_text(err));
  auto seg = std::make_shared<segment>(base, l.total, ranks, ring_bytes);
  auto& h = seg->header();
  if (h.magic.load(std::memory_order_acquire) != segment_magic ||
      h.ranks != static_cast<uint32_t>(ranks) || h.ring_bytes != ring_bytes)
    return make_caf_error(errc::peer_lost, "shm transport: shared memory \"" + name +
                                               "\" is not a segment of this group (" +
                                               std::to_string(h.ranks) + " ranks, rings of " +
                                               std::to_string(h.ring_bytes) + " bytes)");
  return seg;
}

/// Field 22 of /proc/<pid>/stat (the start time), and whether the process is a zombie; nullopt
/// when there is no such process.
struct process_status {
  bool exists = false;
  bool zombie = false;
  uint64_t start_time = 0;
};

process_status status_of(int pid) {
  process_status out;
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!in || !std::getline(in, line))
    return out;
  auto close_paren = line.rfind(')');
  if (close_paren == std::string::npos)
    return out;
  std::istringstream fields(line.substr(close_paren + 1));
  std::string state;
  fields >> state;
  // After the state: ppid pgrp session tty_nr tpgid flags minflt cminflt majflt cmajflt utime
  // stime cutime cstime priority nice num_threads itrealvalue starttime (fields 4..22).
  std::string skip;
  for (int i = 4; i < 22; ++i)
    fields >> skip;
  fields >> out.start_time;
  out.exists = true;
  out.zombie = state == "Z" || state == "X";
  return out;
}

long futex(std::atomic<uint32_t>* word, int op, uint32_t value, const timespec* timeout) {
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, value, timeout, nullptr, 0);
}

/// Rings the doorbell of `b`: wakes its sleepers, if any (a futex wake only when one sleeps).
void ring_bell(rank_block& b) {
  b.bell.fetch_add(1, std::memory_order_seq_cst);
  if (b.sleepers.load(std::memory_order_seq_cst) > 0)
    futex(&b.bell, FUTEX_WAKE, INT_MAX, nullptr);
}

/// Sleeps on the doorbell of `b` until it rings after `seen` was read, or `timeout` passes.
void sleep_on_bell(rank_block& b, uint32_t seen, std::chrono::nanoseconds timeout) {
  b.sleepers.fetch_add(1, std::memory_order_seq_cst);
  if (b.bell.load(std::memory_order_seq_cst) == seen && timeout.count() > 0) {
    timespec ts{};
    ts.tv_sec = static_cast<time_t>(timeout.count() / 1'000'000'000);
    ts.tv_nsec = static_cast<long>(timeout.count() % 1'000'000'000);
    futex(&b.bell, FUTEX_WAIT, seen, &ts);
  }
  b.sleepers.fetch_sub(1, std::memory_order_seq_cst);
}

/// The threads waiting on a context's operations. While there is one, it makes the progress (it
/// polls, or sleeps on the doorbell and polls when rung), and the progress thread stays off the
/// doorbell: on two cores, a second thread woken for every message costs far more than the copy
/// (bench/README.md, "Shared memory"). The progress thread takes over when no thread has waited
/// for `grace`, or at once when sends are queued.
struct waiter_count {
  static constexpr std::chrono::milliseconds grace{5};

  std::atomic<uint32_t> n{0};
  /// Sends that are queued (did not fit into the ring when posted): the progress thread writes
  /// them when no one waits.
  std::atomic<uint32_t> backlog{0};
  /// When the last waiter left (steady clock, nanoseconds since its epoch).
  std::atomic<int64_t> last_leave{0};

  void enter() { n.fetch_add(1, std::memory_order_seq_cst); }
  void leave() {
    last_leave.store(clock::now().time_since_epoch().count(), std::memory_order_relaxed);
    if (n.fetch_sub(1, std::memory_order_seq_cst) == 1 &&
        backlog.load(std::memory_order_seq_cst) > 0)
      futex(&n, FUTEX_WAKE_PRIVATE, 1, nullptr);
  }

  /// Whether waiters make the progress now: one waits, or one left less than `grace` ago and no
  /// send is queued.
  bool active(clock::time_point now) const {
    if (n.load(std::memory_order_seq_cst) > 0)
      return true;
    if (backlog.load(std::memory_order_seq_cst) > 0)
      return false;
    return now - clock::time_point{clock::duration{last_leave.load(std::memory_order_relaxed)}} <
           grace;
  }
};

using waiter_count_ptr = std::shared_ptr<waiter_count>;

// -- frames ---------------------------------------------------------------------------------------

enum frame_kind : uint32_t { data_frame = 1, goodbye_frame = 2 };

struct frame_header {
  uint64_t tag;
  uint64_t bytes;
  uint32_t kind;
  uint32_t reserved;
};
static_assert(sizeof(frame_header) == 24);

// -- operations -----------------------------------------------------------------------------------

class shm_context;

class shm_op final : public operation {
public:
  enum state_t : int { pending = 0, succeeded = 1, failed = 2 };

  shm_op(std::weak_ptr<shm_context> ctx, segment_ptr seg, waiter_count_ptr waiters, bool is_send,
         int self, int peer, uint64_t tag, std::chrono::microseconds spin,
         std::chrono::milliseconds nap)
      : is_send(is_send), self(self), peer(peer), tag(tag), posted(clock::now()),
        ctx_(std::move(ctx)), seg_(std::move(seg)), waiters_(std::move(waiters)), spin_(spin),
        nap_(nap) {}

  caf::error wait(deadline until) override;

  bool done() const noexcept override { return state_.load(std::memory_order_acquire) != pending; }

  std::size_t message_bytes() const noexcept override {
    if (is_send)
      return bytes();
    return state_.load(std::memory_order_acquire) == succeeded ? received : 0;
  }

  /// Completes the operation once with `err` (empty: success); later calls do nothing. Rings
  /// this rank's doorbell, on which a waiter may sleep.
  void complete(caf::error err) {
    {
      std::lock_guard<std::mutex> guard{mtx_};
      if (state_.load(std::memory_order_relaxed) != pending)
        return;
      const int next = err ? failed : succeeded;
      error_ = std::move(err);
      state_.store(next, std::memory_order_release);
    }
    if (in_backlog)
      waiters_->backlog.fetch_sub(1, std::memory_order_seq_cst);
    // Wake a waiter sleeping on the doorbell (the progress thread does not sleep on it then).
    if (waiters_->n.load(std::memory_order_seq_cst) > 0)
      ring_bell(seg_->block(self));
  }

  /// Fails the operation with `code`, its description and `cause`.
  void fail(errc code, const std::string& cause) {
    complete(make_caf_error(code, describe() + ": " + cause));
  }

  std::string describe() const {
    std::ostringstream out;
    out << "shm transport: rank " << self << ": " << (is_send ? "send" : "receive") << " of "
        << bytes() << " bytes with tag 0x" << std::hex << tag << std::dec
        << (is_send ? " to rank " : " from rank ") << peer;
    return out.str();
  }

  std::size_t bytes() const noexcept {
    if (!is_send)
      return into.size();
    std::size_t total = 0;
    for (const auto& part : parts)
      total += part.size();
    return total;
  }

  const bool is_send;
  const int self;
  const int peer;
  const uint64_t tag;
  const clock::time_point posted;
  /// A send: its frame header and its parts, streamed in this order.
  frame_header header{};
  std::vector<const_bytes> parts;
  /// A receive: the buffer, whether a smaller message fits, and what was received.
  mutable_bytes into;
  bool at_most = false;
  std::size_t received = 0;
  /// A send that was queued: counted in the context's backlog until it completes.
  bool in_backlog = false;
  /// Bytes a send owns (a goodbye's reason); `parts` may point into them.
  std::string owned;

private:
  caf::error result() const {
    return state_.load(std::memory_order_acquire) == succeeded ? caf::error{} : error_;
  }

  std::atomic<int> state_{pending};
  std::mutex mtx_;
  caf::error error_;
  std::weak_ptr<shm_context> ctx_;
  /// Keeps the mapping (and this rank's doorbell) alive as long as the operation.
  segment_ptr seg_;
  waiter_count_ptr waiters_;
  std::chrono::microseconds spin_;
  std::chrono::milliseconds nap_;
};

using op_ptr = std::shared_ptr<shm_op>;

/// A message that arrived before its receive was posted. Its buffer comes from the host block
/// cache (device/host_memory.hpp), as the TCP transport's: a fresh buffer per message costs a
/// page fault per 4 KiB on its first write, which made a 64 MiB ring all-reduce 4x slower.
struct stash {
  stash(uint64_t tag, std::size_t size) : tag(tag), size(size) {
    if (size > 0)
      block = consort::detail::host_block(size);
  }

  std::byte* data() { return block.data(); }
  bool complete() const { return got == size; }

  uint64_t tag;
  std::size_t size;
  std::size_t got = 0;
  consort::detail::host_block block;
};

using stash_ptr = std::shared_ptr<stash>;

// -- the context ----------------------------------------------------------------------------------

/// One ring's producer or consumer view.
struct ring_view {
  ring_control* control = nullptr;
  std::byte* bytes = nullptr;
  uint64_t capacity = 0;

  /// Copies `n` bytes from `src` into the ring at position `pos` (wrapping).
  void put(uint64_t pos, const std::byte* src, std::size_t n) const {
    auto at = static_cast<std::size_t>(pos & (capacity - 1));
    auto first = std::min<std::size_t>(n, capacity - at);
    std::memcpy(bytes + at, src, first);
    if (first < n)
      std::memcpy(bytes, src + first, n - first);
  }

  void get(uint64_t pos, std::byte* dst, std::size_t n) const {
    auto at = static_cast<std::size_t>(pos & (capacity - 1));
    auto first = std::min<std::size_t>(n, capacity - at);
    std::memcpy(dst, bytes + at, first);
    if (first < n)
      std::memcpy(dst + first, bytes, n - first);
  }
};

/// This rank's side of the channel with one peer.
struct peer_link {
  int rank = -1;

  // Outgoing: guarded by out_mtx. The front send may be partly written (out_offset bytes of its
  // header and parts).
  std::mutex out_mtx;
  ring_view out;
  std::deque<op_ptr> out_queue;
  std::size_t out_offset = 0;

  // Incoming: guarded by in_mtx.
  std::mutex in_mtx;
  ring_view in;
  std::unordered_map<uint64_t, std::deque<op_ptr>> posted;
  std::unordered_map<uint64_t, std::deque<stash_ptr>> stashed;
  /// The message being read: its header, the bytes read, and where they go (an op, a stash, the
  /// goodbye's reason, or nowhere: a dropped message).
  bool reading = false;
  frame_header current{};
  std::size_t current_got = 0;
  op_ptr current_op;
  stash_ptr current_stash;
  std::string current_text;
  bool goodbye = false;

  /// Set once when the peer is lost, aborted or left: what its operations fail with.
  std::atomic<bool> failed{false};
  errc fail_code = errc::peer_lost;
  std::string fail_cause;
};

class shm_context final : public context, public std::enable_shared_from_this<shm_context> {
public:
  shm_context(segment_ptr seg, int rank, const options& opts)
      : seg_(std::move(seg)), rank_(rank), size_(seg_->ranks()), opts_(opts),
        links_(static_cast<std::size_t>(size_)) {
    for (int p = 0; p < size_; ++p) {
      if (p == rank_)
        continue;
      auto& l = link(p);
      l.rank = p;
      l.out = {&seg_->control(rank_, p), seg_->ring(rank_, p), seg_->ring_bytes()};
      l.in = {&seg_->control(p, rank_), seg_->ring(p, rank_), seg_->ring_bytes()};
    }
    auto& me = seg_->block(rank_);
    auto self = status_of(static_cast<int>(getpid()));
    me.start_time.store(self.start_time, std::memory_order_relaxed);
    me.pid.store(static_cast<int32_t>(getpid()), std::memory_order_release);
  }

  /// Starts the progress thread; called once the context is owned by a shared_ptr.
  void start() {
    progress_ = std::thread([this] { run_progress(); });
  }

  ~shm_context() override {
    {
      std::lock_guard<std::mutex> guard{state_mtx_};
      if (!aborted_) {
        auto& me = seg_->block(rank_);
        copy_reason(me, "its context was destroyed");
        me.code = static_cast<int32_t>(errc::peer_lost);
        me.state.store(gone, std::memory_order_release);
      }
    }
    stop_.store(true);
    ring_bell(seg_->block(rank_));
    futex(&waiters_->n, FUTEX_WAKE_PRIVATE, 1, nullptr);
    for (int p = 0; p < size_; ++p)
      if (p != rank_)
        ring_bell(seg_->block(p));
    if (progress_.joinable())
      progress_.join();
    fail_all(errc::peer_lost, "the context was destroyed");
  }

  int rank() const noexcept override { return rank_; }
  int size() const noexcept override { return size_; }

  pair& to(int peer) override {
    if (peer < 0 || peer >= size_ || peer == rank_)
      throw_error(errc::invalid_argument, "shm transport: rank " + std::to_string(rank_) +
                                              ": no pair to rank " + std::to_string(peer) +
                                              " in a group of " + std::to_string(size_));
    return *pairs_.at(static_cast<std::size_t>(peer));
  }

  void make_pairs();

  operation_ptr send(int peer, uint64_t tag, std::vector<const_bytes> parts);
  /// A new send or receive of this rank with `peer`.
  op_ptr new_op(bool is_send, int peer, uint64_t tag);
  /// Fails `op` when the context takes no new operations (aborted, closed); whether it did.
  bool fail_if_refused(shm_op& op);
  operation_ptr recv(int peer, uint64_t tag, mutable_bytes into, bool at_most);

  void abort(const std::string& why, errc code = errc::peer_lost) override {
    {
      std::lock_guard<std::mutex> guard{state_mtx_};
      if (aborted_)
        return;
      aborted_ = true;
      abort_code_ = code;
      abort_why_ = why;
      auto& me = seg_->block(rank_);
      copy_reason(me, why);
      me.code = static_cast<int32_t>(code);
      me.state.store(aborted, std::memory_order_release);
    }
    for (int p = 0; p < size_; ++p)
      if (p != rank_)
        ring_bell(seg_->block(p));
    fail_all(code, "this rank aborted: " + why);
  }

  caf::error close(const std::string& reason, deadline until) override;

  /// One pass over every peer, after the one under way if any.
  void pass_blocking() {
    std::lock_guard<std::mutex> lock{progress_mtx_};
    pass();
  }

  /// One pass over every peer if no other thread is making progress; whether anything moved.
  bool poll() {
    std::unique_lock<std::mutex> lock{progress_mtx_, std::try_to_lock};
    if (!lock.owns_lock())
      return false;
    return pass();
  }

private:
  peer_link& link(int p) { return links_[static_cast<std::size_t>(p)]; }

  static void copy_reason(rank_block& b, const std::string& why) {
    auto n = std::min(why.size(), reason_bytes - 1);
    std::memcpy(b.reason, why.data(), n);
    b.reason[n] = '\0';
  }

  /// Why new operations are refused (empty: they are not), and the code.
  bool refused(errc& code, std::string& cause) {
    std::lock_guard<std::mutex> guard{state_mtx_};
    if (aborted_) {
      code = abort_code_;
      cause = "this rank aborted: " + abort_why_;
      return true;
    }
    if (closed_) {
      code = errc::shutdown;
      cause = "this rank has left the group (close was called)";
      return true;
    }
    return false;
  }

  /// Writes what fits of the queued sends to `l`'s ring; whether anything was written.
  /// @pre l.out_mtx is held.
  bool write_queued(peer_link& l) {
    bool wrote = false;
    auto& c = *l.out.control;
    while (!l.out_queue.empty()) {
      const auto& op = l.out_queue.front();
      const uint64_t head = c.head.load(std::memory_order_relaxed);
      const uint64_t tail = c.tail.load(std::memory_order_acquire);
      uint64_t space = l.out.capacity - (head - tail);
      // A frame header is written whole, so the reader never sees half of one.
      if (l.out_offset == 0 && space < sizeof(frame_header)) {
        c.wants_space.store(1, std::memory_order_seq_cst);
        if (c.tail.load(std::memory_order_seq_cst) != tail)
          continue;
        break;
      }
      uint64_t pos = head;
      std::size_t skip = l.out_offset;
      auto emit = [&](const std::byte* src, std::size_t n) {
        if (skip >= n) {
          skip -= n;
          return;
        }
        src += skip;
        n -= skip;
        skip = 0;
        auto take = static_cast<std::size_t>(std::min<uint64_t>(n, space));
        if (take == 0)
          return;
        l.out.put(pos, src, take);
        pos += take;
        space -= take;
        l.out_offset += take;
      };
      emit(reinterpret_cast<const std::byte*>(&op->header), sizeof(frame_header));
      for (const auto& part : op->parts)
        emit(part.data(), part.size());
      if (pos != head) {
        c.head.store(pos, std::memory_order_release);
        wrote = true;
      }
      if (l.out_offset < sizeof(frame_header) + op->header.bytes) {
        // The ring is full: ask the consumer to ring once it read, then look again, so that a
        // read between the two is not missed.
        c.wants_space.store(1, std::memory_order_seq_cst);
        if (c.tail.load(std::memory_order_seq_cst) != tail)
          continue;
        break;
      }
      // The last byte is in the ring: the send is done.
      op->complete({});
      l.out_queue.pop_front();
      l.out_offset = 0;
    }
    return wrote;
  }

  /// Starts reading the message of header `h` from `l`: finds its receive, or stashes it.
  /// @pre l.in_mtx is held.
  void begin_message(peer_link& l, const frame_header& h) {
    l.reading = true;
    l.current = h;
    l.current_got = 0;
    l.current_op.reset();
    l.current_stash.reset();
    l.current_text.clear();
    if (h.kind == goodbye_frame)
      return;
    auto it = l.posted.find(h.tag);
    if (it != l.posted.end() && !it->second.empty()) {
      auto op = it->second.front();
      it->second.pop_front();
      if (it->second.empty())
        l.posted.erase(it);
      if (fits(*op, h.bytes))
        l.current_op = std::move(op);
      else
        fail_mismatch(*op, h.bytes); // the message is dropped
      return;
    }
    auto s = std::make_shared<stash>(h.tag, static_cast<std::size_t>(h.bytes));
    l.stashed[h.tag].push_back(s);
    l.current_stash = std::move(s);
  }

  static bool fits(const shm_op& op, uint64_t bytes) {
    return op.at_most ? bytes <= op.into.size() : bytes == op.into.size();
  }

  static void fail_mismatch(shm_op& op, uint64_t bytes) {
    op.fail(errc::invalid_argument, "the message has " + std::to_string(bytes) +
                                        " bytes; expected " + (op.at_most ? "at most " : "") +
                                        std::to_string(op.into.size()) +
                                        " (the message is dropped)");
  }

  /// The message being read is complete.
  /// @pre l.in_mtx is held.
  void end_message(peer_link& l) {
    l.reading = false;
    if (l.current.kind == goodbye_frame) {
      l.goodbye = true;
      set_failed(l, errc::peer_left,
                 "rank " + std::to_string(l.rank) + " left the group: " + l.current_text);
      // Receives that no message of the peer can match any more.
      for (auto& [tag, ops] : l.posted)
        for (auto& op : ops)
          op->fail(l.fail_code, l.fail_cause);
      l.posted.clear();
      return;
    }
    if (l.current_op) {
      l.current_op->received = static_cast<std::size_t>(l.current.bytes);
      l.current_op->complete({});
      l.current_op.reset();
    }
    l.current_stash.reset();
  }

  /// Reads what has arrived from `l`'s peer; whether anything was read.
  /// @pre l.in_mtx is held.
  bool read_incoming(peer_link& l) {
    auto& c = *l.in.control;
    const uint64_t tail0 = c.tail.load(std::memory_order_relaxed);
    uint64_t tail = tail0;
    for (;;) {
      const uint64_t head = c.head.load(std::memory_order_acquire);
      uint64_t avail = head - tail;
      if (!l.reading) {
        if (avail < sizeof(frame_header))
          break;
        frame_header h{};
        l.in.get(tail, reinterpret_cast<std::byte*>(&h), sizeof h);
        tail += sizeof h;
        avail -= sizeof h;
        if ((h.kind != data_frame && h.kind != goodbye_frame) || h.bytes > max_message_bytes ||
            (h.kind == goodbye_frame && h.bytes > 4096)) {
          c.tail.store(tail, std::memory_order_release);
          lose_peer(l, errc::peer_lost,
                    "rank " + std::to_string(l.rank) + " sent a malformed frame (kind " +
                        std::to_string(h.kind) + ", " + std::to_string(h.bytes) + " bytes)");
          return true;
        }
        begin_message(l, h);
        if (h.bytes == 0) {
          end_message(l);
          continue;
        }
      }
      if (avail == 0)
        break;
      const auto remaining = static_cast<std::size_t>(l.current.bytes - l.current_got);
      const auto n = static_cast<std::size_t>(std::min<uint64_t>(avail, remaining));
      if (l.current_op) {
        l.in.get(tail, l.current_op->into.data() + l.current_got, n);
      } else if (l.current_stash) {
        l.in.get(tail, l.current_stash->data() + l.current_got, n);
        l.current_stash->got += n;
      } else if (l.current.kind == goodbye_frame) {
        auto at = l.current_text.size();
        l.current_text.resize(at + n);
        l.in.get(tail, reinterpret_cast<std::byte*>(l.current_text.data() + at), n);
      }
      tail += n;
      l.current_got += n;
      if (l.current_got == l.current.bytes)
        end_message(l);
    }
    if (tail == tail0)
      return false;
    c.tail.store(tail, std::memory_order_seq_cst);
    if (c.wants_space.load(std::memory_order_seq_cst) != 0) {
      c.wants_space.store(0, std::memory_order_relaxed);
      ring_bell(seg_->block(l.rank)); // space for the peer's queued sends
    }
    return true;
  }

  /// Marks `l`'s peer as failed (the first cause wins). @pre l.in_mtx is held.
  static void set_failed(peer_link& l, errc code, const std::string& cause) {
    if (l.failed.load())
      return;
    l.fail_code = code;
    l.fail_cause = cause;
    l.failed.store(true, std::memory_order_release);
  }

  /// The peer is gone for good: every operation with it fails with `code` and `cause`, except
  /// receives of messages already stashed.
  void lose_peer(peer_link& l, errc code, const std::string& cause) {
    // @pre l.in_mtx is held by the caller.
    set_failed(l, code, cause);
    for (auto& [tag, ops] : l.posted)
      for (auto& op : ops)
        op->fail(l.fail_code, l.fail_cause);
    l.posted.clear();
    if (l.current_op) {
      l.current_op->fail(l.fail_code, l.fail_cause + " (in the middle of the message)");
      l.current_op.reset();
    }
    l.reading = false;
    std::lock_guard<std::mutex> guard{l.out_mtx};
    for (auto& op : l.out_queue)
      op->fail(l.fail_code, l.fail_cause);
    l.out_queue.clear();
    l.out_offset = 0;
  }

  /// Looks at `l`'s peer's state: an aborted or destroyed peer fails the operations with it, once
  /// what it had written is read.
  /// @pre l.in_mtx is held.
  void check_peer(peer_link& l) {
    if (l.failed.load(std::memory_order_acquire) && !l.goodbye)
      return;
    auto& b = seg_->block(l.rank);
    const uint32_t state = b.state.load(std::memory_order_acquire);
    if (state == live)
      return;
    read_incoming(l); // deliver what it wrote before
    std::string reason(b.reason, strnlen(b.reason, reason_bytes));
    if (l.goodbye) {
      // It left cleanly; its sends to us are over. Our sends to it fail.
      std::lock_guard<std::mutex> guard{l.out_mtx};
      for (auto& op : l.out_queue)
        op->fail(errc::peer_left, l.fail_cause);
      l.out_queue.clear();
      l.out_offset = 0;
      return;
    }
    if (state == aborted)
      lose_peer(l, static_cast<errc>(b.code),
                "rank " + std::to_string(l.rank) + " aborted: " + reason);
    else
      lose_peer(l, errc::peer_lost, "rank " + std::to_string(l.rank) + " is gone: " + reason);
  }

  /// Checks that the peers' processes are alive.
  void check_liveness() {
    for (auto& l : links_) {
      if (l.rank < 0 || l.failed.load(std::memory_order_acquire))
        continue;
      auto& b = seg_->block(l.rank);
      const int pid = b.pid.load(std::memory_order_acquire);
      if (pid <= 0 || pid == static_cast<int>(getpid()))
        continue;
      auto s = status_of(pid);
      if (s.exists && !s.zombie && s.start_time == b.start_time.load(std::memory_order_relaxed))
        continue;
      std::lock_guard<std::mutex> guard{l.in_mtx};
      read_incoming(l);
      if (!l.goodbye)
        lose_peer(l, errc::peer_lost,
                  "rank " + std::to_string(l.rank) + " (pid " + std::to_string(pid) +
                      ") died: its process " + (s.exists ? "is a zombie" : "no longer exists"));
    }
  }

  /// One pass: every queued send, every incoming ring, every peer's state.
  /// @pre progress_mtx_ is held.
  bool pass() {
    bool moved = false;
    for (auto& l : links_) {
      if (l.rank < 0)
        continue;
      {
        std::lock_guard<std::mutex> guard{l.out_mtx};
        if (!l.out_queue.empty() && write_queued(l)) {
          moved = true;
          ring_bell(seg_->block(l.rank));
        }
      }
      std::lock_guard<std::mutex> guard{l.in_mtx};
      moved |= read_incoming(l);
      check_peer(l);
    }
    return moved;
  }

  void run_progress() {
    auto& me = seg_->block(rank_);
    auto next_check = clock::now() + opts_.liveness_interval;
    while (!stop_.load()) {
      const uint32_t w = waiters_->n.load(std::memory_order_seq_cst);
      if (auto now = clock::now(); waiters_->active(now)) {
        // Waiters make the progress; look again when the last one leaves with sends queued,
        // after the grace, or to check liveness.
        if (now >= next_check) {
          check_liveness();
          next_check = now + opts_.liveness_interval;
        }
        auto nap = std::chrono::duration_cast<std::chrono::nanoseconds>(std::min<clock::duration>(
            next_check - now, w > 0 ? opts_.liveness_interval : waiter_count::grace));
        timespec ts{};
        ts.tv_sec = static_cast<time_t>(nap.count() / 1'000'000'000);
        ts.tv_nsec = static_cast<long>(nap.count() % 1'000'000'000);
        futex(&waiters_->n, FUTEX_WAIT_PRIVATE, w, &ts);
        continue;
      }
      const uint32_t seen = me.bell.load(std::memory_order_seq_cst);
      bool moved;
      {
        std::lock_guard<std::mutex> lock{progress_mtx_};
        moved = pass();
      }
      if (moved)
        continue;
      auto now = clock::now();
      if (now >= next_check) {
        check_liveness();
        next_check = now + opts_.liveness_interval;
      }
      sleep_on_bell(me, seen, next_check - now);
    }
  }

  /// Fails every operation of this context with `code` and `cause`.
  void fail_all(errc code, const std::string& cause) {
    for (auto& l : links_) {
      if (l.rank < 0)
        continue;
      {
        std::lock_guard<std::mutex> guard{l.in_mtx};
        for (auto& [tag, ops] : l.posted)
          for (auto& op : ops)
            op->fail(code, cause);
        l.posted.clear();
        if (l.current_op) {
          l.current_op->fail(code, cause);
          l.current_op.reset();
        }
      }
      std::lock_guard<std::mutex> guard{l.out_mtx};
      for (auto& op : l.out_queue)
        op->fail(code, cause);
      l.out_queue.clear();
      // A partly written message stays partial: the peer sees this rank's state first.
    }
  }

  friend class shm_op;

  segment_ptr seg_;
  const int rank_;
  const int size_;
  const options opts_;
  std::vector<peer_link> links_;
  std::vector<std::unique_ptr<pair>> pairs_;

  std::mutex progress_mtx_;
  waiter_count_ptr waiters_ = std::make_shared<waiter_count>();
  std::thread progress_;
  std::atomic<bool> stop_{false};

  std::mutex state_mtx_;
  bool aborted_ = false;
  bool closed_ = false;
  errc abort_code_ = errc::peer_lost;
  std::string abort_why_;
};

class shm_pair final : public pair {
public:
  shm_pair(shm_context& ctx, int peer) : ctx_(ctx), peer_(peer) {}
  int peer_rank() const noexcept override { return peer_; }
  operation_ptr send(uint64_t tag, std::vector<const_bytes> parts) override {
    return ctx_.send(peer_, tag, std::move(parts));
  }
  operation_ptr recv(uint64_t tag, mutable_bytes into) override {
    return ctx_.recv(peer_, tag, into, false);
  }
  operation_ptr recv_at_most(uint64_t tag, mutable_bytes into) override {
    return ctx_.recv(peer_, tag, into, true);
  }

private:
  shm_context& ctx_;
  int peer_;
};

void shm_context::make_pairs() {
  pairs_.resize(static_cast<std::size_t>(size_));
  for (int p = 0; p < size_; ++p)
    if (p != rank_)
      pairs_[static_cast<std::size_t>(p)] = std::make_unique<shm_pair>(*this, p);
}

op_ptr shm_context::new_op(bool is_send, int peer, uint64_t tag) {
  return std::make_shared<shm_op>(weak_from_this(), seg_, waiters_, is_send, rank_, peer, tag,
                                  opts_.spin, opts_.liveness_interval);
}

bool shm_context::fail_if_refused(shm_op& op) {
  errc code{};
  std::string cause;
  if (!refused(code, cause))
    return false;
  op.fail(code, cause);
  return true;
}

operation_ptr shm_context::send(int peer, uint64_t tag, std::vector<const_bytes> parts) {
  auto op = new_op(true, peer, tag);
  op->parts = std::move(parts);
  op->header = {tag, op->bytes(), data_frame, 0};
  if (fail_if_refused(*op))
    return op;
  auto& l = link(peer);
  if (op->header.bytes > max_message_bytes) {
    op->fail(errc::invalid_argument,
             "a message may have at most " + std::to_string(max_message_bytes) + " bytes");
    return op;
  }
  bool wrote = false;
  {
    std::lock_guard<std::mutex> guard{l.out_mtx};
    if (l.failed.load(std::memory_order_acquire)) {
      op->fail(l.fail_code, l.fail_cause);
      return op;
    }
    l.out_queue.push_back(op);
    if (l.out_queue.size() == 1)
      wrote = write_queued(l);
    if (!op->done()) {
      op->in_backlog = true;
      waiters_->backlog.fetch_add(1, std::memory_order_seq_cst);
    }
  }
  if (wrote)
    ring_bell(seg_->block(peer));
  // (`in_backlog` is set under out_mtx, before anything can complete the queued send.)
  if (op->in_backlog)
    ring_bell(seg_->block(rank_)); // the progress thread writes the rest as space frees
  return op;
}

operation_ptr shm_context::recv(int peer, uint64_t tag, mutable_bytes into, bool at_most) {
  auto op = new_op(false, peer, tag);
  op->into = into;
  op->at_most = at_most;
  if (fail_if_refused(*op))
    return op;
  auto& l = link(peer);
  std::lock_guard<std::mutex> guard{l.in_mtx};
  auto it = l.stashed.find(tag);
  if (it != l.stashed.end() && !it->second.empty()) {
    auto s = it->second.front();
    it->second.pop_front();
    if (it->second.empty())
      l.stashed.erase(it);
    const bool in_flight = l.current_stash == s;
    if (!fits(*op, s->size)) {
      fail_mismatch(*op, s->size);
      if (in_flight)
        l.current_stash.reset(); // the rest of it is dropped
      return op;
    }
    if (s->got > 0)
      std::memcpy(op->into.data(), s->data(), s->got);
    if (in_flight) {
      // The rest of the message goes straight into the receive buffer.
      l.current_stash.reset();
      l.current_op = op;
    } else {
      op->received = s->size;
      op->complete({});
    }
    return op;
  }
  if (l.failed.load(std::memory_order_acquire)) {
    op->fail(l.fail_code, l.fail_cause);
    return op;
  }
  l.posted[tag].push_back(op);
  return op;
}

caf::error shm_context::close(const std::string& reason, deadline until) {
  {
    std::lock_guard<std::mutex> guard{state_mtx_};
    if (closed_ || aborted_)
      return {};
    closed_ = true;
  }
  // Pending receives end; posted sends go on, followed by the goodbye.
  for (auto& l : links_) {
    if (l.rank < 0)
      continue;
    bool lost;
    {
      std::lock_guard<std::mutex> guard{l.in_mtx};
      for (auto& [tag, ops] : l.posted)
        for (auto& op : ops)
          op->fail(errc::shutdown, "this rank has left the group (close was called)");
      l.posted.clear();
      // A peer that left still reads until it has this rank's goodbye; a lost one reads nothing.
      lost = l.failed.load(std::memory_order_acquire) && !l.goodbye;
    }
    if (lost)
      continue;
    auto op = new_op(true, l.rank, 0);
    // The goodbye owns its text: it may still be queued when close gives up.
    op->owned = reason.substr(0, 4096);
    op->parts = {
        const_bytes{reinterpret_cast<const std::byte*>(op->owned.data()), op->owned.size()}};
    op->header = {0, op->owned.size(), goodbye_frame, 0};
    std::lock_guard<std::mutex> guard{l.out_mtx};
    l.out_queue.push_back(op);
  }
  auto& me = seg_->block(rank_);
  ring_bell(me);
  for (;;) {
    const uint32_t seen = me.bell.load(std::memory_order_seq_cst);
    // A blocking pass: after it, whatever the progress thread read is seen below.
    pass_blocking();
    std::string waiting;
    for (auto& l : links_) {
      if (l.rank < 0)
        continue;
      std::lock_guard<std::mutex> guard{l.in_mtx};
      bool sent;
      {
        std::lock_guard<std::mutex> out_guard{l.out_mtx};
        sent = l.out_queue.empty();
      }
      if (!(sent && (l.goodbye || l.failed.load())))
        waiting += (waiting.empty() ? "" : ", ") + std::to_string(l.rank);
    }
    if (waiting.empty())
      return {};
    auto now = clock::now();
    if (now >= until)
      return make_caf_error(errc::collective_timeout,
                            "shm transport: rank " + std::to_string(rank_) + ": close: ranks " +
                                waiting +
                                " had not taken every message and left before the deadline");
    sleep_on_bell(me, seen, std::min<clock::duration>(until - now, opts_.liveness_interval));
  }
}

caf::error shm_op::wait(deadline until) {
  if (done())
    return result();
  waiters_->enter();
  struct leaving {
    waiter_count& w;
    ~leaving() { w.leave(); }
  } leave{*waiters_};
  auto spin_until = std::min(until, clock::now() + spin_);
  for (uint32_t i = 1;; ++i) {
    if ((i & 15) == 0) {
      if (auto ctx = ctx_.lock())
        ctx->poll();
    }
    if (done())
      return result();
    if ((i & 255) == 0) {
      if (clock::now() >= spin_until)
        break;
      std::this_thread::yield();
    } else {
      cpu_relax();
    }
  }
  // Then sleep on this rank's doorbell, which peers ring when they write to this rank and which
  // every completion rings, and make progress on each wake-up: one wake-up per hop instead of
  // two (progress thread, then waiter). The context is not held while sleeping, so that
  // destroying it (which rings the bell and fails every operation) is never delayed.
  auto& bell = seg_->block(self);
  for (;;) {
    const uint32_t seen = bell.bell.load(std::memory_order_seq_cst);
    if (auto ctx = ctx_.lock())
      ctx->pass_blocking();
    if (done())
      return result();
    auto now = clock::now();
    if (now >= until) {
      auto ms = std::chrono::duration<double, std::milli>(now - posted).count();
      return make_caf_error(errc::collective_timeout,
                            describe() + " did not complete before its deadline (posted " +
                                std::to_string(static_cast<int64_t>(ms)) + " ms ago)");
    }
    sleep_on_bell(bell, seen, std::min<clock::duration>(until - now, nap_));
  }
}

std::shared_ptr<shm_context> make_context(segment_ptr seg, int rank, const options& opts) {
  auto ctx = std::make_shared<shm_context>(std::move(seg), rank, opts);
  ctx->make_pairs();
  ctx->start();
  return ctx;
}

std::string hex(std::span<const std::byte> bytes, std::size_t max_chars) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (auto b : bytes) {
    out += digits[static_cast<unsigned>(b) >> 4];
    out += digits[static_cast<unsigned>(b) & 15];
  }
  return out.substr(0, max_chars);
}

/// The segment name of a group: an HMAC under the secret over the group, the size and rank 0's
/// nonce, so that only members can name it and each run gets a new one.
std::string segment_name(const options& opts, int size, std::span<const std::byte> nonce) {
  auth::transcript t("consort-shm-v1");
  t.u64(opts.group_id).u64(opts.epoch).u32(static_cast<uint32_t>(size)).bytes(nonce);
  auto mac = t.sign(opts.secret);
  return "/consort-" + hex(mac, 32);
}

} // namespace

std::string unavailable_reason() {
  auto nonce = auth::random_bytes(16);
  std::string name = "/consort-probe-" + std::to_string(getpid()) + "-" + hex(nonce, 16);
  auto seg = create_segment(name, 2, min_ring_bytes);
  shm_unlink(name.c_str());
  if (!seg)
    return to_consort_error(seg.error(), "").what();
  return {};
}

std::vector<context_ptr> make_group(int size, const options& opts) {
  if (auto err = check_options(opts, size))
    throw to_consort_error(err, "shm::make_group");
  auto nonce = auth::random_bytes(16);
  auto name = segment_name(opts, size, nonce);
  auto first = create_segment(name, size, opts.ring_bytes);
  if (!first)
    throw to_consort_error(first.error(), "shm::make_group");
  // Every rank maps the segment on its own, as ranks in other processes do.
  std::vector<segment_ptr> maps{*first};
  for (int r = 1; r < size; ++r) {
    auto seg = open_segment(name, size, opts.ring_bytes);
    if (!seg) {
      shm_unlink(name.c_str());
      throw to_consort_error(seg.error(), "shm::make_group");
    }
    maps.push_back(*seg);
  }
  shm_unlink(name.c_str());
  std::vector<context_ptr> group;
  for (int r = 0; r < size; ++r)
    group.push_back(make_context(maps[static_cast<std::size_t>(r)], r, opts));
  return group;
}

caf::expected<context_ptr> connect(context& bootstrap, const options& opts) {
  const int size = bootstrap.size();
  const int rank = bootstrap.rank();
  if (auto err = check_options(opts, size))
    return err;
  const auto until = clock::now() + opts.connect_timeout;
  // Messages: a status byte (0: ok, 1: failed) and then the nonce or the failure's text.
  auto message = [](uint8_t status, std::span<const std::byte> rest) {
    std::vector<std::byte> m(1 + rest.size());
    m[0] = std::byte{status};
    if (!rest.empty())
      std::memcpy(m.data() + 1, rest.data(), rest.size());
    return m;
  };
  auto text_bytes = [](const std::string& s) {
    return std::span<const std::byte>{reinterpret_cast<const std::byte*>(s.data()), s.size()};
  };
  auto failure_of = [](const std::vector<std::byte>& m, std::size_t n) {
    return std::string{reinterpret_cast<const char*>(m.data() + 1), n - 1};
  };
  constexpr std::size_t max_message = 1024;
  if (rank == 0) {
    auto nonce = auth::random_bytes(16);
    auto name = segment_name(opts, size, nonce);
    auto seg = create_segment(name, size, opts.ring_bytes);
    auto first =
        seg ? message(0, nonce) : message(1, text_bytes(to_consort_error(seg.error(), "").what()));
    std::vector<operation_ptr> sends;
    for (int p = 1; p < size; ++p)
      sends.push_back(bootstrap.to(p).send(tag_name, {const_bytes{first}}));
    if (auto err = wait_all(sends, until)) {
      shm_unlink(name.c_str());
      return err;
    }
    if (!seg)
      return seg.error();
    // Every rank answers whether it mapped the segment.
    std::string failures;
    caf::error transport_error;
    for (int p = 1; p < size; ++p) {
      std::vector<std::byte> answer(max_message);
      auto op = bootstrap.to(p).recv_at_most(tag_mapped, answer);
      if (auto err = op->wait(until)) {
        transport_error = err;
        break;
      }
      if (op->message_bytes() < 1 || answer[0] != std::byte{0})
        failures += " rank " + std::to_string(p) + ": " +
                    failure_of(answer, std::max<std::size_t>(op->message_bytes(), 1));
    }
    shm_unlink(name.c_str());
    if (transport_error)
      return transport_error;
    auto go = failures.empty() ? message(0, {}) : message(1, text_bytes(failures));
    sends.clear();
    for (int p = 1; p < size; ++p)
      sends.push_back(bootstrap.to(p).send(tag_go, {const_bytes{go}}));
    if (auto err = wait_all(sends, until))
      return err;
    if (!failures.empty())
      return make_caf_error(errc::peer_lost,
                            "shm transport: not every rank could map the segment:" + failures);
    return context_ptr{make_context(*seg, 0, opts)};
  }
  std::vector<std::byte> first(max_message);
  auto op = bootstrap.to(0).recv_at_most(tag_name, first);
  if (auto err = op->wait(until))
    return err;
  if (op->message_bytes() < 1 || first[0] != std::byte{0})
    return make_caf_error(errc::peer_lost,
                          "shm transport: rank 0 could not create the segment: " +
                              failure_of(first, std::max<std::size_t>(op->message_bytes(), 1)));
  if (op->message_bytes() != 17)
    return make_caf_error(errc::peer_lost, "shm transport: rank 0 sent a malformed segment "
                                           "announcement (" +
                                               std::to_string(op->message_bytes()) + " bytes)");
  auto name = segment_name(opts, size, std::span<const std::byte>{first.data() + 1, 16});
  auto seg = open_segment(name, size, opts.ring_bytes);
  auto answer =
      seg ? message(0, {}) : message(1, text_bytes(to_consort_error(seg.error(), "").what()));
  if (auto err = bootstrap.to(0).send(tag_mapped, {const_bytes{answer}})->wait(until))
    return err;
  std::vector<std::byte> go(max_message);
  auto go_op = bootstrap.to(0).recv_at_most(tag_go, go);
  if (auto err = go_op->wait(until))
    return err;
  if (!seg)
    return seg.error();
  if (go_op->message_bytes() < 1 || go[0] != std::byte{0})
    return make_caf_error(errc::peer_lost,
                          "shm transport: not every rank could map the segment:" +
                              failure_of(go, std::max<std::size_t>(go_op->message_bytes(), 1)));
  return context_ptr{make_context(*seg, rank, opts)};
}

} // namespace consort::transport::shm
