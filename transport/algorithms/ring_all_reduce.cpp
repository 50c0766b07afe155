// Ring all-reduce: reduce-scatter, then all-gather, chunked and pipelined (docs/algorithms.md).

#include "transport/algorithms/common.hpp"

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <utility>

namespace consort::transport {

namespace {

constexpr const char* algorithm = "ring_all_reduce";

} // namespace

ring_all_reduce::ring_all_reduce(context_ptr ctx, void* data, size_t count, dtype type,
                                 reduce_op op, const algorithm_options& opts)
    : ring_all_reduce(std::move(ctx), data, data, count, type, op, opts) {}

ring_all_reduce::ring_all_reduce(context_ptr ctx, const void* in, void* out, size_t count,
                                 dtype type, reduce_op op, const algorithm_options& opts)
    : ctx_(std::move(ctx)), in_(static_cast<const std::byte*>(in)),
      data_(static_cast<std::byte*>(out)), count_(count), type_(type), op_(op), opts_(opts) {
  setup_error_ = detail::check_options(algorithm, *ctx_, opts_);
  if (!setup_error_)
    setup_error_ = detail::check_reduction(algorithm, *ctx_, opts_, type_, op_);
  const int n = ctx_->size();
  if (setup_error_ || n == 1 || count_ == 0)
    return;
  const int r = ctx_->rank();
  left_ = &ctx_->to(detail::ring_add(r, -1, n));
  right_ = &ctx_->to(detail::ring_add(r, 1, n));
  // Segment i is reduced by rank i - 1 and ends there first; the first segments are the larger.
  segments_.resize(static_cast<size_t>(n) + 1);
  for (size_t i = 0; i <= static_cast<size_t>(n); ++i)
    segments_[i] = detail::part_begin(count_, static_cast<size_t>(n), i);
  const size_t elem = size_of(type_);
  const size_t largest = segments_[1] - segments_[0];
  // A quarter of a segment per chunk (docs/algorithms.md, "ring_all_reduce", has the timings of
  // each chunk size).
  const size_t chunk_bytes = detail::pipeline_chunk_bytes(opts_.chunk_bytes, largest * elem, 4);
  const size_t chunk_elems = std::max<size_t>(1, chunk_bytes / elem);
  chunks_ = detail::chunk_count(largest, chunk_elems);
  slot_bytes_ = (largest + chunks_ - 1) / chunks_ * elem;
  const size_t total = 2 * (static_cast<size_t>(n) - 1) * chunks_;
  window_ = std::clamp<size_t>(opts_.window_bytes / std::max<size_t>(slot_bytes_, 1), 2, total);
  scratch_ = detail::scratch(window_ * slot_bytes_);
}

caf::error ring_all_reduce::run() {
  if (setup_error_)
    return setup_error_;
  const int n = ctx_->size();
  if (n == 1 || count_ == 0) {
    // MEAN over one rank is the value itself.
    if (in_ != data_ && count_ > 0)
      std::memcpy(data_, in_, count_ * size_of(type_));
    return {};
  }
  const auto until = clock::now() + opts_.timeout;
  const int r = ctx_->rank();
  const size_t elem = size_of(type_);
  const size_t steps = static_cast<size_t>(n) - 1;
  const size_t rs_messages = steps * chunks_;
  const size_t total = 2 * rs_messages;
  const int left_rank = left_->peer_rank();
  const int right_rank = right_->peer_rank();

  // Message m: step s and chunk j of the reduce-scatter (m < rs_messages) or of the all-gather.
  // Reduce-scatter step s sends segment r - s and receives segment r - s - 1; all-gather step s
  // sends segment r + 1 - s (fully reduced) and receives segment r - s.
  struct message {
    bool reduce;
    size_t step;
    size_t chunk;
    int send_segment;
    int recv_segment;
  };
  auto locate = [&](size_t m) {
    const bool reduce = m < rs_messages;
    const size_t k = reduce ? m : m - rs_messages;
    const int s = static_cast<int>(k / chunks_);
    return message{reduce, k / chunks_, k % chunks_, detail::ring_add(r, reduce ? -s : 1 - s, n),
                   detail::ring_add(r, reduce ? -s - 1 : -s, n)};
  };
  // Element range [first, second) of chunk j of segment i.
  auto range = [&](int i, size_t j) {
    const size_t begin = segments_[static_cast<size_t>(i)];
    const size_t len = segments_[static_cast<size_t>(i) + 1] - begin;
    return std::pair{begin + detail::part_begin(len, chunks_, j),
                     begin + detail::part_begin(len, chunks_, j + 1)};
  };
  auto tag = [&](const message& w) {
    return detail::message_tag(opts_.tag, w.reduce ? w.step : steps + w.step);
  };
  auto step_name = [&](size_t m) {
    auto w = locate(m);
    return std::string{w.reduce ? "reduce-scatter" : "all-gather"} + " step " +
           std::to_string(w.step + 1) + " of " + std::to_string(steps) + ", chunk " +
           std::to_string(w.chunk + 1) + " of " + std::to_string(chunks_);
  };
  std::vector<operation_ptr> sends(total);
  std::vector<operation_ptr> recvs(total);
  // Whether send m was posted (an empty chunk posts nothing, but counts as posted).
  std::vector<char> send_posted(total, 0);
  // Empty chunks (fewer elements than ranks) are skipped on both sides alike.
  auto post_recv = [&](size_t m) {
    auto w = locate(m);
    auto [b, e] = range(w.recv_segment, w.chunk);
    if (b == e)
      return;
    std::byte* into = w.reduce ? scratch_.get() + (m % window_) * slot_bytes_ : data_ + b * elem;
    recvs[m] = left_->recv(tag(w), mutable_bytes{into, (e - b) * elem});
  };
  auto post_send = [&](size_t m) {
    send_posted[m] = 1;
    auto w = locate(m);
    auto [b, e] = range(w.send_segment, w.chunk);
    if (b == e)
      return;
    // The first step sends this rank's own input; every later one forwards what it folded or
    // received into the output.
    const std::byte* from = w.reduce && w.step == 0 ? in_ : data_;
    sends[m] = right_->send(tag(w), {const_bytes{from + b * elem, (e - b) * elem}});
  };
  auto fail = [&](size_t m, bool send, const caf::error& err) {
    return detail::step_failed(*ctx_, opts_, algorithm, step_name(m),
                               send ? "send to" : "receive from", send ? right_rank : left_rank,
                               err);
  };
  // Posts the receives of the messages before `limit` that are not posted yet, in order. An
  // all-gather receive lands in place, over the chunk that the reduce-scatter send with the same
  // step and chunk reads: it is posted only once that send is done (and not before the send is
  // even posted; the loop below posts it on a later turn, always before it waits for it).
  size_t next_post = 0;
  auto refill = [&](size_t limit) -> caf::error {
    for (; next_post < std::min(limit, total); ++next_post) {
      if (next_post >= rs_messages) {
        const size_t k = next_post - rs_messages;
        if (!send_posted[k])
          break;
        if (const auto& prior = sends[k]) {
          if (auto err = prior->wait(until))
            return fail(k, true, err);
        }
      }
      post_recv(next_post);
    }
    return {};
  };

  // Step 1: post the receives of the first chunks, then send this rank's own segment, read in
  // place (reduce-scatter step 1), as far as the window allows.
  const size_t window = window_;
  if (auto err = refill(std::min(window, rs_messages)))
    return err;
  for (size_t j = 0; j < std::min(window, chunks_); ++j)
    post_send(j);
  if (auto err = refill(window))
    return err;
  for (size_t m = 0; m < total; ++m) {
    const auto w = locate(m);
    // Step 2: wait for message m; the receives of the next ones are already posted, so they
    // arrive while m is being reduced.
    if (recvs[m]) {
      if (auto err = recvs[m]->wait(until))
        return fail(m, false, err);
      // Step 3 (reduce-scatter): fold the chunk into the buffer, the partial result from the
      // left first; the last step's fold also applies MEAN's 1/size to the segment this rank
      // now owns.
      if (w.reduce) {
        auto [b, e] = range(w.recv_segment, w.chunk);
        auto* out = data_ + b * elem;
        const bool last = w.step + 1 == steps;
        // This rank's own contribution to the segment is still the input's (each segment is
        // folded once per rank).
        detail::combine(type_, op_, out, scratch_.get() + (m % window_) * slot_bytes_,
                        in_ + b * elem, e - b, op_ == reduce_op::mean && last ? n : 0);
      }
    }
    // Step 4: forward: the chunk that arrived (and was reduced) in step s is the one this rank
    // sends in step s + 1; after the last reduce-scatter step it is the reduced segment.
    if (m + chunks_ < total)
      post_send(m + chunks_);
    // Step 5: pace the first step's sends: one more of this rank's own chunks for each chunk
    // received, so that the right neighbour, which posts its receives the same way, is sent at
    // most a window more than it has posted.
    if (m + window < chunks_)
      post_send(m + window);
    // Step 6: refill the window: `window` receives posted after the one waited for next. The
    // all-gather receive of message m + 1 needs send m + 1 - rs_messages, which is posted by now
    // (at this turn at the latest), so it is always posted before its turn.
    if (auto err = refill(m + 1 + window))
      return err;
  }
  // Step 7: wait for the sends; the right neighbour has the last chunks when they complete.
  for (size_t m = 0; m < total; ++m) {
    if (sends[m]) {
      if (auto err = sends[m]->wait(until))
        return fail(m, true, err);
    }
  }
  return {};
}

} // namespace consort::transport
