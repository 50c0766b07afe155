// The cross-worker phase of collectives: descriptor exchange, then the transport algorithm.

#include "actors/cross_worker.hpp"
#include "transport/algorithms/common.hpp"

#include <consort/ops.hpp>
#include <consort/transport/algorithms.hpp>

#include <algorithm>
#include <cstring>
#include <sstream>

namespace consort::detail {

namespace {

using clock = std::chrono::steady_clock;

/// The descriptor every worker sends every other at the start of a call (fixed size; a fused
/// call's data follows it in the same message).
struct descriptor {
  static constexpr size_t text_bytes = 198;
  uint8_t failed = 0;
  uint8_t kind = 0;
  uint8_t op = 0;
  uint8_t error_code = 0;
  int32_t root = 0;
  int64_t axis = 0;
  uint64_t step = 0;
  uint32_t seq = 0;
  uint32_t num_leaves = 0;
  double count = 0;
  uint64_t signature_hash = 0;
  /// The call's description (ok) or the local error (failed), truncated, NUL-padded.
  char text[text_bytes] = {};
  /// cross_call::flags of the sender (OR-ed over every worker into all_flags).
  uint8_t flags = 0;
  /// 1: the sender's data follows this descriptor in its message (a fused all-reduce or
  /// all-gather, or the root's worker of a fused broadcast).
  uint8_t fused = 0;
};
static_assert(sizeof(descriptor) == 248);

/// A fused call's data at most: the direct exchange's range (algorithm_options::small_bytes).
constexpr size_t fused_max_bytes = size_t{64} << 10;
/// Groups up to this many workers exchange descriptors (and fused data) directly, one message to
/// every other worker (algorithm_options::direct_max_ranks); larger ones by a ring all-gather.
constexpr int direct_max_workers = 8;

std::string text_of(const descriptor& d) {
  return std::string(d.text, strnlen(d.text, descriptor::text_bytes));
}

void set_text(descriptor& d, const std::string& s) {
  auto n = std::min(s.size(), descriptor::text_bytes - 1);
  std::memcpy(d.text, s.data(), n);
}

std::string worker_name(int rank) {
  return rank == 0 ? "worker 0 (the chief)" : "worker " + std::to_string(rank);
}

std::string describe(const descriptor& d) {
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

/// The first disagreement between the descriptors of all workers, or an empty string.
std::string disagreement(const std::vector<descriptor>& all, const cross_call& call) {
  const auto& a = all.front();
  for (size_t w = 1; w < all.size(); ++w) {
    const auto& b = all[w];
    if (a.step != b.step || a.seq != b.seq || a.kind != b.kind ||
        (a.kind == static_cast<uint8_t>(collective_kind::all_reduce) && a.op != b.op) ||
        (a.kind == static_cast<uint8_t>(collective_kind::all_gather) && a.axis != b.axis) ||
        (a.kind == static_cast<uint8_t>(collective_kind::broadcast) && a.root != b.root)) {
      std::ostringstream out;
      out << "collective mismatch between workers at " << call.what << ": " << worker_name(0)
          << " is at " << describe(a) << " but " << worker_name(static_cast<int>(w)) << " is at "
          << describe(b)
          << "; every replica on every worker must make the same collective calls in the same "
             "order";
      return out.str();
    }
    // An all-gather's parts differ in size between workers (ragged), so some may travel with
    // their descriptor and some not: only an all-reduce's workers must agree on it.
    const bool fused_differs =
        a.fused != b.fused && a.kind == static_cast<uint8_t>(collective_kind::all_reduce);
    if (a.signature_hash != b.signature_hash || a.num_leaves != b.num_leaves || fused_differs) {
      std::ostringstream out;
      out << "collective mismatch between workers at " << call.what << ": " << worker_name(0)
          << " passed " << text_of(a) << " but " << worker_name(static_cast<int>(w)) << " passed "
          << text_of(b) << "; structure, dtypes and shapes must agree on every worker";
      return out.str();
    }
  }
  return {};
}

/// The remaining time until `until`, at least 1 ms so that the algorithms accept it.
std::chrono::milliseconds remaining(clock::time_point until) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - clock::now());
  return std::max(left, std::chrono::milliseconds{1});
}

caf::error wrap(const caf::error& err, const std::string& what) {
  auto e = to_consort_error(err, "");
  return make_caf_error(e.code(), what + " failed between workers: " + e.what());
}

/// Bytes of a tensor, for algorithms that only read them (a root's broadcast, a gather's input).
transport::const_bytes bytes_of(const tensor& t) {
  return {static_cast<const std::byte*>(t.raw_data()), t.num_bytes()};
}

transport::mutable_bytes mutable_bytes_of(tensor& t) {
  return {static_cast<std::byte*>(t.raw_mutable_data()), t.num_bytes()};
}

/// Whether any of `n` extents a peer announced is negative or absurd (its part would not fit a
/// message).
bool extents_invalid(const int64_t* extents, size_t n) {
  for (size_t i = 0; i < n; ++i)
    if (extents[i] < 0 || extents[i] > (int64_t{1} << 40))
      return true;
  return false;
}

/// Whether every leaf of an all-reduce can be reduced by the element-wise kernel (else the data
/// phase reports why, as the algorithms do).
bool reducible(const cross_call& call, const transport::context& ctx) {
  auto wire_op = call.op == reduce_op::mean ? reduce_op::sum : call.op;
  transport::algorithm_options opts;
  opts.tag = 1;
  for (const auto& t : call.leaves)
    if (transport::detail::check_reduction("fused all-reduce", ctx, opts, t.dtype(), wire_op))
      return false;
  return true;
}

/// The result of a fused all-reduce: every worker's leaves folded in rank order, the same order
/// (and so the same bits) on every worker. `data_of(p)` is where worker p's data begins.
template <class DataOf>
std::vector<tensor> fold_fused(cross_call& call, const std::vector<descriptor>& all, int rank,
                               DataOf data_of) {
  auto wire_op = call.op == reduce_op::mean ? reduce_op::sum : call.op;
  double total = 0;
  for (const auto& d : all)
    total += d.count;
  call.total_count = total;
  const int size = static_cast<int>(all.size());
  std::vector<tensor> out;
  out.reserve(call.leaves.size());
  size_t offset = 0;
  for (auto& leaf : call.leaves) {
    const auto bytes = leaf.num_bytes();
    const auto n = static_cast<size_t>(leaf.num_elements());
    auto at = [&](int p) -> const void* {
      return p == rank ? leaf.raw_data() : static_cast<const void*>(data_of(p) + offset);
    };
    tensor t;
    if (rank == 0) {
      t = std::move(leaf); // ours alone, and first in the fold: reduced in place
    } else {
      t = tensor::empty(leaf.dtype(), leaf.shape());
      if (bytes > 0)
        std::memcpy(t.raw_mutable_data(), at(0), bytes);
    }
    if (bytes > 0) {
      auto* acc = t.raw_mutable_data();
      for (int p = 1; p < size; ++p)
        transport::detail::combine(t.dtype(), wire_op, acc, acc, at(p), n);
    }
    offset += bytes;
    if (call.op == reduce_op::mean && !call.defer_mean)
      t = reduce_elementwise(reduce_op::mean, {t}, total);
    out.push_back(std::move(t));
  }
  return out;
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

cross_worker::cross_worker(transport::context_ptr ctx, int devices_per_worker,
                           std::chrono::milliseconds close_timeout)
    : ctx_(std::move(ctx)), rank_(ctx_->rank()), size_(ctx_->size()),
      devices_per_worker_(devices_per_worker), close_timeout_(close_timeout) {
  for (auto& ls : lanes_)
    ls.thread = std::thread([this, &ls] { serve(ls); });
}

cross_worker::~cross_worker() {
  (void)stop();
}

caf::error cross_worker::stop() {
  caf::error closed;
  bool whole;
  {
    std::lock_guard<std::mutex> guard{lost_mtx_};
    whole = lost_.empty() && !stopped_;
    stopped_ = true;
  }
  // A clean end first: the peers may still be reading this worker's part of the last call.
  if (whole)
    closed = ctx_->close(worker_name(rank_) + " left: its strategy was shut down",
                         clock::now() + close_timeout_);
  abort("the strategy was shut down");
  for (auto& ls : lanes_) {
    {
      std::lock_guard<std::mutex> guard{ls.mtx};
      ls.stopping = true;
    }
    ls.cv.notify_all();
  }
  for (auto& ls : lanes_)
    if (ls.thread.joinable())
      ls.thread.join();
  return closed;
}

void cross_worker::serve(lane_state& ls) {
  for (;;) {
    std::function<void()> job;
    {
      std::unique_lock<std::mutex> lock{ls.mtx};
      // An inline job (run_or_post) runs first to its end: the lane keeps its order.
      ls.cv.wait(lock, [&] { return (ls.stopping || !ls.jobs.empty()) && !ls.busy; });
      // Drains the queue before stopping: a queued job fails fast once aborted, and must still
      // answer its callers.
      if (ls.jobs.empty())
        return;
      job = std::move(ls.jobs.front());
      ls.jobs.pop_front();
      ls.busy = true;
    }
    job();
    {
      std::lock_guard<std::mutex> guard{ls.mtx};
      ls.busy = false;
    }
  }
}

void cross_worker::post(lane l, std::function<void()> job) {
  auto& ls = lanes_[static_cast<size_t>(l)];
  {
    std::lock_guard<std::mutex> guard{ls.mtx};
    if (!ls.stopping) {
      ls.jobs.push_back(std::move(job));
      ls.cv.notify_one();
      return;
    }
  }
  // Stopped: the group is aborted, so the job fails at once, here.
  job();
}

void cross_worker::run_or_post(lane l, std::function<void()> job) {
  auto& ls = lanes_[static_cast<size_t>(l)];
  bool inline_run = false;
  {
    std::lock_guard<std::mutex> guard{ls.mtx};
    if (!ls.stopping) {
      if (ls.busy || !ls.jobs.empty()) {
        ls.jobs.push_back(std::move(job));
        ls.cv.notify_one();
        return;
      }
      ls.busy = true;
      inline_run = true;
    }
  }
  // Idle: it runs here, and the lane's thread waits for it, also if it throws. (Stopped: the
  // job fails at once.)
  struct release {
    lane_state* ls;
    ~release() {
      if (!ls)
        return;
      {
        std::lock_guard<std::mutex> guard{ls->mtx};
        ls->busy = false;
      }
      ls->cv.notify_one();
    }
  } done{inline_run ? &ls : nullptr};
  job();
}

uint64_t cross_worker::take_tag(lane l) {
  auto& ls = lanes_[static_cast<size_t>(l)];
  // Lanes use alternate base tags; 0 stays unused.
  auto index = ls.next_tag++;
  return 1 + 2 * index + static_cast<uint64_t>(l);
}

void cross_worker::abort(const std::string& cause) {
  {
    std::lock_guard<std::mutex> guard{lost_mtx_};
    if (!lost_.empty())
      return;
    lost_ = cause;
  }
  ctx_->abort(cause);
}

std::string cross_worker::lost_cause() const {
  std::lock_guard<std::mutex> guard{lost_mtx_};
  return lost_;
}

caf::error cross_worker::lost_error(const std::string& what) const {
  return make_caf_error(errc::peer_lost,
                        what + " cannot run: the group of workers is broken: " + lost_cause());
}

caf::expected<std::vector<tensor>> cross_worker::run(lane l, cross_call& call) {
  auto& ls = lanes_[static_cast<size_t>(l)];
  // Held for the whole call: a lane's calls never overlap, whether they come from its thread or
  // straight from a replica's (run_here).
  std::lock_guard<std::mutex> running{ls.run_mtx};
  if (!lost_cause().empty())
    return call.local_failure ? call.local_failure : lost_error(call.what);
  auto until = clock::now() + call.timeout;
  auto options = [&] {
    transport::algorithm_options opts;
    opts.tag = take_tag(l);
    opts.timeout = remaining(until);
    return opts;
  };

  // 1. Descriptors: each worker's, to every other worker. A small all-reduce sends its data in
  // the same message (fused): the call then takes one round, with the check on receipt.
  descriptor mine;
  mine.kind = static_cast<uint8_t>(call.kind);
  mine.op = static_cast<uint8_t>(call.op);
  mine.root = call.root;
  mine.axis = call.axis;
  mine.step = call.step;
  mine.seq = call.seq;
  mine.num_leaves = static_cast<uint32_t>(call.leaves.size());
  mine.count = call.count;
  mine.signature_hash = fnv1a(call.signature);
  mine.flags = call.flags;
  size_t data_bytes = 0;
  for (const auto& t : call.leaves)
    data_bytes += t.num_bytes();
  if (call.local_failure) {
    mine.failed = 1;
    auto err = to_consort_error(call.local_failure, "");
    mine.error_code = static_cast<uint8_t>(err.code());
    set_text(mine, err.what());
  } else {
    set_text(mine, call.signature);
    if (call.kind == collective_kind::all_reduce)
      mine.fused = !call.data_phase && size_ <= direct_max_workers &&
                   data_bytes <= fused_max_bytes && reducible(call, *ctx_);
    else if (call.kind == collective_kind::all_gather)
      mine.fused = !call.data_phase && size_ <= direct_max_workers &&
                   call.leaves.size() * 8 + data_bytes <= fused_max_bytes;
    else if (call.kind == collective_kind::broadcast)
      // Only the root's worker has data to send; the others read from its descriptor whether it
      // came with its data (every worker sees the same descriptor, so all decide alike).
      mine.fused = !call.data_phase && size_ <= direct_max_workers &&
                   data_bytes <= fused_max_bytes && rank_ == call.root / devices_per_worker_;
  }
  // An all-gather's extents along its axis, leaf by leaf: they travel with the descriptor (up to
  // 8 workers), so the data needs no round of sizes first.
  const bool gather_extents = call.kind == collective_kind::all_gather && !call.local_failure &&
                              !call.data_phase && size_ <= direct_max_workers;
  std::vector<int64_t> my_extents;
  if (gather_extents)
    for (const auto& t : call.leaves)
      my_extents.push_back(t.shape()[static_cast<size_t>(call.axis)]);
  std::vector<descriptor> all(static_cast<size_t>(size_));
  all[static_cast<size_t>(rank_)] = mine;
  // Where the peers' messages land, and how long each was (direct exchange only).
  std::vector<size_t> got(static_cast<size_t>(size_), 0);
  const size_t slot_bytes = sizeof(descriptor) + fused_max_bytes;
  auto slot = [&](int p) {
    return ls.scratch.data() + static_cast<size_t>(p) * slot_bytes;
  };
  if (size_ <= direct_max_workers) {
    // Every worker receives up to a descriptor and a fused call's data from each peer, whatever
    // its own call is: workers whose calls disagree still read each other's descriptors whole.
    ls.scratch.resize(static_cast<size_t>(size_) * slot_bytes);
    auto opts = options();
    const auto tag = transport::detail::message_tag(opts.tag, 0);
    std::vector<transport::operation_ptr> recvs(static_cast<size_t>(size_));
    std::vector<transport::operation_ptr> sends(static_cast<size_t>(size_));
    std::vector<transport::const_bytes> parts{
        {reinterpret_cast<const std::byte*>(&mine), sizeof(descriptor)}};
    if (gather_extents)
      parts.push_back({reinterpret_cast<const std::byte*>(my_extents.data()),
                       my_extents.size() * sizeof(int64_t)});
    if (mine.fused)
      for (const auto& t : call.leaves)
        parts.push_back(bytes_of(t));
    // This thread reads the peers' messages itself, also those that arrive while it is still
    // sending (pair.hpp, reading_here): no other thread is woken for them.
    transport::reading_from_peers reading{*ctx_};
    for (int p = 0; p < size_; ++p)
      if (p != rank_)
        recvs[static_cast<size_t>(p)] = ctx_->to(p).recv_at_most(tag, {slot(p), slot_bytes});
    for (int k = 1; k < size_; ++k) {
      const int p = transport::detail::ring_add(rank_, k, size_);
      sends[static_cast<size_t>(p)] = ctx_->to(p).send(tag, parts);
    }
    for (int k = 1; k < size_; ++k) {
      const int p = transport::detail::ring_add(rank_, -k, size_);
      auto& op = recvs[static_cast<size_t>(p)];
      caf::error err = op->wait(until);
      if (!err && op->message_bytes() < sizeof(descriptor))
        err = make_caf_error(errc::invalid_argument,
                             "its descriptor has " + std::to_string(op->message_bytes()) +
                                 " bytes, fewer than " + std::to_string(sizeof(descriptor)));
      if (err) {
        auto failed = transport::detail::step_failed(*ctx_, opts, "descriptor exchange",
                                                     "descriptors", "receive from", p, err);
        return call.local_failure ? call.local_failure : wrap(failed, call.what);
      }
      got[static_cast<size_t>(p)] = op->message_bytes();
      std::memcpy(&all[static_cast<size_t>(p)], slot(p), sizeof(descriptor));
    }
    reading.release();
    for (int p = 0; p < size_; ++p) {
      if (p == rank_)
        continue;
      if (auto err = sends[static_cast<size_t>(p)]->wait(until)) {
        auto failed = transport::detail::step_failed(*ctx_, opts, "descriptor exchange",
                                                     "descriptors", "send to", p, err);
        return call.local_failure ? call.local_failure : wrap(failed, call.what);
      }
    }
  } else {
    auto* base = reinterpret_cast<std::byte*>(all.data());
    transport::mutable_bytes out{base, all.size() * sizeof(descriptor)};
    transport::const_bytes in{base + static_cast<size_t>(rank_) * sizeof(descriptor),
                              sizeof(descriptor)};
    transport::ring_all_gather gather(
        ctx_, in, out, std::vector<size_t>(all.size(), sizeof(descriptor)), options());
    if (auto err = gather.run())
      return call.local_failure ? call.local_failure : wrap(err, call.what);
  }
  if (call.local_failure)
    return call.local_failure;
  for (int w = 0; w < size_; ++w) {
    const auto& d = all[static_cast<size_t>(w)];
    if (d.failed) {
      auto code = static_cast<errc>(d.error_code);
      // A timeout or a lost peer elsewhere keeps its code; any other failure of a peer's
      // replicas aborts the call here.
      if (code != errc::collective_timeout && code != errc::peer_lost && code != errc::peer_left)
        code = errc::collective_aborted;
      return make_caf_error(code, call.what + " failed on " + worker_name(w) + ": " + text_of(d));
    }
  }
  if (auto problem = disagreement(all, call); !problem.empty())
    return make_caf_error(errc::collective_mismatch, problem);

  call.all_flags = 0;
  for (const auto& d : all)
    call.all_flags |= d.flags;

  if (mine.fused && call.kind == collective_kind::all_reduce) {
    // Every descriptor agreed, so every peer sent this many bytes of data; check it anyway.
    for (int p = 0; p < size_; ++p)
      if (p != rank_ && got[static_cast<size_t>(p)] != sizeof(descriptor) + data_bytes)
        return make_caf_error(
            errc::collective_mismatch,
            "collective mismatch between workers at " + call.what + ": " + worker_name(p) +
                " sent " + std::to_string(got[static_cast<size_t>(p)] - sizeof(descriptor)) +
                " bytes of data where this worker has " + std::to_string(data_bytes));
    return fold_fused(call, all, rank_, [&](int p) { return slot(p) + sizeof(descriptor); });
  }

  // 2. Data: by the caller's own means (NCCL), or by the TCP algorithms.
  if (call.data_phase) {
    auto share = [&](std::vector<uint8_t>& bytes) -> caf::error {
      return transport::broadcast(ctx_, {reinterpret_cast<std::byte*>(bytes.data()), bytes.size()},
                                  0, options());
    };
    auto result = call.data_phase(share, remaining(until), call.all_flags);
    if (!result)
      return wrap(result.error(), call.what);
    return result;
  }
  std::vector<tensor> out;
  out.reserve(call.leaves.size());
  switch (call.kind) {
  case collective_kind::all_reduce: {
    auto wire_op = call.op == reduce_op::mean ? reduce_op::sum : call.op;
    double total = 0;
    for (const auto& d : all)
      total += d.count;
    call.total_count = total;
    for (auto& leaf : call.leaves) {
      tensor t;
      if (call.leaves_are_inputs && leaf.num_elements() > 0) {
        // The caller's tensor: read in place, the result in a tensor of its own.
        t = tensor::empty(leaf.dtype(), leaf.shape());
        auto err = transport::all_reduce(ctx_, leaf.raw_data(), t.raw_mutable_data(),
                                         static_cast<size_t>(leaf.num_elements()), leaf.dtype(),
                                         wire_op, options());
        if (err)
          return wrap(err, call.what);
      } else if (leaf.num_elements() > 0) {
        t = std::move(leaf); // the partial is ours alone: written in place, no copy
        auto err =
            transport::all_reduce(ctx_, t.raw_mutable_data(), static_cast<size_t>(t.num_elements()),
                                  t.dtype(), wire_op, options());
        if (err)
          return wrap(err, call.what);
      } else {
        t = std::move(leaf);
        (void)take_tag(l); // keeps the tag sequence equal on every worker
      }
      if (call.op == reduce_op::mean && !call.defer_mean)
        t = reduce_elementwise(reduce_op::mean, {t}, total);
      out.push_back(std::move(t));
    }
    break;
  }
  case collective_kind::all_gather: {
    // Every worker's extent along the axis, for every leaf.
    auto n = call.leaves.size();
    std::vector<int64_t> extents(n * static_cast<size_t>(size_));
    auto* mine_at = extents.data() + static_cast<size_t>(rank_) * n;
    for (size_t i = 0; i < n; ++i)
      mine_at[i] = call.leaves[i].shape()[static_cast<size_t>(call.axis)];
    // Bytes per unit of the axis, leaf by leaf (the other extents agree on every worker).
    std::vector<size_t> units(n);
    for (size_t i = 0; i < n; ++i) {
      const auto& shape = call.leaves[i].shape();
      int64_t inner = 1;
      for (size_t d = 0; d < shape.size(); ++d)
        if (d != static_cast<size_t>(call.axis))
          inner *= shape[d];
      units[i] = static_cast<size_t>(inner) * size_of(call.leaves[i].dtype());
    }
    // With up to 8 workers every worker's extents came with its descriptor, and, when every
    // worker's part was small, its data too: the gather is then complete already.
    bool all_fused = gather_extents;
    if (gather_extents) {
      for (int p = 0; p < size_; ++p) {
        if (p == rank_)
          continue;
        const auto at = static_cast<size_t>(p);
        if (got[at] < sizeof(descriptor) + n * 8)
          return make_caf_error(errc::collective_mismatch, call.what + ": " + worker_name(p) +
                                                               " sent " + std::to_string(got[at]) +
                                                               " bytes with its descriptor, " +
                                                               "fewer than its extents take");
        std::memcpy(extents.data() + at * n, slot(p) + sizeof(descriptor), n * 8);
        size_t expect = sizeof(descriptor) + n * 8;
        if (all[at].fused)
          for (size_t i = 0; i < n; ++i)
            expect += static_cast<size_t>(extents[at * n + i]) * units[i];
        if (got[at] != expect || extents_invalid(extents.data() + at * n, n))
          return make_caf_error(errc::collective_mismatch,
                                call.what + ": " + worker_name(p) + " sent " +
                                    std::to_string(got[at]) + " bytes with its descriptor where " +
                                    "its extents announce " + std::to_string(expect));
        all_fused = all_fused && all[at].fused;
      }
      all_fused = all_fused && mine.fused;
    } else {
      auto* base = reinterpret_cast<std::byte*>(extents.data());
      transport::ring_all_gather gather(
          ctx_, {base + static_cast<size_t>(rank_) * n * 8, n * 8}, {base, extents.size() * 8},
          std::vector<size_t>(static_cast<size_t>(size_), n * 8), options());
      if (auto err = gather.run())
        return wrap(err, call.what);
    }
    // Where worker p's part of leaf i starts in its message (all_fused only).
    std::vector<size_t> data_at(static_cast<size_t>(size_), sizeof(descriptor) + n * 8);
    for (size_t i = 0; i < n; ++i) {
      const auto& leaf = call.leaves[i];
      auto shape = leaf.shape();
      auto axis = static_cast<size_t>(call.axis);
      auto unit = units[i];
      std::vector<size_t> sizes(static_cast<size_t>(size_));
      int64_t total = 0;
      for (int w = 0; w < size_; ++w) {
        auto e = extents[static_cast<size_t>(w) * n + i];
        sizes[static_cast<size_t>(w)] = static_cast<size_t>(e) * unit;
        total += e;
      }
      // Along axis 0 the blocks of the workers are the result's bytes in order; along another
      // axis they are gathered into a byte buffer and then interleaved by concat.
      tensor gathered;
      if (axis == 0) {
        auto gathered_shape = shape;
        gathered_shape[0] = total;
        gathered = tensor::empty(leaf.dtype(), gathered_shape);
      } else {
        gathered = tensor::empty(dtype::uint8, {total * static_cast<int64_t>(unit)});
      }
      if (all_fused) {
        auto* into = static_cast<std::byte*>(gathered.raw_mutable_data());
        for (int w = 0; w < size_; ++w) {
          const auto at = static_cast<size_t>(w);
          const auto* from =
              w == rank_ ? static_cast<const std::byte*>(leaf.raw_data()) : slot(w) + data_at[at];
          if (sizes[at] > 0)
            std::memcpy(into, from, sizes[at]);
          into += sizes[at];
          data_at[at] += sizes[at];
        }
      } else {
        transport::ring_all_gather gather(ctx_, bytes_of(leaf), mutable_bytes_of(gathered), sizes,
                                          options());
        if (auto err = gather.run())
          return wrap(err, call.what);
      }
      if (axis == 0) {
        out.push_back(std::move(gathered));
        continue;
      }
      std::vector<tensor> blocks;
      size_t offset = 0;
      for (int w = 0; w < size_; ++w) {
        auto block_shape = shape;
        block_shape[axis] = extents[static_cast<size_t>(w) * n + i];
        auto block = tensor::empty(leaf.dtype(), block_shape);
        auto bytes = sizes[static_cast<size_t>(w)];
        if (bytes > 0)
          std::memcpy(block.raw_mutable_data(),
                      static_cast<const std::byte*>(gathered.raw_data()) + offset, bytes);
        offset += bytes;
        blocks.push_back(std::move(block));
      }
      out.push_back(concat(blocks, call.axis));
    }
    break;
  }
  case collective_kind::broadcast: {
    auto root_worker = call.root / devices_per_worker_;
    if (size_ <= direct_max_workers && all[static_cast<size_t>(root_worker)].fused) {
      // A small broadcast: the root's data came with its descriptor, so the call took one round.
      if (rank_ != root_worker) {
        const auto sent = got[static_cast<size_t>(root_worker)];
        if (sent != sizeof(descriptor) + data_bytes)
          return make_caf_error(errc::collective_mismatch,
                                "collective mismatch between workers at " + call.what + ": " +
                                    worker_name(root_worker) + " (the root) sent " +
                                    std::to_string(sent - sizeof(descriptor)) +
                                    " bytes of data where this worker " + "expects " +
                                    std::to_string(data_bytes));
        const std::byte* from = slot(root_worker) + sizeof(descriptor);
        for (auto& leaf : call.leaves) {
          auto t = std::move(leaf);
          if (t.num_bytes() > 0)
            std::memcpy(t.raw_mutable_data(), from, t.num_bytes());
          from += t.num_bytes();
          out.push_back(std::move(t));
        }
      } else {
        for (auto& leaf : call.leaves)
          out.push_back(std::move(leaf));
      }
      break;
    }
    for (auto& leaf : call.leaves) {
      auto t = std::move(leaf);
      if (t.num_bytes() > 0) {
        // The root only reads its bytes; the others receive into their own fresh tensor.
        transport::mutable_bytes data =
            rank_ == root_worker
                ? transport::mutable_bytes{const_cast<std::byte*>(
                                               static_cast<const std::byte*>(t.raw_data())),
                                           t.num_bytes()}
                : mutable_bytes_of(t);
        if (auto err = transport::broadcast(ctx_, data, root_worker, options()))
          return wrap(err, call.what);
      } else {
        (void)take_tag(l);
      }
      out.push_back(std::move(t));
    }
    break;
  }
  }
  return out;
}

} // namespace consort::detail
