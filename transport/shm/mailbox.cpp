// The lockstep channels of an shm context (shm_mailbox, shm_impl.hpp; the contract is
// transport::mailbox in include/consort/transport/pair.hpp): a message is copied into the slot of
// the segment from this rank to the peer and published by storing its number last; the peer
// spins on that number, then reads the message where it lies. Two slots per channel and ordered
// pair are enough: a rank puts message n+1 only once it took the peer's message n, which the
// peer put only once it took (and was done with) message n-1, whose slot n+1 reuses.
//
// A waiter spins, polling the rings when a peer may have moved (a goodbye or an abort comes that
// way), then sleeps on its rank's doorbell as an operation's wait does (operation.cpp); a sender
// rings the doorbell only when someone sleeps on it.

#include "transport/shm/shm_impl.hpp"

#include <algorithm>
#include <climits>
#include <cstring>
#include <sched.h>
#include <sstream>

#include <linux/futex.h>

namespace consort::transport::shm::impl {

shm_mailbox::shm_mailbox(shm_context& ctx, int channel)
    : ctx_(ctx), channel_(channel), puts_(static_cast<std::size_t>(ctx.size_), 0),
      takes_(static_cast<std::size_t>(ctx.size_), 0) {}

std::string shm_mailbox::describe(int peer, uint64_t seq, const char* from) const {
  std::ostringstream out;
  out << "shm transport: rank " << ctx_.rank_ << ": message " << seq << " of lockstep channel "
      << channel_ << ' ' << from << " rank " << peer;
  return out.str();
}

caf::error shm_mailbox::check_peer(int peer, const char* action) const {
  if (peer >= 0 && peer < ctx_.size_ && peer != ctx_.rank_)
    return {};
  return make_caf_error(errc::invalid_argument,
                        "shm transport: rank " + std::to_string(ctx_.rank_) + ": cannot " + action +
                            " a lockstep message of rank " + std::to_string(peer) +
                            "; expected another rank of the group of " +
                            std::to_string(ctx_.size_));
}

mailbox_slot& shm_mailbox::incoming(int peer) const {
  const uint64_t seq = takes_[static_cast<std::size_t>(peer)] + 1;
  return ctx_.seg_->mailbox(peer, ctx_.rank_, channel_, static_cast<int>(seq & 1));
}

bool shm_mailbox::arrived(int peer) const noexcept {
  if (peer < 0 || peer >= ctx_.size_ || peer == ctx_.rank_)
    return false;
  const uint64_t seq = takes_[static_cast<std::size_t>(peer)] + 1;
  return incoming(peer).seq.load(std::memory_order_acquire) == seq;
}

caf::error shm_mailbox::put(int peer, uint64_t tag, const send_parts& parts) {
  if (auto err = check_peer(peer, "put"))
    return err;
  auto& puts = puts_[static_cast<std::size_t>(peer)];
  const uint64_t seq = puts + 1;
  // A context that aborted or left says so first: after a failed exchange the channel is out of
  // step, and the abort's cause is what the caller needs to hear.
  errc code{};
  std::string cause;
  if (ctx_.refused(code, cause))
    return make_caf_error(code, describe(peer, seq, "to") + ": " + cause);
  if (puts > takes_[static_cast<std::size_t>(peer)])
    return make_caf_error(errc::invalid_argument,
                          describe(peer, seq, "to") + ": message " + std::to_string(puts) +
                              " of rank " + std::to_string(peer) +
                              " was not taken yet; take each of a peer's messages before putting "
                              "the next one to it (the peer may still read the slot)");
  std::size_t total = 0;
  for (const auto& part : parts)
    total += part.size();
  if (total > capacity())
    return make_caf_error(errc::invalid_argument,
                          describe(peer, seq, "to") + " has " + std::to_string(total) +
                              " bytes; a message may have at most " + std::to_string(capacity()));
  auto& slot = ctx_.seg_->mailbox(ctx_.rank_, peer, channel_, static_cast<int>(seq & 1));
  std::byte* at = slot.data;
  for (const auto& part : parts) {
    if (!part.empty())
      std::memcpy(at, part.data(), part.size());
    at += part.size();
  }
  slot.tag = tag;
  slot.bytes = static_cast<uint32_t>(total);
  // Stored last, and before the look at the peer's sleepers (both sequentially consistent, as
  // the sleeper's count and its look at the slot are): either the peer sees the message before
  // it sleeps, or this rank sees it sleeping and rings.
  slot.seq.store(seq, std::memory_order_seq_cst);
  puts = seq;
  auto& b = ctx_.seg_->block(peer);
  if (b.sleepers.load(std::memory_order_seq_cst) > 0)
    ring_bell(b);
  return {};
}

inline caf::error shm_mailbox::failure_of(int peer, uint64_t seq) {
  errc code{};
  std::string cause;
  if (ctx_.refused(code, cause))
    return make_caf_error(code, describe(peer, seq, "from") + ": " + cause);
  auto& l = ctx_.link(peer);
  if (!l.failed.load(std::memory_order_acquire))
    return {};
  // A message put before the peer failed or left is still taken (the failure is seen after it).
  if (arrived(peer))
    return {};
  std::lock_guard<std::mutex> guard{l.in_mtx};
  return make_caf_error(l.fail_code, describe(peer, seq, "from") + ": " + l.fail_cause);
}

inline bool shm_mailbox::spin_for(int peer, uint64_t seq, deadline until, caf::error& err) {
  const auto& slot = incoming(peer);
  // The spin's end is read off the clock at the first look, 16 or 256 turns in (operation.cpp).
  const auto spin = ctx_.yield_ ? ctx_.opts_.yield_spin : ctx_.opts_.spin;
  const uint32_t every = ctx_.yield_ ? 15 : 255;
  deadline spin_until{};
  for (uint32_t i = 1;; ++i) {
    if (slot.seq.load(std::memory_order_acquire) == seq)
      return true;
    if (ctx_.may_move() || (i & every) == 0)
      ctx_.poll();
    if ((err = failure_of(peer, seq)))
      return true;
    if ((i & every) == 0) {
      const auto now = clock::now();
      if (spin_until == deadline{})
        spin_until = std::min(until, now + spin);
      if (now >= spin_until)
        return false;
    }
    if (ctx_.yield_)
      sched_yield();
    else if ((i & every) == 0)
      std::this_thread::yield();
    else
      cpu_relax();
  }
}

inline caf::error shm_mailbox::sleep_for(int peer, uint64_t seq, deadline until) {
  const auto& slot = incoming(peer);
  auto& bell = ctx_.seg_->block(ctx_.rank_);
  const int64_t began = coarse_now_ns();
  for (;;) {
    const uint32_t seen = bell.bell.load(std::memory_order_seq_cst);
    ctx_.pass_blocking();
    if (slot.seq.load(std::memory_order_acquire) == seq)
      return {};
    if (auto err = failure_of(peer, seq))
      return err;
    const auto now = clock::now();
    if (now >= until) {
      const auto ms = (coarse_now_ns() - began) / 1'000'000;
      return make_caf_error(errc::collective_timeout,
                            describe(peer, seq, "from") +
                                " did not arrive before its deadline (slept on it " +
                                std::to_string(ms) + " ms after spinning)");
    }
    // Counted as a sleeper before the last look at the slot: the sender stores the message, then
    // looks at the count (put), so one of the two sees the other.
    bell.sleepers.fetch_add(1, std::memory_order_seq_cst);
    if (slot.seq.load(std::memory_order_seq_cst) != seq &&
        bell.bell.load(std::memory_order_seq_cst) == seen) {
      const timespec ts = to_timespec(std::chrono::duration_cast<std::chrono::nanoseconds>(
          std::min<clock::duration>(until - now, ctx_.opts_.liveness_interval)));
      futex(&bell.bell, FUTEX_WAIT, seen, &ts);
    }
    bell.sleepers.fetch_sub(1, std::memory_order_seq_cst);
  }
}

caf::expected<const_bytes> shm_mailbox::take(int peer, uint64_t tag, deadline until) {
  if (auto err = check_peer(peer, "take"))
    return err;
  auto& takes = takes_[static_cast<std::size_t>(peer)];
  const uint64_t seq = takes + 1;
  auto& slot = incoming(peer);
  auto& waiters = *ctx_.waiters_;
  if (slot.seq.load(std::memory_order_acquire) == seq) {
    // No wait, yet this thread makes the progress as a waiter would: the progress thread stays
    // off the doorbell (waiter_count::active), so that the peers' puts need not ring it.
    waiters.last_leave.store(coarse_now_ns(), std::memory_order_relaxed);
  } else {
    waiters.enter();
    struct leaving {
      waiter_count& w;
      ~leaving() { w.leave(); }
    } leave{waiters};
    caf::error err;
    if (!spin_for(peer, seq, until, err))
      err = sleep_for(peer, seq, until);
    if (err)
      return err;
  }
  takes = seq;
  const uint64_t got_tag = slot.tag;
  const uint32_t bytes = slot.bytes;
  if (bytes > capacity())
    return make_caf_error(errc::peer_lost, describe(peer, seq, "from") + " says it has " +
                                               std::to_string(bytes) +
                                               " bytes, more than a slot holds (" +
                                               std::to_string(capacity()) + "): a malformed slot");
  if (got_tag != tag) {
    std::ostringstream out;
    out << describe(peer, seq, "from") << " carries tag 0x" << std::hex << got_tag
        << " where tag 0x" << tag << " was expected: the ranks' exchanges on the channel are out "
        << "of step";
    return make_caf_error(errc::invalid_argument, out.str());
  }
  return const_bytes{slot.data, bytes};
}

} // namespace consort::transport::shm::impl
