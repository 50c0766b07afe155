// The membership service's workers (every rank but 0; see service_impl.hpp): the connection to
// the chief, the Join, the view received, and losing the chief.
//
// Connections. A worker connects to the chief (retrying refused, reset or timed-out attempts
// with back-off until its rendezvous deadline), answers the Challenge with its Join (with its
// proof of the secret: proofs.hpp) and waits for the View, a Refusal or an Abort. After the view
// it reports the chief's Aborts, and the chief's own loss, through on_lost.

#include "transport/auth.hpp"
#include "transport/membership/proofs.hpp"
#include "transport/membership/service_impl.hpp"

#include <consort/caf_error.hpp>
#include <consort/error.hpp>

#include <boost/asio/connect.hpp>

#include <algorithm>

#include <unistd.h>

namespace consort::transport::membership {

using auth::nonce_bytes;
using auth::random_bytes;

// -- I/O thread: worker --------------------------------------------------------------------------

codec::join service::impl::join_for(const std::string& address) {
  codec::join j;
  j.task = opts_.tasks[opts_.rank];
  j.address = address;
  j.standby_address = standby_address_;
  j.devices = opts_.devices;
  j.nonce = my_nonce_ = random_bytes(nonce_bytes);
  if (!opts_.secret.empty())
    j.auth_proof = proofs::join_proof(opts_.secret, chief_nonce_, my_nonce_, j.task, j.address);
  j.pid = static_cast<uint32_t>(::getpid());
  j.cluster_digest = cluster_.digest;
  j.sent_ns = wall_ns(); // sent right away: the chief echoes it in its view
  return j;
}

void service::impl::start_attempt() {
  if (stopped_ || crashed_ || leaving_ ||
      (!failing_over_ && (rendezvous_failed_ || view_formed_ || decided())))
    return;
  auto c = new_connection();
  c->remote(opts_.chief_address);
  c->rank = 0;
  c->opened_at = now();
  chief_conn_ = c;
  conns_.insert(c);
  resolver_.async_resolve(
      chief_hp_.host, chief_hp_.port, asio_tcp::resolver::numeric_service,
      [this, c](const error_code& ec, asio_tcp::resolver::results_type results) {
        if (stopped_ || c->closed())
          return;
        if (ec || results.empty())
          return attempt_failed(c, "resolve " + chief_hp_.host + ": " +
                                       (ec ? ec.message() : std::string{"no address"}));
        asio::async_connect(
            c->socket(), results, [this, c](const error_code& ec, const asio_tcp::endpoint& ep) {
              if (stopped_ || c->closed())
                return;
              if (ec)
                return attempt_failed(c, "connect to " + opts_.chief_address + ": " + ec.message());
              // A connect to a port of the ephemeral range on which nobody listens yet can be
              // given that very port as its source: a TCP self-connect, which would read its
              // own Join back. Treat it as the refusal it stands for.
              error_code local_ec;
              if (c->socket().local_endpoint(local_ec) == ep && !local_ec)
                return attempt_failed(c, "connect to " + opts_.chief_address +
                                             ": connected to itself (nobody listens there yet)");
              c->remote(endpoint_text(ep));
              error_code ignored;
              c->socket().set_option(asio_tcp::no_delay(true), ignored);
              c->read_frames();
            });
      });
}

void service::impl::attempt_failed(const conn_ptr& c, const std::string& why) {
  close(c);
  last_error_ = why;
  if (stopped_ || crashed_ || leaving_ ||
      (!failing_over_ && (rendezvous_failed_ || view_formed_ || decided())))
    return;
  auto now = this->now();
  if (now + backoff_ >= rendezvous_deadline_)
    return; // the tick fails the rendezvous at its deadline with this error
  if (!warned_) {
    // Once: workers usually start before the chief listens, so a refused attempt is common.
    warned_ = true;
    auto left = std::chrono::duration_cast<milliseconds>(rendezvous_deadline_ - now);
    log_line("cannot join the chief at " + opts_.chief_address + " yet (" + why +
             "); retrying for up to " + ms_text(left));
  }
  retry_timer_.expires_after(backoff_);
  backoff_ = std::min(backoff_ * 2, max_backoff);
  retry_timer_.async_wait([this](const error_code& ec) {
    if (!ec && !stopped_)
      start_attempt();
  });
}

void service::impl::on_worker_message(const conn_ptr& c, codec::message& m) {
  switch (c->state) {
  case phase::handshake: {
    auto* ch = std::get_if<codec::challenge>(&m);
    if (!ch)
      return failed(c, std::string("protocol error: expected a Challenge, got a ") +
                           codec::kind_of(m) + " message");
    if (auto why = proofs::check_challenge(*ch); !why.empty())
      return failed(c, why);
    chief_nonce_ = ch->nonce;
    if (failing_over_) {
      // The successor's Challenge: the Join carries this member's part of the next epoch, once
      // its caller offered it (maybe_rejoin).
      c->state = phase::joined;
      join_pending_ = true;
      last_error_ = "reached the chief's successor at " + c->remote() + ", but no view arrived";
      return maybe_rejoin();
    }
    codec::join j = join_for(opts_.address);
    // The list as far as it fits the frame (a text takes its length, a NUL and padding to 8).
    auto base = codec::encode(j).size() - codec::prefix_bytes;
    auto room = opts_.max_message_bytes > base + 16 ? opts_.max_message_bytes - base - 16 : 0;
    j.cluster = cluster_check::abbreviate(cluster_.text, std::min(room, codec::max_field_bytes));
    c->state = phase::joined;
    last_error_ = "joined the chief at " + c->remote() + ", but no view arrived";
    return send(c, j);
  }
  case phase::joined:
    if (auto* v = std::get_if<codec::view_message>(&m))
      return on_view(c, *v);
    if (failing_over_ &&
        (std::holds_alternative<codec::refusal>(m) || std::holds_alternative<codec::abort>(m) ||
         std::holds_alternative<codec::leave>(m))) {
      failing_over_ = false;
      c->state = phase::left;
      close_gracefully(c);
      auto text = "the chief's successor at " + c->remote() + " ended the group (a " +
                  std::string(codec::kind_of(m)) + " message)";
      log_line(text);
      return end_group(make_caf_error(errc::peer_lost, self_ + ": " + text));
    }
    if (auto* r = std::get_if<codec::refusal>(&m)) {
      auto text = "refused by the chief at " + opts_.chief_address + ": " + r->reason;
      return chief_ended_join(c, text, make_caf_error(errc::invalid_argument, text));
    }
    if (auto* a = std::get_if<codec::abort>(&m))
      return chief_ended_join(
          c, "the chief at " + opts_.chief_address + " aborted the rendezvous: " + a->cause,
          make_caf_error(errc::collective_timeout, a->cause));
    if (auto* l = std::get_if<codec::leave>(&m)) {
      auto text = "the chief at " + opts_.chief_address + " left before the view: " + l->reason;
      return chief_ended_join(c, text, make_caf_error(errc::peer_lost, text));
    }
    return unexpected(c, m);
  case phase::member:
    if (std::holds_alternative<codec::heartbeat>(m))
      return;
    if (auto* a = std::get_if<codec::abort>(&m)) {
      std::vector<int> ranks;
      for (auto r : a->lost_ranks)
        if (r < opts_.tasks.size())
          ranks.push_back(static_cast<int>(r));
      if (elastic() && a->epoch > view_.epoch) {
        // A notice: the group re-forms as epoch a->epoch.
        log_line("the chief re-forms the group as epoch " + std::to_string(a->epoch) +
                 (a->at_boundary ? " at the next step boundary: " : ": ") + a->cause);
        notice_epoch_ = std::max(notice_epoch_, a->epoch);
        report(std::move(ranks), a->cause, a->epoch, {}, a->at_boundary);
        return maybe_rejoin();
      }
      if (std::find(ranks.begin(), ranks.end(), opts_.rank) != ranks.end()) {
        // Lost for its silence (stopped, hung, cut off) while the others went on.
        auto what = "the chief left this worker out of the group: " + a->cause +
                    (elastic() ? "; the others went on without it (a new process of this task "
                                 "joins them)"
                               : "");
        log_line(what);
        // Reported before the group ends, so that a caller woken by the end (in next_view)
        // already knows it was left out.
        report({}, what, 0, {}, false, elastic());
        end_group(make_caf_error(errc::peer_lost, self_ + ": " + what));
        c->state = phase::lost;
        return close_gracefully(c);
      }
      log_line("the chief aborted epoch " + std::to_string(a->epoch) + ": " + a->cause);
      if (elastic())
        end_group(
            make_caf_error(errc::peer_lost, self_ + ": the chief ended the group: " + a->cause));
      return report(std::move(ranks), a->cause);
    }
    if (auto* v = std::get_if<codec::view_message>(&m); v && elastic())
      return on_view(c, *v);
    if (auto* l = std::get_if<codec::leave>(&m)) {
      log_line("the chief left: " + l->reason);
      c->state = phase::left;
      return close_gracefully(c);
    }
    return unexpected(c, m);
  default:
    return;
  }
}

void service::impl::worker_failed(const conn_ptr& c, const std::string& what) {
  if (c->state == phase::member)
    return lose_chief(name_of(0) + ": " + what);
  attempt_failed(c, "the chief at " + c->remote() + ": " + what);
}

void service::impl::on_view(const conn_ptr& c, codec::view_message& m) {
  const int64_t received_ns = wall_ns();
  auto& v = m.view;
  auto why = proofs::check_view(opts_.secret, chief_nonce_, my_nonce_, opts_.tasks[opts_.rank], m);
  if (why.empty() && elastic())
    why = check_elastic_view(v);
  if (why.empty() && view_formed_ && v.epoch <= view_.epoch)
    why = "its view has epoch " + std::to_string(v.epoch) + ", not later than epoch " +
          std::to_string(view_.epoch);
  if (!elastic() && why.empty() && v.epoch == 0)
    why = "its view has epoch 0";
  if (!elastic() && why.empty() && v.members.size() != opts_.tasks.size())
    why = "its view has " + std::to_string(v.members.size()) + " members, expected " +
          std::to_string(opts_.tasks.size());
  for (std::size_t r = 0; !elastic() && why.empty() && r < v.members.size(); ++r)
    if (v.members[r].rank != static_cast<int>(r) || !(v.members[r].task == opts_.tasks[r]))
      why = "its view lists " + to_string(v.members[r].task) + " with rank " +
            std::to_string(v.members[r].rank) + " at position " + std::to_string(r) +
            ", expected " + to_string(opts_.tasks[r]) + " with rank " + std::to_string(r) +
            " (do all tasks share one cluster spec?)";
  if (!why.empty() && view_formed_) {
    // An elastic group's later view: the group ends for this member.
    auto text = "the chief at " + opts_.chief_address + " sent an invalid view: " + why;
    c->state = phase::left;
    close(c);
    log_line(text);
    return end_group(make_caf_error(errc::invalid_argument, self_ + ": " + text));
  }
  if (!why.empty()) {
    auto text = "the chief at " + opts_.chief_address + " sent an invalid view: " + why;
    log_line(text);
    rendezvous_failed_ = true;
    c->state = phase::left;
    close(c);
    return set_outcome(make_caf_error(errc::invalid_argument, self_ + ": " + text));
  }
  view_formed_ = true;
  view_ = v;
  failing_over_ = false;
  join_pending_ = false;
  c->state = phase::member;
  auto now = this->now();
  c->last_rx = now;
  next_heartbeat_ = now + opts_.heartbeat_interval;
  // The view echoes this worker's Join: the first sample of the chief's clock, with the view.
  if (m.join_sent_ns != 0 && m.join_received_ns != 0 && m.sent_ns != 0)
    record_round_trip(m.join_sent_ns, m.join_received_ns, m.sent_ns, received_ns);
  log_line("received the view of epoch " + std::to_string(v.epoch) + " from the chief at " +
           c->remote() + ": " + std::to_string(v.members.size()) + " members, group " +
           std::to_string(v.group_id));
  publish_view(v);
  set_outcome(std::move(v));
}

void service::impl::chief_ended_join(const conn_ptr& c, const std::string& text,
                                     caf::error outcome) {
  log_line(text);
  rendezvous_failed_ = true;
  c->state = phase::left;
  close_gracefully(c);
  set_outcome(std::move(outcome));
}

void service::impl::join_timed_out() {
  rendezvous_failed_ = true;
  auto why = last_error_.empty() ? std::string{"no attempt finished"} : last_error_;
  if (chief_conn_ && !chief_conn_->closed() && chief_conn_->state == phase::joined)
    why = "joined the chief at " + chief_conn_->remote() +
          ", but no view arrived (the chief waits for every task to join)";
  auto text = self_ + " could not join the cluster at chief " + opts_.chief_address + " within " +
              ms_text(opts_.rendezvous_timeout) + ": " + why;
  log_line(text);
  retry_timer_.cancel();
  if (chief_conn_)
    close(chief_conn_);
  set_outcome(make_caf_error(errc::collective_timeout, text));
}

void service::impl::lose_chief(const std::string& cause, bool silent) {
  auto c = chief_conn_;
  if (!c || c->state != phase::member)
    return;
  c->state = phase::lost;
  log_line("lost the chief: " + cause + " (connection to " + c->remote() + ")");
  const bool stuck = c->writing() && now() - c->write_started() >= opts_.peer_timeout;
  chief_maybe_alive_ = silent || stuck; // perhaps only cut off, and leading on
  if (elastic() && silent && !stuck && !c->closed()) {
    // The chief may only be stopped or cut off for a while: should it read on, it learns first
    // that the group goes on without it (an Abort of its epoch naming it), so that it does not
    // lead a second group of its own.
    const auto leader =
        std::find(opts_.tasks.begin(), opts_.tasks.end(), view_.members.front().task) -
        opts_.tasks.begin();
    send(c, codec::abort{view_.epoch, cause, {static_cast<uint32_t>(leader)}});
    close_gracefully(c);
  } else {
    close(c);
  }
  if (elastic())
    return fail_over(cause);
  report({0}, cause);
}

void service::impl::fail_over(const std::string& cause) {
  const auto& members = view_.members;
  const auto leader =
      std::find(opts_.tasks.begin(), opts_.tasks.end(), members.front().task) - opts_.tasks.begin();
  if (members.size() < 2 || group_ended_) {
    end_group(make_caf_error(errc::peer_lost, self_ + ": lost the chief (" + cause + ")"));
    return report({static_cast<int>(leader)}, cause);
  }
  // The first member after the chief succeeds it; the others reach it at its standby address.
  // Only it: if it is gone too, the group ends (a second candidate could split the group).
  const auto& successor = members[1];
  notice_epoch_ = std::max(notice_epoch_, view_.epoch + 1);
  {
    std::lock_guard lock(mu_);
    round_trips_.clear(); // offsets to the lost chief's clock; the successor's come next
  }
  report({static_cast<int>(leader)}, cause + "; " + to_string(successor.task) + " succeeds it",
         notice_epoch_);
  if (successor.task == opts_.tasks[opts_.rank])
    return promote();
  if (successor.standby_address.empty() ||
      !split_address(successor.standby_address, chief_hp_).empty()) {
    return end_group(make_caf_error(
        errc::peer_lost, self_ + ": lost the chief (" + cause + "), and its successor " +
                             to_string(successor.task) + " announced no standby address"));
  }
  log_line("the chief was lost (" + cause + "); reaching its successor " +
           to_string(successor.task) + " at " + successor.standby_address);
  opts_.chief_address = successor.standby_address;
  failing_over_ = true;
  join_pending_ = false;
  warned_ = false;
  backoff_ = first_backoff;
  last_error_ = "no attempt to reach " + successor.standby_address + " finished";
  rendezvous_deadline_ = now() + opts_.reform_timeout;
  start_attempt();
}

void service::impl::maybe_rejoin() {
  if (!has_offer_ || offer_after_ != view_.epoch || notice_epoch_ <= view_.epoch ||
      rejoined_for_ >= notice_epoch_ || group_ended_)
    return;
  auto c = chief_conn_;
  const auto wanted = failing_over_ ? phase::joined : phase::member;
  if (!c || c->state != wanted || c->closed() || (failing_over_ && !join_pending_))
    return;
  join_pending_ = false;
  codec::join j = join_for(offer_address_);
  rejoined_for_ = notice_epoch_;
  log_line("offers its part of epoch " + std::to_string(notice_epoch_) + " (collective address " +
           j.address + ")");
  send(c, j);
}

void service::impl::offer(uint64_t after, const std::string& address) {
  has_offer_ = true;
  offer_after_ = after;
  offer_address_ = address;
  if (chief_)
    maybe_form_next_view();
  else
    maybe_rejoin();
}

} // namespace consort::transport::membership
