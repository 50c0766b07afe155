// The lean path of a lone replica's small all-reduce (group_call.hpp, lone_all_reduce): the
// descriptor exchange and the fused all-reduce of one leaf in one pass through the lockstep
// channel, or a hand-over to the descriptor exchange at the first thing that is not plain.

#include "transport/algorithms/common.hpp"
#include "transport/algorithms/group_call.hpp"

#include <consort/ops.hpp>

#include <cstring>

namespace consort::transport {

bool lone_all_reduce::fits(const context& ctx, const mailbox* box, const tensor& t,
                           reduce_op op) noexcept {
  const auto bytes = t.num_bytes();
  return box != nullptr && ctx.size() > 1 &&
         ctx.size() <= descriptor_exchange::direct_max_workers && bytes > 0 && bytes <= max_bytes &&
         call_descriptor::compact_bytes + bytes <= box->capacity() && !t.on_gpu() &&
         t.dtype() != dtype::boolean && (op != reduce_op::mean || is_floating(t.dtype()));
}

lone_all_reduce::lone_all_reduce(context& ctx, mailbox& box, const lone_call& call,
                                 uint64_t base_tag, deadline until)
    : ctx_(ctx), box_(box), call_(call), until_(until), rank_(ctx.rank()), size_(ctx.size()) {
  // The descriptor the general exchange would send for this call (describe_mine): a fused
  // all-reduce of one leaf of one replica.
  mine_.kind = static_cast<uint8_t>(collective_kind::all_reduce);
  mine_.op = static_cast<uint8_t>(call.op);
  mine_.root = call.root;
  mine_.axis = call.axis;
  mine_.step = call.step;
  mine_.seq = call.seq;
  mine_.num_leaves = 1;
  mine_.count = 1;
  mine_.signature_hash = call.signature_hash;
  mine_.flags = 0;
  mine_.fused = 1;
  if (call.lateness != nullptr)
    mine_.entered_ns = call.entered_unix_ns + call.clock_offset_ns;
  mine_.write_compact(compact_);
  taken_.base_tag = base_tag;
}

namespace {

/// The field of a descriptor at `offset` in a message, read in place.
template <class T>
T field(const std::byte* message, size_t offset) noexcept {
  T value;
  std::memcpy(&value, message + offset, sizeof value);
  return value;
}

} // namespace

bool lone_all_reduce::matches(const_bytes message) const noexcept {
  // This call's own compact descriptor, which a plain peer sends (the same call): every field the
  // descriptor exchange checks or sums (check_outcomes, check_agreement, all_flags, total_count,
  // the fused data's size) the same; only the entry time, last, may differ.
  return message.size() == call_descriptor::compact_bytes + call_.input->num_bytes() &&
         std::memcmp(message.data(), compact_, call_descriptor::compact_entered) == 0;
}

std::optional<tensor> lone_all_reduce::run() {
  const tensor& in = *call_.input;
  const auto bytes = in.num_bytes();
  const auto tag = detail::message_tag(taken_.base_tag, 0);
  send_parts parts;
  parts.push_back({compact_, call_descriptor::compact_bytes});
  parts.push_back({static_cast<const std::byte*>(in.raw_data()), bytes});
  for (int k = 1; k < size_; ++k) {
    // A put that fails puts nothing, and fails again the same way (the context refuses, or the
    // channel is out of step): the exchange makes it again and fails as it would have.
    if (box_.put(detail::ring_add(rank_, k, size_), tag, parts))
      return std::nullopt;
    taken_.puts = k;
  }
  // Every peer's message, taken in the exchange's order; its data is read where it lies.
  std::array<const std::byte*, descriptor_exchange::direct_max_workers> data{};
  bool plain = true;
  for (int k = 1; k < size_; ++k) {
    const int p = detail::ring_add(rank_, -k, size_);
    auto got = box_.take(p, tag, until_);
    if (!got) {
      taken_.failed = std::move(got.error());
      taken_.failed_peer = p;
      return std::nullopt;
    }
    taken_.has[static_cast<size_t>(p)] = true;
    taken_.got[static_cast<size_t>(p)] = *got;
    if (call_.arrivals != nullptr && !got->empty()) // as the exchange's accept marks it
      call_.arrivals->store(call_.arrivals->load(std::memory_order_relaxed) | (uint64_t{1} << p),
                            std::memory_order_relaxed);
    // An empty message (the peer's was too large for a slot) or another call: the exchange
    // takes over once every message is in, as it would have taken them all itself.
    if (!matches(*got)) {
      plain = false;
      if (got->empty())
        return std::nullopt; // the exchange answers it (a receive from the peer) before the rest
      continue;
    }
    data[static_cast<size_t>(p)] = got->data() + call_descriptor::compact_bytes;
  }
  if (!plain)
    return std::nullopt;
  data[static_cast<size_t>(rank_)] = static_cast<const std::byte*>(in.raw_data());
  // Who came last, and by how much (descriptor_exchange::run).
  if (call_.lateness != nullptr) {
    auto entered = [&](int w) {
      if (w == rank_)
        return mine_.entered_ns;
      return field<int64_t>(taken_.got[static_cast<size_t>(w)].data(),
                            call_descriptor::compact_entered);
    };
    int last = 0;
    for (int w = 1; w < size_; ++w)
      if (entered(w) > entered(last))
        last = w;
    int64_t before = std::numeric_limits<int64_t>::min();
    for (int w = 0; w < size_; ++w)
      if (w != last)
        before = std::max(before, entered(w));
    call_.lateness->last.store(last, std::memory_order_relaxed);
    call_.lateness->margin_ns.store(entered(last) - before, std::memory_order_relaxed);
  }
  // The fold of fused_all_reduce: worker 0's data, then every other worker's in rank order.
  const auto wire_op = call_.op == reduce_op::mean ? reduce_op::sum : call_.op;
  tensor out = tensor::empty(in.dtype(), in.shape());
  auto* acc = out.raw_mutable_data();
  std::memcpy(acc, data[0], bytes);
  const auto n = static_cast<size_t>(in.num_elements());
  for (int p = 1; p < size_; ++p)
    detail::combine(in.dtype(), wire_op, acc, acc, data[static_cast<size_t>(p)], n);
  if (call_.op == reduce_op::mean) // finish_mean, over one count a worker
    return reduce_elementwise(reduce_op::mean, {out}, static_cast<double>(size_));
  return out;
}

} // namespace consort::transport
