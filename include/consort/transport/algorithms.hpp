#pragma once

// Collective algorithms over the transport abstraction (Gloo's pattern: an algorithm is a class;
// its constructor does the setup, `run()` holds the hot loop). They see only `transport::context`
// and `transport::pair`, so the local (in-process) and TCP transports stand behind them alike.
// Steps and bytes on the wire of each: docs/algorithms.md.
//
// Common rules:
// - Every rank of the context calls the same algorithm with the same options (tag, thresholds,
//   chunk size) and agreeing sizes; `run()` returns an empty error on success.
// - `opts.timeout` bounds the whole operation: `run()` takes one deadline when it starts and
//   every wait uses it.
// - Errors keep the transport's code (`collective_timeout`, `peer_lost`, `invalid_argument` for
//   sizes that disagree between ranks) and name the algorithm, this rank, the step and the peer.
//   Argument errors found by the constructor (`invalid_argument`, `dtype_mismatch`) are returned by
//   `run()` before anything is sent.
// - When a step fails, operations already posted may still refer to the caller's buffers and to
//   the algorithm's scratch memory. With `abort_on_failure` (the default) `run()` therefore aborts
//   the context before it returns: nothing touches those buffers afterwards, and the peers fail
//   promptly with `peer_lost` instead of waiting for their own deadlines (the group must be rebuilt
//   through membership anyway, as after any failed collective).
// - Reductions: SUM, MIN, MAX and PROD on float32, float64, int32, int64 and uint8 (integers wrap
//   as TensorFlow's do); MEAN (SUM, then times 1/size) on float32 and float64 only. Integer MEAN
//   yields float64 (docs/semantics.md); the caller converts its integers to float64 and reduces
//   those with MEAN: the algorithms reject integer MEAN with `dtype_mismatch` rather than widen
//   behind the caller's back. bool is rejected (cast to int32 first), as by the host kernels.

#include <consort/reduce_op.hpp>
#include <consort/tensor.hpp>
#include <consort/transport/pair.hpp>

#include <caf/error.hpp>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

namespace consort::transport {

/// Options shared by every collective algorithm (Gloo's `AllreduceOptions`).
struct algorithm_options {
  /// Time the whole operation may take. `run()` turns it into one deadline when it starts.
  std::chrono::milliseconds timeout = std::chrono::seconds{30};

  /// Base tag, unique among the operations that run at the same time on the context, and below
  /// `max_tag`. The algorithm uses the tags `[tag << 24, (tag + 1) << 24)` for its messages (one
  /// per step; the chunks of a step share it and rely on the per-tag FIFO order of a pair).
  uint64_t tag = 0;

  /// Largest message of the pipelined algorithms (ring all-reduce, ring all-gather, chain
  /// broadcast): each block is cut into chunks of at most this many bytes, so that reducing or
  /// forwarding chunk k overlaps receiving chunk k + 1. Below it the algorithms pick their own
  /// size: about a quarter of a block (four per hop for the chain), but not below 256 KiB unless
  /// this option is smaller (docs/algorithms.md).
  size_t chunk_bytes = size_t{2} << 20;

  /// Bytes of receives the ring all-reduce keeps posted ahead of the one it waits for (its
  /// scratch: this many bytes of chunk slots, at least 2), and how far its first step's sends run
  /// ahead of its receives (docs/algorithms.md, "Why a window, and why pacing").
  size_t window_bytes = size_t{8} << 20;

  /// `all_reduce()` uses a latency-optimised algorithm up to this many bytes, the ring above.
  size_t small_bytes = size_t{64} << 10;

  /// `all_reduce()` below `small_bytes`: the direct exchange up to this many ranks (one round,
  /// (size - 1) messages per rank), recursive doubling above (log2(size) rounds).
  int direct_max_ranks = 8;

  /// `broadcast()` sends up to this many bytes down a binomial tree, more down a pipelined chain.
  size_t tree_max_bytes = size_t{64} << 10;

  /// Abort the context when a step fails (see the note at the top of this header). Turn it off
  /// only to observe each rank's own failure; then call `abort` on the context before releasing
  /// the buffers or the algorithm object.
  bool abort_on_failure = true;
};

/// Base tags must be below this (the low 24 bits of a message tag number the step).
inline constexpr uint64_t max_tag = uint64_t{1} << 40;

// -- all-reduce ---------------------------------------------------------------------------------

/// All-reduce over a ring: reduce-scatter, then all-gather, chunked and pipelined.
///
/// The buffer is cut into `size` segments, each segment into chunks. In `size - 1` reduce-scatter
/// steps each rank receives a chunk from its left neighbour, folds it into its buffer and forwards
/// the result to its right neighbour; the receive of the next chunk is posted before the current
/// one is reduced. Then `size - 1` all-gather steps pass the fully reduced segments around,
/// received straight into the caller's buffer. Bytes sent and received per rank: `2 (size - 1) /
/// size * B`. Every rank ends with bitwise identical values. Scratch: a window of chunks (8 MiB).
///
/// Thread safety: not thread-safe (one `run()` at a time); the context is shared.
class ring_all_reduce {
public:
  /// Reduces the `count` elements of `type` at `data` in place, across the ranks of `ctx`.
  /// @pre `data` holds `count` elements of `type` and stays valid until `run()` returns.
  ring_all_reduce(context_ptr ctx, void* data, size_t count, dtype type, reduce_op op,
                  const algorithm_options& opts = {});

  /// Out of place: reads the `count` elements at `in` and writes the result to `out`, with no copy
  /// of the input first (the first step sends and folds straight from `in`). `in` is only read.
  /// @pre `in` and `out` hold `count` elements of `type`, are equal or do not overlap, and stay
  /// valid until `run()` returns.
  ring_all_reduce(context_ptr ctx, const void* in, void* out, size_t count, dtype type,
                  reduce_op op, const algorithm_options& opts = {});

  /// Runs the collective; an empty error on success.
  caf::error run();

private:
  context_ptr ctx_;
  const std::byte* in_; // the input (== data_ in place)
  std::byte* data_;     // the output
  size_t count_;
  dtype type_;
  reduce_op op_;
  algorithm_options opts_;
  caf::error setup_error_;
  pair* left_ = nullptr;
  pair* right_ = nullptr;
  /// Element offsets of the segments (size + 1 entries).
  std::vector<size_t> segments_;
  /// Chunks per segment (the same for every segment, so that the steps line up).
  size_t chunks_ = 0;
  /// `window_` receive slots of one chunk each (not zero-filled: every byte is received before
  /// use).
  std::shared_ptr<std::byte> scratch_;
  size_t slot_bytes_ = 0;
  size_t window_ = 2;
};

/// All-reduce by direct exchange: every rank sends its whole buffer to every other rank in one
/// round and reduces the `size` buffers locally, in rank order.
///
/// One round trip of latency whatever the size (two ranks: one message each way), at the price of
/// `(size - 1) * B` bytes sent and received per rank: the algorithm for small tensors. Because
/// every rank folds the buffers in the order 0, 1, ..., size - 1, the results are bitwise
/// identical on every rank and equal a sequential reduction in rank order. Scratch: `size * B`.
///
/// Thread safety: not thread-safe (one `run()` at a time); the context is shared.
class direct_all_reduce {
public:
  /// As `ring_all_reduce`.
  direct_all_reduce(context_ptr ctx, void* data, size_t count, dtype type, reduce_op op,
                    const algorithm_options& opts = {});

  /// Runs the collective; an empty error on success.
  caf::error run();

private:
  context_ptr ctx_;
  std::byte* data_;
  size_t count_;
  dtype type_;
  reduce_op op_;
  algorithm_options opts_;
  caf::error setup_error_;
  std::vector<pair*> pairs_;
  /// One slot of `count` elements per rank (not zero-filled).
  std::shared_ptr<std::byte> scratch_;
};

/// All-reduce by recursive doubling, with the standard fix-up for a size that is not a power of
/// two (Thakur, Rabenseifner and Gropp 2005).
///
/// With `p` the largest power of two <= size and `r = size - p`: the first `2r` ranks pair up and
/// the even one hands its buffer to the odd one; the `p` remaining ranks exchange whole buffers in
/// log2(p) rounds with partners at distance 1, 2, 4, ...; the odd ranks hand the result back.
/// Bytes per rank: `log2(p) * B` (plus B for the pairs of the fix-up); rounds: `log2(p)` (+2).
/// Each exchange folds the lower ranks' value first, so the results are bitwise identical on every
/// rank. Scratch: B.
///
/// Thread safety: not thread-safe (one `run()` at a time); the context is shared.
class recursive_doubling_all_reduce {
public:
  /// As `ring_all_reduce`.
  recursive_doubling_all_reduce(context_ptr ctx, void* data, size_t count, dtype type, reduce_op op,
                                const algorithm_options& opts = {});

  /// Runs the collective; an empty error on success.
  caf::error run();

private:
  context_ptr ctx_;
  std::byte* data_;
  size_t count_;
  dtype type_;
  reduce_op op_;
  algorithm_options opts_;
  caf::error setup_error_;
  /// One buffer of `count` elements (not zero-filled).
  std::shared_ptr<std::byte> scratch_;
};

/// All-reduce that picks the algorithm by size: the direct exchange up to `opts.small_bytes`
/// (recursive doubling when there are more than `opts.direct_max_ranks` ranks), the ring above.
/// Every rank must pass the same count, dtype and options, so every rank picks the same.
caf::error all_reduce(const context_ptr& ctx, void* data, size_t count, dtype type, reduce_op op,
                      const algorithm_options& opts = {});

/// Out of place: `in` is only read, the result goes to `out` (the ring reads its input in place;
/// below `opts.small_bytes` the input is copied to `out` first, which costs little there).
/// @pre `in` and `out` hold `count` elements of `type` and are equal or do not overlap.
caf::error all_reduce(const context_ptr& ctx, const void* in, void* out, size_t count, dtype type,
                      reduce_op op, const algorithm_options& opts = {});

// -- all-gather ---------------------------------------------------------------------------------

/// All-gather over a ring, for contributions of different sizes ("ragged"); the output is the
/// contributions concatenated in rank order.
///
/// Each rank copies its contribution into place, then in `size - 1` steps receives the block that
/// originated `s + 1` ranks to its left from its left neighbour, straight into the output, and
/// forwards it to its right neighbour, chunk by chunk (a chunk is forwarded as soon as it has
/// arrived). Bytes per rank: sends `T - B[rank + 1]`, receives `T - B[rank]` (T: the total).
///
/// Thread safety: not thread-safe (one `run()` at a time); the context is shared.
class ring_all_gather {
public:
  /// Gathers `input` (this rank's `sizes[rank]` bytes) from every rank into `output` (the sum of
  /// `sizes` bytes). `input` may lie inside `output` at this rank's offset (gather in place).
  /// @pre `sizes` has one byte count per rank and is the same on every rank (see
  ///      `exchange_sizes`); the buffers stay valid until `run()` returns.
  ring_all_gather(context_ptr ctx, const_bytes input, mutable_bytes output,
                  std::vector<size_t> sizes, const algorithm_options& opts = {});

  /// Runs the collective; an empty error on success.
  caf::error run();

private:
  context_ptr ctx_;
  const_bytes input_;
  mutable_bytes output_;
  std::vector<size_t> sizes_;
  /// Byte offset of each rank's block in the output (size + 1 entries).
  std::vector<size_t> offsets_;
  algorithm_options opts_;
  caf::error setup_error_;
  pair* left_ = nullptr;
  pair* right_ = nullptr;
};

/// Exchanges each rank's byte count: on success `sizes[i]` is rank i's `mine`. One round of
/// 8-byte messages to and from every peer (little-endian on the wire). Uses the tag index
/// 0xffffff of `opts.tag`, so it can precede a `ring_all_gather` with the same base tag.
caf::error exchange_sizes(const context_ptr& ctx, size_t mine, std::vector<size_t>& sizes,
                          const algorithm_options& opts = {});

/// `exchange_sizes`, then `ring_all_gather` into `output` (resized to the total). When `sizes` is
/// not null it receives every rank's byte count.
caf::error all_gather(const context_ptr& ctx, const_bytes input, std::vector<std::byte>& output,
                      std::vector<size_t>* sizes = nullptr, const algorithm_options& opts = {});

// -- broadcast ----------------------------------------------------------------------------------

/// Broadcast down a binomial tree rooted at `root`: in round k every rank that has the data sends
/// it to the rank 2^k further on (relative to the root). ceil(log2(size)) rounds; the root sends B
/// bytes to each of up to log2(size) children, every other rank receives B once. For small
/// messages, where the latency of the rounds dominates.
///
/// Thread safety: not thread-safe (one `run()` at a time); the context is shared.
class binomial_broadcast {
public:
  /// Copies the root's `data` into `data` on every other rank (the same size on every rank).
  binomial_broadcast(context_ptr ctx, mutable_bytes data, int root,
                     const algorithm_options& opts = {});

  /// Runs the collective; an empty error on success.
  caf::error run();

private:
  context_ptr ctx_;
  mutable_bytes data_;
  int root_;
  algorithm_options opts_;
  caf::error setup_error_;
  /// The parent in the tree (null on the root) and the children, largest subtree first.
  pair* parent_ = nullptr;
  std::vector<pair*> children_;
};

/// Broadcast down a pipelined chain root -> root + 1 -> ... -> root - 1: the data is cut into
/// chunks and each rank forwards a chunk as soon as it has it. Every rank receives and sends B
/// once (the last sends nothing); time about B / bandwidth + (size - 2) chunk times. For large
/// messages, where the tree's log2(size) B at the root would dominate.
///
/// Thread safety: not thread-safe (one `run()` at a time); the context is shared.
class chain_broadcast {
public:
  /// As `binomial_broadcast`.
  chain_broadcast(context_ptr ctx, mutable_bytes data, int root,
                  const algorithm_options& opts = {});

  /// Runs the collective; an empty error on success.
  caf::error run();

private:
  context_ptr ctx_;
  mutable_bytes data_;
  int root_;
  algorithm_options opts_;
  caf::error setup_error_;
  pair* prev_ = nullptr;
  pair* next_ = nullptr;
};

/// Broadcast that picks the algorithm by size: the binomial tree up to `opts.tree_max_bytes`,
/// the pipelined chain above.
caf::error broadcast(const context_ptr& ctx, mutable_bytes data, int root,
                     const algorithm_options& opts = {});

} // namespace consort::transport
