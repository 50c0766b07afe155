// NCCL communicators (device/cuda/nccl.hpp). Uses the CUDA runtime API and NCCL directly, nothing
// else of the CUDA layer, so that it links on its own.

#include "device/cuda/nccl.hpp"

#include "core/report.hpp"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>

namespace consort::cuda::nccl {

namespace {

using clock = std::chrono::steady_clock;

std::string ms_text(std::chrono::milliseconds ms) {
  return std::to_string(ms.count()) + " ms";
}

/// The pause between two polls: the thread yields for the first few (a collective that is about
/// to finish is seen within microseconds), then sleeps 16 us, doubling up to 1 ms, so that a
/// long wait costs almost no CPU.
class backoff {
public:
  void pause() {
    if (yields_ < 64) {
      ++yields_;
      std::this_thread::yield();
      return;
    }
    std::this_thread::sleep_for(sleep_);
    sleep_ = std::min(sleep_ * 2, std::chrono::microseconds{1000});
  }

private:
  int yields_ = 0;
  std::chrono::microseconds sleep_{16};
};

/// The ncclCommAbort calls in flight, each on a helper thread of its own: NCCL's abort returns
/// only once the GPU work queued before the communicator's operations is done, and a deadline
/// must not wait for a stream that a stuck kernel (or a peer that never comes) holds. Never
/// destroyed (a helper may outlive main); at exit the process waits for them, bounded.
class aborter {
public:
  static aborter& get() {
    static aborter* the = [] {
      auto* a = new aborter; // NOLINT(cppcoreguidelines-owning-memory): lives for the process
      std::atexit([] { (void)get().wait_idle(std::chrono::seconds(5)); });
      return a;
    }();
    return *the;
  }

  void start(ncclComm_t comm) noexcept {
    {
      std::lock_guard<std::mutex> guard{mu_};
      ++running_;
    }
    try {
      std::thread([this, comm] { finish(comm); }).detach();
    } catch (...) { // no thread to be had: abort here, waiting as NCCL does
      static std::atomic<bool> reported{false};
      detail::report_once(reported, "aborting an NCCL communicator: no helper thread could be "
                                    "started; the abort runs on the calling thread");
      finish(comm);
    }
  }

  bool wait_idle(std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lock{mu_};
    return cv_.wait_for(lock, timeout, [this] { return running_ == 0; });
  }

private:
  void finish(ncclComm_t comm) noexcept {
    (void)ncclCommAbort(comm);
    std::lock_guard<std::mutex> guard{mu_};
    --running_;
    cv_.notify_all();
  }

  std::mutex mu_;
  std::condition_variable cv_;
  int running_ = 0; // guarded by mu_
};

/// How many GPUs this process sees, and CUDA's reason when it sees none.
struct gpu_census {
  int count = 0;
  std::string reason;
};

gpu_census visible_gpus() {
  int count = 0;
  auto status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess) {
    (void)cudaGetLastError(); // not sticky, but keep the per-thread last error clean
    return {0, std::string{cudaGetErrorString(status)} + " (" + cudaGetErrorName(status) + ")"};
  }
  if (count == 0)
    return {0, "no CUDA device is visible"};
  return {count, {}};
}

[[noreturn]] void throw_cuda(cudaError_t status, const std::string& call, int device) {
  std::string where = device >= 0 ? " on GPU:" + std::to_string(device) : std::string{};
  throw_error(errc::device_error, call + where + " failed: " + cudaGetErrorString(status) + " (" +
                                      cudaGetErrorName(status) + ")");
}

/// NCCL's text for `result`, with ncclGetLastError's detail when there is one.
std::string nccl_text(ncclResult_t result, ncclComm_t comm) {
  std::string text = std::string{ncclGetErrorString(result)} + " [" + to_string(result) + "]";
  const char* last = ncclGetLastError(comm);
  if (last != nullptr && *last != '\0')
    text += "; NCCL: " + std::string{last};
  return text;
}

/// The state NCCL reports for `comm`: ncclSuccess, ncclInProgress or the error.
ncclResult_t async_state(ncclComm_t comm) noexcept {
  ncclResult_t state = ncclSuccess;
  auto result = ncclCommGetAsyncError(comm, &state);
  return result != ncclSuccess ? result : state;
}

/// "ranks 0, 1 (GPU:0, GPU:1)"-style list of the communicators in `members`.
std::string describe_all(const std::vector<communicator*>& members) {
  std::string out;
  for (auto* m : members) {
    if (m == nullptr)
      continue;
    if (!out.empty())
      out += ", ";
    out += m->describe();
  }
  return out;
}

const char* const abort_advice = "; the communicators were aborted (build new ones with "
                                 "init_group and a new unique id)";

} // namespace

// -- type and op mapping -------------------------------------------------------------------------

ncclDataType_t to_nccl(dtype t) {
  switch (t) {
  case dtype::float32:
    return ncclFloat32;
  case dtype::float64:
    return ncclFloat64;
  case dtype::int32:
    return ncclInt32;
  case dtype::int64:
    return ncclInt64;
  case dtype::uint8:
    return ncclUint8;
  case dtype::float16:
    return ncclFloat16;
  case dtype::bfloat16:
    return ncclBfloat16;
  case dtype::boolean:
    break;
  }
  throw_error(errc::dtype_mismatch, std::string{"NCCL has no type for "} + consort::to_string(t) +
                                        " tensors; expected float32, float64, float16, bfloat16, "
                                        "int32, int64 or uint8 (cast bool to uint8 first)");
}

ncclRedOp_t to_nccl(reduce_op op, dtype t) {
  (void)to_nccl(t); // rejects bool
  switch (op) {
  case reduce_op::sum:
    return ncclSum;
  case reduce_op::prod:
    return ncclProd;
  case reduce_op::min:
    return ncclMin;
  case reduce_op::max:
    return ncclMax;
  case reduce_op::mean:
    if (is_floating(t))
      return ncclAvg;
    throw_error(errc::dtype_mismatch,
                std::string{"MEAN of "} + consort::to_string(t) +
                    " tensors is not done by NCCL (ncclAvg would divide integers with its own "
                    "rounding); expected float32, float64, float16 or bfloat16, or all-reduce with "
                    "SUM and divide "
                    "as the runtime does for integer means");
  }
  throw_error(errc::unknown_reduce_op, "unknown reduce op " + std::to_string(static_cast<int>(op)) +
                                           "; expected SUM, MEAN, MIN, MAX or PROD");
}

size_t size_of(ncclDataType_t t) noexcept {
  switch (t) {
  case ncclInt8:
  case ncclUint8:
  case ncclFloat8e4m3:
  case ncclFloat8e5m2:
    return 1;
  case ncclFloat16:
  case ncclBfloat16:
    return 2;
  case ncclInt32:
  case ncclUint32:
  case ncclFloat32:
    return 4;
  case ncclInt64:
  case ncclUint64:
  case ncclFloat64:
    return 8;
  default:
    return 0;
  }
}

const char* to_string(ncclDataType_t t) noexcept {
  switch (t) {
  case ncclInt8:
    return "int8";
  case ncclUint8:
    return "uint8";
  case ncclInt32:
    return "int32";
  case ncclUint32:
    return "uint32";
  case ncclInt64:
    return "int64";
  case ncclUint64:
    return "uint64";
  case ncclFloat16:
    return "half";
  case ncclFloat32:
    return "float";
  case ncclFloat64:
    return "double";
  case ncclBfloat16:
    return "bfloat16";
  case ncclFloat8e4m3:
    return "f8e4m3";
  case ncclFloat8e5m2:
    return "f8e5m2";
  default:
    return "unknown";
  }
}

const char* to_string(ncclRedOp_t op) noexcept {
  switch (op) {
  case ncclSum:
    return "sum";
  case ncclProd:
    return "prod";
  case ncclMax:
    return "max";
  case ncclMin:
    return "min";
  case ncclAvg:
    return "avg";
  default:
    return "user";
  }
}

const char* to_string(ncclResult_t r) noexcept {
  switch (r) {
  case ncclSuccess:
    return "ncclSuccess";
  case ncclUnhandledCudaError:
    return "ncclUnhandledCudaError";
  case ncclSystemError:
    return "ncclSystemError";
  case ncclInternalError:
    return "ncclInternalError";
  case ncclInvalidArgument:
    return "ncclInvalidArgument";
  case ncclInvalidUsage:
    return "ncclInvalidUsage";
  case ncclRemoteError:
    return "ncclRemoteError";
  case ncclInProgress:
    return "ncclInProgress";
  default:
    return "ncclResult(unknown)";
  }
}

errc error_code(ncclResult_t r) noexcept {
  return r == ncclRemoteError ? errc::peer_lost : errc::device_error;
}

// -- unique id -----------------------------------------------------------------------------------

unique_id unique_id::make() {
  ncclUniqueId raw;
  auto result = ncclGetUniqueId(&raw);
  if (result != ncclSuccess)
    throw_error(errc::device_error, "ncclGetUniqueId failed: " + nccl_text(result, nullptr));
  unique_id id;
  std::memcpy(id.bytes_.data(), raw.internal, byte_count);
  return id;
}

unique_id unique_id::from_bytes(std::span<const uint8_t> bytes) {
  if (bytes.size() != byte_count)
    throw_error(errc::invalid_argument, "an NCCL unique id is " + std::to_string(byte_count) +
                                            " bytes, got " + std::to_string(bytes.size()) +
                                            " bytes");
  unique_id id;
  std::copy(bytes.begin(), bytes.end(), id.bytes_.begin());
  return id;
}

std::vector<uint8_t> unique_id::to_bytes() const {
  return {bytes_.begin(), bytes_.end()};
}

bool unique_id::empty() const noexcept {
  return std::all_of(bytes_.begin(), bytes_.end(), [](uint8_t b) { return b == 0; });
}

ncclUniqueId unique_id::get() const noexcept {
  ncclUniqueId raw;
  static_assert(sizeof(raw.internal) == byte_count);
  std::memcpy(raw.internal, bytes_.data(), byte_count);
  return raw;
}

// -- creation ------------------------------------------------------------------------------------

std::vector<communicator> init_group(const unique_id& id, int nranks, int first_rank,
                                     const std::vector<int>& devices,
                                     std::chrono::milliseconds timeout) {
  // Validate everything before NCCL or CUDA is touched, so that a bad call costs nothing and
  // leaves nothing behind.
  if (nranks < 1)
    throw_error(errc::invalid_argument,
                "nccl::init_group: nranks is " + std::to_string(nranks) + "; expected at least 1");
  if (devices.empty())
    throw_error(errc::invalid_argument,
                "nccl::init_group: no devices; expected at least one local GPU index");
  const auto local = static_cast<int64_t>(devices.size());
  if (first_rank < 0 || first_rank + local > nranks)
    throw_error(errc::invalid_argument,
                "nccl::init_group: the local ranks " + std::to_string(first_rank) + ".." +
                    std::to_string(first_rank + local - 1) + " (first_rank " +
                    std::to_string(first_rank) + ", " + std::to_string(local) +
                    " devices) are not all within 0.." + std::to_string(nranks - 1) + " of a " +
                    std::to_string(nranks) + "-rank communicator");
  for (size_t i = 0; i < devices.size(); ++i)
    for (size_t j = 0; j < i; ++j)
      if (devices[i] == devices[j])
        throw_error(errc::invalid_argument, "nccl::init_group: GPU:" + std::to_string(devices[i]) +
                                                " is listed twice in devices; NCCL needs one "
                                                "rank per GPU");
  if (id.empty())
    throw_error(errc::invalid_argument, "nccl::init_group: the unique id is all zero; expected "
                                        "one made by unique_id::make() on the chief");
  if (timeout.count() <= 0)
    throw_error(errc::invalid_argument, "nccl::init_group: timeout is " + ms_text(timeout) +
                                            "; expected a positive deadline");
  auto gpus = visible_gpus();
  for (int d : devices) {
    if (d < 0 || d >= gpus.count) {
      std::string seen = gpus.count == 0
                             ? "this process sees 0 GPUs (" + gpus.reason + ")"
                             : "this process sees " + std::to_string(gpus.count) +
                                   " GPU(s): GPU:0..GPU:" + std::to_string(gpus.count - 1);
      throw_error(errc::unknown_device,
                  "nccl::init_group: GPU:" + std::to_string(d) + " is not a device; " + seen);
    }
  }

  std::vector<ncclComm_t> comms(devices.size(), nullptr);
  // On helper threads, as communicator::abort: an init past its deadline returns at it.
  auto abort_all = [&comms]() noexcept {
    for (auto& c : comms)
      if (c != nullptr) {
        aborter::get().start(c);
        c = nullptr;
      }
  };
  const std::string expected = std::to_string(nranks) + " ranks were expected (this process " +
                               "holds ranks " + std::to_string(first_rank) + ".." +
                               std::to_string(first_rank + local - 1) + ")";

  // NCCL takes each rank's GPU from the current device; restore the caller's afterwards.
  int previous_device = -1;
  if (cudaGetDevice(&previous_device) != cudaSuccess)
    previous_device = -1;
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  std::vector<ncclConfig_t> configs(devices.size(), config);
  const ncclUniqueId raw_id = id.get();

  std::string failure;
  errc failure_code = errc::device_error;
  auto start_result = ncclGroupStart();
  if (start_result != ncclSuccess)
    throw_error(errc::device_error,
                "nccl::init_group: ncclGroupStart failed: " + nccl_text(start_result, nullptr));
  for (size_t i = 0; i < devices.size(); ++i) {
    const int rank = first_rank + static_cast<int>(i);
    auto set = cudaSetDevice(devices[i]);
    if (set != cudaSuccess) {
      failure = "cudaSetDevice on GPU:" + std::to_string(devices[i]) +
                " failed: " + cudaGetErrorString(set);
      break;
    }
    auto result = ncclCommInitRankConfig(&comms[i], nranks, raw_id, rank, &configs[i]);
    if (result != ncclSuccess && result != ncclInProgress) {
      failure = "ncclCommInitRankConfig for rank " + std::to_string(rank) + " of " +
                std::to_string(nranks) + " on GPU:" + std::to_string(devices[i]) +
                " failed: " + nccl_text(result, comms[i]);
      failure_code = error_code(result);
      break;
    }
  }
  // Always end the group, also after a failure: NCCL cleans up the group's state only there.
  auto end_result = ncclGroupEnd();
  if (previous_device >= 0)
    (void)cudaSetDevice(previous_device);
  if (failure.empty() && end_result != ncclSuccess && end_result != ncclInProgress) {
    failure = "ncclGroupEnd after ncclCommInitRankConfig failed: " + nccl_text(end_result, nullptr);
    failure_code = error_code(end_result);
  }
  if (!failure.empty()) {
    abort_all();
    throw_error(failure_code, "nccl::init_group: " + failure + "; " + expected + abort_advice);
  }

  // Every local rank now initialises in NCCL's background threads; poll until all have joined.
  const auto deadline = clock::now() + timeout;
  backoff pause;
  for (;;) {
    bool all_ready = true;
    for (size_t i = 0; i < comms.size(); ++i) {
      auto state = async_state(comms[i]);
      if (state == ncclInProgress) {
        all_ready = false;
      } else if (state != ncclSuccess) {
        auto text = "nccl::init_group: rank " + std::to_string(first_rank + i) + " of " +
                    std::to_string(nranks) + " on GPU:" + std::to_string(devices[i]) +
                    " failed to initialise: " + nccl_text(state, comms[i]) + "; " + expected;
        abort_all();
        throw_error(error_code(state), text + abort_advice);
      }
    }
    if (all_ready)
      break;
    if (clock::now() >= deadline) {
      abort_all();
      throw_error(errc::collective_timeout,
                  "nccl::init_group: the NCCL communicator was not complete within " +
                      ms_text(timeout) + ": " + expected +
                      " but some did not join (a peer process is missing, or it was given "
                      "another unique id or rank count)" +
                      abort_advice);
    }
    pause.pause();
  }

  std::vector<communicator> out;
  out.reserve(comms.size());
  for (size_t i = 0; i < comms.size(); ++i) {
    out.push_back(
        communicator{comms[i], first_rank + static_cast<int>(i), nranks, devices[i], timeout});
    comms[i] = nullptr; // owned by out[i] now
  }
  return out;
}

// -- completion ----------------------------------------------------------------------------------

void wait(const std::vector<std::pair<communicator*, cudaStream_t>>& work,
          std::chrono::milliseconds timeout, const std::string& what) {
  std::vector<communicator*> members;
  for (const auto& [c, s] : work) {
    if (c == nullptr)
      continue;
    c->require_usable(what.c_str());
    if (std::find(members.begin(), members.end(), c) == members.end())
      members.push_back(c);
  }
  auto fail = [&members](errc code, const std::string& text) {
    for (auto* m : members) {
      m->failed_ = true;
      m->abort();
    }
    throw_error(code, text + (members.empty() ? std::string{} : std::string{abort_advice}));
  };
  // Asks NCCL about every communicator; on an error aborts them all and throws.
  auto check_async = [&]() {
    for (auto* m : members) {
      auto state = async_state(m->comm_);
      if (state != ncclSuccess && state != ncclInProgress)
        fail(error_code(state),
             what + " failed on " + m->describe() + ": " + nccl_text(state, m->comm_));
    }
  };

  const auto deadline = clock::now() + timeout;
  std::vector<bool> done(work.size(), false);
  size_t remaining = work.size();
  backoff pause;
  for (;;) {
    check_async();
    for (size_t i = 0; i < work.size(); ++i) {
      if (done[i])
        continue;
      auto status = cudaStreamQuery(work[i].second);
      if (status == cudaSuccess) {
        done[i] = true;
        --remaining;
      } else if (status != cudaErrorNotReady) {
        (void)cudaGetLastError();
        auto* c = work[i].first;
        fail(errc::device_error,
             what + ": the CUDA stream" + (c ? " of " + c->describe() : std::string{}) +
                 " failed: " + cudaGetErrorString(status) + " (" + cudaGetErrorName(status) + ")");
      }
    }
    if (remaining == 0) {
      // A last look: an error NCCL raised while the final kernels drained is still an error.
      check_async();
      return;
    }
    if (clock::now() >= deadline) {
      std::string busy;
      for (size_t i = 0; i < work.size(); ++i) {
        if (done[i])
          continue;
        if (!busy.empty())
          busy += ", ";
        busy += work[i].first ? work[i].first->describe() : "stream " + std::to_string(i);
      }
      fail(errc::collective_timeout, what + " did not complete within " + ms_text(timeout) +
                                         ": still running on " + busy +
                                         " (a peer is missing, slow or stuck)");
    }
    pause.pause();
  }
}

// -- communicator --------------------------------------------------------------------------------

communicator::~communicator() {
  if (comm_ == nullptr || aborted_)
    return;
  // A communicator with an error (seen by us, or pending in NCCL) cannot be destroyed cleanly:
  // ncclCommDestroy would refuse it and leak it. Abort it instead.
  if (failed_ || async_state(comm_) != ncclSuccess)
    aborter::get().start(comm_);
  else
    (void)ncclCommDestroy(comm_); // waits for this rank's queued operations (even non-blocking)
  comm_ = nullptr;
}

communicator::communicator(communicator&& other) noexcept
    : comm_(std::exchange(other.comm_, nullptr)), rank_(other.rank_), size_(other.size_),
      device_(other.device_), timeout_(other.timeout_), aborted_(other.aborted_),
      failed_(other.failed_) {}

communicator& communicator::operator=(communicator&& other) noexcept {
  if (this != &other) {
    communicator old{std::move(*this)}; // releases our communicator at the end of the scope
    comm_ = std::exchange(other.comm_, nullptr);
    rank_ = other.rank_;
    size_ = other.size_;
    device_ = other.device_;
    timeout_ = other.timeout_;
    aborted_ = other.aborted_;
    failed_ = other.failed_;
  }
  return *this;
}

std::string communicator::describe() const {
  return "rank " + std::to_string(rank_) + " of " + std::to_string(size_) +
         " on GPU:" + std::to_string(device_);
}

void communicator::require_usable(const char* call) const {
  if (aborted_)
    throw_error(errc::collective_aborted,
                std::string{call} + " on " + describe() +
                    ": the communicator was aborted (after a timeout, a peer failure or an "
                    "explicit abort) and can never be used again; build a new one with "
                    "init_group and a new unique id");
  if (comm_ == nullptr)
    throw_error(errc::invalid_argument, std::string{call} +
                                            ": the communicator is empty (default-constructed "
                                            "or moved from); expected one from init_group");
}

bool communicator::join_group() {
  auto* open = group::current();
  if (open == nullptr)
    return false;
  open->join(this);
  return true;
}

std::string communicator::failure_text(const char* call, ncclResult_t result) const {
  return std::string{call} + " on " + describe() + " failed: " + nccl_text(result, comm_);
}

void communicator::after_call(ncclResult_t result, const char* call, bool in_group) {
  if (result == ncclSuccess)
    return;
  if (result == ncclInProgress) {
    // NCCL is still connecting to peers or launching in its background thread. Inside a group
    // the group's end() settles every member; outside, wait here (within timeout()) so that the
    // next call does not find the communicator busy.
    if (!in_group)
      settle(call);
    return;
  }
  // A failed call leaves a non-blocking communicator in an error state (NCCL records the error
  // as its asynchronous state), so it is dead either way. Inside a group, the group's end()
  // aborts it after ncclGroupEnd; aborting in the middle of an open group is not allowed.
  auto text = failure_text(call, result);
  failed_ = true;
  if (!in_group) {
    abort();
    text += abort_advice;
  }
  throw_error(error_code(result), text);
}

void communicator::settle(const char* call) {
  const auto deadline = clock::now() + timeout_;
  backoff pause;
  for (;;) {
    auto state = async_state(comm_);
    if (state == ncclSuccess)
      return;
    if (state != ncclInProgress) {
      auto text = failure_text(call, state);
      failed_ = true;
      abort();
      throw_error(error_code(state), text + abort_advice);
    }
    if (clock::now() >= deadline) {
      failed_ = true;
      abort();
      throw_error(errc::collective_timeout,
                  std::string{call} + " on " + describe() + " was not accepted by NCCL within " +
                      ms_text(timeout_) + " (it was still connecting to its peers)" + abort_advice);
    }
    pause.pause();
  }
}

namespace {

void require_buffer(const void* pointer, size_t count, const char* call, const char* name) {
  if (pointer == nullptr && count > 0)
    throw_error(errc::invalid_argument, std::string{call} + ": " + name + " is null for " +
                                            std::to_string(count) +
                                            " elements; expected a device pointer");
}

void require_type(ncclDataType_t t, const char* call) {
  if (size_of(t) == 0)
    throw_error(errc::dtype_mismatch, std::string{call} + ": " +
                                          std::to_string(static_cast<int>(t)) +
                                          " is not an NCCL data type");
}

void require_rank(int rank, int size, const char* call, const char* name) {
  if (rank < 0 || rank >= size)
    throw_error(errc::invalid_argument, std::string{call} + ": " + name + " " +
                                            std::to_string(rank) + " is not a rank of a " +
                                            std::to_string(size) + "-rank communicator");
}

} // namespace

void communicator::all_reduce(const void* send, void* recv, size_t count, dtype t, reduce_op op,
                              cudaStream_t stream) {
  require_usable("ncclAllReduce");
  auto nop = to_nccl(op, t);
  all_reduce(send, recv, count, to_nccl(t), nop, stream);
}

void communicator::all_reduce(const void* send, void* recv, size_t count, ncclDataType_t t,
                              ncclRedOp_t op, cudaStream_t stream) {
  const char* call = "ncclAllReduce";
  require_usable(call);
  require_type(t, call);
  require_buffer(send, count, call, "send");
  require_buffer(recv, count, call, "recv");
  bool in_group = join_group();
  after_call(ncclAllReduce(send, recv, count, t, op, comm_, stream), call, in_group);
}

void communicator::all_gather(const void* send, void* recv, size_t send_count, dtype t,
                              cudaStream_t stream) {
  require_usable("ncclAllGather");
  all_gather(send, recv, send_count, to_nccl(t), stream);
}

void communicator::all_gather(const void* send, void* recv, size_t send_count, ncclDataType_t t,
                              cudaStream_t stream) {
  const char* call = "ncclAllGather";
  require_usable(call);
  require_type(t, call);
  require_buffer(send, send_count, call, "send");
  require_buffer(recv, send_count, call, "recv");
  bool in_group = join_group();
  after_call(ncclAllGather(send, recv, send_count, t, comm_, stream), call, in_group);
}

void communicator::broadcast(const void* send, void* recv, size_t count, dtype t, int root,
                             cudaStream_t stream) {
  require_usable("ncclBroadcast");
  broadcast(send, recv, count, to_nccl(t), root, stream);
}

void communicator::broadcast(const void* send, void* recv, size_t count, ncclDataType_t t, int root,
                             cudaStream_t stream) {
  const char* call = "ncclBroadcast";
  require_usable(call);
  require_type(t, call);
  require_rank(root, size_, call, "root");
  if (rank_ == root)
    require_buffer(send, count, call, "send");
  require_buffer(recv, count, call, "recv");
  bool in_group = join_group();
  after_call(ncclBroadcast(send, recv, count, t, root, comm_, stream), call, in_group);
}

void communicator::reduce(const void* send, void* recv, size_t count, dtype t, reduce_op op,
                          int root, cudaStream_t stream) {
  require_usable("ncclReduce");
  auto nop = to_nccl(op, t);
  reduce(send, recv, count, to_nccl(t), nop, root, stream);
}

void communicator::reduce(const void* send, void* recv, size_t count, ncclDataType_t t,
                          ncclRedOp_t op, int root, cudaStream_t stream) {
  const char* call = "ncclReduce";
  require_usable(call);
  require_type(t, call);
  require_rank(root, size_, call, "root");
  require_buffer(send, count, call, "send");
  if (rank_ == root)
    require_buffer(recv, count, call, "recv");
  bool in_group = join_group();
  after_call(ncclReduce(send, recv, count, t, op, root, comm_, stream), call, in_group);
}

void communicator::send(const void* buffer, size_t count, dtype t, int peer, cudaStream_t stream) {
  require_usable("ncclSend");
  send(buffer, count, to_nccl(t), peer, stream);
}

void communicator::send(const void* buffer, size_t count, ncclDataType_t t, int peer,
                        cudaStream_t stream) {
  const char* call = "ncclSend";
  require_usable(call);
  require_type(t, call);
  require_rank(peer, size_, call, "peer");
  require_buffer(buffer, count, call, "buffer");
  bool in_group = join_group();
  after_call(ncclSend(buffer, count, t, peer, comm_, stream), call, in_group);
}

void communicator::recv(void* buffer, size_t count, dtype t, int peer, cudaStream_t stream) {
  require_usable("ncclRecv");
  recv(buffer, count, to_nccl(t), peer, stream);
}

void communicator::recv(void* buffer, size_t count, ncclDataType_t t, int peer,
                        cudaStream_t stream) {
  const char* call = "ncclRecv";
  require_usable(call);
  require_type(t, call);
  require_rank(peer, size_, call, "peer");
  require_buffer(buffer, count, call, "buffer");
  bool in_group = join_group();
  after_call(ncclRecv(buffer, count, t, peer, comm_, stream), call, in_group);
}

void communicator::all_gather_ragged(const void* send, const std::vector<size_t>& counts,
                                     void* recv, dtype t, cudaStream_t stream) {
  require_usable("all_gather_ragged");
  all_gather_ragged(send, counts, recv, to_nccl(t), stream);
}

void communicator::all_gather_ragged(const void* send, const std::vector<size_t>& counts,
                                     void* recv, ncclDataType_t t, cudaStream_t stream) {
  const char* call = "all_gather_ragged";
  require_usable(call);
  require_type(t, call);
  if (counts.size() != static_cast<size_t>(size_))
    throw_error(errc::invalid_argument,
                std::string{call} + " on " + describe() + ": " + std::to_string(counts.size()) +
                    " counts; expected one per rank (" + std::to_string(size_) + ")");
  const size_t element = size_of(t);
  size_t total = 0;
  std::vector<size_t> offsets(counts.size());
  for (size_t r = 0; r < counts.size(); ++r) {
    offsets[r] = total;
    total += counts[r];
  }
  const auto own = static_cast<size_t>(rank_);
  require_buffer(send, counts[own], call, "send");
  require_buffer(recv, total, call, "recv");

  // Our own part: a device-to-device copy on the stream, unless it is already in place.
  auto* base = static_cast<char*>(recv);
  if (counts[own] > 0 && base + offsets[own] * element != send) {
    int previous = -1;
    if (cudaGetDevice(&previous) != cudaSuccess)
      previous = -1;
    auto status = cudaSetDevice(device_);
    if (status == cudaSuccess)
      status = cudaMemcpyAsync(base + offsets[own] * element, send, counts[own] * element,
                               cudaMemcpyDeviceToDevice, stream);
    if (previous >= 0 && previous != device_)
      (void)cudaSetDevice(previous);
    if (status != cudaSuccess) {
      (void)cudaGetLastError();
      throw_cuda(status, std::string{call} + ": cudaMemcpyAsync of the own part", device_);
    }
  }
  if (size_ == 1)
    return;
  // The peers' parts: one send and one receive per peer, fused in one NCCL group so that they
  // progress together (each rank sends to and receives from every other at once). Nested in the
  // caller's group when there is one, so that several local ranks can call this in one group.
  group exchange;
  for (int peer = 0; peer < size_; ++peer) {
    if (peer == rank_)
      continue;
    // `send` and `recv` name the buffers here, hence this->.
    if (counts[own] > 0)
      this->send(send, counts[own], t, peer, stream);
    const auto p = static_cast<size_t>(peer);
    if (counts[p] > 0)
      this->recv(base + offsets[p] * element, counts[p], t, peer, stream);
  }
  exchange.end();
}

void communicator::wait(cudaStream_t stream, std::chrono::milliseconds timeout,
                        const std::string& what) {
  nccl::wait({{this, stream}}, timeout, what);
}

void communicator::check() {
  require_usable("check");
  auto state = async_state(comm_);
  if (state == ncclSuccess || state == ncclInProgress)
    return;
  auto text = failure_text("ncclCommGetAsyncError", state);
  failed_ = true;
  abort();
  throw_error(error_code(state), text + abort_advice);
}

void communicator::abort() noexcept {
  if (comm_ != nullptr && !aborted_)
    // On a helper thread: ncclCommAbort blocks even for a non-blocking communicator. NCCL sets
    // the abort flag (a running kernel of this communicator exits), then reclaims the
    // communicator, which waits for the work queued before its operations on the streams it was
    // used on; a kernel that never ends would keep the caller here, past its deadline (as the
    // first H100 run saw; docs/gpu.md). Nothing uses the handle after this.
    aborter::get().start(comm_);
  comm_ = nullptr;
  aborted_ = true;
}

bool wait_for_aborts(std::chrono::milliseconds timeout) {
  return aborter::get().wait_idle(timeout);
}

// -- group ---------------------------------------------------------------------------------------

group*& group::current() noexcept {
  static thread_local group* innermost = nullptr;
  return innermost;
}

group::group() {
  auto result = ncclGroupStart();
  if (result != ncclSuccess)
    throw_error(errc::device_error, "ncclGroupStart failed: " + nccl_text(result, nullptr));
  outer_ = current();
  current() = this;
}

group::~group() {
  if (ended_)
    return;
  try {
    end();
  } catch (...) { // NOLINT(bugprone-empty-catch): end() aborted the members; nothing else to do
  }
}

void group::join(communicator* member) {
  if (std::find(members_.begin(), members_.end(), member) == members_.end())
    members_.push_back(member);
}

void group::end() {
  if (ended_)
    return;
  ended_ = true;
  current() = outer_;
  auto result = ncclGroupEnd();
  if (outer_ != nullptr) {
    // A nested group: NCCL launches (and reports errors) at the outermost ncclGroupEnd, which
    // must settle our members too.
    for (auto* m : members_)
      outer_->join(m);
    return;
  }
  auto fail = [this](errc code, const std::string& text) {
    for (auto* m : members_) {
      m->failed_ = true;
      m->abort();
    }
    throw_error(code, text + abort_advice);
  };
  const bool member_failed =
      std::any_of(members_.begin(), members_.end(), [](communicator* m) { return m->failed_; });
  if (result != ncclSuccess && result != ncclInProgress)
    fail(error_code(result),
         "ncclGroupEnd for " + describe_all(members_) + " failed: " + nccl_text(result, nullptr));
  if (member_failed)
    fail(errc::device_error, "an operation of the NCCL group of " + describe_all(members_) +
                                 " failed when it was issued");

  // Non-blocking communicators may still be launching in NCCL's background thread: poll each
  // until it reports ncclSuccess, within the largest timeout among them.
  std::chrono::milliseconds timeout{0};
  for (auto* m : members_)
    timeout = std::max(timeout, m->timeout_);
  const auto deadline = clock::now() + timeout;
  backoff pause;
  for (;;) {
    std::vector<communicator*> pending;
    for (auto* m : members_) {
      auto state = async_state(m->comm_);
      if (state == ncclInProgress)
        pending.push_back(m);
      else if (state != ncclSuccess)
        fail(error_code(state),
             "the NCCL group failed on " + m->describe() + ": " + nccl_text(state, m->comm_));
    }
    if (pending.empty())
      return;
    if (clock::now() >= deadline)
      fail(errc::collective_timeout, "the NCCL group of " + describe_all(members_) +
                                         " was not launched within " + ms_text(timeout) +
                                         ": still connecting on " + describe_all(pending));
    pause.pause();
  }
}

} // namespace consort::cuda::nccl
