// The membership service's I/O thread, the part common to both roles (see service_impl.hpp):
// the tick, frames in and out, failures, the losses reported, leave and crash.
//
// Deadlines. One periodic tick (at most 50 ms apart) enforces all of them: handshakes, connection
// attempts, the rendezvous, heartbeats sent and expected, writes that do not complete, and the
// linger of graceful closes. Nothing else waits. The times are read from `now()`: the options'
// clock (a test's manual clock, which `check_deadlines` runs the tick after moving) or the
// steady clock.
//
// Closing. A clean close (Leave, Refusal, Abort before the view) queues its last message and
// closes the connection gracefully (transport/framed_connection.hpp): the sending side is shut
// down once the queue is written, and what arrives until the peer closes too or the linger
// passes is dropped (`on_frame`): the last message is never lost to a reset.

#include "transport/membership/service_impl.hpp"

#include <consort/caf_error.hpp>
#include <consort/error.hpp>

#include <algorithm>
#include <cstdio>

namespace consort::transport::membership {

// -- I/O thread: common --------------------------------------------------------------------------

service::impl::conn_ptr service::impl::new_connection() {
  // The cast here, where the private base is accessible, and not inside make_shared.
  return std::make_shared<connection>(io_, static_cast<framed_connection::owner&>(*this));
}

void service::impl::log_line(const std::string& line) const {
  auto text = self_ + ": " + line;
  if (opts_.log) {
    opts_.log(text);
    return;
  }
  text = "consort membership: " + text + "\n";
  std::fwrite(text.data(), 1, text.size(), stderr); // one write: lines of threads do not mix
}

std::size_t service::impl::text_limit() const {
  // A Refusal or an Abort takes well under 256 bytes besides its text (and a task type).
  return std::min(codec::max_field_bytes, opts_.max_message_bytes - 256);
}

std::string service::impl::name_of(int rank) const {
  return to_string(opts_.tasks[rank]) + " (rank " + std::to_string(rank) + ")";
}

void service::impl::set_outcome(caf::expected<view> outcome) {
  {
    std::lock_guard lock(mu_);
    if (outcome_)
      return;
    outcome_ = std::move(outcome);
  }
  cv_.notify_all();
}

bool service::impl::decided() {
  std::lock_guard lock(mu_);
  return outcome_.has_value();
}

void service::impl::report(std::vector<int> ranks, const std::string& cause, uint64_t next_epoch,
                           std::vector<int> joining, bool at_boundary, bool left_out) {
  if (suspended_ || crashed_ || leaving_ || stopped_)
    return;
  auto had_ranks = !ranks.empty();
  std::erase_if(ranks, [this](int r) {
    if (r < 0 || static_cast<std::size_t>(r) >= reported_.size() || reported_[r])
      return true;
    reported_[r] = true;
    return false;
  });
  if (had_ranks && ranks.empty() && joining.empty())
    return; // every rank of it was reported already
  std::function<void(const lost_event&)> fn;
  {
    std::lock_guard lock(mu_);
    fn = on_lost_;
  }
  if (fn)
    fn(lost_event{std::move(ranks), cause, next_epoch, std::move(joining), at_boundary, left_out});
}

void service::impl::publish_view(const view& v) {
  // A member of the new view may be lost (and reported) again.
  for (const auto& m : v.members)
    for (std::size_t r = 0; r < opts_.tasks.size(); ++r)
      if (opts_.tasks[r] == m.task)
        reported_[r] = false;
  {
    std::lock_guard lock(mu_);
    latest_ = v;
  }
  cv_.notify_all();
}

void service::impl::end_group(caf::error err) {
  group_ended_ = true;
  {
    std::lock_guard lock(mu_);
    if (!group_error_)
      group_error_ = std::move(err);
  }
  cv_.notify_all();
}

std::string service::impl::check_elastic_view(const view& v) const {
  if (v.epoch == 0)
    return "its view has epoch 0";
  if (v.members.empty() || v.members.size() > opts_.tasks.size())
    return "its view has " + std::to_string(v.members.size()) + " members, expected 1 to " +
           std::to_string(opts_.tasks.size());
  std::size_t next_task = 0;
  bool self = false;
  for (std::size_t i = 0; i < v.members.size(); ++i) {
    const auto& m = v.members[i];
    if (m.rank != static_cast<int>(i))
      return "its view lists " + to_string(m.task) + " with rank " + std::to_string(m.rank) +
             " at position " + std::to_string(i);
    auto it = std::find(opts_.tasks.begin() + static_cast<std::ptrdiff_t>(next_task),
                        opts_.tasks.end(), m.task);
    if (it == opts_.tasks.end())
      return "its view lists " + to_string(m.task) +
             ", which is not a task of this cluster after the members before it (do all tasks "
             "share one cluster spec?)";
    auto r = static_cast<std::size_t>(it - opts_.tasks.begin());
    self = self || r == static_cast<std::size_t>(opts_.rank);
    next_task = r + 1;
  }
  if (!self)
    return "its view of epoch " + std::to_string(v.epoch) + " leaves this task out";
  return {};
}

void service::impl::arm_tick() {
  tick_timer_.expires_after(tick_period_);
  tick_timer_.async_wait([this](const error_code& ec) {
    if (ec || stopped_ || crashed_)
      return;
    tick();
    arm_tick();
  });
}

void service::impl::tick() {
  auto now = this->now();
  const auto real_now = std::chrono::steady_clock::now();
  const auto real_gap = real_now - last_tick_real_;
  last_tick_real_ = real_now;
  // Graceful closes whose peer did not close in time.
  std::vector<conn_ptr> expired;
  for (const auto& c : conns_)
    if (c->linger_expired(now))
      expired.push_back(c);
  for (const auto& c : expired)
    close(c);
  if (suspended_ || leaving_)
    return;
  // Handshakes and connection attempts.
  std::vector<conn_ptr> stale;
  for (const auto& c : conns_)
    if (c->state == phase::handshake && now - c->opened_at >= opts_.handshake_timeout)
      stale.push_back(c);
  for (const auto& c : stale) {
    if (chief_) {
      log_line("closed the connection from " + c->remote() + ": no valid Join within " +
               ms_text(opts_.handshake_timeout));
      close(c);
    } else {
      attempt_failed(c, "no challenge from the chief at " + opts_.chief_address + " within " +
                            ms_text(opts_.handshake_timeout) + " (connecting or waiting)");
    }
  }
  // The rendezvous.
  if (rendezvous_started_ && !view_formed_ && !rendezvous_failed_) {
    if (now >= rendezvous_deadline_) {
      if (chief_) {
        rendezvous_timed_out();
      } else if (!decided()) {
        join_timed_out();
      }
    } else if (chief_ && now >= next_missing_log_) {
      log_missing();
      next_missing_log_ = now + opts_.missing_log_interval;
    }
  }
  if (!view_formed_)
    return;
  if (chief_ && reforming_ && now >= reform_deadline_)
    reform_timed_out();
  if (chief_)
    serve_former_chief_address();
  if (failing_over_ && now >= rendezvous_deadline_) {
    failing_over_ = false;
    if (chief_conn_)
      close(chief_conn_);
    log_line("could not re-form the group at the chief's successor in time: " + last_error_);
    end_group(make_caf_error(errc::peer_lost,
                             self_ +
                                 ": the chief was lost and its successor could not be reached "
                                 "within reform_timeout: " +
                                 last_error_));
  }
  // Heartbeats out, liveness and stuck writes in.
  std::vector<conn_ptr> members;
  for (const auto& c : conns_)
    if (c->state == phase::member)
      members.push_back(c);
  // This process itself was stopped (a debugger, SIGSTOP, a host that froze) or not scheduled
  // for half a timeout: the silence it sees is its own. Each peer gets a full peer_timeout from
  // now, in which what it sent meanwhile is read, instead of every peer being lost at once.
  // Measured on real time: a test's manual clock jumps on purpose.
  if (!members.empty() && real_gap >= opts_.peer_timeout / 2) {
    log_line("this process did not run for " +
             ms_text(std::chrono::duration_cast<milliseconds>(real_gap)) +
             "; its peers get a full peer_timeout (" + ms_text(opts_.peer_timeout) +
             ") from now before their silence counts");
    for (const auto& c : members)
      c->last_rx = std::max(c->last_rx, now);
  }
  if (now >= next_heartbeat_) {
    next_heartbeat_ = now + opts_.heartbeat_interval;
    ++heartbeat_sequence_;
    for (const auto& c : members)
      send(c, codec::heartbeat{view_.epoch, static_cast<uint32_t>(opts_.rank), heartbeat_sequence_,
                               wall_ns(), c->peer_sent_ns, c->peer_received_ns});
  }
  for (const auto& c : members) {
    if (c->closed() || c->state != phase::member)
      continue; // lost through an earlier one of this loop
    std::string cause;
    const bool silent = now - c->last_rx >= opts_.peer_timeout;
    if (silent) {
      // A peer on this host whose process waits for a CPU is not hung: it gets longer.
      if (held_up_by_host(c, now - c->last_rx, cause))
        continue;
      if (cause.empty())
        cause = name_of(c->rank) + " sent no heartbeat for " + ms_text(opts_.peer_timeout);
    } else if (c->writing() && now - c->write_started() >= opts_.peer_timeout)
      cause = name_of(c->rank) + ": a write of " + std::to_string(c->front_bytes()) + " bytes to " +
              c->remote() + " did not complete within " + ms_text(opts_.peer_timeout);
    if (cause.empty())
      continue;
    if (chief_)
      lose_member(c->rank, cause, silent);
    else
      lose_chief(cause, silent);
  }
}

uint32_t service::impl::peer_pid(const conn_ptr& c) const {
  if (chief_)
    return c->join.pid;
  return c == chief_conn_ && !view_.members.empty() ? view_.members.front().pid : 0;
}

bool service::impl::held_up_by_host(const conn_ptr& c, clock::duration silence,
                                    std::string& cause) {
  const uint32_t pid = peer_pid(c);
  if (pid == 0 || !peer_on_this_host(c->socket()))
    return false;
  const auto state = probe_(pid);
  const auto waited = std::chrono::duration_cast<milliseconds>(silence);
  if (state != host_process::held_up) {
    if (c->held_up) // it was waiting for a CPU, and is stopped or asleep now
      cause = name_of(c->rank) + " sent no heartbeat for " + ms_text(waited) +
              "; its process (pid " + std::to_string(pid) + " on this host) is " +
              to_string(state) + " now";
    return false;
  }
  if (silence >= held_up_limit()) {
    cause = name_of(c->rank) + " sent no heartbeat for " + ms_text(waited) + "; its process (pid " +
            std::to_string(pid) + " on this host) was runnable all that time but not scheduled";
    return false;
  }
  if (!c->held_up) {
    c->held_up = true;
    log_line(name_of(c->rank) + " sent no heartbeat for " + ms_text(waited) +
             ", but its process (pid " + std::to_string(pid) +
             ") on this host is runnable, waiting for a CPU: not lost while it is, for up to " +
             ms_text(std::chrono::duration_cast<milliseconds>(held_up_limit())) + " of silence");
  }
  return true;
}

std::string service::impl::frame_length(std::span<const std::byte, codec::prefix_bytes> prefix,
                                        uint32_t& length) {
  return codec::decode_length(prefix, opts_.max_message_bytes, length);
}

void service::impl::on_frame(const std::shared_ptr<framed_connection>& fc,
                             std::vector<std::byte> body) {
  auto c = std::static_pointer_cast<connection>(fc);
  codec::message m;
  auto why = codec::decode(body, opts_.max_message_bytes, m);
  body = {}; // frames are rare: do not keep up to max_message_bytes per connection
  if (!why.empty())
    return failed(c, "malformed message: " + why);
  if (!suspended_ && !c->graceful()) {
    if (c->held_up) {
      c->held_up = false;
      log_line("heard from " + name_of(c->rank) + " again after " +
               ms_text(std::chrono::duration_cast<milliseconds>(now() - c->last_rx)) +
               " of silence: its process was held up on this host, not lost");
    }
    c->last_rx = now();
    if (const auto* h = std::get_if<codec::heartbeat>(&m))
      on_heartbeat(c, *h);
    on_message(c, m);
  }
}

int64_t service::impl::wall_ns() const {
  if (opts_.wall_clock)
    return opts_.wall_clock();
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

void service::impl::on_heartbeat(const conn_ptr& c, const codec::heartbeat& h) {
  const int64_t t4 = wall_ns();
  c->peer_sent_ns = h.sent_ns;
  c->peer_received_ns = t4;
  // From the chief, echoing one of ours: t1 we sent, t2 it received, t3 it sent, t4 we received.
  if (chief_ || c != chief_conn_ || c->state != phase::member || h.echo_sent_ns == 0 ||
      h.sent_ns == 0)
    return;
  record_round_trip(h.echo_sent_ns, h.echo_received_ns, h.sent_ns, t4);
}

void service::impl::record_round_trip(int64_t t1, int64_t t2, int64_t t3, int64_t t4) {
  const int64_t delay = (t4 - t1) - (t3 - t2);
  if (delay < 0)
    return; // a clock stepped between the two: no sample
  const int64_t offset = ((t2 - t1) + (t3 - t4)) / 2;
  std::lock_guard lock(mu_);
  round_trips_.emplace_back(offset, delay);
  while (round_trips_.size() > 16)
    round_trips_.pop_front();
  ++round_trip_count_;
}

clock_offset service::impl::chief_clock_offset() const {
  clock_offset out;
  std::lock_guard lock(mu_);
  if (reference_clock_) {
    out.known = true; // the chief's clock is the reference
    return out;
  }
  if (round_trips_.empty())
    return out;
  const auto best =
      std::min_element(round_trips_.begin(), round_trips_.end(),
                       [](const auto& a, const auto& b) { return a.second < b.second; });
  out.known = true;
  out.offset_ns = best->first;
  out.delay_ns = best->second;
  out.samples = round_trip_count_;
  return out;
}

void service::impl::on_read_error(const std::shared_ptr<framed_connection>& fc,
                                  const error_code& ec) {
  auto c = std::static_pointer_cast<connection>(fc);
  if (c->state == phase::handshake && chief_)
    return failed(c, "the connection closed without a Join (" + reason_of(ec) + ")");
  if (!chief_ && c->state != phase::member)
    return failed(c, "the connection closed (" + reason_of(ec) + ")");
  failed(c, "connection closed without leave (" + reason_of(ec) + ")");
}

void service::impl::on_failure(const std::shared_ptr<framed_connection>& fc,
                               const std::string& what) {
  failed(std::static_pointer_cast<connection>(fc), what);
}

void service::impl::failed(const conn_ptr& c, const std::string& what) {
  if (c->closed())
    return;
  if (suspended_)
    return; // deaf: it does not even notice; the socket stays open until the service goes
  if (c->graceful() || leaving_ || crashed_ || c->state == phase::left || c->state == phase::lost)
    return close(c); // expected: this side or the peer is closing
  if (chief_)
    return chief_failed(c, what);
  worker_failed(c, what);
}

void service::impl::send(const conn_ptr& c, const codec::message& m) {
  if (c->closed() || c->send_shut() || suspended_ || crashed_)
    return;
  auto frame = codec::encode(m);
  if (frame.size() - codec::prefix_bytes > opts_.max_message_bytes) {
    // Only a view can be this large; maybe_form_view checks it before sending.
    log_line("not sending a " + std::string(codec::kind_of(m)) + " of " +
             std::to_string(frame.size()) + " bytes to " + c->remote() +
             ": over options.max_message_bytes");
    return;
  }
  c->send(std::move(frame));
}

void service::impl::close(const conn_ptr& c) {
  if (!c->close())
    return;
  if (c->state == phase::handshake && chief_)
    --handshakes_;
  conns_.erase(c);
  maybe_leave_done();
}

void service::impl::close_gracefully(const conn_ptr& c) {
  c->close_gracefully(linger_);
}

void service::impl::on_message(const conn_ptr& c, codec::message& m) {
  if (chief_)
    return on_chief_message(c, m);
  on_worker_message(c, m);
}

void service::impl::unexpected(const conn_ptr& c, const codec::message& m) {
  failed(c, std::string("protocol error: unexpected ") + codec::kind_of(m) + " message " +
                (c->state == phase::handshake ? "before the handshake finished"
                 : c->state == phase::joined  ? "before the view"
                                              : "after the view"));
}

void service::impl::start_rendezvous() {
  if (rendezvous_started_ || leaving_ || crashed_ || decided())
    return;
  rendezvous_started_ = true;
  auto now = this->now();
  rendezvous_deadline_ = now + opts_.rendezvous_timeout;
  next_missing_log_ = now + opts_.missing_log_interval;
  if (chief_)
    maybe_form_view();
  else
    start_attempt();
}

void service::impl::do_leave(const std::string& reason) {
  if (crashed_ || leaving_)
    return maybe_leave_done();
  leaving_ = true;
  set_outcome(
      make_caf_error(errc::shutdown, self_ + " left the cluster before the view: " + reason));
  error_code ignored;
  acceptor_.close(ignored);
  standby_.close(ignored);
  former_chief_.close(ignored);
  retry_timer_.cancel();
  resolver_.cancel();
  log_line("leaving the cluster: " + reason);
  auto epoch = view_formed_ ? view_.epoch : 0;
  for (const auto& c : std::vector<conn_ptr>(conns_.begin(), conns_.end())) {
    if (c->state == phase::handshake) {
      close(c);
      continue;
    }
    if (c->state == phase::joined || c->state == phase::member)
      send(c, codec::leave{epoch, static_cast<uint32_t>(opts_.rank), reason});
    c->state = phase::left;
    close_gracefully(c);
  }
  maybe_leave_done();
}

void service::impl::maybe_leave_done() {
  if (!leaving_ || !conns_.empty())
    return;
  {
    std::lock_guard lock(mu_);
    leave_done_ = true;
  }
  cv_.notify_all();
}

void service::impl::do_crash() {
  crashed_ = true;
  set_outcome(make_caf_error(errc::shutdown, self_ + " crashed (test hook) before the view"));
  error_code ignored;
  acceptor_.close(ignored);
  standby_.close(ignored);
  former_chief_.close(ignored);
  retry_timer_.cancel();
  resolver_.cancel();
  tick_timer_.cancel();
  for (const auto& c : std::vector<conn_ptr>(conns_.begin(), conns_.end()))
    close(c);
  {
    std::lock_guard lock(mu_);
    crash_done_ = true;
    leave_done_ = true;
  }
  cv_.notify_all();
}

} // namespace consort::transport::membership
