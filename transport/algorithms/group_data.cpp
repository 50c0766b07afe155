// Part 2 of a group call: the data, from what came with the descriptors or by the transport's
// algorithms leaf by leaf.

#include "transport/algorithms/common.hpp"
#include "transport/algorithms/group_call.hpp"

#include <consort/caf_error.hpp>
#include <consort/ops.hpp>

#include <cstring>

namespace consort::transport {

namespace {

mutable_bytes mutable_bytes_of(tensor& t) {
  return {static_cast<std::byte*>(t.raw_mutable_data()), t.num_bytes()};
}

const_bytes bytes_of(const tensor& t) {
  return {static_cast<const std::byte*>(t.raw_data()), t.num_bytes()};
}

/// Whether any of `n` extents a peer announced is negative or absurd (its part would not fit a
/// message).
bool extents_invalid(const int64_t* extents, size_t n) {
  for (size_t i = 0; i < n; ++i)
    if (extents[i] < 0 || extents[i] > (int64_t{1} << 40))
      return true;
  return false;
}

reduce_op wire_op_of(reduce_op op) {
  return op == reduce_op::mean ? reduce_op::sum : op;
}

/// A MEAN's sum divided by the count over every worker, unless the call defers it.
tensor finish_mean(const group_call& call, tensor t) {
  if (call.op == reduce_op::mean && !call.defer_mean)
    return reduce_elementwise(reduce_op::mean, {t}, call.total_count);
  return t;
}

} // namespace

// -- fused_all_reduce ----------------------------------------------------------------------------

fused_all_reduce::fused_all_reduce(const descriptor_exchange& exchange, const context& ctx,
                                   group_call& call)
    : exchange_(exchange), call_(call), rank_(ctx.rank()), size_(ctx.size()) {}

caf::expected<std::vector<tensor>> fused_all_reduce::run() {
  // Every descriptor agreed, so every peer sent this many bytes of data; check it anyway.
  const auto expected_bytes = call_descriptor::header_bytes + exchange_.data_bytes();
  for (int p = 0; p < size_; ++p)
    if (p != rank_ && exchange_.received(p) != expected_bytes)
      return make_caf_error(
          errc::collective_mismatch,
          "collective mismatch between workers at " + call_.name() + ": " + worker_name(p) +
              " sent " + std::to_string(exchange_.received(p) - call_descriptor::header_bytes) +
              " bytes of data where this worker has " + std::to_string(exchange_.data_bytes()));
  const auto wire_op = wire_op_of(call_.op);
  std::vector<tensor> out;
  if (call_.result_capacity != nullptr) {
    out = std::move(*call_.result_capacity);
    out.clear();
  }
  out.reserve(call_.leaves.size());
  size_t offset = 0;
  for (auto& leaf : call_.leaves) {
    const auto bytes = leaf.num_bytes();
    const auto n = static_cast<size_t>(leaf.num_elements());
    auto at = [&](int p) -> const void* {
      return p == rank_ ? leaf.raw_data() : static_cast<const void*>(exchange_.payload(p) + offset);
    };
    tensor t;
    if (rank_ == 0) {
      t = std::move(leaf); // ours alone, and first in the fold: reduced in place
    } else {
      t = tensor::empty(leaf.dtype(), leaf.shape());
      if (bytes > 0)
        std::memcpy(t.raw_mutable_data(), at(0), bytes);
    }
    if (bytes > 0) {
      auto* acc = t.raw_mutable_data();
      for (int p = 1; p < size_; ++p)
        detail::combine(t.dtype(), wire_op, acc, acc, at(p), n);
    }
    offset += bytes;
    out.push_back(finish_mean(call_, std::move(t)));
  }
  return out;
}

// -- group_all_reduce ----------------------------------------------------------------------------

group_all_reduce::group_all_reduce(const context_ptr& ctx, group_call& call, call_clock& clock)
    : ctx_(ctx), call_(call), clock_(clock) {}

caf::expected<std::vector<tensor>> group_all_reduce::run() {
  const auto wire_op = wire_op_of(call_.op);
  std::vector<tensor> out;
  out.reserve(call_.leaves.size());
  for (auto& leaf : call_.leaves) {
    const auto n = static_cast<size_t>(leaf.num_elements());
    tensor t;
    caf::error err;
    if (n == 0) {
      t = std::move(leaf);
      clock_.skip(); // keeps the tag sequence equal on every worker
    } else if (call_.leaves_are_inputs) {
      // The caller's tensor: read in place, the result in a tensor of its own.
      t = tensor::empty(leaf.dtype(), leaf.shape());
      err = all_reduce(ctx_, leaf.raw_data(), t.raw_mutable_data(), n, leaf.dtype(), wire_op,
                       clock_.next());
    } else {
      t = std::move(leaf); // the partial is ours alone: written in place, no copy
      err = all_reduce(ctx_, t.raw_mutable_data(), n, t.dtype(), wire_op, clock_.next());
    }
    if (err)
      return failed_between_workers(err, call_.name());
    out.push_back(finish_mean(call_, std::move(t)));
  }
  return out;
}

// -- group_all_gather ----------------------------------------------------------------------------

group_all_gather::group_all_gather(const context_ptr& ctx, const descriptor_exchange& exchange,
                                   group_call& call, call_clock& clock)
    : ctx_(ctx), exchange_(exchange), call_(call), clock_(clock), rank_(ctx->rank()),
      size_(ctx->size()), leaves_(call.leaves.size()),
      extents_(leaves_ * static_cast<size_t>(size_)), units_(leaves_),
      data_at_(static_cast<size_t>(size_), call_descriptor::header_bytes + leaves_ * 8) {
  auto* mine = extents_.data() + static_cast<size_t>(rank_) * leaves_;
  const auto axis = static_cast<size_t>(call_.axis);
  for (size_t i = 0; i < leaves_; ++i) {
    const auto& shape = call_.leaves[i].shape();
    mine[i] = shape[axis];
    int64_t inner = 1;
    for (size_t d = 0; d < shape.size(); ++d)
      if (d != axis)
        inner *= shape[d];
    units_[i] = static_cast<size_t>(inner) * size_of(call_.leaves[i].dtype());
  }
}

caf::error group_all_gather::gather_extents() {
  if (!exchange_.extents_sent()) {
    auto* base = reinterpret_cast<std::byte*>(extents_.data());
    const auto row = leaves_ * 8;
    ring_all_gather gather(ctx_, {base + static_cast<size_t>(rank_) * row, row},
                           {base, extents_.size() * 8},
                           std::vector<size_t>(static_cast<size_t>(size_), row), clock_.next());
    if (auto err = gather.run())
      return failed_between_workers(err, call_.name());
    return {};
  }
  // With up to 8 workers every worker's extents came with its descriptor, and, when every
  // worker's part was small, its data too: the gather is then complete already.
  all_fused_ = exchange_.sent_data();
  for (int p = 0; p < size_; ++p) {
    if (p == rank_)
      continue;
    const auto at = static_cast<size_t>(p);
    const auto got = exchange_.received(p);
    if (got < call_descriptor::header_bytes + leaves_ * 8)
      return make_caf_error(errc::collective_mismatch,
                            call_.name() + ": " + worker_name(p) + " sent " + std::to_string(got) +
                                " bytes with its descriptor, fewer than its extents take");
    std::memcpy(extents_.data() + at * leaves_, exchange_.payload(p), leaves_ * 8);
    size_t expect = call_descriptor::header_bytes + leaves_ * 8;
    if (exchange_.fused(p))
      for (size_t i = 0; i < leaves_; ++i)
        expect += static_cast<size_t>(extents_[at * leaves_ + i]) * units_[i];
    if (got != expect || extents_invalid(extents_.data() + at * leaves_, leaves_))
      return make_caf_error(errc::collective_mismatch,
                            call_.name() + ": " + worker_name(p) + " sent " + std::to_string(got) +
                                " bytes with its descriptor where its extents announce " +
                                std::to_string(expect));
    all_fused_ = all_fused_ && exchange_.fused(p);
  }
  return {};
}

caf::expected<tensor> group_all_gather::gather_leaf(size_t i) {
  const auto& leaf = call_.leaves[i];
  const auto& shape = leaf.shape();
  const auto axis = static_cast<size_t>(call_.axis);
  const auto unit = units_[i];
  std::vector<size_t> sizes(static_cast<size_t>(size_));
  int64_t total = 0;
  for (int w = 0; w < size_; ++w) {
    auto e = extents_[static_cast<size_t>(w) * leaves_ + i];
    sizes[static_cast<size_t>(w)] = static_cast<size_t>(e) * unit;
    total += e;
  }
  // Along axis 0 the blocks of the workers are the result's bytes in order; along another axis
  // they are gathered into a byte buffer and then interleaved by concat.
  tensor gathered;
  if (axis == 0) {
    auto gathered_shape = shape;
    gathered_shape[0] = total;
    gathered = tensor::empty(leaf.dtype(), gathered_shape);
  } else {
    gathered = tensor::empty(dtype::uint8, {total * static_cast<int64_t>(unit)});
  }
  if (all_fused_) {
    auto* into = static_cast<std::byte*>(gathered.raw_mutable_data());
    for (int w = 0; w < size_; ++w) {
      const auto at = static_cast<size_t>(w);
      const auto* from = w == rank_
                             ? static_cast<const std::byte*>(leaf.raw_data())
                             : exchange_.payload(w) - call_descriptor::header_bytes + data_at_[at];
      if (sizes[at] > 0)
        std::memcpy(into, from, sizes[at]);
      into += sizes[at];
      data_at_[at] += sizes[at];
    }
  } else {
    ring_all_gather gather(ctx_, bytes_of(leaf), mutable_bytes_of(gathered), sizes, clock_.next());
    if (auto err = gather.run())
      return failed_between_workers(err, call_.name());
  }
  if (axis == 0)
    return gathered;
  std::vector<tensor> blocks;
  size_t offset = 0;
  for (int w = 0; w < size_; ++w) {
    auto block_shape = shape;
    block_shape[axis] = extents_[static_cast<size_t>(w) * leaves_ + i];
    auto block = tensor::empty(leaf.dtype(), block_shape);
    auto bytes = sizes[static_cast<size_t>(w)];
    if (bytes > 0)
      std::memcpy(block.raw_mutable_data(),
                  static_cast<const std::byte*>(gathered.raw_data()) + offset, bytes);
    offset += bytes;
    blocks.push_back(std::move(block));
  }
  return concat(blocks, call_.axis);
}

caf::expected<std::vector<tensor>> group_all_gather::run() {
  if (auto err = gather_extents())
    return err;
  std::vector<tensor> out;
  out.reserve(leaves_);
  for (size_t i = 0; i < leaves_; ++i) {
    auto t = gather_leaf(i);
    if (!t)
      return t.error();
    out.push_back(std::move(*t));
  }
  return out;
}

// -- group_broadcast -----------------------------------------------------------------------------

group_broadcast::group_broadcast(const context_ptr& ctx, const descriptor_exchange& exchange,
                                 group_call& call, call_clock& clock)
    : ctx_(ctx), exchange_(exchange), call_(call), clock_(clock), rank_(ctx->rank()) {}

caf::expected<std::vector<tensor>> group_broadcast::from_descriptor() {
  const int root = exchange_.root_worker();
  std::vector<tensor> out;
  out.reserve(call_.leaves.size());
  if (rank_ == root) {
    for (auto& leaf : call_.leaves)
      out.push_back(std::move(leaf));
    return out;
  }
  const auto sent = exchange_.received(root);
  if (sent != call_descriptor::header_bytes + exchange_.data_bytes())
    return make_caf_error(
        errc::collective_mismatch,
        "collective mismatch between workers at " + call_.name() + ": " + worker_name(root) +
            " (the root) sent " + std::to_string(sent - call_descriptor::header_bytes) +
            " bytes of data where this worker expects " + std::to_string(exchange_.data_bytes()));
  const std::byte* from = exchange_.payload(root);
  for (auto& leaf : call_.leaves) {
    auto t = std::move(leaf);
    if (t.num_bytes() > 0)
      std::memcpy(t.raw_mutable_data(), from, t.num_bytes());
    from += t.num_bytes();
    out.push_back(std::move(t));
  }
  return out;
}

caf::expected<std::vector<tensor>> group_broadcast::run() {
  const int root = exchange_.root_worker();
  // A small broadcast: the root's data came with its descriptor, so the call took one round.
  if (exchange_.direct() && exchange_.fused(root))
    return from_descriptor();
  std::vector<tensor> out;
  out.reserve(call_.leaves.size());
  for (auto& leaf : call_.leaves) {
    auto t = std::move(leaf);
    if (t.num_bytes() == 0) {
      clock_.skip();
      out.push_back(std::move(t));
      continue;
    }
    // The root only reads its bytes; the others receive into their own fresh tensor.
    mutable_bytes data =
        rank_ == root
            ? mutable_bytes{const_cast<std::byte*>(static_cast<const std::byte*>(t.raw_data())),
                            t.num_bytes()}
            : mutable_bytes_of(t);
    if (auto err = broadcast(ctx_, data, root, clock_.next()))
      return failed_between_workers(err, call_.name());
    out.push_back(std::move(t));
  }
  return out;
}

} // namespace consort::transport
