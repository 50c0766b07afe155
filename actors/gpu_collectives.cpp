#include "actors/gpu_collectives.hpp"

#include <consort/config.hpp>
#include <consort/error.hpp>
#include <consort/ops.hpp>

#include "device/gpu.hpp"

#if CONSORT_WITH_CUDA
#include "device/cuda/nccl.hpp"
#include "device/cuda/runtime.hpp"
#endif

#include <algorithm>
#include <set>

namespace consort::detail {

#if CONSORT_WITH_CUDA

struct local_nccl::impl {
  std::vector<int> devices;
  std::vector<cuda::nccl::communicator> comms;
  std::vector<cuda::stream> streams;

  /// The outputs of a failed call with the streams NCCL wrote them on. An aborted or timed-out
  /// operation may still be running there: releasing its buffers at once would let the caching
  /// allocator hand them to another tensor (their release is ordered on this thread's stream, not
  /// NCCL's) while NCCL still writes into them. They are released once those streams are idle.
  struct quarantined {
    std::vector<cuda::stream> streams;
    std::vector<std::vector<tensor>> buffers;
  };
  std::vector<quarantined> quarantine;

  static bool idle(const cuda::stream& s) noexcept {
    const auto status = cudaStreamQuery(s.get());
    if (status != cudaSuccess)
      (void)cudaGetLastError(); // cudaErrorNotReady (or the stream's failure) is not reported here
    // A failed stream will run nothing more, so its buffers are free as well.
    return status != cudaErrorNotReady;
  }

  /// Releases the quarantined buffers whose streams have finished.
  void reap() noexcept {
    std::erase_if(quarantine, [](const quarantined& q) {
      return std::all_of(q.streams.begin(), q.streams.end(), idle);
    });
  }

  ~impl() {
    reap();
    // Still running at shutdown (stuck on an aborted peer): leak the buffers rather than let the
    // allocator reuse memory that the GPU may still write.
    for (auto& q : quarantine)
      new quarantined(std::move(q)); // NOLINT(cppcoreguidelines-owning-memory): deliberate leak
  }

  /// Aborts the communicators after a failed call and keeps its outputs until NCCL's streams are
  /// idle; the next call builds new communicators.
  void discard(std::vector<std::vector<tensor>>& outputs) noexcept {
    for (auto& c : comms)
      c.abort(); // also those a non-NCCL failure left with work queued inside the group
    try {
      quarantine.push_back({std::move(streams), std::move(outputs)});
    } catch (...) {
      // Out of host memory: the outputs and streams go out of scope below.
    }
    comms.clear();
    streams.clear();
    devices.clear();
  }

  /// The communicators for `wanted`, made (or remade after an abort) when needed.
  bool usable(const std::vector<int>& wanted) const {
    bool ok = wanted == devices && comms.size() == wanted.size();
    for (const auto& c : comms)
      ok = ok && c.valid() && !c.aborted();
    return ok;
  }

  void ensure(const std::vector<int>& wanted, std::chrono::milliseconds timeout,
              const group_spec& spec) {
    if (usable(wanted) && !spec.rebuild)
      return;
    comms.clear();
    streams.clear();
    devices.clear();
    cuda::nccl::unique_id id;
    const int nranks = spec.nranks > 0 ? spec.nranks : static_cast<int>(wanted.size());
    if (spec.share) {
      // Worker 0 (whose first replica is rank 0) makes the id; every worker gets its bytes.
      std::vector<uint8_t> bytes(cuda::nccl::unique_id::byte_count, 0);
      if (spec.first_rank == 0)
        bytes = cuda::nccl::unique_id::make().to_bytes();
      spec.share(bytes);
      id = cuda::nccl::unique_id::from_bytes(bytes);
    } else {
      id = cuda::nccl::unique_id::make();
    }
    auto made = cuda::nccl::init_group(id, nranks, spec.first_rank, wanted, timeout);
    std::vector<cuda::stream> fresh;
    for (int d : wanted)
      fresh.emplace_back(d);
    comms = std::move(made);
    streams = std::move(fresh);
    devices = wanted;
  }
};

local_nccl::local_nccl() : impl_(std::make_unique<impl>()) {}

local_nccl::~local_nccl() = default;

bool local_nccl::needs_build(const std::vector<int>& devices) const {
  return !impl_->usable(devices);
}

bool local_nccl::eligible(collective_kind kind, reduce_op op, int64_t axis,
                          const std::vector<std::vector<tensor>>& leaves, bool across_workers) {
  if (leaves.empty() || leaves.front().empty())
    return false;
  if (across_workers && kind == collective_kind::all_gather)
    return false;
  std::set<std::string> seen;
  for (const auto& replica : leaves) {
    const auto& device = replica.front().device();
    if (!seen.insert(device).second)
      return false;
    for (const auto& t : replica) {
      if (!t.on_gpu() || t.device() != device || t.dtype() == dtype::boolean)
        return false;
      if (kind == collective_kind::all_reduce && op == reduce_op::mean && !is_floating(t.dtype()))
        return false;
    }
  }
  return kind != collective_kind::all_gather || axis == 0;
}

std::vector<std::vector<tensor>> local_nccl::run(collective_kind kind, reduce_op op, int root,
                                                 const std::vector<std::vector<tensor>>& leaves,
                                                 std::chrono::milliseconds timeout,
                                                 const std::string& what, const group_spec& spec) {
  const size_t n = leaves.size();
  const size_t count = leaves.front().size();
  std::vector<int> devices;
  for (const auto& replica : leaves)
    devices.push_back(gpu::index_of(replica.front().device()));
  auto& im = *impl_;
  im.reap();
  im.ensure(devices, timeout, spec);
  // Outputs first (allocation may fail cleanly before NCCL sees anything).
  std::vector<std::vector<tensor>> out(n);
  for (size_t r = 0; r < n; ++r) {
    for (size_t i = 0; i < count; ++i) {
      const auto& in = leaves[r][i];
      auto shape = in.shape();
      if (kind == collective_kind::all_gather) {
        int64_t total = 0;
        for (size_t q = 0; q < n; ++q)
          total += leaves[q][i].shape().front();
        shape.front() = total;
      }
      out[r].push_back(tensor::empty(in.dtype(), shape, in.device()));
    }
  }
  try {
    cuda::nccl::group group;
    for (size_t i = 0; i < count; ++i) {
      std::vector<size_t> counts;
      if (kind == collective_kind::all_gather)
        for (size_t q = 0; q < n; ++q)
          counts.push_back(static_cast<size_t>(leaves[q][i].num_elements()));
      for (size_t r = 0; r < n; ++r) {
        const auto& in = leaves[r][i];
        auto& comm = im.comms[r];
        auto s = im.streams[r].get();
        void* dst = out[r][i].raw_mutable_data();
        const auto elements = static_cast<size_t>(in.num_elements());
        switch (kind) {
        case collective_kind::all_reduce:
          comm.all_reduce(in.raw_data(), dst, elements, in.dtype(), op, s);
          break;
        case collective_kind::all_gather:
          comm.all_gather_ragged(in.raw_data(), counts, dst, in.dtype(), s);
          break;
        case collective_kind::broadcast:
          comm.broadcast(in.raw_data(), dst, elements, in.dtype(), root, s);
          break;
        }
      }
    }
    group.end();
    std::vector<std::pair<cuda::nccl::communicator*, cudaStream_t>> work;
    for (size_t r = 0; r < n; ++r)
      work.emplace_back(&im.comms[r], im.streams[r].get());
    cuda::nccl::wait(work, timeout, what);
  } catch (const error& e) {
    // Aborted communicators are rebuilt by the next call; say which call failed.
    im.discard(out);
    throw_error(e.code(), what + " on NCCL: " + e.what());
  } catch (...) {
    im.discard(out);
    throw;
  }
  return out;
}

#else // !CONSORT_WITH_CUDA

struct local_nccl::impl {};

local_nccl::local_nccl() = default;

local_nccl::~local_nccl() = default;

bool local_nccl::needs_build(const std::vector<int>&) const {
  return true;
}

bool local_nccl::eligible(collective_kind, reduce_op, int64_t,
                          const std::vector<std::vector<tensor>>&, bool) {
  return false;
}

std::vector<std::vector<tensor>> local_nccl::run(collective_kind, reduce_op, int,
                                                 const std::vector<std::vector<tensor>>&,
                                                 std::chrono::milliseconds, const std::string& what,
                                                 const group_spec&) {
  throw_error(errc::unsupported, what + ": this build of consort has no NCCL");
}

#endif

} // namespace consort::detail
