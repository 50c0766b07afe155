#pragma once

// What the collective algorithms share: message tags, error reports that name the step and the
// peer, argument checks, block layout, and the element-wise combine kernel.

#include <consort/caf_error.hpp>
#include <consort/error.hpp>
#include <consort/reduce_op.hpp>
#include <consort/tensor.hpp>
#include <consort/transport/algorithms.hpp>
#include <consort/transport/pair.hpp>

#include <caf/error.hpp>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace consort::transport::detail {

// -- tags -----------------------------------------------------------------------------------------

/// Bits of a message tag that number the step inside one operation.
inline constexpr unsigned step_bits = 24;

/// The tag of step `index` of the operation with base tag `base` (< max_tag).
constexpr uint64_t message_tag(uint64_t base, uint64_t index) noexcept {
  return (base << step_bits) | (index & ((uint64_t{1} << step_bits) - 1));
}

/// The step index that `exchange_sizes` uses (the last one, so it never meets a ring step).
inline constexpr uint64_t sizes_step = (uint64_t{1} << step_bits) - 1;

// -- errors ---------------------------------------------------------------------------------------

/// Who is running: "ring_all_reduce (rank 1 of 4, tag 7)", the prefix of every error.
std::string who(const char* algorithm, const context& ctx, uint64_t tag);

/// The error of a failed wait: keeps the transport's code and says which algorithm, step and peer
/// failed; aborts the context first when `opts.abort_on_failure` (posted operations may still
/// refer to buffers that are about to be released).
/// `step` reads like "reduce-scatter step 2 of 3, chunk 1 of 4"; `action` is "send to" or
/// "receive from".
caf::error step_failed(context& ctx, const algorithm_options& opts, const char* algorithm,
                       const std::string& step, const char* action, int peer,
                       const caf::error& cause);

/// An argument error found before anything was sent.
caf::error argument_error(errc code, const char* algorithm, const context& ctx, uint64_t tag,
                          const std::string& what);

/// Checks the tag and the timeout of `opts`; an empty error when they are usable.
caf::error check_options(const char* algorithm, const context& ctx, const algorithm_options& opts);

/// Checks that `op` can reduce `type` (see the rules in algorithms.hpp).
caf::error check_reduction(const char* algorithm, const context& ctx, const algorithm_options& opts,
                           dtype type, reduce_op op);

// -- layout ---------------------------------------------------------------------------------------

/// Start of part `i` when `total` items are cut into `parts` parts whose sizes differ by at most
/// one (the first `total % parts` parts are the larger ones). `part_begin(total, parts, parts)`
/// is `total`.
constexpr size_t part_begin(size_t total, size_t parts, size_t i) noexcept {
  const size_t q = total / parts;
  const size_t r = total % parts;
  return i * q + (i < r ? i : r);
}

/// Number of chunks of at most `chunk` items that hold `total` items (at least 1).
constexpr size_t chunk_count(size_t total, size_t chunk) noexcept {
  return total == 0 ? 1 : (total + chunk - 1) / chunk;
}

/// The smallest chunk the pipelined algorithms pick by themselves (`chunk_bytes` can ask for
/// smaller ones).
inline constexpr size_t min_chunk_bytes = size_t{256} << 10;

/// The chunk size of a pipelined algorithm for a block of `block_bytes` that it cuts into about
/// `pieces` chunks: `block_bytes / pieces` between `min_chunk_bytes` and `chunk_bytes` (the
/// option, which wins when it is smaller). Enough chunks to overlap one chunk's forwarding or
/// folding with the next one's receive, and no more: on 2 cores each chunk costs a wake-up on both
/// sides (docs/algorithms.md, "ring_all_reduce", has the measurements).
constexpr size_t pipeline_chunk_bytes(size_t chunk_bytes, size_t block_bytes,
                                      size_t pieces) noexcept {
  const size_t wanted = block_bytes / (pieces > 0 ? pieces : 1);
  const size_t at_least = wanted > min_chunk_bytes ? wanted : min_chunk_bytes;
  return chunk_bytes < at_least ? chunk_bytes : at_least;
}

/// `(a + b) mod n` for ranks, with `b` possibly negative.
constexpr int ring_add(int a, int b, int n) noexcept {
  return ((a + b) % n + n) % n;
}

// -- scratch --------------------------------------------------------------------------------------

/// `bytes` of uninitialised scratch from the process-wide host block cache
/// (device/host_memory.hpp), so that an algorithm run on every call does not pay for fresh pages
/// on every call. Null for 0 bytes.
std::shared_ptr<std::byte> scratch(size_t bytes);

// -- kernels --------------------------------------------------------------------------------------

/// `out[i] = a[i] op b[i]` for `n` elements of `type` (MEAN combines as SUM); then, when `divisor`
/// is positive, `out[i] *= T(1) / T(divisor)` (floating types only). `out` may be `a` or `b` but
/// must not overlap them otherwise. Plain typed loops over restrict pointers, which g++ vectorises.
/// @pre the reduction passed `check_reduction`.
void combine(dtype type, reduce_op op, void* out, const void* a, const void* b, size_t n,
             int divisor = 0);

/// `data[i] *= T(1) / T(divisor)` for `n` elements of a floating `type`.
void scale(dtype type, void* data, size_t n, int divisor);

} // namespace consort::transport::detail
