// Ragged ring all-gather and the exchange of contribution sizes (docs/algorithms.md).

#include "transport/algorithms/common.hpp"

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>

namespace consort::transport {

namespace {

constexpr const char* gather_name = "ring_all_gather";
constexpr const char* sizes_name = "exchange_sizes";

} // namespace

ring_all_gather::ring_all_gather(context_ptr ctx, const_bytes input, mutable_bytes output,
                                 std::vector<size_t> sizes, const algorithm_options& opts)
    : ctx_(std::move(ctx)), input_(input), output_(output), sizes_(std::move(sizes)), opts_(opts) {
  setup_error_ = detail::check_options(gather_name, *ctx_, opts_);
  if (setup_error_)
    return;
  const int n = ctx_->size();
  const int r = ctx_->rank();
  auto bad = [&](const std::string& what) {
    setup_error_ =
        detail::argument_error(errc::invalid_argument, gather_name, *ctx_, opts_.tag, what);
  };
  if (sizes_.size() != static_cast<size_t>(n)) {
    bad("got " + std::to_string(sizes_.size()) + " sizes for " + std::to_string(n) +
        " ranks; pass one byte count per rank");
    return;
  }
  offsets_.resize(static_cast<size_t>(n) + 1, 0);
  for (size_t i = 0; i < static_cast<size_t>(n); ++i)
    offsets_[i + 1] = offsets_[i] + sizes_[i];
  const auto mine = static_cast<size_t>(r);
  if (input_.size() != sizes_[mine]) {
    bad("the input has " + std::to_string(input_.size()) + " bytes but sizes[" + std::to_string(r) +
        "] is " + std::to_string(sizes_[mine]));
    return;
  }
  if (output_.size() != offsets_.back()) {
    bad("the output has " + std::to_string(output_.size()) + " bytes; the sizes add up to " +
        std::to_string(offsets_.back()));
    return;
  }
  // The input is either outside the output or exactly at this rank's place (in place).
  const auto in = reinterpret_cast<uintptr_t>(input_.data());
  const auto out = reinterpret_cast<uintptr_t>(output_.data());
  if (!input_.empty() && in < out + output_.size() && out < in + input_.size() &&
      in != out + offsets_[mine]) {
    bad("the input overlaps the output but not at this rank's offset " +
        std::to_string(offsets_[mine]));
    return;
  }
  if (n == 1)
    return;
  left_ = &ctx_->to(detail::ring_add(r, -1, n));
  right_ = &ctx_->to(detail::ring_add(r, 1, n));
}

caf::error ring_all_gather::run() {
  if (setup_error_)
    return setup_error_;
  const int n = ctx_->size();
  const int r = ctx_->rank();
  const auto mine = static_cast<size_t>(r);
  // Step 1: copy this rank's contribution into its place (unless it is gathered in place).
  std::byte* own = output_.data() + offsets_[mine];
  if (!input_.empty() && input_.data() != own)
    std::memcpy(own, input_.data(), input_.size());
  if (n == 1)
    return {};
  const auto until = clock::now() + opts_.timeout;
  const size_t steps = static_cast<size_t>(n) - 1;
  // Chunk j of block b: a byte range of the output; every rank computes the same cuts.
  auto chunks_of = [&](size_t b) {
    return detail::chunk_count(sizes_[b],
                               detail::pipeline_chunk_bytes(opts_.chunk_bytes, sizes_[b], 4));
  };
  auto range = [&](size_t b, size_t j) {
    const size_t c = chunks_of(b);
    return std::pair{offsets_[b] + detail::part_begin(sizes_[b], c, j),
                     offsets_[b] + detail::part_begin(sizes_[b], c, j + 1)};
  };
  // In step s this rank receives the block that started s + 1 ranks to its left.
  auto block_at = [&](size_t s) {
    return static_cast<size_t>(detail::ring_add(r, -static_cast<int>(s) - 1, n));
  };
  auto step_name = [&](size_t s, size_t j) {
    return "step " + std::to_string(s + 1) + " of " + std::to_string(steps) + " (block of rank " +
           std::to_string(block_at(s)) + "), chunk " + std::to_string(j + 1) + " of " +
           std::to_string(chunks_of(block_at(s)));
  };
  auto fail = [&](const std::string& step, bool send, const caf::error& err) {
    return detail::step_failed(*ctx_, opts_, gather_name, step, send ? "send to" : "receive from",
                               send ? right_->peer_rank() : left_->peer_rank(), err);
  };
  struct posted {
    operation_ptr op;
    std::string step;
  };
  std::vector<std::vector<operation_ptr>> recvs(steps);
  std::vector<posted> sends;

  // Step 2: post every receive up front, straight into place: the blocks are disjoint and
  // nothing reads a chunk before it has arrived. Empty chunks are skipped on both sides alike.
  for (size_t s = 0; s < steps; ++s) {
    const size_t b = block_at(s);
    recvs[s].resize(chunks_of(b));
    for (size_t j = 0; j < recvs[s].size(); ++j) {
      auto [lo, hi] = range(b, j);
      if (lo != hi)
        recvs[s][j] = left_->recv(detail::message_tag(opts_.tag, s),
                                  mutable_bytes{output_.data() + lo, hi - lo});
    }
  }
  // Step 3: send this rank's block to the right neighbour, read in place from the input.
  for (size_t j = 0, c = chunks_of(mine); j < c; ++j) {
    auto [lo, hi] = range(mine, j);
    if (lo != hi)
      sends.push_back({right_->send(detail::message_tag(opts_.tag, 0),
                                    {input_.subspan(lo - offsets_[mine], hi - lo)}),
                       "step 1 of " + std::to_string(steps) + " (own block), chunk " +
                           std::to_string(j + 1) + " of " + std::to_string(c)});
  }
  // Step 4: wait for each chunk in turn and forward it at once, except in the last step, whose
  // block the right neighbour started.
  for (size_t s = 0; s < steps; ++s) {
    const size_t b = block_at(s);
    for (size_t j = 0; j < recvs[s].size(); ++j) {
      const auto& op = recvs[s][j];
      if (!op)
        continue;
      if (auto err = op->wait(until))
        return fail(step_name(s, j), false, err);
      if (s + 1 < steps) {
        auto [lo, hi] = range(b, j);
        sends.push_back({right_->send(detail::message_tag(opts_.tag, s + 1),
                                      {const_bytes{output_.data() + lo, hi - lo}}),
                         step_name(s, j) + ", forwarded"});
      }
    }
  }
  // Step 5: wait for the sends.
  for (const auto& send : sends) {
    if (auto err = send.op->wait(until))
      return fail(send.step, true, err);
  }
  return {};
}

caf::error exchange_sizes(const context_ptr& ctx, size_t mine, std::vector<size_t>& sizes,
                          const algorithm_options& opts) {
  if (auto err = detail::check_options(sizes_name, *ctx, opts))
    return err;
  const int n = ctx->size();
  const int r = ctx->rank();
  sizes.assign(static_cast<size_t>(n), 0);
  sizes[static_cast<size_t>(r)] = mine;
  if (n == 1)
    return {};
  const auto until = clock::now() + opts.timeout;
  const uint64_t tag = detail::message_tag(opts.tag, detail::sizes_step);
  using word = std::array<std::byte, 8>;
  // Little-endian on the wire, whatever the hosts are.
  auto encode = [](uint64_t v) {
    word w;
    for (size_t i = 0; i < w.size(); ++i)
      w[i] = static_cast<std::byte>(v >> (8 * i));
    return w;
  };
  auto decode = [](const word& w) {
    uint64_t v = 0;
    for (size_t i = 0; i < w.size(); ++i)
      v |= static_cast<uint64_t>(w[i]) << (8 * i);
    return v;
  };
  std::vector<word> wire(static_cast<size_t>(n));
  wire[static_cast<size_t>(r)] = encode(mine);
  std::vector<operation_ptr> recvs(static_cast<size_t>(n));
  std::vector<operation_ptr> sends(static_cast<size_t>(n));
  // Step 1: post a receive from every peer, then send this rank's count to every peer.
  for (int p = 0; p < n; ++p)
    if (p != r)
      recvs[static_cast<size_t>(p)] = ctx->to(p).recv(tag, wire[static_cast<size_t>(p)]);
  for (int k = 1; k < n; ++k) {
    const int p = detail::ring_add(r, k, n);
    sends[static_cast<size_t>(p)] =
        ctx->to(p).send(tag, {const_bytes{wire[static_cast<size_t>(r)]}});
  }
  // Step 2: wait for the counts, then for the sends.
  for (int p = 0; p < n; ++p) {
    if (p == r)
      continue;
    if (auto err = recvs[static_cast<size_t>(p)]->wait(until))
      return detail::step_failed(*ctx, opts, sizes_name, "exchange", "receive from", p, err);
    sizes[static_cast<size_t>(p)] = static_cast<size_t>(decode(wire[static_cast<size_t>(p)]));
  }
  for (int p = 0; p < n; ++p) {
    if (p == r)
      continue;
    if (auto err = sends[static_cast<size_t>(p)]->wait(until))
      return detail::step_failed(*ctx, opts, sizes_name, "exchange", "send to", p, err);
  }
  return {};
}

caf::error all_gather(const context_ptr& ctx, const_bytes input, std::vector<std::byte>& output,
                      std::vector<size_t>* sizes, const algorithm_options& opts) {
  // One deadline for both parts: the gather gets what the size exchange left of the timeout.
  const auto until = clock::now() + opts.timeout;
  std::vector<size_t> counts;
  if (auto err = exchange_sizes(ctx, input.size(), counts, opts))
    return err;
  size_t total = 0;
  for (auto c : counts)
    total += c;
  output.resize(total);
  auto rest = opts;
  rest.timeout =
      std::max(std::chrono::milliseconds{0},
               std::chrono::duration_cast<std::chrono::milliseconds>(until - clock::now()));
  if (auto err = ring_all_gather{ctx, input, output, counts, rest}.run())
    return err;
  if (sizes)
    *sizes = std::move(counts);
  return {};
}

} // namespace consort::transport
