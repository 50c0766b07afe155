// An shm operation's wait (shm_op, shm_impl.hpp): the waiting thread makes the progress itself,
// first spinning and polling the rings, then sleeping on its rank's doorbell and making progress
// on each wake-up; and the operation's description in errors.

#include "transport/shm/shm_impl.hpp"

#include <algorithm>
#include <sched.h>
#include <sstream>

namespace consort::transport::shm::impl {

std::string shm_op::describe() const {
  std::ostringstream out;
  out << "shm transport: rank " << self << ": " << (is_send ? "send" : "receive") << " of "
      << bytes() << " bytes with tag 0x" << std::hex << tag << std::dec
      << (is_send ? " to rank " : " from rank ") << peer;
  return out.str();
}

inline bool shm_op::spin_until_done(deadline until) {
  // Held while spinning (the sleep below holds it only for each pass): looking for work is then
  // a few loads, and a pass runs only when a peer wrote, a send is queued, or a peer's state
  // changed (and every 256 turns regardless).
  auto ctx = ctx_.lock();
  if (!ctx)
    return done();
  // The spin's end is read off the clock at the first look, 16 or 256 turns in: most waits end
  // before it, and read no clock at all.
  deadline spin_until{};
  auto spun_out = [&] {
    const auto now = clock::now();
    if (spin_until == deadline{})
      spin_until = std::min(until, now + spin_);
    return now >= spin_until;
  };
  if (yield_) {
    // Oversubscribed: every poll hands the core to whoever else is runnable on it (the peer that
    // must answer), and comes back at once when no one is.
    for (uint32_t i = 1;; ++i) {
      if (ctx->may_move() || (i & 15) == 0)
        ctx->poll();
      if (done())
        return true;
      if ((i & 15) == 0 && spun_out())
        return false;
      sched_yield();
    }
  }
  for (uint32_t i = 1;; ++i) {
    if (ctx->may_move() || (i & 255) == 0)
      ctx->poll();
    if (done())
      return true;
    if ((i & 255) == 0) {
      if (spun_out())
        return false;
      std::this_thread::yield();
    } else {
      cpu_relax();
    }
  }
}

inline caf::error shm_op::sleep_until_done(deadline until) {
  // Sleep on this rank's doorbell, which peers ring when they write to this rank and which every
  // completion rings, and make progress on each wake-up: one wake-up per hop instead of two
  // (progress thread, then waiter). The context is not held while sleeping, so that destroying
  // it (which rings the bell and fails every operation) is never delayed.
  auto& bell = seg_->block(self);
  for (;;) {
    const uint32_t seen = bell.bell.load(std::memory_order_seq_cst);
    if (auto ctx = ctx_.lock())
      ctx->pass_blocking();
    if (done())
      return result();
    auto now = clock::now();
    if (now >= until) {
      const auto ms = (coarse_now_ns() - posted_ns) / 1'000'000;
      return make_caf_error(errc::collective_timeout,
                            describe() + " did not complete before its deadline (posted " +
                                std::to_string(ms) + " ms ago)");
    }
    sleep_on_bell(bell, seen, std::min<clock::duration>(until - now, nap_));
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
  if (spin_until_done(until))
    return result();
  return sleep_until_done(until);
}

} // namespace consort::transport::shm::impl
