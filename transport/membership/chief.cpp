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
  if (stopped_ || crashed_ || leaving_)
    return;
  auto c = new_connection();
  acceptor_.async_accept(c->socket(), [this, c](const error_code& ec) {
    if (stopped_ || crashed_ || leaving_ || ec == asio::error::operation_aborted)
      return;
    if (ec) {
      // Out of descriptors and the like: log, and keep accepting after a pause.
      log_line("accept on " + listen_address_ + " failed: " + ec.message());
      retry_timer_.expires_after(milliseconds{50});
      retry_timer_.async_wait([this](const error_code& ec) {
        if (!ec)
          accept_next();
      });
      return;
    }
    accept_next();
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
      c->state = phase::left;
      return close_gracefully(c);
    }
    return unexpected(c, m);
  case phase::member:
    if (std::holds_alternative<codec::heartbeat>(m))
      return;
    if (auto* l = std::get_if<codec::leave>(&m)) {
      log_line(name_of(c->rank) + " left: " + l->reason);
      c->state = phase::left;
      return close_gracefully(c);
    }
    return unexpected(c, m);
  default:
    return;
  }
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
    return close(c);
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
  if (rank == 0)
    return "task " + who + " is the chief's own task (rank 0)";
  if (view_formed_)
    return "task " + who + " (rank " + std::to_string(rank) +
           ") is already a member of this cluster's view (epoch " + std::to_string(view_.epoch) +
           "); joining again is not supported";
  if (by_rank_[rank])
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
  c->state = phase::joined;
  c->rank = rank;
  c->join = std::move(j);
  by_rank_[rank] = c;
  log_line(name_of(rank) + " joined from " + c->remote() + " (collective address " +
           c->join.address + ", " + std::to_string(c->join.devices.size()) + " devices, pid " +
           std::to_string(c->join.pid) + ")");
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
    } else {
      m.address = by_rank_[r]->join.address;
      m.devices = by_rank_[r]->join.devices;
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
  auto now = this->now();
  next_heartbeat_ = now + opts_.heartbeat_interval;
  for (std::size_t r = 1; r < by_rank_.size(); ++r) {
    auto& c = by_rank_[r];
    c->state = phase::member;
    c->last_rx = now;
    codec::view_message m{v, {}};
    if (!opts_.secret.empty())
      m.auth_proof = proofs::view_proof(opts_.secret, c->nonce, c->join.nonce, c->join.task,
                                        v.epoch, v.group_id);
    send(c, m);
  }
  log_line("formed the view of epoch " + std::to_string(v.epoch) + ": " +
           std::to_string(v.members.size()) + " members, group " + std::to_string(v.group_id));
  set_outcome(std::move(v));
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

void service::impl::lose_member(int rank, const std::string& cause) {
  auto c = by_rank_[rank];
  if (!c || c->state != phase::member)
    return;
  c->state = phase::lost;
  log_line("lost " + cause + " (connection from " + c->remote() + ")");
  close(c);
  report({rank}, cause);
  for (const auto& other : std::vector<conn_ptr>(conns_.begin(), conns_.end()))
    if (other->state == phase::member)
      send(other, codec::abort{view_.epoch, cause, {static_cast<uint32_t>(rank)}});
}

} // namespace consort::transport::membership
