// Tests of the NCCL communicator layer (device/cuda/nccl.hpp).
//
// Without a GPU: the unique id's bytes, init_group's argument checks (before any CUDA or NCCL
// call), the dtype/op mapping and the empty communicator run and must pass; every test that
// needs a GPU skips with cudaGetDeviceCount's reason.
//
// With a GPU (the GPU machines have one, so one rank per process): every collective of a 1-rank
// communicator for every dtype and op, checked element by element against a sentinel-filled
// output (so a call that does nothing fails); a 2-rank init whose second rank never comes, which
// must fail with collective_timeout within its deadline and leave a fresh communicator working;
// aborted communicators; a wait whose stream never finishes.

#include "device/cuda/nccl.hpp"

#include <consort/error.hpp>

#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace {

/// A door a host function waits at: opened by the test, or given up on after a deadline.
class gate {
public:
  void open() {
    std::lock_guard lock{mu_};
    open_ = true;
    cv_.notify_all();
  }
  void wait_for(std::chrono::milliseconds limit) {
    std::unique_lock lock{mu_};
    cv_.wait_for(lock, limit, [this] { return open_; });
  }

private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = false;
};

namespace nccl = consort::cuda::nccl;
using consort::dtype;
using consort::errc;
using consort::reduce_op;
using namespace std::chrono_literals;

/// Why this process cannot run GPU tests (cudaGetDeviceCount's error), or "" when it can.
std::string gpu_unavailable() {
  int count = 0;
  auto status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess) {
    (void)cudaGetLastError();
    return std::string{"no GPU: cudaGetDeviceCount failed: "} + cudaGetErrorString(status) + " (" +
           cudaGetErrorName(status) + ")";
  }
  if (count == 0)
    return "no GPU: cudaGetDeviceCount found 0 devices";
  return {};
}

int visible_gpu_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return count;
}

/// Runs `f`, expects it to throw consort::error with `expected`, returns the message.
template <class F>
std::string error_message(errc expected, F&& f) {
  try {
    f();
  } catch (const consort::error& e) {
    EXPECT_EQ(e.code(), expected) << "got " << consort::to_string(e.code()) << ": " << e.what();
    return e.what();
  }
  ADD_FAILURE() << "expected error(" << consort::to_string(expected) << "), nothing was thrown";
  return {};
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

nccl::unique_id patterned_id() {
  std::vector<uint8_t> bytes(nccl::unique_id::byte_count);
  for (size_t i = 0; i < bytes.size(); ++i)
    bytes[i] = static_cast<uint8_t>(i * 7 + 3);
  return nccl::unique_id::from_bytes(bytes);
}

// -- without a GPU -------------------------------------------------------------------------------

TEST(UniqueIdTest, RoundTripsThroughBytes) {
  auto id = patterned_id();
  auto bytes = id.to_bytes();
  ASSERT_EQ(bytes.size(), 128u);
  for (size_t i = 0; i < bytes.size(); ++i)
    EXPECT_EQ(bytes[i], static_cast<uint8_t>(i * 7 + 3)) << "byte " << i;
  auto again = nccl::unique_id::from_bytes(bytes);
  EXPECT_EQ(again, id);
  EXPECT_FALSE(again.empty());
  auto raw = again.get();
  EXPECT_EQ(static_cast<uint8_t>(raw.internal[0]), 3);
  EXPECT_EQ(static_cast<uint8_t>(raw.internal[127]), static_cast<uint8_t>(127 * 7 + 3));
}

TEST(UniqueIdTest, FromBytesRejectsAWrongLength) {
  for (size_t size : {size_t{0}, size_t{127}, size_t{129}}) {
    std::vector<uint8_t> bytes(size, 1);
    auto what = error_message(errc::invalid_argument, [&] { nccl::unique_id::from_bytes(bytes); });
    EXPECT_TRUE(contains(what, "128 bytes")) << what;
    EXPECT_TRUE(contains(what, "got " + std::to_string(size))) << what;
  }
}

TEST(UniqueIdTest, DefaultIsEmptyAndDiffersFromAMadeOne) {
  nccl::unique_id id;
  EXPECT_TRUE(id.empty());
  EXPECT_NE(id, patterned_id());
}

TEST(InitGroupTest, RejectsADeviceBeyondTheCountWithUnknownDevice) {
  const int count = visible_gpu_count();
  auto what = error_message(errc::unknown_device,
                            [&] { nccl::init_group(patterned_id(), 1, 0, {count}, 1s); });
  EXPECT_TRUE(contains(what, "GPU:" + std::to_string(count))) << what;
  EXPECT_TRUE(contains(what, "sees " + std::to_string(count) + " GPU")) << what;
}

TEST(InitGroupTest, RejectsBadArgumentsBeforeTouchingCudaOrNccl) {
  auto id = patterned_id();
  auto what = error_message(errc::invalid_argument, [&] { nccl::init_group(id, 0, 0, {0}, 1s); });
  EXPECT_TRUE(contains(what, "nranks is 0")) << what;
  what = error_message(errc::invalid_argument, [&] { nccl::init_group(id, 2, 0, {}, 1s); });
  EXPECT_TRUE(contains(what, "no devices")) << what;
  what = error_message(errc::invalid_argument, [&] { nccl::init_group(id, 2, -1, {0}, 1s); });
  EXPECT_TRUE(contains(what, "not all within 0..1")) << what;
  what = error_message(errc::invalid_argument, [&] { nccl::init_group(id, 2, 1, {0, 1}, 1s); });
  EXPECT_TRUE(contains(what, "local ranks 1..2")) << what;
  what = error_message(errc::invalid_argument, [&] { nccl::init_group(id, 2, 0, {0, 0}, 1s); });
  EXPECT_TRUE(contains(what, "GPU:0 is listed twice")) << what;
  what = error_message(errc::invalid_argument,
                       [&] { nccl::init_group(nccl::unique_id{}, 1, 0, {0}, 1s); });
  EXPECT_TRUE(contains(what, "all zero")) << what;
  what = error_message(errc::invalid_argument, [&] { nccl::init_group(id, 1, 0, {0}, 0ms); });
  EXPECT_TRUE(contains(what, "timeout is 0 ms")) << what;
}

TEST(NcclTypeMappingTest, MapsEveryDtype) {
  EXPECT_EQ(nccl::to_nccl(dtype::float32), ncclFloat32);
  EXPECT_EQ(nccl::to_nccl(dtype::float64), ncclFloat64);
  EXPECT_EQ(nccl::to_nccl(dtype::int32), ncclInt32);
  EXPECT_EQ(nccl::to_nccl(dtype::int64), ncclInt64);
  EXPECT_EQ(nccl::to_nccl(dtype::uint8), ncclUint8);
  for (auto t : {dtype::float32, dtype::float64, dtype::int32, dtype::int64, dtype::uint8})
    EXPECT_EQ(nccl::size_of(nccl::to_nccl(t)), consort::size_of(t)) << consort::to_string(t);
}

TEST(NcclTypeMappingTest, MapsFloat16AndBfloat16WithMeanAsAvg) {
  EXPECT_EQ(nccl::to_nccl(dtype::float16), ncclFloat16);
  EXPECT_EQ(nccl::to_nccl(dtype::bfloat16), ncclBfloat16);
  for (auto t : {dtype::float16, dtype::bfloat16}) {
    EXPECT_EQ(nccl::size_of(nccl::to_nccl(t)), 2u);
    EXPECT_EQ(nccl::to_nccl(reduce_op::mean, t), ncclAvg);
    EXPECT_EQ(nccl::to_nccl(reduce_op::sum, t), ncclSum);
  }
}

TEST(NcclTypeMappingTest, RejectsBoolWithDtypeMismatch) {
  auto what = error_message(errc::dtype_mismatch, [] { nccl::to_nccl(dtype::boolean); });
  EXPECT_TRUE(contains(what, "bool")) << what;
  what = error_message(errc::dtype_mismatch, [] { nccl::to_nccl(reduce_op::sum, dtype::boolean); });
  EXPECT_TRUE(contains(what, "bool")) << what;
}

TEST(NcclTypeMappingTest, MapsEveryReduceOpAndMeanOnlyForFloatingTypes) {
  for (auto t : {dtype::float32, dtype::float64, dtype::int32, dtype::int64, dtype::uint8}) {
    SCOPED_TRACE(consort::to_string(t));
    EXPECT_EQ(nccl::to_nccl(reduce_op::sum, t), ncclSum);
    EXPECT_EQ(nccl::to_nccl(reduce_op::prod, t), ncclProd);
    EXPECT_EQ(nccl::to_nccl(reduce_op::min, t), ncclMin);
    EXPECT_EQ(nccl::to_nccl(reduce_op::max, t), ncclMax);
    if (consort::is_floating(t)) {
      EXPECT_EQ(nccl::to_nccl(reduce_op::mean, t), ncclAvg);
    } else {
      auto what = error_message(errc::dtype_mismatch, [&] { nccl::to_nccl(reduce_op::mean, t); });
      EXPECT_TRUE(contains(what, std::string{"MEAN of "} + consort::to_string(t))) << what;
      EXPECT_TRUE(contains(what, "SUM")) << what;
    }
  }
}

TEST(NcclTypeMappingTest, NamesSizesAndErrorCodesFollowNcclTests) {
  EXPECT_STREQ(nccl::to_string(ncclFloat32), "float");
  EXPECT_STREQ(nccl::to_string(ncclBfloat16), "bfloat16");
  EXPECT_EQ(nccl::size_of(ncclBfloat16), 2u);
  EXPECT_EQ(nccl::size_of(ncclFloat16), 2u);
  EXPECT_EQ(nccl::size_of(ncclNumTypes), 0u);
  EXPECT_STREQ(nccl::to_string(ncclAvg), "avg");
  EXPECT_STREQ(nccl::to_string(ncclRemoteError), "ncclRemoteError");
  EXPECT_EQ(nccl::error_code(ncclRemoteError), errc::peer_lost);
  EXPECT_EQ(nccl::error_code(ncclSystemError), errc::device_error);
  EXPECT_EQ(nccl::error_code(ncclInternalError), errc::device_error);
}

TEST(EmptyCommunicatorTest, RefusesEveryOperationWithInvalidArgument) {
  nccl::communicator comm;
  EXPECT_FALSE(comm.valid());
  EXPECT_FALSE(comm.aborted());
  float x = 0;
  auto what = error_message(errc::invalid_argument, [&] {
    comm.all_reduce(&x, &x, 1, dtype::float32, reduce_op::sum, nullptr);
  });
  EXPECT_TRUE(contains(what, "empty")) << what;
  error_message(errc::invalid_argument,
                [&] { comm.all_gather(&x, &x, 1, dtype::float32, nullptr); });
  error_message(errc::invalid_argument,
                [&] { comm.all_gather_ragged(&x, {1}, &x, dtype::float32, nullptr); });
  error_message(errc::invalid_argument, [&] { comm.wait(nullptr, 1s, "nothing"); });
  nccl::communicator moved{std::move(comm)};
  EXPECT_FALSE(moved.valid());
}

// -- with a GPU ----------------------------------------------------------------------------------

/// Device memory for one test; freed with the test.
class device_buffer {
public:
  explicit device_buffer(size_t bytes) : bytes_(bytes) {
    if (bytes > 0 && cudaMalloc(&pointer_, bytes) != cudaSuccess)
      throw std::runtime_error("cudaMalloc of " + std::to_string(bytes) + " bytes failed");
  }
  ~device_buffer() {
    if (pointer_ != nullptr)
      (void)cudaFree(pointer_);
  }
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;

  void* get() const { return pointer_; }
  size_t bytes() const { return bytes_; }

private:
  void* pointer_ = nullptr;
  size_t bytes_ = 0;
};

/// GPU 0, a non-blocking stream on it, and helpers to move data; skips without a GPU.
class CommunicatorTest : public ::testing::Test {
protected:
  void SetUp() override {
    auto why = gpu_unavailable();
    if (!why.empty())
      GTEST_SKIP() << why;
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), cudaSuccess);
  }
  void TearDown() override {
    if (stream_ != nullptr) {
      sync();
      (void)cudaStreamDestroy(stream_);
    }
  }

  /// A fresh 1-rank communicator on GPU 0 with a new unique id.
  static nccl::communicator one_rank() {
    auto comms = nccl::init_group(nccl::unique_id::make(), 1, 0, {0}, 30s);
    EXPECT_EQ(comms.size(), 1u);
    return std::move(comms.at(0));
  }

  void sync() { nccl::wait({{nullptr, stream_}}, 30s, "the test's stream"); }

  template <class T>
  void upload(const device_buffer& buffer, const std::vector<T>& values) {
    ASSERT_LE(values.size() * sizeof(T), buffer.bytes());
    ASSERT_EQ(cudaMemcpyAsync(buffer.get(), values.data(), values.size() * sizeof(T),
                              cudaMemcpyHostToDevice, stream_),
              cudaSuccess);
    sync();
  }

  /// Fills `buffer` with 0xAB bytes, so that an output nobody wrote is seen.
  void poison(const device_buffer& buffer) {
    ASSERT_EQ(cudaMemsetAsync(buffer.get(), 0xAB, buffer.bytes(), stream_), cudaSuccess);
    sync();
  }

  template <class T>
  std::vector<T> download(const device_buffer& buffer, size_t count) {
    std::vector<T> values(count);
    EXPECT_EQ(cudaMemcpyAsync(values.data(), buffer.get(), count * sizeof(T),
                              cudaMemcpyDeviceToHost, stream_),
              cudaSuccess);
    sync();
    return values;
  }

  /// 1-rank all-reduce of every op on `T`: each is the identity, but goes through NCCL.
  template <class T>
  void check_all_reduce_identity(nccl::communicator& comm) {
    const auto t = consort::dtype_of<T>;
    SCOPED_TRACE(consort::to_string(t));
    const std::vector<T> input{T(1), T(2), T(3), T(4), T(5), T(6), T(7)};
    device_buffer send{input.size() * sizeof(T)};
    device_buffer recv{input.size() * sizeof(T)};
    upload(send, input);
    for (auto op :
         {reduce_op::sum, reduce_op::mean, reduce_op::min, reduce_op::max, reduce_op::prod}) {
      SCOPED_TRACE(consort::to_string(op));
      poison(recv);
      if (op == reduce_op::mean && !consort::is_floating(t)) {
        error_message(errc::dtype_mismatch, [&] {
          comm.all_reduce(send.get(), recv.get(), input.size(), t, op, stream_);
        });
        EXPECT_TRUE(comm.valid()) << "a refused call must leave the communicator usable";
        continue;
      }
      comm.all_reduce(send.get(), recv.get(), input.size(), t, op, stream_);
      comm.wait(stream_, 30s, "all_reduce");
      EXPECT_EQ(download<T>(recv, input.size()), input);
    }
  }

  cudaStream_t stream_ = nullptr;
};

TEST_F(CommunicatorTest, MakesDistinctNonEmptyUniqueIds) {
  auto a = nccl::unique_id::make();
  auto b = nccl::unique_id::make();
  EXPECT_FALSE(a.empty());
  EXPECT_NE(a, b);
  EXPECT_EQ(nccl::unique_id::from_bytes(a.to_bytes()), a);
}

TEST_F(CommunicatorTest, OneRankCommunicatorDescribesItself) {
  auto comm = one_rank();
  EXPECT_TRUE(comm.valid());
  EXPECT_EQ(comm.rank(), 0);
  EXPECT_EQ(comm.size(), 1);
  EXPECT_EQ(comm.device(), 0);
  EXPECT_NE(comm.get(), nullptr);
  EXPECT_EQ(comm.timeout(), 30s);
  EXPECT_EQ(comm.describe(), "rank 0 of 1 on GPU:0");
  int count = 0;
  ASSERT_EQ(ncclCommCount(comm.get(), &count), ncclSuccess);
  EXPECT_EQ(count, 1);
}

TEST_F(CommunicatorTest, AllReduceOfOneRankIsTheIdentityForEveryDtypeAndOp) {
  auto comm = one_rank();
  check_all_reduce_identity<float>(comm);
  check_all_reduce_identity<double>(comm);
  check_all_reduce_identity<int32_t>(comm);
  check_all_reduce_identity<int64_t>(comm);
  check_all_reduce_identity<uint8_t>(comm);
}

TEST_F(CommunicatorTest, AllReduceOfOneRankIsTheIdentityForFloat16AndBfloat16) {
  auto comm = one_rank();
  check_all_reduce_identity<consort::float16_t>(comm);
  check_all_reduce_identity<consort::bfloat16_t>(comm);
}

TEST_F(CommunicatorTest, AllGatherBroadcastAndReduceOfOneRankCopyTheInput) {
  auto comm = one_rank();
  const std::vector<int64_t> input{5, -4, 3, -2, 1};
  device_buffer send{input.size() * sizeof(int64_t)};
  device_buffer recv{input.size() * sizeof(int64_t)};
  upload(send, input);

  poison(recv);
  comm.all_gather(send.get(), recv.get(), input.size(), dtype::int64, stream_);
  comm.wait(stream_, 30s, "all_gather");
  EXPECT_EQ(download<int64_t>(recv, input.size()), input);

  poison(recv);
  comm.broadcast(send.get(), recv.get(), input.size(), dtype::int64, 0, stream_);
  comm.wait(stream_, 30s, "broadcast");
  EXPECT_EQ(download<int64_t>(recv, input.size()), input);

  poison(recv);
  comm.reduce(send.get(), recv.get(), input.size(), dtype::int64, reduce_op::max, 0, stream_);
  comm.wait(stream_, 30s, "reduce");
  EXPECT_EQ(download<int64_t>(recv, input.size()), input);

  auto what = error_message(errc::invalid_argument, [&] {
    comm.broadcast(send.get(), recv.get(), input.size(), dtype::int64, 1, stream_);
  });
  EXPECT_TRUE(contains(what, "root 1 is not a rank of a 1-rank communicator")) << what;
  EXPECT_TRUE(comm.valid());
}

TEST_F(CommunicatorTest, RaggedAllGatherToSelfCopiesTheInput) {
  auto comm = one_rank();
  const std::vector<float> input{1.5f, 2.5f, 3.5f};
  device_buffer send{input.size() * sizeof(float)};
  device_buffer recv{input.size() * sizeof(float)};
  upload(send, input);
  poison(recv);
  comm.all_gather_ragged(send.get(), {input.size()}, recv.get(), dtype::float32, stream_);
  comm.wait(stream_, 30s, "all_gather_ragged");
  EXPECT_EQ(download<float>(recv, input.size()), input);

  // In place (send is already our part of recv) and empty parts are fine too.
  comm.all_gather_ragged(recv.get(), {input.size()}, recv.get(), dtype::float32, stream_);
  comm.all_gather_ragged(nullptr, {0}, nullptr, dtype::float32, stream_);
  comm.wait(stream_, 30s, "all_gather_ragged");
  EXPECT_EQ(download<float>(recv, input.size()), input);

  auto what = error_message(errc::invalid_argument, [&] {
    comm.all_gather_ragged(send.get(), {1, 2}, recv.get(), dtype::float32, stream_);
  });
  EXPECT_TRUE(contains(what, "2 counts; expected one per rank (1)")) << what;
}

TEST_F(CommunicatorTest, AGroupLaunchesEveryOperationIssuedInIt) {
  auto comm = one_rank();
  const std::vector<double> input{0.25, 0.5, 0.75, 1.0};
  device_buffer send{input.size() * sizeof(double)};
  device_buffer sum{input.size() * sizeof(double)};
  device_buffer gathered{input.size() * sizeof(double)};
  upload(send, input);
  poison(sum);
  poison(gathered);
  {
    nccl::group g;
    comm.all_reduce(send.get(), sum.get(), input.size(), dtype::float64, reduce_op::sum, stream_);
    comm.all_gather(send.get(), gathered.get(), input.size(), dtype::float64, stream_);
    g.end();
  }
  comm.wait(stream_, 30s, "grouped collectives");
  EXPECT_EQ(download<double>(sum, input.size()), input);
  EXPECT_EQ(download<double>(gathered, input.size()), input);
}

TEST_F(CommunicatorTest, InitTimesOutWhenARankNeverJoinsAndAFreshCommunicatorWorksAfterwards) {
  const auto timeout = 3s;
  const auto start = std::chrono::steady_clock::now();
  auto what = error_message(errc::collective_timeout, [&] {
    // Rank 1 of 2 never calls init: rank 0 must give up at the deadline, never hang.
    nccl::init_group(nccl::unique_id::make(), 2, 0, {0}, timeout);
  });
  const auto elapsed = std::chrono::steady_clock::now() - start;
  EXPECT_GE(elapsed, timeout);
  EXPECT_LT(elapsed, timeout + 30s) << "the abort after the deadline took too long";
  EXPECT_TRUE(contains(what, "2 ranks were expected")) << what;
  EXPECT_TRUE(contains(what, "did not join")) << what;
  EXPECT_TRUE(contains(what, "aborted")) << what;

  // Nothing of the failed init stands in the way of a new communicator.
  auto comm = one_rank();
  const std::vector<int32_t> input{7, 8, 9};
  device_buffer send{input.size() * sizeof(int32_t)};
  device_buffer recv{input.size() * sizeof(int32_t)};
  upload(send, input);
  poison(recv);
  comm.all_reduce(send.get(), recv.get(), input.size(), dtype::int32, reduce_op::sum, stream_);
  comm.wait(stream_, 30s, "all_reduce after a failed init");
  EXPECT_EQ(download<int32_t>(recv, input.size()), input);
}

TEST_F(CommunicatorTest, OperationsOnAnAbortedCommunicatorFailWithCollectiveAborted) {
  auto comm = one_rank();
  comm.abort();
  EXPECT_TRUE(comm.aborted());
  EXPECT_FALSE(comm.valid());
  EXPECT_EQ(comm.get(), nullptr);
  comm.abort(); // idempotent
  device_buffer buffer{16};
  auto what = error_message(errc::collective_aborted, [&] {
    comm.all_reduce(buffer.get(), buffer.get(), 4, dtype::float32, reduce_op::sum, stream_);
  });
  EXPECT_TRUE(contains(what, "was aborted")) << what;
  EXPECT_TRUE(contains(what, "new unique id")) << what;
  error_message(errc::collective_aborted,
                [&] { comm.all_gather(buffer.get(), buffer.get(), 4, dtype::float32, stream_); });
  error_message(errc::collective_aborted,
                [&] { comm.broadcast(buffer.get(), buffer.get(), 4, dtype::float32, 0, stream_); });
  error_message(errc::collective_aborted, [&] {
    comm.all_gather_ragged(buffer.get(), {4}, buffer.get(), dtype::float32, stream_);
  });
  error_message(errc::collective_aborted, [&] { comm.wait(stream_, 1s, "a wait"); });
}

TEST_F(CommunicatorTest, WaitAbortsAndFailsWithCollectiveTimeoutWhenTheStreamDoesNotFinish) {
  auto comm = one_rank();
  const std::vector<float> input{1, 2, 3, 4};
  device_buffer send{input.size() * sizeof(float)};
  device_buffer recv{input.size() * sizeof(float)};
  upload(send, input);
  // A host function that holds the stream until the test opens the gate stands in for a peer
  // that never arrives. It gives up after 5 s, so that an abort that waited for the stream would
  // show as a slow wait below instead of a deadlock.
  gate release;
  ASSERT_EQ(cudaLaunchHostFunc(
                stream_, [](void* g) { static_cast<gate*>(g)->wait_for(5s); }, &release),
            cudaSuccess);
  comm.all_reduce(send.get(), recv.get(), input.size(), dtype::float32, reduce_op::sum, stream_);

  const auto start = std::chrono::steady_clock::now();
  auto what = error_message(errc::collective_timeout,
                            [&] { comm.wait(stream_, 300ms, "the blocked all-reduce"); });
  const auto elapsed = std::chrono::steady_clock::now() - start;
  release.open();
  EXPECT_GE(elapsed, 300ms);
  EXPECT_LT(elapsed, 3s) << "the wait (or the abort after it) waited for the stream";
  EXPECT_TRUE(contains(what, "the blocked all-reduce did not complete within 300 ms")) << what;
  EXPECT_TRUE(contains(what, "rank 0 of 1 on GPU:0")) << what;
  EXPECT_TRUE(comm.aborted());
  error_message(errc::collective_aborted, [&] {
    comm.all_reduce(send.get(), recv.get(), input.size(), dtype::float32, reduce_op::sum, stream_);
  });
  sync(); // the stream drains once released; TearDown would too
  // The abort ran on a helper thread; with the stream moving again it ends.
  EXPECT_TRUE(nccl::wait_for_aborts(5s)) << "ncclCommAbort did not return once the stream drained";
}

} // namespace
