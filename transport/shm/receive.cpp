// The receive side of the shm transport: posting a receive (matched to a stashed message, or
// posted for its tag), and reading a peer's ring: frame headers, then each message's bytes,
// straight into its receive's buffer, into a stash until a receive is posted, or into a goodbye's
// reason.

#include "transport/shm/shm_impl.hpp"

#include <algorithm>
#include <cstring>

namespace consort::transport::shm::impl {

namespace {

/// Removes and returns the oldest entry of `pending` (posted receives or stashes) with `tag`, or
/// null.
template <class Ptr>
Ptr take_oldest(std::vector<Ptr>& pending, uint64_t tag) {
  auto it =
      std::find_if(pending.begin(), pending.end(), [tag](const Ptr& p) { return p->tag == tag; });
  if (it == pending.end())
    return nullptr;
  Ptr found = std::move(*it);
  pending.erase(it);
  return found;
}

/// Whether a message of `bytes` fits receive `op`.
inline bool fits(const shm_op& op, uint64_t bytes) {
  return op.at_most ? bytes <= op.into.size() : bytes == op.into.size();
}

void fail_mismatch(shm_op& op, uint64_t bytes) {
  op.fail(errc::invalid_argument, "the message has " + std::to_string(bytes) + " bytes; expected " +
                                      (op.at_most ? "at most " : "") +
                                      std::to_string(op.into.size()) + " (the message is dropped)");
}

/// Gives new receive `op` the oldest message of its tag that arrived before it, if any: copies
/// what arrived of it, and either completes `op` or makes it take the rest as it arrives. Whether
/// there was such a message. @pre l.in_mtx is held.
bool take_stashed(peer_link& l, const op_ptr& op) {
  auto s = take_oldest(l.stashed, op->tag);
  if (!s)
    return false;
  const bool in_flight = l.current_stash == s;
  if (!fits(*op, s->size)) {
    fail_mismatch(*op, s->size);
    if (in_flight)
      l.current_stash.reset(); // the rest of it is dropped
    return true;
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
  return true;
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
  if (auto op = take_oldest(l.posted, h.tag)) {
    if (fits(*op, h.bytes))
      l.current_op = std::move(op);
    else
      fail_mismatch(*op, h.bytes); // the message is dropped
    return;
  }
  auto s = std::make_shared<stash>(h.tag, static_cast<std::size_t>(h.bytes));
  l.stashed.push_back(s);
  l.current_stash = std::move(s);
}

/// The message being read is complete. @pre l.in_mtx is held.
void end_message(peer_link& l) {
  l.reading = false;
  if (l.current.kind == goodbye_frame) {
    l.goodbye = true;
    l.set_failed(errc::peer_left,
                 "rank " + std::to_string(l.rank) + " left the group: " + l.current_text);
    // Receives that no message of the peer can match any more.
    l.fail_posted();
    return;
  }
  if (l.current_op) {
    l.current_op->received = static_cast<std::size_t>(l.current.bytes);
    l.current_op->complete({});
    l.current_op.reset();
  }
  l.current_stash.reset();
}

/// Copies the next `n` bytes of the message being read, at `tail` of `l`'s incoming ring, to where
/// they go. @pre l.in_mtx is held.
inline void read_payload(peer_link& l, uint64_t tail, std::size_t n) {
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
}

} // namespace

operation_ptr shm_pair::recv(uint64_t tag, mutable_bytes into) {
  return ctx_.recv(peer_, tag, into, false);
}

operation_ptr shm_pair::recv_at_most(uint64_t tag, mutable_bytes into) {
  return ctx_.recv(peer_, tag, into, true);
}

operation_ptr shm_context::recv(int peer, uint64_t tag, mutable_bytes into, bool at_most) {
  auto op = new_op(false, peer, tag);
  op->into = into;
  op->at_most = at_most;
  if (fail_if_refused(*op))
    return op;
  auto& l = link(peer);
  std::lock_guard<std::mutex> guard{l.in_mtx};
  if (take_stashed(l, op))
    return op;
  if (l.failed.load(std::memory_order_acquire)) {
    op->fail(l.fail_code, l.fail_cause);
    return op;
  }
  l.posted.push_back(op);
  return op;
}

bool shm_context::read_incoming(peer_link& l) {
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
      if (!valid_frame(h)) {
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
    read_payload(l, tail, n);
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

} // namespace consort::transport::shm::impl
