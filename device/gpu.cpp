#include "device/gpu.hpp"

#include <consort/config.hpp>
#include <consort/device.hpp>
#include <consort/error.hpp>
#include <consort/ops.hpp>

#if CONSORT_WITH_CUDA
#include "device/cuda/kernels.hpp"
#include "device/cuda/runtime.hpp"

#include "core/report.hpp"
#endif

#include <atomic>
#include <charconv>
#include <chrono>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace consort::detail::gpu {

int index_of(const std::string& device) noexcept {
  // Canonical spelling only ("GPU:3"): every caller holds a device string that parse_device has
  // already checked, so this is a prefix test and a number, never a second parse.
  if (device.size() <= 4 || device.compare(0, 4, "GPU:") != 0)
    return -1;
  int index = -1;
  auto [end, ec] = std::from_chars(device.data() + 4, device.data() + device.size(), index);
  return ec == std::errc{} && end == device.data() + device.size() ? index : -1;
}

#if CONSORT_WITH_CUDA

namespace {

/// The stream of the replica bound to this thread, or null (CUDA's per-thread default stream).
thread_local cudaStream_t bound_stream = nullptr;
/// The GPU of `bound_stream` (-1 when none is bound).
thread_local int bound_device = -1;
/// The bound replica's fence (see replica_binding::fence), or null.
thread_local const std::function<void()>* bound_fence = nullptr;

/// Every replica stream alive in the process, with its GPU. Leaked on purpose: tensors may be
/// released during static destruction.
struct stream_registry {
  std::mutex mutex;
  std::vector<std::pair<int, cudaStream_t>> streams;
};

stream_registry& registry() noexcept {
  static auto* r = new stream_registry; // NOLINT(cppcoreguidelines-owning-memory)
  return *r;
}

/// Makes `s`, a stream of GPU `index`, wait for the work queued so far on every other replica
/// stream of that GPU. A block of device memory may be in use on any of them (an NCCL call that
/// another thread queued on a replica's stream, a result shared by replicas of one GPU, a tensor
/// that a replica handed to the collective actor), whichever thread drops its last reference: its
/// release is ordered on `s`, so it is reused only after all of them have passed this point. With
/// one replica per GPU released on its own thread there is nothing to wait for.
/// Returns false when CUDA refused to order it (the block must then not be reused).
/// @pre the caller holds device_guard(index) when `s` is cudaStreamPerThread.
bool order_after_replicas(int index, cudaStream_t s) noexcept {
  auto& reg = registry();
  std::lock_guard lock(reg.mutex);
  bool ordered = true;
  for (const auto& [device, other] : reg.streams) {
    if (device != index || other == s)
      continue;
    cudaEvent_t e = nullptr;
    if (cudaEventCreateWithFlags(&e, cudaEventDisableTiming) != cudaSuccess) {
      (void)cudaGetLastError();
      ordered = false;
      continue;
    }
    // The wait takes the event's state now, so the event may be destroyed at once.
    if (cudaEventRecord(e, other) != cudaSuccess || cudaStreamWaitEvent(s, e, 0) != cudaSuccess) {
      (void)cudaGetLastError();
      ordered = false;
    }
    (void)cudaEventDestroy(e);
  }
  return ordered;
}

/// How long an unordered release waits for the replicas' streams to go idle.
constexpr auto release_wait = std::chrono::seconds(10);

/// Whether every registered replica stream of GPU `index` is idle (its work done, successfully)
/// within `timeout`. Never throws.
bool replicas_idle_within(int index, std::chrono::milliseconds timeout) noexcept {
  std::vector<cudaStream_t> streams;
  try {
    auto& reg = registry();
    std::lock_guard lock(reg.mutex);
    for (const auto& [device, stream] : reg.streams)
      if (device == index)
        streams.push_back(stream);
    cuda::device_guard guard(index);
    for (auto stream : streams)
      cuda::synchronize_for(stream, index, timeout, "releasing GPU memory");
    return true;
  } catch (...) {
    (void)cudaGetLastError();
    return false;
  }
}

/// Runs the bound replica's fence before this thread waits for its stream.
void fence_bound() {
  if (bound_fence != nullptr && *bound_fence)
    (*bound_fence)();
}

cudaStream_t stream_now() noexcept {
  return bound_stream != nullptr ? bound_stream : cudaStreamPerThread;
}

/// True when work on GPU `index` from this thread goes on the replica's bound stream.
bool on_bound(int index) noexcept {
  return bound_stream != nullptr && bound_device == index;
}

/// The stream for a kernel, memset or release on GPU `index`: the replica's stream when this
/// thread is bound to that GPU, else CUDA's per-thread default stream, which the caller's
/// device_guard(index) resolves to `index`'s. (A replica's stream belongs to its own GPU: a kernel
/// queued on it would run there, not on `index`, and an event of `index` cannot be recorded on
/// it.)
cudaStream_t stream_for(int index) noexcept {
  return on_bound(index) ? bound_stream : cudaStreamPerThread;
}

constexpr auto host_wait = std::chrono::seconds(60);

/// The device of the calling thread (for messages), or -1.
int current_device() noexcept {
  int device = -1;
  return cudaGetDevice(&device) == cudaSuccess ? device : -1;
}

void wait_stream(cudaStream_t stream, std::chrono::milliseconds timeout, const std::string& what) {
  cuda::synchronize_for(stream, current_device(), timeout, what);
}

/// Work queued on stream_for(index) off a replica's own stream is finished before a call returns:
/// its results may be read by any thread (or stream) next. On a replica thread, work on its own
/// GPU stays ordered on the replica's stream. @pre the caller holds device_guard(index).
void settle(int index, const char* what) {
  if (on_bound(index))
    return;
  wait_stream(cudaStreamPerThread, host_wait, what);
}

} // namespace

bool built() noexcept {
  return true;
}

int count() noexcept {
  return cuda::device_count();
}

std::string unavailable_reason() {
  return cuda::unavailable_reason();
}

void require(int index) {
  cuda::require_device(index);
}

replica_binding::replica_binding(int index) : device_(index) {
  cuda::require_device(index);
  cuda::check(cudaSetDevice(index), "cudaSetDevice", index);
  cudaStream_t s = nullptr;
  cuda::check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags",
              index);
  try {
    auto& reg = registry();
    std::lock_guard lock(reg.mutex);
    reg.streams.emplace_back(index, s);
  } catch (...) {
    cudaStreamDestroy(s);
    throw;
  }
  // The last owner (this binding, or a thread still holding the replica's queue) unregisters
  // the stream and destroys it; destroying a stream with queued work is allowed (CUDA releases
  // it when the work is done).
  owner_ = std::shared_ptr<void>(s, [index](void* p) {
    auto stream = static_cast<cudaStream_t>(p);
    {
      auto& reg = registry();
      std::lock_guard lock(reg.mutex);
      std::erase(reg.streams, std::pair<int, cudaStream_t>{index, stream});
    }
    cudaStreamDestroy(stream);
  });
  stream_ = s;
  bound_stream = s;
  bound_device = index;
}

replica_binding::~replica_binding() {
  if (bound_stream == static_cast<cudaStream_t>(stream_)) {
    bound_stream = nullptr;
    bound_device = -1;
    bound_fence = nullptr;
  }
}

void replica_binding::fence(std::function<void()> before_wait) {
  fence_ = std::move(before_wait);
  if (bound_stream == static_cast<cudaStream_t>(stream_))
    bound_fence = &fence_;
}

void replica_binding::synchronize(std::chrono::milliseconds timeout,
                                  const std::string& what) const {
  if (fence_)
    fence_();
  try {
    wait_stream(static_cast<cudaStream_t>(stream_), timeout, what);
  } catch (const error& e) {
    if (e.code() == errc::collective_timeout)
      throw_error(errc::step_timeout, e.what());
    throw;
  }
}

void* current_stream() noexcept {
  return stream_now();
}

void* allocate(int index, size_t bytes, bool zeroed) {
  require(index);
  // At least one byte, so that a tensor's data pointer is never null.
  void* p = cuda::allocate(index, bytes > 0 ? bytes : 1);
  if (zeroed && bytes > 0) {
    try {
      cuda::device_guard guard(index);
      cuda::check(cudaMemsetAsync(p, 0, bytes, stream_for(index)), "cudaMemsetAsync", index);
      settle(index, "zero-filling a GPU tensor");
    } catch (...) {
      cuda::release(index, p, bytes > 0 ? bytes : 1, stream_for(index));
      throw;
    }
  }
  return p;
}

void release(int index, void* pointer, size_t bytes) noexcept {
  static std::atomic<bool> unordered_reported{false};
  static std::atomic<bool> leak_reported{false};
  const auto s = stream_for(index);
  bool ordered = false;
  try {
    cuda::device_guard guard(index);
    ordered = order_after_replicas(index, s);
    if (!ordered)
      detail::report_once(unordered_reported,
                          "releasing a GPU block: CUDA could not order the release after the "
                          "replicas' streams; waiting for them instead",
                          cudaGetErrorString(cudaPeekAtLastError()));
  } catch (...) {
    detail::report_once(unordered_reported,
                        "releasing a GPU block: the release could not be ordered after the "
                        "replicas' streams; waiting for them instead");
  }
  // Unordered, the block may be reused only once every stream that may still use it is idle;
  // a stream still busy after release_wait keeps the block (leaked, and said so) rather than
  // hand memory it may still write to another tensor.
  if (!ordered && !replicas_idle_within(index, release_wait)) {
    detail::report_once(leak_reported,
                        "releasing a GPU block: a replica's stream was still busy or failed after "
                        "10 s; the block is leaked rather than reused while in use");
    return;
  }
  cuda::release(index, pointer, bytes > 0 ? bytes : 1, s);
}

void synchronize_stream(void* stream, int device, std::chrono::milliseconds timeout,
                        const std::string& what) {
  cuda::synchronize_for(static_cast<cudaStream_t>(stream), device, timeout, what);
}

void copy(void* dst, int dst_device, const void* src, int src_device, size_t bytes) {
  if (bytes == 0)
    return;
  // The copy waits for the stream: what other threads queued on it must not have failed.
  if (bound_stream != nullptr)
    fence_bound();
  cuda::copy(dst, dst_device, src, src_device, bytes, stream_now(), host_wait);
}

tensor reduce_elementwise(reduce_op op, const std::vector<tensor>& inputs, double mean_divisor) {
  const auto& first = inputs.front();
  const int index = index_of(first.device());
  auto out = tensor::empty(reduced_dtype(op, first.dtype()), first.shape(), first.device());
  const int64_t n = first.num_elements();
  if (n == 0)
    return out;
  std::vector<const void*> pointers;
  pointers.reserve(inputs.size());
  for (const auto& t : inputs)
    pointers.push_back(t.raw_data());
  cuda::device_guard guard(index);
  cuda::reduce_elementwise(first.dtype(), op, pointers.data(), static_cast<int>(pointers.size()),
                           out.raw_mutable_data(), n, mean_divisor, stream_for(index));
  settle(index, "an element-wise reduction on a GPU");
  return out;
}

tensor reduce_axis(reduce_op op, const tensor& input, int64_t axis, bool divide) {
  const auto& shape = input.shape();
  const int index = index_of(input.device());
  shape_t out_shape;
  int64_t outer = 1, inner = 1;
  const int64_t k = shape[static_cast<size_t>(axis)];
  for (size_t d = 0; d < shape.size(); ++d) {
    if (static_cast<int64_t>(d) == axis)
      continue;
    out_shape.push_back(shape[d]);
    (static_cast<int64_t>(d) < axis ? outer : inner) *= shape[d];
  }
  const auto out_type = reduced_dtype(op, input.dtype());
  auto out = tensor::empty(out_type, out_shape, input.device());
  if (out.num_elements() == 0)
    return out;
  cuda::device_guard guard(index);
  if (k == 0) {
    // SUM of nothing is 0, PROD 1, MEAN 0/0 (NaN) or 0 when the caller divides later; MIN and MAX
    // were rejected by the caller.
    double value = op == reduce_op::prod             ? 1.0
                   : op == reduce_op::mean && divide ? std::numeric_limits<double>::quiet_NaN()
                                                     : 0.0;
    cuda::fill(out_type, out.raw_mutable_data(), out.num_elements(), value, stream_for(index));
  } else {
    cuda::reduce_axis(input.dtype(), op, input.raw_data(), out.raw_mutable_data(), outer, k, inner,
                      op == reduce_op::mean && divide ? static_cast<double>(k) : 0.0,
                      stream_for(index));
  }
  settle(index, "a reduction along an axis on a GPU");
  return out;
}

tensor concat(const std::vector<tensor>& inputs, int64_t axis, const shape_t& out_shape) {
  const auto& first = inputs.front();
  const int index = index_of(first.device());
  auto out = tensor::empty(first.dtype(), out_shape, first.device());
  if (out.num_bytes() == 0)
    return out;
  int64_t outer = 1;
  size_t inner_bytes = size_of(first.dtype());
  for (size_t d = 0; d < out_shape.size(); ++d) {
    if (static_cast<int64_t>(d) < axis)
      outer *= out_shape[d];
    else if (static_cast<int64_t>(d) > axis)
      inner_bytes *= static_cast<size_t>(out_shape[d]);
  }
  std::vector<const void*> pointers;
  std::vector<size_t> row_bytes;
  for (const auto& t : inputs) {
    pointers.push_back(t.raw_data());
    row_bytes.push_back(static_cast<size_t>(t.shape()[static_cast<size_t>(axis)]) * inner_bytes);
  }
  cuda::device_guard guard(index);
  cuda::concat(pointers.data(), row_bytes.data(), static_cast<int>(pointers.size()),
               out.raw_mutable_data(), outer, stream_for(index));
  settle(index, "a concatenation on a GPU");
  return out;
}

void divide(tensor& t, double divisor) {
  if (t.num_elements() == 0)
    return;
  const int index = index_of(t.device());
  void* p = t.raw_mutable_data();
  cuda::device_guard guard(index);
  cuda::divide(t.dtype(), p, t.num_elements(), divisor, stream_for(index));
  settle(index, "a division on a GPU");
}

namespace {

/// `b` on `a`'s GPU (a copy, waited for, when it is elsewhere).
tensor beside(const tensor& a, const tensor& b) {
  return b.device() == a.device() ? b : b.to(a.device());
}

} // namespace

tensor scaled_sum(const tensor& a, double alpha, const tensor& b_in, double beta) {
  const tensor b = beside(a, b_in);
  auto out = tensor::empty(a.dtype(), a.shape(), a.device());
  if (out.num_elements() == 0)
    return out;
  const int index = index_of(a.device());
  cuda::device_guard guard(index);
  cuda::scaled_sum(a.dtype(), alpha, a.raw_data(), beta, b.raw_data(), out.raw_mutable_data(),
                   a.num_elements(), stream_for(index));
  settle(index, "a scaled sum on a GPU");
  return out;
}

void add_scaled_in_place(tensor& a, const tensor& b_in, double beta) {
  if (a.num_elements() == 0)
    return;
  const tensor b = beside(a, b_in);
  const int index = index_of(a.device());
  void* p = a.raw_mutable_data();
  cuda::device_guard guard(index);
  cuda::scaled_sum(a.dtype(), 1.0, p, beta, b.raw_data(), p, a.num_elements(), stream_for(index));
  settle(index, "an in-place update on a GPU");
}

void add_scaled_in_place_many(const std::vector<tensor*>& a, const std::vector<tensor>& b_in,
                              double beta) {
  if (a.empty())
    return;
  const tensor& first = *a.front();
  const int index = index_of(first.device());
  std::vector<tensor> b;
  std::vector<const void*> pb;
  std::vector<void*> pa;
  std::vector<int64_t> n;
  b.reserve(a.size());
  pb.reserve(a.size());
  pa.reserve(a.size());
  n.reserve(a.size());
  for (size_t i = 0; i < a.size(); ++i) {
    b.push_back(beside(*a[i], b_in[i]));
    n.push_back(a[i]->num_elements());
    pa.push_back(n.back() > 0 ? a[i]->raw_mutable_data() : nullptr);
    pb.push_back(b.back().raw_data());
  }
  cuda::device_guard guard(index);
  cuda::scaled_sum_many(first.dtype(), 1.0, pa.data(), beta, pb.data(), pa.data(), n.data(),
                        static_cast<int>(a.size()), stream_for(index));
  settle(index, "an in-place update on a GPU");
}

#else // !CONSORT_WITH_CUDA

namespace {

[[noreturn]] void no_cuda(const std::string& what) {
  throw_error(errc::unsupported, what + ": this build of consort has no CUDA support (configure "
                                        "with CONSORT_WITH_CUDA=ON and a CUDA toolkit with NCCL)");
}

} // namespace

bool built() noexcept {
  return false;
}

int count() noexcept {
  return 0;
}

std::string unavailable_reason() {
  return "this build of consort has no CUDA support";
}

void require(int index) {
  no_cuda("GPU:" + std::to_string(index));
}

replica_binding::replica_binding(int index) : device_(index) {
  no_cuda("binding a replica to GPU:" + std::to_string(index));
}

replica_binding::~replica_binding() = default;

void replica_binding::fence(std::function<void()> before_wait) {
  fence_ = std::move(before_wait);
}

void replica_binding::synchronize(std::chrono::milliseconds, const std::string&) const {}

void synchronize_stream(void*, int device, std::chrono::milliseconds, const std::string& what) {
  no_cuda(what + " on GPU:" + std::to_string(device));
}

void* current_stream() noexcept {
  return nullptr;
}

void* allocate(int index, size_t, bool) {
  no_cuda("allocating on GPU:" + std::to_string(index));
}

void release(int, void*, size_t) noexcept {}

void copy(void*, int, const void*, int, size_t) {
  no_cuda("copying to or from a GPU");
}

tensor reduce_elementwise(reduce_op, const std::vector<tensor>&, double) {
  no_cuda("a reduction on a GPU");
}

tensor reduce_axis(reduce_op, const tensor&, int64_t, bool) {
  no_cuda("a reduction on a GPU");
}

tensor concat(const std::vector<tensor>&, int64_t, const shape_t&) {
  no_cuda("a concatenation on a GPU");
}

void divide(tensor&, double) {
  no_cuda("a division on a GPU");
}

tensor scaled_sum(const tensor&, double, const tensor&, double) {
  no_cuda("a scaled sum on a GPU");
}

void add_scaled_in_place(tensor&, const tensor&, double) {
  no_cuda("an in-place update on a GPU");
}

void add_scaled_in_place_many(const std::vector<tensor*>&, const std::vector<tensor>&, double) {
  no_cuda("an in-place update on a GPU");
}

#endif

} // namespace consort::detail::gpu
