// Part 1 of a group call: the descriptors, their checks, and a small call's data with them.

#include "transport/algorithms/common.hpp"
#include "transport/algorithms/group_call.hpp"

#include <consort/caf_error.hpp>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <limits>
#include <sstream>

namespace consort::transport {

namespace {

std::string text_of(const call_descriptor& d) {
  return std::string(d.text, strnlen(d.text, call_descriptor::text_bytes));
}

void set_text(call_descriptor& d, const std::string& s) {
  auto n = std::min(s.size(), call_descriptor::text_bytes - 1);
  std::memcpy(d.text, s.data(), n);
}

std::string describe(const call_descriptor& d) {
  std::ostringstream out;
  out << to_string(static_cast<collective_kind>(d.kind));
  switch (static_cast<collective_kind>(d.kind)) {
  case collective_kind::all_reduce:
    out << '(' << to_string(static_cast<reduce_op>(d.op)) << ')';
    break;
  case collective_kind::all_gather:
    out << "(axis=" << d.axis << ')';
    break;
  case collective_kind::broadcast:
    out << "(root=" << d.root << ')';
    break;
  }
  out << " #" << d.seq << " of step " << d.step;
  return out.str();
}

/// Whether every leaf of an all-reduce can be reduced by the element-wise kernel (else the data
/// phase reports why, as the algorithms do).
bool reducible(const group_call& call, const context& ctx) {
  auto wire_op = call.op == reduce_op::mean ? reduce_op::sum : call.op;
  algorithm_options opts;
  opts.tag = 1;
  for (const auto& t : call.leaves)
    if (detail::check_reduction("fused all-reduce", ctx, opts, t.dtype(), wire_op))
      return false;
  return true;
}

const_bytes bytes_of(const tensor& t) {
  return {static_cast<const std::byte*>(t.raw_data()), t.num_bytes()};
}

} // namespace

uint64_t fnv1a(const std::string& s) noexcept {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

bool call_descriptor::compactable() const noexcept {
  return failed == 0 && error_code == 0 &&
         kind == static_cast<uint8_t>(collective_kind::all_reduce) && num_leaves == 1 &&
         count == 1 && root == 0 && axis == 0;
}

void call_descriptor::write_compact(std::byte* out) const noexcept {
  std::memset(out, 0, compact_bytes);
  out[0] = static_cast<std::byte>(compact_format);
  out[compact_op] = static_cast<std::byte>(op);
  out[compact_flags] = static_cast<std::byte>(flags);
  out[compact_fused] = static_cast<std::byte>(fused);
  std::memcpy(out + compact_seq, &seq, sizeof seq);
  std::memcpy(out + compact_step, &step, sizeof step);
  std::memcpy(out + compact_hash, &signature_hash, sizeof signature_hash);
  std::memcpy(out + compact_entered, &entered_ns, sizeof entered_ns);
}

void call_descriptor::read_compact(const std::byte* in) noexcept {
  failed = 0;
  kind = static_cast<uint8_t>(collective_kind::all_reduce);
  op = static_cast<uint8_t>(in[compact_op]);
  error_code = 0;
  root = 0;
  axis = 0;
  num_leaves = 1;
  count = 1;
  flags = static_cast<uint8_t>(in[compact_flags]);
  fused = static_cast<uint8_t>(in[compact_fused]);
  std::memcpy(&seq, in + compact_seq, sizeof seq);
  std::memcpy(&step, in + compact_step, sizeof step);
  std::memcpy(&signature_hash, in + compact_hash, sizeof signature_hash);
  std::memcpy(&entered_ns, in + compact_entered, sizeof entered_ns);
}

std::string worker_name(int rank) {
  return rank == 0 ? "worker 0 (the chief)" : "worker " + std::to_string(rank);
}

caf::error failed_between_workers(const caf::error& err, const std::string& what) {
  auto e = to_consort_error(err, "");
  return make_caf_error(e.code(), what + " failed between workers: " + e.what());
}

algorithm_options call_clock::next() {
  algorithm_options opts;
  opts.tag = take();
  opts.timeout = left();
  return opts;
}

std::chrono::milliseconds call_clock::left() const {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until_ - clock::now());
  return std::max(left, std::chrono::milliseconds{1});
}

descriptor_exchange::descriptor_exchange(const context_ptr& ctx, group_call& call,
                                         int devices_per_worker, std::vector<std::byte>& scratch,
                                         call_clock& clock, const taken_messages* resumed)
    : ctx_(ctx), call_(call), scratch_(scratch), clock_(clock), resumed_(resumed),
      rank_(ctx->rank()), size_(ctx->size()),
      root_worker_(call.root / std::max(devices_per_worker, 1)),
      direct_(size_ <= direct_max_workers) {
  if (direct_) {
    all_ = reinterpret_cast<call_descriptor*>(direct_all_);
  } else {
    ring_all_.resize(static_cast<size_t>(size_));
    all_ = ring_all_.data();
  }
  for (const auto& t : call_.leaves)
    data_bytes_ += t.num_bytes();
  describe_mine();
  std::memcpy(static_cast<void*>(&all_[rank_]), &mine_, sizeof mine_);
}

void descriptor_exchange::describe_mine() {
  mine_.kind = static_cast<uint8_t>(call_.kind);
  mine_.op = static_cast<uint8_t>(call_.op);
  mine_.root = call_.root;
  mine_.axis = call_.axis;
  mine_.step = call_.step;
  mine_.seq = call_.seq;
  mine_.num_leaves = static_cast<uint32_t>(call_.leaves.size());
  mine_.count = call_.count;
  mine_.signature_hash = call_.hash();
  mine_.flags = call_.flags;
  if (call_.lateness != nullptr) // the flight recorder's (off: 0, never last)
    mine_.entered_ns =
        (call_.entered_unix_ns != 0 ? call_.entered_unix_ns
                                    : std::chrono::duration_cast<std::chrono::nanoseconds>(
                                          std::chrono::system_clock::now().time_since_epoch())
                                          .count()) +
        call_.clock_offset_ns;
  if (call_.local_failure) {
    mine_.failed = 1;
    auto err = to_consort_error(call_.local_failure, "");
    mine_.error_code = static_cast<uint8_t>(err.code());
    set_text(mine_, err.what());
    return;
  }
  const bool small = !call_.data_phase && direct_ && data_bytes_ <= fused_max_bytes;
  switch (call_.kind) {
  case collective_kind::all_reduce:
    mine_.fused = small && reducible(call_, *ctx_);
    break;
  case collective_kind::all_gather:
    mine_.fused = small && call_.leaves.size() * 8 + data_bytes_ <= fused_max_bytes;
    // The extents along the axis, leaf by leaf, travel with the descriptor: the data then needs
    // no round of sizes first.
    gather_extents_ = !call_.data_phase && direct_;
    if (gather_extents_)
      for (const auto& t : call_.leaves)
        my_extents_.push_back(t.shape()[static_cast<size_t>(call_.axis)]);
    break;
  case collective_kind::broadcast:
    // Only the root's worker has data to send; the others read from its descriptor whether it
    // came with its data (every worker sees the same descriptor, so all decide alike).
    mine_.fused = small && rank_ == root_worker_;
    break;
  }
  // Compact where the message is small (a larger one keeps its data where the full form puts
  // it: 64 bytes in, as the fused fold's loads expect).
  send_compact_ = mine_.compactable() && data_bytes_ <= compact_max_data;
  if (send_compact_)
    mine_.write_compact(compact_);
}

std::byte* descriptor_exchange::slot(int p) const noexcept {
  return const_cast<std::byte*>(scratch_.data()) +
         static_cast<size_t>(p) * (sizeof(call_descriptor) + fused_max_bytes);
}

caf::error descriptor_exchange::run() {
  auto err = direct_ ? exchange_direct() : exchange_ring();
  if (call_.local_failure)
    return call_.local_failure;
  if (err)
    return err;
  if (auto failed = check_outcomes())
    return failed;
  if (auto mismatch = check_agreement())
    return mismatch;
  call_.all_flags = 0;
  call_.total_count = 0;
  for (int w = 0; w < size_; ++w) {
    call_.all_flags |= all_[w].flags;
    call_.total_count += all_[w].count;
  }
  if (call_.lateness != nullptr && size_ > 1) {
    int last = 0;
    for (int w = 1; w < size_; ++w)
      if (all_[w].entered_ns > all_[last].entered_ns)
        last = w;
    int64_t before = std::numeric_limits<int64_t>::min();
    for (int w = 0; w < size_; ++w)
      if (w != last)
        before = std::max(before, all_[w].entered_ns);
    call_.lateness->last.store(last, std::memory_order_relaxed);
    call_.lateness->margin_ns.store(all_[last].entered_ns - before, std::memory_order_relaxed);
  }
  return {};
}

caf::error descriptor_exchange::failure(const caf::error& err) const {
  return failed_between_workers(err, call_.name());
}

send_parts descriptor_exchange::my_message() const {
  send_parts parts;
  parts.reserve(1 + (gather_extents_ ? 1 : 0) + (mine_.fused ? call_.leaves.size() : 0));
  if (send_compact_)
    parts.push_back({compact_, call_descriptor::compact_bytes});
  else
    parts.push_back({reinterpret_cast<const std::byte*>(&mine_), mine_.wire_bytes()});
  if (gather_extents_)
    parts.push_back({reinterpret_cast<const std::byte*>(my_extents_.data()),
                     my_extents_.size() * sizeof(int64_t)});
  if (mine_.fused)
    for (const auto& t : call_.leaves)
      parts.push_back(bytes_of(t));
  return parts;
}

caf::error descriptor_exchange::accept(int p, const_bytes message) {
  const auto at = static_cast<size_t>(p);
  if (message.size() >= call_descriptor::compact_bytes &&
      static_cast<uint8_t>(message[0]) == call_descriptor::compact_format) {
    all_[p].read_compact(message.data());
    header_of_[at] = call_descriptor::compact_bytes;
  } else {
    if (message.size() < call_descriptor::header_bytes)
      return make_caf_error(errc::invalid_argument,
                            "its descriptor has " + std::to_string(message.size()) +
                                " bytes, fewer than " +
                                std::to_string(call_descriptor::header_bytes));
    std::memcpy(static_cast<void*>(&all_[p]), message.data(), call_descriptor::header_bytes);
    header_of_[at] = call_descriptor::header_bytes;
  }
  mark_arrived(p);
  got_[at] = message.size();
  message_[at] = message.data();
  if (all_[p].failed) { // its error's text follows
    const auto text =
        std::min(message.size() - call_descriptor::header_bytes, call_descriptor::text_bytes - 1);
    std::memcpy(all_[p].text, payload(p), text);
    all_[p].text[text] = '\0';
  }
  return {};
}

caf::error descriptor_exchange::exchange_direct() {
  // Every worker receives up to a descriptor and a fused call's data from each peer, whatever its
  // own call is: workers whose calls disagree still read each other's descriptors whole.
  const size_t slot_bytes = sizeof(call_descriptor) + fused_max_bytes;
  scratch_.resize(static_cast<size_t>(size_) * slot_bytes);
  // The waits below run to clock_.until(). A resumed exchange has its tag already.
  algorithm_options opts;
  if (resumed_ != nullptr)
    opts.tag = resumed_->base_tag;
  else
    opts = clock_.next_tag();
  const auto tag = detail::message_tag(opts.tag, 0);
  // Every peer's send takes a copy of the parts but the last, which takes them.
  send_parts parts = my_message();
  if (auto* box = ctx_->mailbox(clock_.lane()))
    return exchange_in_mailbox(*box, parts, opts);
  if (resumed_ != nullptr)
    return make_caf_error(errc::invalid_argument,
                          call_.name() + ": a resumed descriptor exchange needs the lockstep "
                                         "channel its lone all-reduce began in");
  std::array<operation_ptr, direct_max_workers> recvs;
  std::array<operation_ptr, direct_max_workers> sends;
  // This thread reads the peers' messages itself, also those that arrive while it is still
  // sending (pair.hpp, reading_here): no other thread is woken for them.
  reading_from_peers reading{*ctx_};
  for (int p = 0; p < size_; ++p)
    if (p != rank_)
      recvs[static_cast<size_t>(p)] = ctx_->to(p).recv_at_most(tag, {slot(p), slot_bytes});
  for (int k = 1; k < size_; ++k) {
    const int p = detail::ring_add(rank_, k, size_);
    auto& send = sends[static_cast<size_t>(p)];
    if (k + 1 < size_)
      send = ctx_->to(p).send(tag, parts);
    else
      send = ctx_->to(p).send(tag, std::move(parts));
  }
  for (int k = 1; k < size_; ++k) {
    const int p = detail::ring_add(rank_, -k, size_);
    auto& op = recvs[static_cast<size_t>(p)];
    caf::error err = op->wait(clock_.until());
    if (!err)
      err = accept(p, {slot(p), op->message_bytes()});
    if (err) {
      // The descriptors that did arrive say who reached the call (the flight recorder's view).
      for (int q = 0; q < size_ && call_.arrivals != nullptr; ++q) {
        const auto& other = recvs[static_cast<size_t>(q)];
        if (q != rank_ && q != p && other && other->done() &&
            other->message_bytes() >= call_descriptor::compact_bytes)
          mark_arrived(q);
      }
      return failure(detail::step_failed(*ctx_, opts, "descriptor exchange", "descriptors",
                                         "receive from", p, err));
    }
  }
  reading.release();
  for (int p = 0; p < size_; ++p)
    if (p != rank_)
      if (auto err = sends[static_cast<size_t>(p)]->wait(clock_.until()))
        return failure(detail::step_failed(*ctx_, opts, "descriptor exchange", "descriptors",
                                           "send to", p, err));
  return {};
}

caf::error descriptor_exchange::exchange_in_mailbox(mailbox& box, const send_parts& parts,
                                                    const algorithm_options& opts) {
  const auto tag = detail::message_tag(opts.tag, 0);
  size_t bytes = 0;
  for (const auto& part : parts)
    bytes += part.size();
  // Each peer takes one message from the channel per call, whatever its size: a message larger
  // than a slot goes by the pair, and an empty one in the slot says so (a descriptor is never
  // empty). A worker whose message is that large expects the same of its peers (an all-reduce's
  // agree) and posts its receives first, so that their messages land straight in its scratch; a
  // peer whose message did fit a slot, seeing its empty one, answers that receive with an empty
  // message.
  const bool in_slot = bytes <= box.capacity();
  const size_t slot_bytes = sizeof(call_descriptor) + fused_max_bytes;
  std::array<operation_ptr, direct_max_workers> recvs;
  std::array<operation_ptr, direct_max_workers> sends;
  if (!in_slot)
    for (int p = 0; p < size_; ++p)
      if (p != rank_)
        recvs[static_cast<size_t>(p)] = ctx_->to(p).recv_at_most(tag, {slot(p), slot_bytes});
  for (int k = 1 + (resumed_ != nullptr ? resumed_->puts : 0); k < size_; ++k) {
    const int p = detail::ring_add(rank_, k, size_);
    if (auto err = box.put(p, tag, in_slot ? parts : send_parts{}))
      return failure(detail::step_failed(*ctx_, opts, "descriptor exchange", "descriptors",
                                         "send to", p, err));
    if (!in_slot)
      sends[static_cast<size_t>(p)] = ctx_->to(p).send(tag, parts);
  }
  uint64_t taken = 0;
  for (int k = 1; k < size_; ++k) {
    const int p = detail::ring_add(rank_, -k, size_);
    // What the lone all-reduce took from `p` (or the failure of its take), else the take now.
    auto got = resumed_ != nullptr && resumed_->has[static_cast<size_t>(p)]
                   ? caf::expected<const_bytes>{resumed_->got[static_cast<size_t>(p)]}
               : resumed_ != nullptr && resumed_->failed_peer == p
                   ? caf::expected<const_bytes>{resumed_->failed}
                   : box.take(p, tag, clock_.until());
    caf::error err;
    if (!got) {
      err = std::move(got.error());
    } else if (!got->empty()) {
      // (When this worker posted a receive from `p`, p's empty message completes it later.)
      err = accept(p, *got);
    } else {
      auto& recv = recvs[static_cast<size_t>(p)];
      if (in_slot) {
        sends[static_cast<size_t>(p)] = ctx_->to(p).send(tag, {}); // p posted a receive
        recv = ctx_->to(p).recv_at_most(tag, {slot(p), slot_bytes});
      }
      err = recv->wait(clock_.until());
      if (!err)
        err = accept(p, {slot(p), recv->message_bytes()});
    }
    if (err) {
      // The messages that did arrive say who reached the call (the flight recorder's view).
      for (int q = 0; q < size_; ++q)
        if (q != rank_ && q != p && (taken >> q & 1) == 0 && box.arrived(q))
          mark_arrived(q);
      return failure(detail::step_failed(*ctx_, opts, "descriptor exchange", "descriptors",
                                         "receive from", p, err));
    }
    taken |= uint64_t{1} << p;
  }
  for (int p = 0; p < size_; ++p)
    if (const auto& send = sends[static_cast<size_t>(p)])
      if (auto err = send->wait(clock_.until()))
        return failure(detail::step_failed(*ctx_, opts, "descriptor exchange", "descriptors",
                                           "send to", p, err));
  return {};
}

caf::error descriptor_exchange::exchange_ring() {
  auto* base = reinterpret_cast<std::byte*>(all_);
  mutable_bytes out{base, static_cast<size_t>(size_) * sizeof(call_descriptor)};
  const_bytes in{base + static_cast<size_t>(rank_) * sizeof(call_descriptor),
                 sizeof(call_descriptor)};
  ring_all_gather gather(ctx_, in, out,
                         std::vector<size_t>(static_cast<size_t>(size_), sizeof(call_descriptor)),
                         clock_.next());
  if (auto err = gather.run())
    return failure(err);
  if (call_.arrivals != nullptr)
    call_.arrivals->store(size_ >= 64 ? ~uint64_t{0} : (uint64_t{1} << size_) - 1,
                          std::memory_order_relaxed);
  return {};
}

caf::error descriptor_exchange::check_outcomes() const {
  for (int w = 0; w < size_; ++w) {
    const auto& d = all_[w];
    if (!d.failed)
      continue;
    auto code = static_cast<errc>(d.error_code);
    // A timeout or a lost peer elsewhere keeps its code; any other failure of a peer's replicas
    // aborts the call here.
    if (code != errc::collective_timeout && code != errc::peer_lost && code != errc::peer_left)
      code = errc::collective_aborted;
    return make_caf_error(code, call_.name() + " failed on " + worker_name(w) + ": " + text_of(d));
  }
  return {};
}

caf::error descriptor_exchange::check_agreement() {
  auto same_call = [](const call_descriptor& a, const call_descriptor& b) {
    return a.step == b.step && a.seq == b.seq && a.kind == b.kind &&
           (a.kind != static_cast<uint8_t>(collective_kind::all_reduce) || a.op == b.op) &&
           (a.kind != static_cast<uint8_t>(collective_kind::all_gather) || a.axis == b.axis) &&
           (a.kind != static_cast<uint8_t>(collective_kind::broadcast) || a.root == b.root);
  };
  // Each worker is compared with the one most workers agree with (worker 0 on a tie), so that
  // the error names the odd one out (every worker sees the same descriptors, so all pick alike).
  auto reference = [&](auto&& same) {
    int best = 0;
    int best_count = -1;
    for (int r = 0; r < size_; ++r) {
      int count = 0;
      for (int w = 0; w < size_; ++w)
        count += same(all_[r], all_[w]) ? 1 : 0;
      if (count > best_count) {
        best = r;
        best_count = count;
      }
    }
    return best;
  };
  const int ref = reference(same_call);
  const auto& a = all_[ref];
  for (int w = 0; w < size_; ++w) {
    const auto& b = all_[w];
    if (!same_call(a, b)) {
      std::ostringstream out;
      out << "collective mismatch between workers at " << call_.name() << ": " << worker_name(ref)
          << " is at " << describe(a) << " but " << worker_name(w) << " is at " << describe(b)
          << "; every replica on every worker must make the same collective calls in the same "
             "order";
      return make_caf_error(errc::collective_mismatch, out.str());
    }
  }
  const int sig_ref = reference([](const call_descriptor& x, const call_descriptor& y) {
    return x.signature_hash == y.signature_hash && x.num_leaves == y.num_leaves;
  });
  for (int w = 0; w < size_; ++w) {
    const auto& a = all_[sig_ref];
    const auto& b = all_[w];
    // An all-gather's parts differ in size between workers (ragged), so some may travel with
    // their descriptor and some not: only an all-reduce's workers must agree on it.
    const bool fused_differs =
        a.fused != b.fused && a.kind == static_cast<uint8_t>(collective_kind::all_reduce);
    if (a.signature_hash == b.signature_hash && a.num_leaves == b.num_leaves && !fused_differs)
      continue;
    // The descriptors carry hashes; every worker sees the same ones, so all of them exchange
    // their texts now, and only now, to name both sides.
    std::vector<std::string> texts;
    if (auto err = signature_texts(texts))
      return err;
    std::ostringstream out;
    out << "collective mismatch between workers at " << call_.name() << ": " << worker_name(sig_ref)
        << " passed " << texts[static_cast<size_t>(sig_ref)] << " but " << worker_name(w)
        << " passed " << texts[static_cast<size_t>(w)]
        << "; structure, dtypes and shapes must agree on every worker";
    return make_caf_error(errc::collective_mismatch, out.str());
  }
  return {};
}

caf::error descriptor_exchange::signature_texts(std::vector<std::string>& texts) {
  auto mine = call_.signature_text();
  if (mine.size() > signature_text_max) {
    mine.resize(signature_text_max - 3);
    mine += "...";
  }
  std::vector<std::byte> gathered;
  std::vector<size_t> sizes;
  auto err = all_gather(ctx_, {reinterpret_cast<const std::byte*>(mine.data()), mine.size()},
                        gathered, &sizes, clock_.next());
  if (err)
    return failure(err);
  const auto* at = reinterpret_cast<const char*>(gathered.data());
  for (auto size : sizes) {
    texts.emplace_back(at, std::min(size, signature_text_max));
    at += size;
  }
  return {};
}

std::string group_call::signature_text() const {
  if (!signature.empty())
    return signature;
  if (make_signature)
    return make_signature();
  return "a call whose signature hashes to " + std::to_string(signature_hash);
}

uint64_t group_call::hash() const noexcept {
  return signature.empty() ? signature_hash : fnv1a(signature);
}

} // namespace consort::transport
