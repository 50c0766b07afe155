// Leaving an shm group (context::close): pending receives end, every posted send is delivered and
// followed by a goodbye, and close waits until every peer has taken them and said goodbye too.

#include "transport/shm/shm_impl.hpp"

#include <algorithm>

namespace consort::transport::shm::impl {

void shm_context::queue_goodbyes(const std::string& reason) {
  for (auto& l : links_) {
    if (l.rank < 0)
      continue;
    bool lost;
    {
      std::lock_guard<std::mutex> guard{l.in_mtx};
      for (auto& op : l.posted)
        op->fail(errc::shutdown, "this rank has left the group (close was called)");
      l.posted.clear();
      // A peer that left still reads until it has this rank's goodbye; a lost one reads nothing.
      lost = l.failed.load(std::memory_order_acquire) && !l.goodbye;
    }
    if (lost)
      continue;
    auto op = new_op(true, l.rank, 0);
    // The goodbye owns its text: it may still be queued when close gives up.
    op->owned = reason.substr(0, static_cast<std::size_t>(max_goodbye_bytes));
    op->parts = {
        const_bytes{reinterpret_cast<const std::byte*>(op->owned.data()), op->owned.size()}};
    op->header = {0, op->owned.size(), goodbye_frame, 0};
    std::lock_guard<std::mutex> guard{l.out_mtx};
    l.out_queue.push_back(op);
    // Queued as any send that did not fit: the passes write it (pass() looks at the queues only
    // while the backlog counts a send).
    op->in_backlog = true;
    waiters_->backlog.fetch_add(1, std::memory_order_seq_cst);
  }
}

std::string shm_context::peers_not_done() {
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
  return waiting;
}

caf::error shm_context::close(const std::string& reason, deadline until) {
  {
    std::lock_guard<std::mutex> guard{state_mtx_};
    if (closed_ || aborted_)
      return {};
    closed_ = true;
    refusing_.store(true, std::memory_order_release);
  }
  // Pending receives end; posted sends go on, followed by the goodbye.
  queue_goodbyes(reason);
  auto& me = seg_->block(rank_);
  ring_bell(me);
  for (;;) {
    const uint32_t seen = me.bell.load(std::memory_order_seq_cst);
    // A blocking pass: after it, whatever the progress thread read is seen below.
    pass_blocking();
    std::string waiting = peers_not_done();
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

} // namespace consort::transport::shm::impl
