// The send side of the shm transport: posting a send (written at once when nothing is queued
// before it, else queued for the progress), and streaming queued frames (header, then parts) into
// a peer's ring as space frees, a frame at a time and possibly in pieces.

#include "transport/shm/shm_impl.hpp"

#include <algorithm>

namespace consort::transport::shm::impl {

namespace {

/// Streams a send's frame into a ring from where an earlier call stopped: skips the `skip` bytes
/// already written, then writes at `pos` what fits into `space`.
struct frame_writer {
  const ring_view& ring;
  uint64_t pos;
  uint64_t space;
  std::size_t skip;

  void emit(const std::byte* src, std::size_t n) {
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
    ring.put(pos, src, take);
    pos += take;
    space -= take;
  }
};

/// Writes what fits into `space` of `op`'s frame at `head` of `l`'s ring, after the
/// l.out_offset bytes already written, and counts them in l.out_offset; the new head.
inline uint64_t write_frame(peer_link& l, const shm_op& op, uint64_t head, uint64_t space) {
  frame_writer w{l.out, head, space, l.out_offset};
  w.emit(reinterpret_cast<const std::byte*>(&op.header), sizeof(frame_header));
  for (const auto& part : op.parts)
    w.emit(part.data(), part.size());
  l.out_offset += static_cast<std::size_t>(w.pos - head);
  return w.pos;
}

/// The ring is full: asks the consumer to ring once it read, then looks again, so that a read
/// between the two is not missed; whether the consumer read since `tail` was seen.
inline bool ask_for_space(ring_control& c, uint64_t tail) {
  c.wants_space.store(1, std::memory_order_seq_cst);
  return c.tail.load(std::memory_order_seq_cst) != tail;
}

} // namespace

inline operation_ptr shm_context::send(int peer, uint64_t tag, send_parts parts) {
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

operation_ptr shm_pair::send(uint64_t tag, send_parts parts) {
  return ctx_.send(peer_, tag, std::move(parts));
}

bool shm_context::write_queued(peer_link& l) {
  bool wrote = false;
  auto& c = *l.out.control;
  while (!l.out_queue.empty()) {
    const auto& op = l.out_queue.front();
    const uint64_t head = c.head.load(std::memory_order_relaxed);
    const uint64_t tail = c.tail.load(std::memory_order_acquire);
    const uint64_t space = l.out.capacity - (head - tail);
    // A frame header is written whole, so the reader never sees half of one.
    if (l.out_offset == 0 && space < sizeof(frame_header)) {
      if (ask_for_space(c, tail))
        continue;
      break;
    }
    const uint64_t pos = write_frame(l, *op, head, space);
    if (pos != head) {
      c.head.store(pos, std::memory_order_release);
      wrote = true;
    }
    if (l.out_offset < sizeof(frame_header) + op->header.bytes) {
      if (ask_for_space(c, tail))
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

} // namespace consort::transport::shm::impl
