// The latency-optimised all-reduce algorithms (direct exchange, recursive doubling) and the
// all_reduce() dispatcher (docs/algorithms.md).

#include "transport/algorithms/common.hpp"

#include <bit>
#include <cstring>
#include <memory>
#include <string>
#include <utility>

namespace consort::transport {

// -- direct exchange ------------------------------------------------------------------------------

namespace {

constexpr const char* direct_name = "direct_all_reduce";
constexpr const char* doubling_name = "recursive_doubling_all_reduce";

} // namespace

direct_all_reduce::direct_all_reduce(context_ptr ctx, void* data, size_t count, dtype type,
                                     reduce_op op, const algorithm_options& opts)
    : ctx_(std::move(ctx)), data_(static_cast<std::byte*>(data)), count_(count), type_(type),
      op_(op), opts_(opts) {
  setup_error_ = detail::check_options(direct_name, *ctx_, opts_);
  if (!setup_error_)
    setup_error_ = detail::check_reduction(direct_name, *ctx_, opts_, type_, op_);
  const int n = ctx_->size();
  if (setup_error_ || n == 1 || count_ == 0)
    return;
  pairs_.resize(static_cast<size_t>(n), nullptr);
  for (int p = 0; p < n; ++p)
    if (p != ctx_->rank())
      pairs_[static_cast<size_t>(p)] = &ctx_->to(p);
  scratch_ = detail::scratch(static_cast<size_t>(n) * count_ * size_of(type_));
}

caf::error direct_all_reduce::run() {
  if (setup_error_)
    return setup_error_;
  const int n = ctx_->size();
  if (n == 1 || count_ == 0)
    return {};
  const auto until = clock::now() + opts_.timeout;
  const int r = ctx_->rank();
  const size_t bytes = count_ * size_of(type_);
  const uint64_t tag = detail::message_tag(opts_.tag, 0);
  auto slot = [&](int p) {
    return scratch_.get() + static_cast<size_t>(p) * bytes;
  };
  auto fail = [&](bool send, int peer, const caf::error& err) {
    return detail::step_failed(*ctx_, opts_, direct_name, "exchange",
                               send ? "send to" : "receive from", peer, err);
  };
  std::vector<operation_ptr> recvs(static_cast<size_t>(n));
  std::vector<operation_ptr> sends(static_cast<size_t>(n));

  // Step 1: copy this rank's input into its slot; the sends read it there, so the result can be
  // written into the caller's buffer while they are still in flight.
  std::memcpy(slot(r), data_, bytes);
  // Step 2: post a receive from every peer into its slot, then send this rank's slot to every
  // peer, the right neighbour first (so that not every rank starts with rank 0). This thread
  // reads the peers' messages itself, also those that arrive while it is still sending
  // (pair.hpp, reading_here): no other thread is woken for them.
  reading_from_peers reading{*ctx_};
  for (int p = 0; p < n; ++p)
    if (p != r)
      recvs[static_cast<size_t>(p)] = pairs_[static_cast<size_t>(p)]->recv(tag, {slot(p), bytes});
  for (int k = 1; k < n; ++k) {
    const int p = detail::ring_add(r, k, n);
    sends[static_cast<size_t>(p)] =
        pairs_[static_cast<size_t>(p)]->send(tag, {const_bytes{slot(r), bytes}});
  }
  // Step 3: fold the slots in rank order as they arrive, out = x0 op x1, then out = out op xp;
  // MEAN's 1/size rides on the last fold. The same order on every rank: identical results.
  for (int p = 0; p < n; ++p) {
    if (p != r) {
      if (auto err = recvs[static_cast<size_t>(p)]->wait(until))
        return fail(false, p, err);
    }
    if (p == 0)
      continue;
    const int divisor = op_ == reduce_op::mean && p == n - 1 ? n : 0;
    detail::combine(type_, op_, data_, p == 1 ? slot(0) : data_, slot(p), count_, divisor);
  }
  reading.release();
  // Step 4: wait for the sends (they read the scratch slot, which dies with this object).
  for (int p = 0; p < n; ++p) {
    if (const auto& op = sends[static_cast<size_t>(p)]) {
      if (auto err = op->wait(until))
        return fail(true, p, err);
    }
  }
  return {};
}

// -- recursive doubling -----------------------------------------------------------------------

recursive_doubling_all_reduce::recursive_doubling_all_reduce(context_ptr ctx, void* data,
                                                             size_t count, dtype type, reduce_op op,
                                                             const algorithm_options& opts)
    : ctx_(std::move(ctx)), data_(static_cast<std::byte*>(data)), count_(count), type_(type),
      op_(op), opts_(opts) {
  setup_error_ = detail::check_options(doubling_name, *ctx_, opts_);
  if (!setup_error_)
    setup_error_ = detail::check_reduction(doubling_name, *ctx_, opts_, type_, op_);
  if (setup_error_ || ctx_->size() == 1 || count_ == 0)
    return;
  scratch_ = detail::scratch(count_ * size_of(type_));
}

caf::error recursive_doubling_all_reduce::run() {
  if (setup_error_)
    return setup_error_;
  const int n = ctx_->size();
  if (n == 1 || count_ == 0)
    return {};
  const auto until = clock::now() + opts_.timeout;
  const int r = ctx_->rank();
  const size_t bytes = count_ * size_of(type_);
  // p ranks take part in the rounds; the first 2 * extra ranks fold pairwise into their odd one.
  const int p = static_cast<int>(std::bit_floor(static_cast<unsigned>(n)));
  const int extra = n - p;
  const int rounds = std::countr_zero(static_cast<unsigned>(p));
  // Rank in the rounds (-1: an even rank of the fix-up, which sits them out), and back.
  const int v = r < 2 * extra ? (r % 2 == 1 ? r / 2 : -1) : r - extra;
  auto real = [&](int u) {
    return u < extra ? 2 * u + 1 : u + extra;
  };
  const mutable_bytes buffer{data_, bytes};
  const mutable_bytes scratch{scratch_.get(), bytes};
  const bool mean = op_ == reduce_op::mean;
  auto tag = [&](int index) {
    return detail::message_tag(opts_.tag, static_cast<uint64_t>(index));
  };
  auto wait = [&](const operation_ptr& op, const std::string& step, bool send, int peer) {
    auto err = op->wait(until);
    return err ? detail::step_failed(*ctx_, opts_, doubling_name, step,
                                     send ? "send to" : "receive from", peer, err)
               : caf::error{};
  };

  if (v < 0) {
    // Step 1 (even rank of the fix-up): hand the buffer to the next rank, then receive the
    // result from it (posted once the send is done, since it lands in the same buffer).
    auto& partner = ctx_->to(r + 1);
    if (auto err = wait(partner.send(tag(0), {buffer}), "fix-up in", true, r + 1))
      return err;
    return wait(partner.recv(tag(rounds + 1), buffer), "fix-up out", false, r + 1);
  }
  if (r < 2 * extra) {
    // Step 1 (odd rank of the fix-up): fold in the even neighbour's buffer, the lower rank first.
    if (auto err = wait(ctx_->to(r - 1).recv(tag(0), scratch), "fix-up in", false, r - 1))
      return err;
    detail::combine(type_, op_, data_, scratch_.get(), data_, count_);
  }
  // Step 2: log2(p) rounds; in round k exchange whole buffers with the partner at distance 2^k
  // and fold, the lower ranks' value first (both partners compute the same expression). MEAN's
  // 1/size rides on the last fold.
  for (int k = 0; k < rounds; ++k) {
    const int u = v ^ (1 << k);
    const int peer = real(u);
    auto& partner = ctx_->to(peer);
    const std::string step = "round " + std::to_string(k + 1) + " of " + std::to_string(rounds);
    auto recv = partner.recv(tag(k + 1), scratch);
    auto send = partner.send(tag(k + 1), {buffer});
    if (auto err = wait(recv, step, false, peer))
      return err;
    // The fold overwrites what the send reads.
    if (auto err = wait(send, step, true, peer))
      return err;
    const bool lower = u < v;
    detail::combine(type_, op_, data_, lower ? scratch_.get() : data_,
                    lower ? data_ : scratch_.get(), count_, mean && k + 1 == rounds ? n : 0);
  }
  // Step 3 (odd rank of the fix-up): hand the result back to the even neighbour.
  if (r < 2 * extra)
    return wait(ctx_->to(r - 1).send(tag(rounds + 1), {buffer}), "fix-up out", true, r - 1);
  return {};
}

// -- dispatcher ---------------------------------------------------------------------------------

caf::error all_reduce(const context_ptr& ctx, void* data, size_t count, dtype type, reduce_op op,
                      const algorithm_options& opts) {
  if (count * size_of(type) <= opts.small_bytes) {
    if (ctx->size() <= opts.direct_max_ranks)
      return direct_all_reduce{ctx, data, count, type, op, opts}.run();
    return recursive_doubling_all_reduce{ctx, data, count, type, op, opts}.run();
  }
  return ring_all_reduce{ctx, data, count, type, op, opts}.run();
}

caf::error all_reduce(const context_ptr& ctx, const void* in, void* out, size_t count, dtype type,
                      reduce_op op, const algorithm_options& opts) {
  if (count * size_of(type) <= opts.small_bytes) {
    if (in != out && count > 0)
      std::memcpy(out, in, count * size_of(type));
    return all_reduce(ctx, out, count, type, op, opts);
  }
  return ring_all_reduce{ctx, in, out, count, type, op, opts}.run();
}

} // namespace consort::transport
