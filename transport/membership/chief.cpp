// The membership service's chief (rank 0; see service_impl.hpp): the server, the Joins, the
// view, and losing a member.
//
// Connections. The chief accepts; on every accepted connection it first sends a Challenge (a
// fresh nonce, with or without a shared secret, so that there is one flow), then reads frames.
// The first must be a valid Join within `handshake_timeout`; the chief checks it and either
// refuses it (Refusal with the reason, then a graceful close) or records the worker as joined.
// When every task has joined and `rendezvous()` was called, the chief sends each worker the view
// (with its proof of the secret for that worker's connection: proofs.hpp). After the view, a lost
// member is reported through on_lost and announced to every other member with an Abort.

#include "transport/auth.hpp"
#include "transport/membership/proofs.hpp"
#include "transport/membership/service_impl.hpp"

#include <consort/caf_error.hpp>
#include <consort/error.hpp>

#include <unistd.h>

#include <algorithm>

namespace consort::transport::membership {

using auth::nonce_bytes;
using auth::random_bytes;

namespace {

/// How many accepted connections may be in their handshake at once; more are closed at once.
constexpr std::size_t max_pending_handshakes = 64;

std::string join_names(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& name : names)
    out += (out.empty() ? "" : ", ") + name;
  return out.empty() ? std::string{"none"} : out;
}

} // namespace

// -- I/O thread: chief ---------------------------------------------------------------------------

void service::impl::accept_next() {
  accept_on(acceptor_);
}

void service::impl::accept_on(asio_tcp::acceptor& acceptor) {
  if (stopped_ || crashed_ || leaving_)
    return;
  auto c = new_connection();
  acceptor.async_accept(c->socket(), [this, c, &acceptor](const error_code& ec) {
    if (stopped_ || crashed_ || leaving_ || ec == asio::error::operation_aborted)
      return;
    if (ec) {
      // Out of descriptors and the like: log, and keep accepting after a pause.
      log_line("accept on " + listen_address_ + " failed: " + ec.message());
      retry_timer_.expires_after(milliseconds{50});
      retry_timer_.async_wait([this, &acceptor](const error_code& ec) {
        if (!ec)
          accept_on(acceptor);
      });
      return;
    }
    accept_on(acceptor);
    on_accepted(c);
  });
}

void service::impl::on_accepted(const conn_ptr& c) {
  error_code ec;
  auto remote = c->socket().remote_endpoint(ec);
  c->remote(ec ? std::string{"an unknown address"} : endpoint_text(remote));
  if (handshakes_ >= max_pending_handshakes) {
    log_line("closed the connection from " + c->remote() + ": " + std::to_string(handshakes_) +
             " connections are already in their handshake");
    c->close();
    return;
  }
  ++handshakes_;
  conns_.insert(c);
  c->socket().set_option(asio_tcp::no_delay(true), ec);
  c->opened_at = now();
  c->nonce = random_bytes(nonce_bytes);
  send(c, codec::challenge{c->nonce});
  c->read_frames();
}

void service::impl::on_chief_message(const conn_ptr& c, codec::message& m) {
  switch (c->state) {
  case phase::handshake:
    if (auto* j = std::get_if<codec::join>(&m))
      return on_join(c, *j);
    return failed(c, std::string("expected a Join, got a ") + codec::kind_of(m) + " message");
  case phase::joined:
    if (auto* l = std::get_if<codec::leave>(&m)) {
      log_line(name_of(c->rank) + " left before the view: " + l->reason);
      by_rank_[c->rank].reset();
      deferred_joins_.erase(c->rank);
      c->state = phase::left;
      if (reforming_ && next_set_.erase(c->rank) != 0)
        maybe_form_next_view();
      return close_gracefully(c);
    }
    return unexpected(c, m);
  case phase::member:
    if (std::holds_alternative<codec::heartbeat>(m))
      return;
    if (auto* j = std::get_if<codec::join>(&m); j && elastic())
      return on_rejoin(c, *j);
    if (auto* a = std::get_if<codec::abort>(&m);
        a && elastic() &&
        std::find(a->lost_ranks.begin(), a->lost_ranks.end(), static_cast<uint32_t>(opts_.rank)) !=
            a->lost_ranks.end())
      return deposed(name_of(c->rank) + " lost this chief: " + a->cause);
    if (auto* l = std::get_if<codec::leave>(&m)) {
      log_line(name_of(c->rank) + " left: " + l->reason);
      c->state = phase::left;
      if (elastic()) {
        // Done, not lost: the group's later epochs leave it out; its task may join again.
        in_view_.erase(c->rank);
        by_rank_[c->rank].reset();
        if (reforming_ && next_set_.erase(c->rank) != 0)
          maybe_form_next_view();
      }
      return close_gracefully(c);
    }
    return unexpected(c, m);
  default:
    return;
  }
}

void service::impl::deposed(const std::string& cause) {
  if (group_ended_)
    return;
  // This chief was stopped or cut off past peer_timeout, and its members went on under a
  // successor: it leads no group of its own (a second group would train apart).
  auto what = "the others went on without this chief, under its successor: " + cause;
  log_line(what);
  end_group(make_caf_error(errc::peer_lost, self_ + ": " + what));
  reforming_ = false;
  for (const auto& other : std::vector<conn_ptr>(conns_.begin(), conns_.end()))
    if (other->state == phase::member || other->state == phase::joined) {
      other->state = phase::lost;
      close(other);
    }
  report({}, what);
}

void service::impl::chief_failed(const conn_ptr& c, const std::string& what) {
  switch (c->state) {
  case phase::handshake:
    log_line("closed the connection from " + c->remote() + ": " + what);
    return close(c);
  case phase::joined:
    log_line(name_of(c->rank) + " at " + c->remote() + " dropped out before the view: " + what +
             "; it may join again");
    by_rank_[c->rank].reset();
    deferred_joins_.erase(c->rank);
    close(c);
    if (reforming_ && next_set_.erase(c->rank) != 0)
      maybe_form_next_view();
    return;
  case phase::member:
    return lose_member(c->rank, name_of(c->rank) + ": " + what);
  default:
    return close(c);
  }
}

std::string service::impl::check_join(const codec::join& j, const std::vector<std::byte>& nonce,
                                      int& rank, bool& other_cluster) const {
  if (j.version != codec::protocol_version)
    return "it speaks membership protocol version " + std::to_string(j.version) +
           ", this chief speaks version " + std::to_string(codec::protocol_version);
  if (rendezvous_failed_)
    return "the rendezvous of this cluster has failed already (" + failure_ + ")";
  if (auto why = proofs::check_join(opts_.secret, nonce, j); !why.empty())
    return why;
  // Before the task: a worker given another cluster may name a task this one does not have.
  if (j.cluster_digest == 0)
    return "its Join carries no digest of its cluster (a worker of another build?); every task "
           "must run the same build";
  if (j.cluster_digest != cluster_.digest) {
    other_cluster = true;
    // Two lists and the rest of the reason within one text: a quarter of it each.
    return cluster_check::mismatch(cluster_, opts_.tasks[0], j, text_limit() / 4);
  }
  auto who = to_string(j.task);
  auto it = std::find(opts_.tasks.begin(), opts_.tasks.end(), j.task);
  if (it == opts_.tasks.end()) {
    std::vector<std::string> names;
    for (const auto& t : opts_.tasks)
      names.push_back(to_string(t));
    return "task " + who +
           " is not a worker of this cluster (expected one of: " + join_names(names) + ")";
  }
  rank = static_cast<int>(it - opts_.tasks.begin());
  if (rank == opts_.rank)
    return "task " + who + " is the chief's own task (rank " + std::to_string(rank) + ")";
  if (view_formed_ && !elastic())
    return "task " + who + " (rank " + std::to_string(rank) +
           ") is already a member of this cluster's view (epoch " + std::to_string(view_.epoch) +
           "); joining again is not supported";
  if (view_formed_ && group_ended_)
    return "the elastic group of this cluster has ended";
  // In an elastic group a member's task may join again from a new process (a restart that came
  // before its previous process was seen lost): the new process replaces the old (on_join).
  if (by_rank_[rank] && !(view_formed_ && by_rank_[rank]->state == phase::member))
    return "task " + who + " (rank " + std::to_string(rank) + ") already joined, from " +
           by_rank_[rank]->remote() + " (a duplicate task)";
  if (j.devices.size() != opts_.devices.size())
    return who + " announces " + std::to_string(j.devices.size()) + " devices but the chief (" +
           to_string(opts_.tasks[0]) + ") has " + std::to_string(opts_.devices.size()) +
           "; multi_worker_mirrored_strategy needs the same number of devices on every worker";
  host_port hp;
  if (auto why = split_address(j.address, hp); !why.empty())
    return "its collective address: " + why;
  return {};
}

void service::impl::on_join(const conn_ptr& c, codec::join& j) {
  int rank = -1;
  bool other_cluster = false;
  auto why = check_join(j, c->nonce, rank, other_cluster);
  if (!why.empty()) {
    refuse(c, j, why);
    if (other_cluster)
      fail_for_other_cluster(j, c->remote(), why);
    return;
  }
  --handshakes_;
  std::vector<int> replaced;
  if (view_formed_ && by_rank_[rank]) {
    // Elastic: a new process of a member's task; its previous process is taken as lost.
    auto old = by_rank_[rank];
    log_line(name_of(rank) + " joins again from " + c->remote() + " (pid " + std::to_string(j.pid) +
             "); its previous process at " + old->remote() + " is taken as lost");
    send(old, codec::abort{view_.epoch, "a new process of its task joined the group", {}});
    old->state = phase::lost;
    close_gracefully(old);
    by_rank_[rank].reset();
    replaced.push_back(rank);
  }
  c->state = phase::joined;
  c->rank = rank;
  c->join = std::move(j);
  c->join_received_ns = wall_ns();
  by_rank_[rank] = c;
  log_line(name_of(rank) + " joined from " + c->remote() + " (collective address " +
           c->join.address + ", " + std::to_string(c->join.devices.size()) + " devices, pid " +
           std::to_string(c->join.pid) + ")");
  if (view_formed_ && reforming_ && next_set_.count(rank) != 0 && replaced.empty())
    return maybe_form_next_view(); // a member reaching the chief's successor
  if (view_formed_ && reforming_ && replaced.empty()) {
    // A re-formation is under way: the task joins in the epoch after it, so that each epoch is
    // one change (a loss, then a join) and the members' counts say what happened.
    deferred_joins_.insert(rank);
    return;
  }
  if (view_formed_) // elastic: it joins the running group in its next epoch
    return start_reform(replaced, rank,
                        name_of(rank) + (replaced.empty() ? " joins the group"
                                                          : " joins the group again from a new "
                                                            "process, replacing its previous one"));
  maybe_form_view();
}

void service::impl::refuse(const conn_ptr& c, const codec::join& j, const std::string& reason) {
  log_line("refused the Join of " + to_string(j.task) + " from " + c->remote() + ": " + reason);
  send(c, codec::refusal{j.task, cluster_check::bounded(reason, text_limit())});
  --handshakes_;
  c->state = phase::left;
  close_gracefully(c);
}

void service::impl::fail_for_other_cluster(const codec::join& j, const std::string& remote,
                                           const std::string& reason) {
  if (view_formed_ || rendezvous_failed_ || leaving_ || crashed_)
    return;
  // Only a task this chief waits for: a stray process given another cluster is refused alone.
  auto it = std::find(opts_.tasks.begin(), opts_.tasks.end(), j.task);
  if (it == opts_.tasks.end() || it == opts_.tasks.begin())
    return;
  auto rank = static_cast<std::size_t>(it - opts_.tasks.begin());
  if (by_rank_[rank])
    return;
  auto text = cluster_check::bounded("the rendezvous failed: the Join of " + to_string(j.task) +
                                         " from " + remote + " was refused: " + reason,
                                     text_limit());
  rendezvous_failed_ = true;
  failure_ = text;
  log_line("the rendezvous failed: " + to_string(j.task) +
           " was given another cluster (above); aborting the workers that joined");
  abort_joined(text);
  set_outcome(make_caf_error(errc::invalid_argument, self_ + ": " + text));
}

std::vector<int> service::impl::missing_ranks() const {
  std::vector<int> out;
  for (std::size_t r = 1; r < by_rank_.size(); ++r)
    if (!by_rank_[r])
      out.push_back(static_cast<int>(r));
  return out;
}

void service::impl::maybe_form_view() {
  if (!rendezvous_started_ || view_formed_ || rendezvous_failed_ || leaving_ || crashed_ ||
      !missing_ranks().empty())
    return;
  view v;
  v.epoch = 1;
  do {
    auto bytes = random_bytes(8);
    for (auto b : bytes)
      v.group_id = (v.group_id << 8) | static_cast<uint64_t>(b);
  } while (v.group_id == 0);
  v.members.resize(opts_.tasks.size());
  for (std::size_t r = 0; r < opts_.tasks.size(); ++r) {
    auto& m = v.members[r];
    m.rank = static_cast<int>(r);
    m.task = opts_.tasks[r];
    if (r == 0) {
      m.address = opts_.address;
      m.devices = opts_.devices;
      m.pid = static_cast<uint32_t>(::getpid());
    } else {
      m.address = by_rank_[r]->join.address;
      m.devices = by_rank_[r]->join.devices;
      m.standby_address = by_rank_[r]->join.standby_address;
      m.pid = by_rank_[r]->join.pid;
    }
  }
  v.nccl_unique_id = opts_.nccl_unique_id;
  auto size = codec::encode(codec::view_message{v, std::vector<std::byte>(32)}).size() -
              codec::prefix_bytes;
  if (size > opts_.max_message_bytes) {
    rendezvous_failed_ = true;
    failure_ = "the view of " + std::to_string(v.members.size()) + " members is " +
               std::to_string(size) + " bytes, over options.max_message_bytes (" +
               std::to_string(opts_.max_message_bytes) + ")";
    log_line(failure_);
    for (std::size_t r = 1; r < by_rank_.size(); ++r) {
      send(by_rank_[r], codec::abort{0, failure_, {}});
      by_rank_[r]->state = phase::left;
      close_gracefully(by_rank_[r]);
    }
    return set_outcome(make_caf_error(errc::invalid_argument, self_ + ": " + failure_));
  }
  view_formed_ = true;
  view_ = v;
  for (std::size_t r = 0; r < opts_.tasks.size(); ++r)
    in_view_.insert(static_cast<int>(r));
  publish_view(v);
  auto now = this->now();
  next_heartbeat_ = now + opts_.heartbeat_interval;
  for (std::size_t r = 1; r < by_rank_.size(); ++r)
    send_view(by_rank_[r], v, now);
  log_line("formed the view of epoch " + std::to_string(v.epoch) + ": " +
           std::to_string(v.members.size()) + " members, group " + std::to_string(v.group_id));
  set_outcome(std::move(v));
}

void service::impl::send_view(const conn_ptr& c, const view& v, clock::time_point now) {
  c->state = phase::member;
  c->last_rx = now;
  codec::view_message m{v, {}};
  // Echoes the member's Join: with the view, it learns the chief's clock (record_round_trip).
  m.sent_ns = wall_ns();
  m.join_sent_ns = c->join.sent_ns;
  m.join_received_ns = c->join_received_ns;
  if (!opts_.secret.empty())
    m.auth_proof = proofs::view_proof(opts_.secret, c->nonce, c->join.nonce, c->join.task, v.epoch,
                                      v.group_id);
  send(c, m);
}

void service::impl::log_missing() {
  auto missing = missing_ranks();
  if (missing.empty())
    return;
  std::vector<std::string> missing_names, joined_names;
  for (std::size_t r = 0; r < by_rank_.size(); ++r)
    (r != 0 && !by_rank_[r] ? missing_names : joined_names).push_back(to_string(opts_.tasks[r]));
  log_line("waiting for " + std::to_string(missing.size()) + " of " +
           std::to_string(opts_.tasks.size()) + " tasks to join: " + join_names(missing_names) +
           " (joined: " + join_names(joined_names) + ")");
}

void service::impl::abort_joined(const std::string& text) {
  for (std::size_t r = 1; r < by_rank_.size(); ++r) {
    if (!by_rank_[r])
      continue;
    send(by_rank_[r], codec::abort{0, text, {}});
    by_rank_[r]->state = phase::left;
    close_gracefully(by_rank_[r]);
    by_rank_[r].reset();
  }
}

void service::impl::rendezvous_timed_out() {
  std::vector<std::string> missing_names, joined_names;
  for (std::size_t r = 0; r < by_rank_.size(); ++r)
    (r != 0 && !by_rank_[r] ? missing_names : joined_names).push_back(to_string(opts_.tasks[r]));
  auto text = "rendezvous at " + listen_address_ + " timed out after " +
              ms_text(opts_.rendezvous_timeout) + ": " + join_names(missing_names) +
              " did not join (joined: " + join_names(joined_names) + ")";
  rendezvous_failed_ = true;
  failure_ = text;
  log_line(text);
  abort_joined(text);
  set_outcome(make_caf_error(errc::collective_timeout, text));
}

void service::impl::lose_member(int rank, const std::string& cause, bool silent) {
  auto c = by_rank_[rank];
  if (!c || c->state != phase::member)
    return;
  c->state = phase::lost;
  log_line("lost " + cause + " (connection from " + c->remote() + ")");
  const bool stuck = c->writing() && now() - c->write_started() >= opts_.peer_timeout;
  const bool maybe_alive = silent || stuck; // no closed connection: perhaps only cut off
  if (!silent || stuck || c->closed()) {
    close(c);
  } else {
    // Silent, it may only be stopped or cut off for a while: should it read on, it learns first
    // that it is no longer a member (an Abort of its epoch naming it) instead of a bare end of
    // file, which it would take for the chief's loss.
    send(c, codec::abort{view_.epoch, cause, {static_cast<uint32_t>(rank)}});
    close_gracefully(c);
  }
  if (elastic()) {
    by_rank_[rank].reset();
    return start_reform({rank}, -1, cause, maybe_alive);
  }
  report({rank}, cause);
  for (const auto& other : std::vector<conn_ptr>(conns_.begin(), conns_.end()))
    if (other->state == phase::member)
      send(other, codec::abort{view_.epoch, cause, {static_cast<uint32_t>(rank)}});
}

} // namespace consort::transport::membership

namespace consort::transport::membership {

// -- I/O thread: chief of an elastic group -------------------------------------------------------
//
// A change (a member lost, a task joining) begins a re-formation: the chief announces the next
// epoch to every member that stays, with an Abort carrying that epoch (later than the view's: a
// notice, not the end) and the lost ranks. Each member answers, once its caller offered its part
// (service::next_view), with a Join carrying its collective address for the next epoch, on the
// connection it has. When every member of the next epoch has answered (the chief through its own
// next_view, a joining task through its first Join), the chief sends the View of the next epoch,
// its members ranked from 0 in the order of options::tasks. A change during a re-formation amends
// it; one after its View begins the next. A member that does not answer within reform_timeout is
// left out as lost; fewer than elastic_min_members ends the group.
//
// A join with nothing lost waits for a step boundary: its notice says so (Abort.atBoundary), and
// the members finish their steps and re-form at the next boundary they agree on
// (multi_worker_mirrored_strategy::step_boundary), with nothing to roll back. A loss meanwhile,
// or no offer within reform_timeout (a loop without boundaries), turns it into the plain notice,
// which aborts the calls in flight.

void service::impl::start_reform(const std::vector<int>& lost, int joining,
                                 const std::string& cause, bool maybe_alive) {
  if (group_ended_ || leaving_ || crashed_)
    return;
  if (!reforming_) {
    reforming_ = true;
    reform_maybe_split_ = false;
    next_epoch_ = view_.epoch + 1;
    next_set_ = in_view_;
    rejoined_.clear();
    notified_.clear();
    reform_deadline_ = now() + opts_.reform_timeout;
    at_boundary_ = lost.empty() && joining >= 0;
    reform_cause_ = cause;
  } else if (!lost.empty()) {
    at_boundary_ = false;
    reform_cause_ = cause;
  }
  reform_maybe_split_ = reform_maybe_split_ || (maybe_alive && !lost.empty());
  for (int r : lost) {
    next_set_.erase(r);
    in_view_.erase(r);
  }
  std::vector<int> joins;
  if (joining >= 0) {
    next_set_.insert(joining);
    joins.push_back(joining);
  }
  log_line("re-forming the group as epoch " + std::to_string(next_epoch_) + " with " +
           std::to_string(next_set_.size()) + " members: " + cause);
  if (static_cast<int>(next_set_.size()) < opts_.elastic_min_members)
    return fail_group("the group of workers ended: " + cause + "; " +
                      std::to_string(next_set_.size()) + " members remain, fewer than the " +
                      std::to_string(opts_.elastic_min_members) + " it needs (elastic)");
  std::vector<uint32_t> lost_ranks(lost.begin(), lost.end());
  for (int r : next_set_) {
    auto& c = by_rank_[static_cast<std::size_t>(r)];
    if (r == opts_.rank || !c || c->state != phase::member)
      continue;
    notified_.insert(r);
    send(c, codec::abort{next_epoch_, cause, lost_ranks, at_boundary_});
  }
  report(lost, cause, next_epoch_, std::move(joins), at_boundary_);
  maybe_form_next_view();
}

void service::impl::boundary_not_reached() {
  // Not every member reached a step boundary in reform_timeout (a loop that does not commit, or
  // a long stretch between commits): the plain notice aborts their calls in flight instead.
  at_boundary_ = false;
  log_line("not every member reached a step boundary within reform_timeout (" +
           ms_text(opts_.reform_timeout) + "): the calls of epoch " + std::to_string(view_.epoch) +
           " are aborted for epoch " + std::to_string(next_epoch_));
  for (int r : next_set_) {
    auto& c = by_rank_[static_cast<std::size_t>(r)];
    if (r == opts_.rank || !c || c->state != phase::member || rejoined_.count(r) != 0)
      continue;
    send(c, codec::abort{next_epoch_, reform_cause_, {}});
  }
  if (!has_offer_ || offer_after_ != view_.epoch)
    report({}, reform_cause_, next_epoch_);
  reform_deadline_ = now() + opts_.reform_timeout;
}

void service::impl::on_rejoin(const conn_ptr& c, codec::join& j) {
  if (!reforming_ || next_set_.count(c->rank) == 0 || rejoined_.count(c->rank) != 0) {
    log_line("ignored a Join of " + name_of(c->rank) + " for no re-formation under way");
    return;
  }
  if (j.task != opts_.tasks[static_cast<std::size_t>(c->rank)])
    return failed(c, "protocol error: its Join for epoch " + std::to_string(next_epoch_) +
                         " names task " + to_string(j.task));
  if (auto why = proofs::check_join(opts_.secret, c->nonce, j); !why.empty())
    return failed(c, "its Join for epoch " + std::to_string(next_epoch_) + ": " + why);
  host_port hp;
  if (auto why = split_address(j.address, hp); !why.empty())
    return failed(c, "its Join for epoch " + std::to_string(next_epoch_) +
                         ": its collective address: " + why);
  c->join.address = std::move(j.address);
  c->join.nonce = std::move(j.nonce);
  c->join.sent_ns = j.sent_ns;
  c->join_received_ns = wall_ns();
  rejoined_.insert(c->rank);
  maybe_form_next_view();
}

void service::impl::maybe_form_next_view() {
  if (!reforming_ || group_ended_ || leaving_ || crashed_)
    return;
  if (static_cast<int>(next_set_.size()) < opts_.elastic_min_members)
    return fail_group("the group of workers ended: " + std::to_string(next_set_.size()) +
                      " members remain, fewer than the " +
                      std::to_string(opts_.elastic_min_members) + " it needs (elastic)");
  if (!has_offer_ || offer_after_ != view_.epoch)
    return; // the chief's own caller has not offered its part yet
  for (int r : next_set_) {
    if (r == opts_.rank)
      continue;
    const auto& c = by_rank_[static_cast<std::size_t>(r)];
    if (!c)
      return;
    if (c->state == phase::member && rejoined_.count(r) == 0)
      return;
  }
  if (auto why = quorum_refusal(); !why.empty())
    return fail_group("the group of workers ended: " + why);
  view v;
  v.epoch = next_epoch_;
  do {
    auto bytes = random_bytes(8);
    for (auto b : bytes)
      v.group_id = (v.group_id << 8) | static_cast<uint64_t>(b);
  } while (v.group_id == 0);
  std::string joined, left;
  for (int r : next_set_) {
    member m;
    m.rank = static_cast<int>(v.members.size());
    m.task = opts_.tasks[static_cast<std::size_t>(r)];
    if (r == opts_.rank) {
      m.address = offer_address_;
      m.devices = opts_.devices;
      m.standby_address = standby_address_;
      m.pid = static_cast<uint32_t>(::getpid());
    } else {
      const auto& c = by_rank_[static_cast<std::size_t>(r)];
      m.address = c->join.address;
      m.devices = c->join.devices;
      m.standby_address = c->join.standby_address;
      m.pid = c->join.pid;
      // New to the group (a member reaching a chief's successor is in phase joined too).
      if (std::none_of(view_.members.begin(), view_.members.end(),
                       [&](const member& o) { return o.task == m.task; }))
        joined += (joined.empty() ? "" : ", ") + to_string(m.task);
    }
    v.members.push_back(std::move(m));
  }
  for (const auto& m : view_.members)
    if (std::none_of(v.members.begin(), v.members.end(),
                     [&](const member& n) { return n.task == m.task; }))
      left += (left.empty() ? "" : ", ") + to_string(m.task);
  v.nccl_unique_id = opts_.nccl_unique_id;
  reforming_ = false;
  succeeding_ = false;
  view_ = v;
  in_view_ = next_set_;
  auto now = this->now();
  for (int r : next_set_)
    if (r != opts_.rank)
      send_view(by_rank_[static_cast<std::size_t>(r)], v, now);
  log_line("formed the view of epoch " + std::to_string(v.epoch) + ": " +
           std::to_string(v.members.size()) + " members, group " + std::to_string(v.group_id) +
           (left.empty() ? "" : ", without " + left) +
           (joined.empty() ? "" : ", joined by " + joined));
  publish_view(v);
  // Tasks that joined during this re-formation: the next one.
  auto deferred = std::exchange(deferred_joins_, {});
  for (int r : deferred)
    if (by_rank_[static_cast<std::size_t>(r)] &&
        by_rank_[static_cast<std::size_t>(r)]->state == phase::joined)
      start_reform({}, r, name_of(r) + " joins the group");
}

std::string service::impl::quorum_refusal() const {
  if (!(succeeding_ ? chief_maybe_alive_ : reform_maybe_split_))
    return {}; // every member lost is dead (its connection closed): nobody else goes on
  int kept = 0;
  for (const auto& m : view_.members) {
    auto it = std::find(opts_.tasks.begin(), opts_.tasks.end(), m.task);
    kept +=
        it != opts_.tasks.end() && next_set_.count(static_cast<int>(it - opts_.tasks.begin())) > 0
            ? 1
            : 0;
  }
  const int of = static_cast<int>(view_.members.size());
  if (succeeding_ ? 2 * kept > of : 2 * kept >= of)
    return {};
  return std::to_string(kept) + " of the " + std::to_string(of) + " members of epoch " +
         std::to_string(view_.epoch) + " remain, " +
         (succeeding_ ? "not a majority, and the lost chief may go on with the others behind a "
                        "partition (a successor needs more than half)"
                      : "fewer than half, and the others may go on under a successor behind a "
                        "partition (the chief needs half)");
}

void service::impl::reform_timed_out() {
  if (at_boundary_)
    return boundary_not_reached();
  std::vector<int> late;
  for (int r : next_set_) {
    if (r == opts_.rank)
      continue;
    const auto& c = by_rank_[static_cast<std::size_t>(r)];
    // Not there at all (a member that never reached a successor), or no part offered.
    if (!c || (c->state == phase::member && rejoined_.count(r) == 0))
      late.push_back(r);
  }
  if (!has_offer_ || offer_after_ != view_.epoch)
    return fail_group("the group of workers ended: the chief did not offer its part of epoch " +
                      std::to_string(next_epoch_) + " within reform_timeout (" +
                      ms_text(opts_.reform_timeout) + ")");
  for (int r : late) {
    auto c = by_rank_[static_cast<std::size_t>(r)];
    log_line("left " + name_of(r) + " out of epoch " + std::to_string(next_epoch_) +
             ": it did not offer its part within reform_timeout (" + ms_text(opts_.reform_timeout) +
             ")");
    if (c) {
      send(c, codec::abort{view_.epoch,
                           "left out of epoch " + std::to_string(next_epoch_) +
                               ": no part offered within reform_timeout",
                           {static_cast<uint32_t>(r)}});
      c->state = phase::lost;
      close_gracefully(c);
    }
    by_rank_[static_cast<std::size_t>(r)].reset();
    next_set_.erase(r);
    in_view_.erase(r);
  }
  reform_deadline_ = now() + opts_.reform_timeout;
  maybe_form_next_view();
}

void service::impl::serve_former_chief_address() {
  if (former_chief_.is_open() || former_chief_until_ == clock::time_point{})
    return;
  host_port hp;
  if (!split_address(first_chief_address_, hp).empty())
    return;
  error_code ec;
  asio_tcp::resolver resolver(io_);
  auto results = resolver.resolve(
      hp.host, hp.port, asio_tcp::resolver::passive | asio_tcp::resolver::numeric_service, ec);
  if (ec || results.empty())
    return;
  const char* step = "";
  ec = listen_at(former_chief_, results.begin()->endpoint(), step);
  if (ec) {
    error_code ignored;
    former_chief_.close(ignored);
    if (now() >= former_chief_until_) {
      former_chief_until_ = {};
      log_line("does not serve at the lost chief's address " + first_chief_address_ + ": " +
               ec.message() + " (a task restarted now cannot find the group)");
    }
    return;
  }
  former_chief_until_ = {};
  log_line("also serves membership at the lost chief's address " + first_chief_address_);
  accept_on(former_chief_);
}

void service::impl::promote() {
  log_line("succeeds the lost chief: leads the re-formation of the group as epoch " +
           std::to_string(notice_epoch_) + " at " + standby_address_);
  chief_ = true;
  {
    std::lock_guard lock(mu_);
    reference_clock_ = true; // the others' offsets are to this clock from now on
  }
  failing_over_ = false;
  if (chief_conn_) {
    if (!chief_conn_->graceful()) // a lingering one still tells the old chief (lose_chief)
      close(chief_conn_);
    chief_conn_.reset();
  }
  retry_timer_.cancel();
  acceptor_ = std::move(standby_);
  listen_address_ = standby_address_;
  by_rank_.assign(opts_.tasks.size(), nullptr);
  handshakes_ = 0;
  // The members of the view but the lost chief, who reach this one at its standby address.
  const auto lost = std::find(opts_.tasks.begin(), opts_.tasks.end(), view_.members.front().task);
  in_view_.clear();
  for (const auto& m : view_.members) {
    auto it = std::find(opts_.tasks.begin(), opts_.tasks.end(), m.task);
    if (it != opts_.tasks.end() && it != lost)
      in_view_.insert(static_cast<int>(it - opts_.tasks.begin()));
  }
  reforming_ = true;
  succeeding_ = true;
  next_epoch_ = notice_epoch_;
  next_set_ = in_view_;
  rejoined_.clear();
  notified_.clear();
  reform_deadline_ = now() + opts_.reform_timeout;
  accept_next();
  // Where the chief served, when it was on this host: a restarted task, which knows only that
  // address from its cluster, finds the group there. Its port is free once the chief's process
  // is gone, which may be a moment after its connections closed: tried again at every tick, for
  // reform_timeout.
  former_chief_until_ = now() + opts_.reform_timeout;
  serve_former_chief_address();
  maybe_form_next_view();
}

void service::impl::fail_group(const std::string& text) {
  if (group_ended_)
    return;
  log_line(text);
  reforming_ = false;
  auto bounded = cluster_check::bounded(text, text_limit());
  for (const auto& c : std::vector<conn_ptr>(conns_.begin(), conns_.end())) {
    if (c->state != phase::member && c->state != phase::joined)
      continue;
    // An Abort of the current epoch (not a later one) ends the group.
    send(c, codec::abort{view_.epoch, bounded, {}});
    c->state = phase::left;
    close_gracefully(c);
  }
  std::fill(by_rank_.begin(), by_rank_.end(), nullptr);
  end_group(make_caf_error(errc::peer_lost, self_ + ": " + text));
  report({}, text); // the chief's own caller: its calls end with the group
}

} // namespace consort::transport::membership
