#pragma once

// One collective of a group of workers, as a communicator runs it (transport/communicator.hpp):
// the call as this worker contributes it (`group_call`) and the algorithms of its two parts, each
// written as Gloo writes an algorithm (set up in the constructor, `run()` short):
//   1. `descriptor_exchange`: a fixed-size descriptor (step, seq, kind, op, axis/root, a hash of
//      structure, dtypes and shapes, this worker's local outcome, its element count) from every
//      worker to every other (one message each up to 8 workers, a ring all-gather beyond), so that
//      a call that disagrees between workers, or failed on one of them, fails on all of them with a
//      clear error instead of exchanging mismatched bytes. A small call's data travels in the same
//      message (it is fused), and so do an all-gather's extents;
//   2. the data: `fused_all_reduce`, `fused_broadcast` and the fused case of `group_all_gather`
//      read what came with the descriptors (the call took one round); `group_all_reduce`,
//      `group_all_gather` and `group_broadcast` otherwise run the transport's algorithms leaf by
//      leaf (transport/algorithms.hpp), or the call's own data phase (NCCL) runs instead.
// docs/multi_worker.md, "One collective's hops", draws the rounds.

#include <consort/collective_kind.hpp>
#include <consort/reduce_op.hpp>
#include <consort/tensor.hpp>
#include <consort/transport/algorithms.hpp>
#include <consort/transport/pair.hpp>

#include <caf/error.hpp>
#include <caf/expected.hpp>

#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace consort::transport {

/// 64-bit FNV-1a of `s`: call signatures in descriptors, group ids of meshes.
uint64_t fnv1a(const std::string& s) noexcept;

/// "worker 0 (the chief)", "worker 3": how errors name a rank of a group of workers.
std::string worker_name(int rank);

/// One collective as this worker contributes it to a group call.
/// Who entered a call between workers last, and by how long after the one before it (by the
/// workers' system clocks, which agree to well within a step on one host or under NTP). Written
/// by the call's thread, read once the call ended.
struct call_lateness {
  std::atomic<int32_t> last{-1};
  std::atomic<int64_t> margin_ns{0};
};

struct group_call {
  collective_kind kind = collective_kind::all_reduce;
  reduce_op op = reduce_op::sum;
  /// all_gather: the (normalised) axis; reduce: unused.
  int64_t axis = 0;
  /// broadcast: the root replica id in sync group.
  int root = 0;
  /// Identifies the call in errors: "all_reduce(SUM) #0 of step 3". May be left empty when
  /// `make_what` is set, which errors call instead (a call that succeeds formats no text).
  std::string what;
  std::function<std::string()> make_what;
  /// Position of the call: every worker must be at the same one.
  uint64_t step = 0;
  uint32_t seq = 0;
  /// What every worker must agree on (structure, dtypes, shapes except a gather's axis), as text;
  /// or, left empty, as `signature_hash` (fnv1a of the text) with `make_signature` to make the text
  /// only when the workers disagree (a call that succeeds formats no text).
  std::string signature;
  uint64_t signature_hash = 0;
  std::function<std::string()> make_signature;
  /// Set when the call failed on this worker already: the other workers learn it in the
  /// descriptor and fail too.
  caf::error local_failure;
  /// This worker's part, one tensor per leaf: the local partial reduction (all_reduce; MEAN as a
  /// SUM, integers widened to float64), the local concatenation (all_gather), the root's value or
  /// an uninitialised tensor of the same dtype and shape (broadcast).
  std::vector<tensor> leaves;
  /// When set, a vector whose capacity a fused all-reduce's result takes (its elements are
  /// dropped), so that a caller that gives the result's vector back here after each call
  /// allocates none: a lone replica's thread keeps one.
  std::vector<tensor>* result_capacity = nullptr;
  /// all_reduce: `leaves` are the caller's own tensors (a lone replica's inputs, not a partial
  /// made for the call), so the reduction writes fresh outputs and only reads them.
  bool leaves_are_inputs = false;
  /// all_reduce MEAN: the number of values this worker summed (replicas, or elements along the
  /// reduced axis); the result is divided by the sum over all workers.
  double count = 0;
  /// all_reduce MEAN: leave the result a SUM and only report `total_count` (the caller divides,
  /// e.g. as a reduce along an axis does).
  bool defer_mean = false;
  /// Set by the descriptor exchange: the sum of `count` over every worker.
  double total_count = 0;
  /// Bounds the whole call.
  std::chrono::milliseconds timeout{std::chrono::seconds(30)};
  /// Bits that travel in the descriptor; the exchange sets `all_flags` to their OR over every
  /// worker before the data phase (e.g. "my NCCL communicator must be rebuilt", so all rebuild
  /// together).
  uint8_t flags = 0;
  uint8_t all_flags = 0;
  /// When set, the descriptor exchange sets bit w as worker w's descriptor arrives (this worker's
  /// own included by the caller), also when the call then fails: the flight recorder's view of
  /// who reached the call (actors/flight_recorder.hpp). Up to 64 workers.
  std::atomic<uint64_t>* arrivals = nullptr;
  /// When set, a descriptor exchange that succeeded stores who entered the call last and by how
  /// much after the one before (the flight recorder's stragglers).
  call_lateness* lateness = nullptr;
  /// When this worker entered the call, if its caller read the clock already (the flight
  /// recorder's start): the call's deadline is `entered + timeout`. Left default, the
  /// communicator reads the clock when the call starts.
  std::chrono::steady_clock::time_point entered{};
  /// `entered` on the system clock (ns since the Unix epoch), for `call_descriptor::entered_ns`;
  /// 0: the exchange reads the system clock.
  int64_t entered_unix_ns = 0;
  /// Added to this worker's system clock for `call_descriptor::entered_ns`: the chief's clock
  /// against this worker's (membership heartbeats), so that the workers of several hosts compare
  /// their entry times on one clock.
  int64_t clock_offset_ns = 0;
  /// Broadcasts bytes from worker 0 to every worker over the group (for `data_phase`).
  using share_fn = std::function<caf::error(std::vector<uint8_t>&)>;
  /// When set, replaces the transport's data phase (NCCL for GPU replicas): called once every
  /// worker's descriptor agreed, with `share` and the time left; its result is the call's. Every
  /// worker must set it for the same calls (put it in `signature`, so a disagreement is a
  /// collective_mismatch rather than a hang).
  std::function<caf::expected<std::vector<tensor>>(
      const share_fn& share, std::chrono::milliseconds left, uint8_t all_flags)>
      data_phase;

  /// `what`, or what `make_what` makes.
  std::string name() const { return what.empty() && make_what ? make_what() : what; }
  /// `signature`, or what `make_signature` makes.
  std::string signature_text() const;
  /// The hash the descriptor carries: fnv1a(signature), or `signature_hash` when `signature` is
  /// empty.
  uint64_t hash() const noexcept;
};

/// Where a call's algorithms take their tags and how much time each has left: every algorithm
/// run takes the next base tag of the call's lane, so that the tag sequence is the same on every
/// worker (a leaf with nothing to send still takes one).
class call_clock {
public:
  using clock = std::chrono::steady_clock;

  /// `next_tag` is the lane's counter; the lane `lane` of `lanes` takes every `lanes`-th tag.
  call_clock(uint64_t& next_tag, uint64_t lane, uint64_t lanes, clock::time_point until)
      : next_tag_(&next_tag), lane_(lane), lanes_(lanes), until_(until) {}

  /// Options for the next algorithm run: its tag, and the time left (at least 1 ms).
  algorithm_options next();
  /// Options with the next tag only, for an exchange that waits until `until()` itself: no clock
  /// read (their timeout is left at its default, which nothing reads).
  algorithm_options next_tag() {
    algorithm_options opts;
    opts.tag = take();
    return opts;
  }
  /// Skips a tag (a leaf with nothing to exchange).
  void skip() { (void)take(); }
  clock::time_point until() const noexcept { return until_; }
  /// The lane whose tags this clock takes (its lockstep channel, context::mailbox).
  int lane() const noexcept { return static_cast<int>(lane_); }
  /// The time left, at least 1 ms.
  std::chrono::milliseconds left() const;

private:
  uint64_t take() { return 1 + lanes_ * (*next_tag_)++ + lane_; }

  uint64_t* next_tag_;
  uint64_t lane_;
  uint64_t lanes_;
  clock::time_point until_;
};

/// The descriptor every worker sends every other at the start of a call: its first
/// `header_bytes` (one cache line), then either a fused call's data or, from a worker whose call
/// failed, the text of its error.
struct call_descriptor {
  /// What every worker sends; a fused call's data (or a failed call's text) follows.
  static constexpr size_t header_bytes = 64;
  static constexpr size_t text_bytes = 192;
  uint8_t failed = 0;
  uint8_t kind = 0;
  uint8_t op = 0;
  uint8_t error_code = 0;
  int32_t root = 0;
  int64_t axis = 0;
  uint64_t step = 0;
  uint32_t seq = 0;
  uint32_t num_leaves = 0;
  double count = 0;
  uint64_t signature_hash = 0;
  /// When the sender entered the call (its descriptor exchange began), in ns since the Unix epoch
  /// on the chief's clock (its system clock plus group_call::clock_offset_ns): who came last, and
  /// by how much (call_lateness).
  int64_t entered_ns = 0;
  /// group_call::flags of the sender (OR-ed over every worker into all_flags).
  uint8_t flags = 0;
  /// 1: the sender's data follows this descriptor in its message (a fused all-reduce or
  /// all-gather, or the root's worker of a fused broadcast).
  uint8_t fused = 0;
  uint8_t reserved[6] = {};
  /// The local error (failed only), truncated, NUL-padded; sent only when failed.
  char text[text_bytes] = {};

  /// The bytes of this descriptor that its message carries (in the full form).
  size_t wire_bytes() const noexcept { return failed ? sizeof(call_descriptor) : header_bytes; }

  /// The compact form, for the commonest call: an all-reduce of one leaf of one value a worker
  /// (count 1, root and axis 0, no error). 32 bytes, so that with a lockstep slot's own words and
  /// up to 8 bytes of data the message fills one cache line. Its first byte is `compact_format`,
  /// which the full form's first byte (`failed`: 0 or 1) never is; then op, flags, fused, the
  /// call's number (4 bytes), step, signature hash and entry time (8 bytes each).
  static constexpr size_t compact_bytes = 32;
  static constexpr uint8_t compact_format = 2;
  /// Whether this descriptor has a compact form.
  bool compactable() const noexcept;
  /// Writes the compact form to `out` (compact_bytes). @pre compactable()
  void write_compact(std::byte* out) const noexcept;
  /// Reads a compact form: this descriptor's header becomes the call it stands for.
  void read_compact(const std::byte* in) noexcept;
  /// The byte offsets of the compact form's fields.
  static constexpr size_t compact_op = 1, compact_flags = 2, compact_fused = 3, compact_seq = 4,
                          compact_step = 8, compact_hash = 16, compact_entered = 24;
};
static_assert(offsetof(call_descriptor, text) == call_descriptor::header_bytes);
static_assert(sizeof(call_descriptor) == 256);

/// What a lone all-reduce (below) did before the descriptor exchange took its call over: under
/// `base_tag`, it put this worker's message to the first `puts` peers in the exchange's order (all
/// of them, or up to a put that failed), and took the peers' messages in the exchange's order (each
/// one in `got`) up to an empty one or a take that failed (`failed`, from `failed_peer`).
struct taken_messages {
  uint64_t base_tag = 0;
  int puts = 0;
  std::array<bool, 8> has{};
  std::array<const_bytes, 8> got{};
  int failed_peer = -1;
  caf::error failed;
};

/// Part 1 of a group call: every worker's descriptor to every other, a small call's data with it.
/// `run()` fails with the call's error (the same on every worker) when a worker's call failed
/// locally, the workers disagree, or the exchange failed; the local failure wins on this worker.
/// Afterwards the accessors say what came from each peer.
class descriptor_exchange {
public:
  /// A fused call's data at most (algorithm_options::small_bytes' range).
  static constexpr size_t fused_max_bytes = size_t{64} << 10;
  /// The most data a call may have to send its descriptor in the compact form.
  static constexpr size_t compact_max_data = 4096;
  /// Groups up to this many workers exchange descriptors (and fused data) directly, one message to
  /// every other worker; larger ones by a ring all-gather (without data).
  static constexpr int direct_max_workers = 8;
  /// The most of a signature's text that a mismatch exchanges and names.
  static constexpr size_t signature_text_max = 4096;

  /// `scratch` is the lane's buffer where the peers' messages land (grown as needed; it must
  /// outlive the call's data phase). `devices_per_worker` locates a broadcast's root worker.
  /// `resumed`: the exchange a lone all-reduce began in the lockstep channel (its message put,
  /// some peers' taken), which this one carries on from as if it had made those moves itself.
  descriptor_exchange(const context_ptr& ctx, group_call& call, int devices_per_worker,
                      std::vector<std::byte>& scratch, call_clock& clock,
                      const taken_messages* resumed = nullptr);

  descriptor_exchange(const descriptor_exchange&) = delete; // `all_` points into this object
  descriptor_exchange& operator=(const descriptor_exchange&) = delete;

  caf::error run();

  /// Whether the peers' messages came one by one (up to 8 workers), with data when fused.
  bool direct() const noexcept { return direct_; }
  /// Whether this worker's data travelled with its descriptor.
  bool sent_data() const noexcept { return mine_.fused != 0; }
  /// Whether worker `p`'s data came with its descriptor.
  bool fused(int p) const noexcept { return all_[p].fused != 0; }
  /// Bytes of worker `p`'s message as if its descriptor had come in the full form (direct
  /// exchange only): call_descriptor::header_bytes and what came after it.
  size_t received(int p) const noexcept {
    if (p >= direct_max_workers || got_[static_cast<size_t>(p)] == 0)
      return 0;
    return got_[static_cast<size_t>(p)] - header_of_[static_cast<size_t>(p)] +
           call_descriptor::header_bytes;
  }
  /// What came after worker `p`'s descriptor in its message (direct exchange only): in the
  /// lane's scratch, or where the transport's mailbox holds it until the next call.
  const std::byte* payload(int p) const noexcept {
    return message_[static_cast<size_t>(p)] + header_of_[static_cast<size_t>(p)];
  }
  /// Whether the all-gather extents travelled with the descriptors.
  bool extents_sent() const noexcept { return gather_extents_; }
  /// Bytes of this worker's data.
  size_t data_bytes() const noexcept { return data_bytes_; }
  /// The worker of a broadcast's root replica.
  int root_worker() const noexcept { return root_worker_; }

private:
  std::byte* slot(int p) const noexcept;
  /// Sets bit `p` of the call's arrivals (when it has them). Only the call's thread writes them
  /// while the call runs, so this is a load and a store, not a read-modify-write.
  void mark_arrived(int p) noexcept {
    if (call_.arrivals != nullptr)
      call_.arrivals->store(call_.arrivals->load(std::memory_order_relaxed) | (uint64_t{1} << p),
                            std::memory_order_relaxed);
  }
  void describe_mine();
  /// This worker's message to every peer: its descriptor, the extents, a fused call's data.
  send_parts my_message() const;
  caf::error exchange_direct();
  /// The direct exchange through the context's lockstep channel of the call's lane.
  caf::error exchange_in_mailbox(mailbox& box, const send_parts& parts,
                                 const algorithm_options& opts);
  /// Takes in worker `p`'s message: its descriptor (and error text), its size, where it lies.
  caf::error accept(int p, const_bytes message);
  caf::error exchange_ring();
  caf::error check_outcomes() const;
  caf::error check_agreement();
  caf::error signature_texts(std::vector<std::string>& texts);
  caf::error failure(const caf::error& err) const;

  const context_ptr& ctx_;
  group_call& call_;
  std::vector<std::byte>& scratch_;
  call_clock& clock_;
  const taken_messages* resumed_;
  int rank_;
  int size_;
  int root_worker_;
  bool direct_;
  bool gather_extents_ = false;
  size_t data_bytes_ = 0;
  call_descriptor mine_;
  std::vector<int64_t> my_extents_;
  /// Every worker's descriptor, by rank: in `direct_all_` up to 8 workers (no allocation on a
  /// call's way, and no 2 KiB cleared on it either: each worker's descriptor is written before it
  /// is read), else in `ring_all_`.
  alignas(call_descriptor) std::byte direct_all_[direct_max_workers * sizeof(call_descriptor)];
  std::vector<call_descriptor> ring_all_;
  call_descriptor* all_ = nullptr;
  /// Bytes of each peer's message, its descriptor's (compact or full), and where it lies (direct
  /// exchange only).
  std::array<size_t, direct_max_workers> got_{};
  std::array<size_t, direct_max_workers> header_of_{};
  std::array<const std::byte*, direct_max_workers> message_{};
  /// This worker's descriptor in the compact form, when it sends that (a call with one, of up to
  /// `compact_max_data` bytes of data).
  bool send_compact_ = false;
  alignas(8) std::byte compact_[call_descriptor::compact_bytes];
};

/// A worker's only replica's all-reduce of one small tensor, as `lone_all_reduce` runs it: what
/// the descriptor needs, and the hooks of the flight recorder.
struct lone_call {
  reduce_op op = reduce_op::sum;
  /// As the general call has them (group_call::axis and root), so that the descriptors agree.
  int64_t axis = 0;
  int root = 0;
  uint64_t step = 0;
  uint32_t seq = 0;
  uint64_t signature_hash = 0;
  /// The replica's tensor, read in place.
  const tensor* input = nullptr;
  std::chrono::milliseconds timeout{std::chrono::seconds(30)};
  std::chrono::steady_clock::time_point entered{};
  int64_t entered_unix_ns = 0;
  int64_t clock_offset_ns = 0;
  std::atomic<uint64_t>* arrivals = nullptr;
  call_lateness* lateness = nullptr;
  /// Makes the general form of this call (its texts, its leaves, everything above), for the
  /// descriptor exchange to take it over (group_call's fields as that worker's general path sets
  /// them).
  std::function<void(group_call&)> complete;
};

/// The lean path of the commonest small call, a lone replica's all-reduce of one tensor that fits
/// a lockstep slot with its descriptor: the descriptor exchange and the fused all-reduce in one
/// pass, with nothing built that a matched call does not need. It sends exactly the message the
/// general exchange sends, and a peer may take either path. It takes each peer's message and
/// compares its descriptor with its own call's; when all are that call (the same step, number,
/// op, signature, one leaf each of one replica, no flags, nothing failed, data along) it folds the
/// data in rank order, as `fused_all_reduce` does, to the same bits. Anything else (a take that
/// failed, a message that is not that, a peer's error) is left to the descriptor exchange, which
/// carries on from `taken()` and makes every error and every other outcome the general path makes.
class lone_all_reduce {
public:
  /// Whether `t` reduced with `op` can take this path on `ctx` (one to 8 workers, its lockstep
  /// channel `box`, a CPU tensor of 1 to `max_bytes`, an op its dtype reduces in place).
  static bool fits(const context& ctx, const mailbox* box, const tensor& t, reduce_op op) noexcept;
  /// The largest tensor this path takes: a descriptor and its data fit a slot of the channel.
  static constexpr size_t max_bytes = descriptor_exchange::compact_max_data;

  /// `base_tag` is the call's tag of its lane (call_clock::next_tag), `until` its deadline.
  lone_all_reduce(context& ctx, mailbox& box, const lone_call& call, uint64_t base_tag,
                  deadline until);

  /// The result, or nothing: then `taken()` says how far it went, and the descriptor exchange
  /// takes the call over.
  std::optional<tensor> run();
  const taken_messages& taken() const noexcept { return taken_; }

private:
  bool matches(const_bytes message) const noexcept;

  context& ctx_;
  mailbox& box_;
  const lone_call& call_;
  deadline until_;
  int rank_;
  int size_;
  alignas(64) call_descriptor mine_;
  alignas(8) std::byte compact_[call_descriptor::compact_bytes];
  taken_messages taken_;
};

/// Part 2 of a small all-reduce whose data came with the descriptors: every worker's leaves
/// folded in rank order, the same order (and so the same bits) on every worker.
class fused_all_reduce {
public:
  fused_all_reduce(const descriptor_exchange& exchange, const context& ctx, group_call& call);
  caf::expected<std::vector<tensor>> run();

private:
  const descriptor_exchange& exchange_;
  group_call& call_;
  int rank_;
  int size_;
};

/// Part 2 of an all-reduce over the transport's algorithms, leaf by leaf (MEAN divides by the
/// count over every worker unless the call defers it).
class group_all_reduce {
public:
  group_all_reduce(const context_ptr& ctx, group_call& call, call_clock& clock);
  caf::expected<std::vector<tensor>> run();

private:
  const context_ptr& ctx_;
  group_call& call_;
  call_clock& clock_;
};

/// Part 2 of a ragged all-gather: every worker's extents (from the descriptors, or a ring round),
/// then every worker's part (from the descriptors when every part came along, or a ring
/// all-gather per leaf), concatenated along the axis in worker order.
class group_all_gather {
public:
  group_all_gather(const context_ptr& ctx, const descriptor_exchange& exchange, group_call& call,
                   call_clock& clock);
  caf::expected<std::vector<tensor>> run();

private:
  caf::error gather_extents();
  caf::expected<tensor> gather_leaf(size_t i);

  const context_ptr& ctx_;
  const descriptor_exchange& exchange_;
  group_call& call_;
  call_clock& clock_;
  int rank_;
  int size_;
  size_t leaves_;
  /// extents_[w * leaves_ + i]: worker w's extent of leaf i along the axis.
  std::vector<int64_t> extents_;
  /// Bytes per unit of the axis, leaf by leaf (the other extents agree on every worker).
  std::vector<size_t> units_;
  /// Whether every worker's part came with its descriptor.
  bool all_fused_ = false;
  /// Where worker w's part of the next leaf starts in its message (all_fused_ only).
  std::vector<size_t> data_at_;
};

/// Part 2 of a broadcast: from the root's descriptor when its data came along (one round),
/// otherwise the transport's broadcast leaf by leaf.
class group_broadcast {
public:
  group_broadcast(const context_ptr& ctx, const descriptor_exchange& exchange, group_call& call,
                  call_clock& clock);
  caf::expected<std::vector<tensor>> run();

private:
  caf::expected<std::vector<tensor>> from_descriptor();

  const context_ptr& ctx_;
  const descriptor_exchange& exchange_;
  group_call& call_;
  call_clock& clock_;
  int rank_;
};

/// An algorithm's error as the call reports it: "<what> failed between workers: <cause>".
caf::error failed_between_workers(const caf::error& err, const std::string& what);

} // namespace consort::transport
