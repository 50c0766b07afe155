#pragma once

// The shared-memory segment of the shm transport: its layout, one process's mapping of it,
// creating and opening it, and the /proc look-up that tells whether a peer's process still lives.
//
// Layout of the segment (all offsets page-aligned):
//   header | one rank_block per rank | one ring_control per ordered pair | the mailboxes |
//   the rings' bytes
// A ring from rank s to rank r is written only by s (under s's out lock of that peer) and read
// only by r (under r's in lock of that peer): single producer, single consumer, with `head`
// (bytes written) and `tail` (bytes read) as the only shared words. A rank's doorbell is a futex
// word in its block (doorbell.hpp); peers ring it after they wrote to it or freed space for it.

#include <consort/transport/shm.hpp>

#include <caf/error.hpp>
#include <caf/expected.hpp>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include <sys/mman.h>

namespace consort::transport::shm::impl {

constexpr uint64_t segment_magic = 0x32'74'72'6f'73'6e'6f'63; // "consort2"
constexpr std::size_t page = 4096;
constexpr std::size_t min_ring_bytes = 4096;
constexpr std::size_t reason_bytes = 192;

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

/// The lockstep channels of a group (transport::mailbox; a communicator's two lanes), and the
/// largest group that has them: each ordered pair of ranks has two slots per channel.
constexpr int mailbox_channels = 2;
constexpr int mailbox_max_ranks = 8;
constexpr std::size_t mailbox_slot_bytes = 8192;

/// One slot of a lockstep channel from one rank to another: messages 1, 3, 5, ... of the channel
/// take slot 1, the others slot 0. Written only by the sender; `seq` (the message's number) is
/// stored last, and the receiver reads the rest once it sees it.
struct mailbox_slot {
  std::atomic<uint64_t> seq;
  uint64_t tag;
  uint32_t bytes;
  uint32_t reserved;
  /// The message: at offset 24, so that a compact 32-byte descriptor and up to 8 bytes of data
  /// share the slot's first cache line with `seq` (one line from sender to receiver), and a full
  /// 64-byte descriptor and a few bytes of data its first two.
  std::byte data[mailbox_slot_bytes - 24];
};
static_assert(sizeof(mailbox_slot) == mailbox_slot_bytes);
static_assert(offsetof(mailbox_slot, data) == 24);

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

inline std::size_t round_up(std::size_t n, std::size_t to) {
  return (n + to - 1) / to * to;
}

/// Where everything lives in a segment of `ranks` ranks.
struct layout {
  std::size_t blocks;    // offset of the rank blocks
  std::size_t controls;  // offset of the ring controls
  std::size_t mailboxes; // offset of the mailbox slots (none beyond mailbox_max_ranks)
  std::size_t rings;     // offset of the rings' bytes
  std::size_t total;

  layout(int ranks, std::size_t ring_bytes) {
    const auto n = static_cast<std::size_t>(ranks);
    const std::size_t pairs = n * (n - 1);
    blocks = page;
    controls = blocks + round_up(n * sizeof(rank_block), page);
    mailboxes = controls + round_up(std::max<std::size_t>(pairs, 1) * sizeof(ring_control), page);
    rings = mailboxes + (ranks <= mailbox_max_ranks
                             ? pairs * mailbox_channels * 2 * sizeof(mailbox_slot)
                             : std::size_t{0});
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
  /// Whether the group has lockstep channels (at most mailbox_max_ranks ranks).
  bool has_mailboxes() const { return ranks_ <= mailbox_max_ranks; }
  /// Slot `which` (0 or 1) of lockstep channel `channel` from `from` to `to`.
  /// @pre has_mailboxes()
  mailbox_slot& mailbox(int from, int to, int channel, int which) {
    const std::size_t i =
        (ring_index(from, to) * mailbox_channels + static_cast<std::size_t>(channel)) * 2 +
        static_cast<std::size_t>(which);
    return reinterpret_cast<mailbox_slot*>(base_ + layout_.mailboxes)[i];
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

/// strerror's text of `err` and its number.
std::string errno_text(int err);

/// Checks a group's size and options (ring size a power of two of at least min_ring_bytes,
/// positive liveness interval); invalid_argument saying which is wrong.
caf::error check_options(const options& opts, int size);

/// Creates, sizes (reserving the memory, so that a full /dev/shm is an error here and not a
/// SIGBUS later) and maps segment `name` with mode 0600, and initializes its header.
caf::expected<segment_ptr> create_segment(const std::string& name, int ranks,
                                          std::size_t ring_bytes);

/// Opens and maps segment `name`, checking that it is what the creator said.
caf::expected<segment_ptr> open_segment(const std::string& name, int ranks, std::size_t ring_bytes);

/// Field 22 of /proc/<pid>/stat (the start time), and whether the process is a zombie; `exists`
/// is false when there is no such process.
struct process_status {
  bool exists = false;
  bool zombie = false;
  uint64_t start_time = 0;
};

process_status status_of(int pid);

} // namespace consort::transport::shm::impl
