// A group of workers for one epoch: its lanes, its calls, its abort and its clean end.

#include "transport/communicator.hpp"

#include <consort/caf_error.hpp>

namespace consort::transport {

namespace {
using clock = std::chrono::steady_clock;
constexpr uint64_t lane_count = 2;
} // namespace

communicator::communicator(context_ptr ctx, int devices_per_worker, group_members members,
                           std::chrono::milliseconds close_timeout)
    : ctx_(std::move(ctx)), rank_(ctx_->rank()), size_(ctx_->size()),
      devices_per_worker_(devices_per_worker), members_(std::move(members)),
      close_timeout_(close_timeout) {
  for (auto& ls : lanes_)
    ls.thread = std::thread([this, &ls] { serve(ls); });
}

communicator::~communicator() {
  (void)stop();
}

caf::expected<std::vector<tensor>> communicator::run(lane l, group_call& call) {
  auto& ls = lanes_[static_cast<size_t>(l)];
  // Held for the whole call: a lane's calls never overlap, whether they come from its thread or
  // straight from a replica's (run_or_post).
  std::lock_guard<std::mutex> running{ls.run_mtx};
  if (broken_.load(std::memory_order_acquire) && !lost_cause().empty())
    return call.local_failure ? call.local_failure : lost_error(call.name());
  const auto entered = call.entered == clock::time_point{} ? clock::now() : call.entered;
  call_clock clock{ls.next_tag, static_cast<uint64_t>(l), lane_count, entered + call.timeout};
  descriptor_exchange exchange{ctx_, call, devices_per_worker_, ls.scratch, clock};
  if (auto err = exchange.run())
    return changed_or(std::move(err), call);
  auto out = data_phase(exchange, call, clock);
  if (!out)
    return changed_or(std::move(out.error()), call);
  return out;
}

std::optional<caf::expected<tensor>> communicator::run_lone(lane l, const lone_call& call) {
  auto* box = ctx_->mailbox(static_cast<int>(l));
  if (!lone_all_reduce::fits(*ctx_, box, *call.input, call.op) || call.root != 0 ||
      call.axis != 0) // (the compact descriptor's call)
    return std::nullopt;
  auto& ls = lanes_[static_cast<size_t>(l)];
  std::lock_guard<std::mutex> running{ls.run_mtx};
  if (broken_.load(std::memory_order_acquire) && !lost_cause().empty())
    return std::nullopt; // the general call says why
  const auto entered = call.entered == clock::time_point{} ? clock::now() : call.entered;
  call_clock clock{ls.next_tag, static_cast<uint64_t>(l), lane_count, entered + call.timeout};
  lone_all_reduce lone{*ctx_, *box, call, clock.next_tag().tag, clock.until()};
  if (auto out = lone.run())
    return caf::expected<tensor>{std::move(*out)};
  // Not a plain match: the descriptor exchange carries on from where the lean path stopped, with
  // the whole call, and the rest is as `run`.
  group_call whole;
  call.complete(whole);
  descriptor_exchange exchange{ctx_, whole, devices_per_worker_, ls.scratch, clock, &lone.taken()};
  if (auto err = exchange.run())
    return caf::expected<tensor>{changed_or(std::move(err), whole)};
  auto out = data_phase(exchange, whole, clock);
  if (!out)
    return caf::expected<tensor>{changed_or(std::move(out.error()), whole)};
  if (out->size() != 1)
    return caf::expected<tensor>{
        make_caf_error(errc::invalid_argument,
                       whole.name() + ": the lone all-reduce of one tensor came back with " +
                           std::to_string(out->size()) + " leaves")};
  return caf::expected<tensor>{std::move(out->front())};
}

void communicator::set_change_grace(std::chrono::milliseconds grace) noexcept {
  change_grace_ns_.store(std::chrono::nanoseconds(grace).count(), std::memory_order_relaxed);
}

caf::error communicator::changed_or(caf::error err, const group_call& call) {
  const auto grace = std::chrono::nanoseconds(change_grace_ns_.load(std::memory_order_relaxed));
  if (grace.count() <= 0)
    return err;
  const auto code = to_consort_error(err, "").code();
  if (code != errc::peer_lost && code != errc::peer_left && code != errc::collective_timeout &&
      code != errc::membership_changed)
    return err;
  // A member lost: the membership's verdict (a change of the group, or its end) may be on its
  // way, and says more than this worker's view of the failure. A peer that aborted for a change
  // of the group (membership_changed, which shared memory passes on) is waited for too: until
  // this worker's own verdict aborts this communicator, its next call would run in the old epoch,
  // whose lockstep channels the failed call left out of step.
  std::unique_lock<std::mutex> lock{lost_mtx_};
  if (!lost_cv_.wait_for(lock, grace, [this] { return !lost_.empty(); })) {
    lock.unlock();
    if (code == errc::membership_changed) // no verdict in time: this epoch is over all the same
      abort(to_consort_error(err, "").what(), errc::membership_changed);
    return err;
  }
  lock.unlock();
  return lost_error(call.name());
}

caf::expected<std::vector<tensor>> communicator::data_phase(const descriptor_exchange& exchange,
                                                            group_call& call, call_clock& clock) {
  if (exchange.sent_data() && call.kind == collective_kind::all_reduce)
    return fused_all_reduce{exchange, *ctx_, call}.run();
  if (call.data_phase) {
    // The caller's own means (NCCL); `share` gives it worker 0's bytes (a unique id).
    auto share = [&](std::vector<uint8_t>& bytes) -> caf::error {
      return broadcast(ctx_, {reinterpret_cast<std::byte*>(bytes.data()), bytes.size()}, 0,
                       clock.next());
    };
    auto result = call.data_phase(share, clock.left(), call.all_flags);
    if (!result)
      return failed_between_workers(result.error(), call.name());
    return result;
  }
  switch (call.kind) {
  case collective_kind::all_reduce:
    return group_all_reduce{ctx_, call, clock}.run();
  case collective_kind::all_gather:
    return group_all_gather{ctx_, exchange, call, clock}.run();
  case collective_kind::broadcast:
    return group_broadcast{ctx_, exchange, call, clock}.run();
  }
  return make_caf_error(errc::invalid_argument, call.name() + ": unknown collective kind");
}

caf::error communicator::stop() {
  caf::error closed;
  bool whole;
  {
    std::lock_guard<std::mutex> guard{lost_mtx_};
    whole = lost_.empty() && !stopped_;
    stopped_ = true;
  }
  // A clean end first: the peers may still be reading this worker's part of the last call.
  if (whole)
    closed = ctx_->close(worker_name(rank_) + " left: its strategy was shut down",
                         clock::now() + close_timeout_);
  abort("the strategy was shut down");
  for (auto& ls : lanes_) {
    {
      std::lock_guard<std::mutex> guard{ls.mtx};
      ls.stopping = true;
    }
    ls.cv.notify_all();
  }
  for (auto& ls : lanes_)
    if (ls.thread.joinable())
      ls.thread.join();
  return closed;
}

void communicator::serve(lane_state& ls) {
  for (;;) {
    std::function<void()> job;
    {
      std::unique_lock<std::mutex> lock{ls.mtx};
      // An inline job (run_or_post) runs first to its end: the lane keeps its order.
      ls.cv.wait(lock, [&] { return (ls.stopping || !ls.jobs.empty()) && !ls.busy; });
      // Drains the queue before stopping: a queued job fails fast once aborted, and must still
      // answer its callers.
      if (ls.jobs.empty())
        return;
      job = std::move(ls.jobs.front());
      ls.jobs.pop_front();
      ls.busy = true;
    }
    job();
    {
      std::lock_guard<std::mutex> guard{ls.mtx};
      ls.busy = false;
    }
  }
}

void communicator::post(lane l, std::function<void()> job) {
  auto& ls = lanes_[static_cast<size_t>(l)];
  {
    std::lock_guard<std::mutex> guard{ls.mtx};
    if (!ls.stopping) {
      ls.jobs.push_back(std::move(job));
      ls.cv.notify_one();
      return;
    }
  }
  // Stopped: the group is aborted, so the job fails at once, here.
  job();
}

void communicator::run_or_post(lane l, std::function<void()> job) {
  auto& ls = lanes_[static_cast<size_t>(l)];
  bool inline_run = false;
  {
    std::lock_guard<std::mutex> guard{ls.mtx};
    if (!ls.stopping) {
      if (ls.busy || !ls.jobs.empty()) {
        ls.jobs.push_back(std::move(job));
        ls.cv.notify_one();
        return;
      }
      ls.busy = true;
      inline_run = true;
    }
  }
  // Idle: it runs here, and the lane's thread waits for it, also if it throws. (Stopped: the
  // job fails at once.)
  struct release {
    lane_state* ls;
    ~release() {
      if (!ls)
        return;
      {
        std::lock_guard<std::mutex> guard{ls->mtx};
        ls->busy = false;
      }
      ls->cv.notify_one();
    }
  } done{inline_run ? &ls : nullptr};
  job();
}

void communicator::abort(const std::string& cause, errc code) {
  {
    std::lock_guard<std::mutex> guard{lost_mtx_};
    if (!lost_.empty())
      return;
    lost_ = cause;
    lost_code_ = code;
    broken_.store(true, std::memory_order_release);
  }
  lost_cv_.notify_all();
  ctx_->abort(cause, code);
}

caf::expected<std::shared_ptr<communicator>> communicator::shrink(const std::vector<int>& lost,
                                                                  uint64_t epoch,
                                                                  const connect_group& connect,
                                                                  deadline until) {
  if (epoch <= members_.epoch)
    return make_caf_error(errc::invalid_argument,
                          "shrinking the group of epoch " + std::to_string(members_.epoch) +
                              " into epoch " + std::to_string(epoch) +
                              "; expected a later epoch than the group's own");
  std::vector<bool> gone(static_cast<size_t>(size_), false);
  std::string names;
  for (int r : lost) {
    if (r < 0 || r >= size_)
      return make_caf_error(errc::invalid_argument, "shrinking a group of " +
                                                        std::to_string(size_) +
                                                        " workers: lost rank " + std::to_string(r) +
                                                        " is not one of its ranks; expected 0.." +
                                                        std::to_string(size_ - 1));
    if (r == rank_)
      return make_caf_error(errc::invalid_argument,
                            "shrinking a group of " + std::to_string(size_) +
                                " workers: " + member_name(r) +
                                " is among the lost ranks but is the one shrinking; a lost "
                                "member does not take part in the next epoch");
    if (!gone[static_cast<size_t>(r)])
      names += (names.empty() ? "" : ", ") + member_name(r);
    gone[static_cast<size_t>(r)] = true;
  }
  group_members next{epoch, {}};
  int new_rank = -1;
  int new_size = 0;
  for (int r = 0; r < size_; ++r) {
    if (gone[static_cast<size_t>(r)])
      continue;
    if (r == rank_)
      new_rank = new_size;
    ++new_size;
    if (!members_.names.empty())
      next.names.push_back(members_.names[static_cast<size_t>(r)]);
  }
  if (new_size < 2)
    return make_caf_error(errc::invalid_argument,
                          "shrinking a group of " + std::to_string(size_) + " workers without " +
                              names + " leaves " + std::to_string(new_size) +
                              " member; a group needs at least 2 (one worker alone needs none)");
  // The calls of this epoch end here, on every member: those in flight would wait for the lost
  // members or meet survivors that already left for the next epoch.
  abort("the group of workers changed: epoch " + std::to_string(members_.epoch) + " lost " +
            (names.empty() ? std::string{"no member"} : names) + "; the next epoch has " +
            std::to_string(new_size) + " workers",
        errc::membership_changed);
  auto ctx = connect(new_rank, new_size, next.epoch, until);
  if (!ctx)
    return ctx.error();
  if (!*ctx || (*ctx)->rank() != new_rank || (*ctx)->size() != new_size)
    return make_caf_error(errc::invalid_argument,
                          "shrinking to epoch " + std::to_string(next.epoch) +
                              ": the connected context is not rank " + std::to_string(new_rank) +
                              " of " + std::to_string(new_size));
  return std::make_shared<communicator>(std::move(*ctx), devices_per_worker_, std::move(next),
                                        close_timeout_);
}

std::string communicator::member_name(int r) const {
  if (static_cast<size_t>(r) < members_.names.size())
    return members_.names[static_cast<size_t>(r)];
  return worker_name(r);
}

std::string communicator::lost_cause() const {
  std::lock_guard<std::mutex> guard{lost_mtx_};
  return lost_;
}

caf::error communicator::lost_error(const std::string& what) const {
  std::lock_guard<std::mutex> guard{lost_mtx_};
  if (lost_code_ == errc::membership_changed)
    return make_caf_error(lost_code_, what + " cannot run: " + lost_);
  return make_caf_error(lost_code_, what + " cannot run: the group of workers is broken: " + lost_);
}

} // namespace consort::transport
