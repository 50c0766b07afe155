// Broadcast: binomial tree for small messages, pipelined chain for large ones, and the
// broadcast() dispatcher (docs/algorithms.md).

#include "transport/algorithms/common.hpp"

#include <string>
#include <utility>

namespace consort::transport {

namespace {

constexpr const char* tree_name = "binomial_broadcast";
constexpr const char* chain_name = "chain_broadcast";

caf::error check_root(const char* algorithm, const context& ctx, const algorithm_options& opts,
                      int root) {
  if (root < 0 || root >= ctx.size())
    return detail::argument_error(errc::invalid_argument, algorithm, ctx, opts.tag,
                                  "root " + std::to_string(root) +
                                      " is out of range; expected 0 <= root < " +
                                      std::to_string(ctx.size()));
  return {};
}

} // namespace

// -- binomial tree ------------------------------------------------------------------------------

binomial_broadcast::binomial_broadcast(context_ptr ctx, mutable_bytes data, int root,
                                       const algorithm_options& opts)
    : ctx_(std::move(ctx)), data_(data), root_(root), opts_(opts) {
  setup_error_ = detail::check_options(tree_name, *ctx_, opts_);
  if (!setup_error_)
    setup_error_ = check_root(tree_name, *ctx_, opts_, root_);
  const int n = ctx_->size();
  if (setup_error_ || n == 1)
    return;
  // Ranks relative to the root: v's parent is v without its lowest set bit; its children are
  // v + 2^k for every 2^k below that bit (the root: below n), largest subtree first.
  const int v = detail::ring_add(ctx_->rank(), -root_, n);
  auto real = [&](int u) {
    return detail::ring_add(u, root_, n);
  };
  int mask = 1;
  while (mask < n) {
    if (v & mask) {
      parent_ = &ctx_->to(real(v - mask));
      break;
    }
    mask <<= 1;
  }
  for (mask >>= 1; mask > 0; mask >>= 1)
    if (v + mask < n)
      children_.push_back(&ctx_->to(real(v + mask)));
}

caf::error binomial_broadcast::run() {
  if (setup_error_)
    return setup_error_;
  if (ctx_->size() == 1 || data_.empty())
    return {};
  const auto until = clock::now() + opts_.timeout;
  const uint64_t tag = detail::message_tag(opts_.tag, 0);
  // Step 1: every rank but the root receives the data from its parent.
  if (parent_) {
    if (auto err = parent_->recv(tag, data_)->wait(until))
      return detail::step_failed(*ctx_, opts_, tree_name, "receive from the parent", "receive from",
                                 parent_->peer_rank(), err);
  }
  // Step 2: send it to every child at once, largest subtree first (the sends read one buffer).
  std::vector<operation_ptr> sends;
  sends.reserve(children_.size());
  for (auto* child : children_)
    sends.push_back(child->send(tag, {data_}));
  // Step 3: wait for the sends.
  for (size_t i = 0; i < sends.size(); ++i) {
    if (auto err = sends[i]->wait(until))
      return detail::step_failed(*ctx_, opts_, tree_name,
                                 "send to child " + std::to_string(i + 1) + " of " +
                                     std::to_string(sends.size()),
                                 "send to", children_[i]->peer_rank(), err);
  }
  return {};
}

// -- pipelined chain ----------------------------------------------------------------------------

chain_broadcast::chain_broadcast(context_ptr ctx, mutable_bytes data, int root,
                                 const algorithm_options& opts)
    : ctx_(std::move(ctx)), data_(data), root_(root), opts_(opts) {
  setup_error_ = detail::check_options(chain_name, *ctx_, opts_);
  if (!setup_error_)
    setup_error_ = check_root(chain_name, *ctx_, opts_, root_);
  const int n = ctx_->size();
  if (setup_error_ || n == 1)
    return;
  const int r = ctx_->rank();
  const int v = detail::ring_add(r, -root_, n);
  if (v > 0)
    prev_ = &ctx_->to(detail::ring_add(r, -1, n));
  if (v < n - 1)
    next_ = &ctx_->to(detail::ring_add(r, 1, n));
}

caf::error chain_broadcast::run() {
  if (setup_error_)
    return setup_error_;
  if (ctx_->size() == 1 || data_.empty())
    return {};
  const auto until = clock::now() + opts_.timeout;
  const uint64_t tag = detail::message_tag(opts_.tag, 0);
  // About 4 chunks per hop: the chain fills after n - 2 chunks, so longer chains want smaller ones.
  const size_t chunks = detail::chunk_count(
      data_.size(), detail::pipeline_chunk_bytes(opts_.chunk_bytes, data_.size(),
                                                 4 * static_cast<size_t>(ctx_->size() - 1)));
  auto chunk = [&](size_t j) {
    const size_t lo = detail::part_begin(data_.size(), chunks, j);
    return data_.subspan(lo, detail::part_begin(data_.size(), chunks, j + 1) - lo);
  };
  auto step_name = [&](size_t j) {
    return "chunk " + std::to_string(j + 1) + " of " + std::to_string(chunks);
  };
  std::vector<operation_ptr> recvs(prev_ ? chunks : 0);
  std::vector<operation_ptr> sends(next_ ? chunks : 0);

  // Step 1: every rank but the root posts all its receives up front, straight into place.
  for (size_t j = 0; j < recvs.size(); ++j)
    recvs[j] = prev_->recv(tag, chunk(j));
  for (size_t j = 0; j < chunks; ++j) {
    // Step 2: wait for chunk j (the root has them all).
    if (prev_) {
      if (auto err = recvs[j]->wait(until))
        return detail::step_failed(*ctx_, opts_, chain_name, step_name(j), "receive from",
                                   prev_->peer_rank(), err);
    }
    // Step 3: forward it at once, unless this rank ends the chain.
    if (next_)
      sends[j] = next_->send(tag, {chunk(j)});
  }
  // Step 4: wait for the sends.
  for (size_t j = 0; j < sends.size(); ++j) {
    if (auto err = sends[j]->wait(until))
      return detail::step_failed(*ctx_, opts_, chain_name, step_name(j), "send to",
                                 next_->peer_rank(), err);
  }
  return {};
}

// -- dispatcher ---------------------------------------------------------------------------------

caf::error broadcast(const context_ptr& ctx, mutable_bytes data, int root,
                     const algorithm_options& opts) {
  if (data.size() <= opts.tree_max_bytes)
    return binomial_broadcast{ctx, data, root, opts}.run();
  return chain_broadcast{ctx, data, root, opts}.run();
}

} // namespace consort::transport
