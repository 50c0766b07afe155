// GPU tensors and GPU replicas through the public API: placement, copies, host reads, the kernels
// behind reduce/gather/collectives, and mirrored_strategy on a GPU. Every test needs a GPU and
// skips (reported as skipped by CTest) when this process sees none.

#include "device/gpu.hpp"
#include "support/stream_blocker.hpp"

#include <consort/consort.hpp>

#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

using namespace consort;

namespace {

#define REQUIRE_GPU()                                                                              \
  do {                                                                                             \
    if (detail::gpu::count() == 0)                                                                 \
      GTEST_SKIP() << "no GPU: " << detail::gpu::unavailable_reason();                             \
  } while (false)

std::vector<float> iota(size_t n, float start = 1) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i)
    v[i] = start + static_cast<float>(i) * 0.5f;
  return v;
}

} // namespace

TEST(GpuTensor, RoundTripsThroughTheGpu) {
  REQUIRE_GPU();
  auto host = tensor::from<float>(iota(1001), {7, 143});
  auto dev = host.to("GPU:0");
  EXPECT_TRUE(dev.on_gpu());
  EXPECT_EQ(dev.device(), "GPU:0");
  EXPECT_FALSE(dev.shares_storage_with(host));
  EXPECT_EQ(dev.shape(), host.shape());
  EXPECT_EQ(dev.to_vector<float>(), host.to_vector<float>());
  auto back = dev.to("CPU:0");
  EXPECT_FALSE(back.on_gpu());
  EXPECT_EQ(back, host);
  EXPECT_EQ(dev, host); // == compares bytes wherever they live
  EXPECT_EQ(dev.slice(2, 4).to_vector<float>(), host.slice(2, 4).to_vector<float>());
  EXPECT_EQ(tensor::scalar<int64_t>(-5, "GPU:0").item<int64_t>(), -5);
  EXPECT_NE(dev.to_string().find("on GPU:0"), std::string::npos);
}

TEST(GpuTensor, ZerosCloneAndCopyOnWriteStayOnTheGpu) {
  REQUIRE_GPU();
  auto z = tensor::zeros(dtype::int32, {3, 5}, "GPU:0");
  EXPECT_EQ(z.to_vector<int32_t>(), std::vector<int32_t>(15, 0));
  auto a = tensor::from<double>({1, 2, 3}, {3}, "GPU:0");
  auto b = a.clone();
  EXPECT_TRUE(b.on_gpu());
  EXPECT_FALSE(b.shares_storage_with(a));
  EXPECT_EQ(b, a);
  auto shared = a;
  void* p = shared.raw_mutable_data(); // copy-on-write: `a` keeps its bytes
  EXPECT_NE(p, a.raw_data());
  EXPECT_EQ(shared.to_vector<double>(), (std::vector<double>{1, 2, 3}));
}

TEST(GpuKernels, ReduceAndConcatOnAGpuMatchTheHostBitwise) {
  REQUIRE_GPU();
  std::vector<tensor> host, dev;
  for (int r = 0; r < 3; ++r) {
    host.push_back(tensor::from<float>(iota(4099, static_cast<float>(r) * 0.1f), {4099}));
    dev.push_back(host.back().to("GPU:0"));
  }
  for (auto op :
       {reduce_op::sum, reduce_op::mean, reduce_op::min, reduce_op::max, reduce_op::prod}) {
    auto on_gpu = reduce_elementwise(op, dev);
    EXPECT_TRUE(on_gpu.on_gpu());
    EXPECT_EQ(on_gpu.to("CPU:0"), reduce_elementwise(op, host)) << to_string(op);
  }
  auto m = tensor::from<int32_t>({1, 2, 3, 4, 5, 6}, {2, 3});
  auto md = m.to("GPU:0");
  for (int64_t axis : {0, 1}) {
    EXPECT_EQ(reduce_axis(reduce_op::mean, md, axis).to("CPU:0"),
              reduce_axis(reduce_op::mean, m, axis));
    EXPECT_EQ(concat({md, md}, axis).to("CPU:0"), concat({m, m}, axis));
  }
}

TEST(GpuKernels, InputsOnSeveralDevicesAreCombinedOnTheHost) {
  REQUIRE_GPU();
  auto a = tensor::from<float>({1, 2});
  auto b = tensor::from<float>({10, 20}, {2}, "GPU:0");
  auto sum = reduce_elementwise(reduce_op::sum, {a, b});
  EXPECT_FALSE(sum.on_gpu());
  EXPECT_EQ(sum.to_vector<float>(), (std::vector<float>{11, 22}));
}

TEST(GpuStrategy, AGpuReplicaGetsItsInputsOnItsDeviceAndReducesToTheHost) {
  REQUIRE_GPU();
  mirrored_strategy gpus({"GPU:0"});
  auto inputs = gpus.distribute_values([](int) { return tensor::from<float>({1, 2}, {2}); });
  auto v = gpus.run(
      [](replica_context& ctx, const tensor& x) {
        EXPECT_EQ(ctx.device(), "GPU:0");
        EXPECT_EQ(x.device(), "GPU:0");
        auto total = ctx.all_reduce(reduce_op::sum, x);
        EXPECT_EQ(total.device(), "GPU:0");
        return total;
      },
      inputs);
  ASSERT_EQ(v.values().size(), 1u);
  EXPECT_TRUE(v.values()[0].on_gpu());
  auto host_total = gpus.reduce("MEAN", v, 0);
  EXPECT_FALSE(host_total.on_gpu());
  EXPECT_EQ(host_total.to_vector<float>(), (std::vector<float>{1.5f}));
  auto gathered = gpus.gather(v, 0);
  EXPECT_FALSE(gathered.on_gpu());
  EXPECT_EQ(gathered.to_vector<float>(), (std::vector<float>{1, 2}));
}

TEST(GpuStrategy, ACpuAndAGpuReplicaAllReduceTogether) {
  REQUIRE_GPU();
  mirrored_strategy mixed({"CPU:0", "GPU:0"});
  auto v = mixed.run([](replica_context& ctx) {
    auto mine = tensor::from<float>({1.0f + static_cast<float>(ctx.replica_id_in_sync_group())},
                                    {1}, ctx.device());
    auto total = ctx.all_reduce(reduce_op::sum, mine);
    EXPECT_EQ(total.device(), ctx.device());
    auto all = ctx.all_gather(mine, 0);
    EXPECT_EQ(all.to_vector<float>(), (std::vector<float>{1, 2}));
    return total;
  });
  for (const auto& t : v.values())
    EXPECT_EQ(t.to_vector<float>(), (std::vector<float>{3}));
}

// float16 and bfloat16 on GPU replicas: a lone GPU replica's collectives (NCCL's 16-bit types), and
// a CPU and a GPU replica together (the host kernels), each result the float32 value rounded once.
// `mixed_second` is the second replica beside CPU:0, `lone` the replica of a one-replica strategy.
template <class T>
void half_on_replicas(const std::string& mixed_second, const std::string& lone) {
  // 2048 + 1 + 1 + 1 is 2051 in float32, which rounds to 2052 in float16; a float16 accumulator
  // would stop at 2048. bfloat16: 256 + 1 + 1 + 1 is 259, which rounds to 260; bfloat16 alone
  // would stop at 256.
  const float big = std::is_same_v<T, float16_t> ? 2048.0f : 256.0f;
  mirrored_strategy mixed({"CPU:0", mixed_second});
  auto v = mixed.run([&](replica_context& ctx) {
    const int id = ctx.replica_id_in_sync_group();
    tensor mine = tensor::from<T>({T(id == 0 ? big : 1.0f), T(1.0f), T(-0.5f)}, {3}, ctx.device());
    tensor sum = ctx.all_reduce(reduce_op::sum, mine);
    tensor mean = ctx.all_reduce(reduce_op::mean, mine);
    tensor max = ctx.all_reduce(reduce_op::max, mine);
    EXPECT_EQ(sum.dtype(), dtype_of<T>);
    EXPECT_EQ(mean.dtype(), dtype_of<T>);
    EXPECT_EQ(sum.device(), ctx.device());
    EXPECT_EQ(sum.template to_vector<T>(), (std::vector<T>{T(big + 1.0f), T(2.0f), T(-1.0f)}));
    EXPECT_EQ(mean.template to_vector<T>(),
              (std::vector<T>{T((big + 1.0f) / 2.0f), T(1.0f), T(-0.5f)}));
    EXPECT_EQ(max.template to_vector<T>(), (std::vector<T>{T(big), T(1.0f), T(-0.5f)}));
    return sum;
  });
  ASSERT_EQ(v.values().size(), 2u);
  // Three ones onto `big` in one reduction: float32 accumulation, one rounding.
  mirrored_strategy gpu({lone});
  auto inputs = gpu.distribute_values([&](int) {
    return tensor::from<T>({T(big), T(1.0f), T(1.0f), T(1.0f)}, {4});
  });
  auto total = gpu.run(
      [&](replica_context& ctx, const tensor& x) -> tensor {
        EXPECT_EQ(x.device(), lone);
        tensor same = ctx.all_reduce(reduce_op::sum, x); // one replica: the identity, on NCCL
        EXPECT_EQ(same.device(), lone);
        EXPECT_EQ(same.template to_vector<T>(), x.template to_vector<T>());
        tensor gathered = ctx.all_gather(x, 0);
        EXPECT_EQ(gathered.template to_vector<T>(), x.template to_vector<T>());
        return ctx.broadcast(x, 0);
      },
      inputs);
  tensor reduced = gpu.reduce("SUM", total, 0);
  EXPECT_EQ(reduced.dtype(), dtype_of<T>);
  EXPECT_EQ(reduced.template to_vector<T>(), (std::vector<T>{T(big + 3.0f)}));
  EXPECT_NE(T(big + 3.0f).bits(), T(big).bits()) << "the check must tell the accumulators apart";
}

TEST(GpuStrategy, Float16OnGpuReplicasAccumulatesInFloat32AndRoundsOnce) {
  REQUIRE_GPU();
  half_on_replicas<float16_t>("GPU:0", "GPU:0");
}

TEST(GpuStrategy, Bfloat16OnGpuReplicasAccumulatesInFloat32AndRoundsOnce) {
  REQUIRE_GPU();
  half_on_replicas<bfloat16_t>("GPU:0", "GPU:0");
}

// The same checks on CPU replicas (any machine): what the GPU tests above must agree with.
TEST(GpuStrategy, TheHalfChecksHoldOnCpuReplicas) {
  half_on_replicas<float16_t>("CPU:1", "CPU:0");
  half_on_replicas<bfloat16_t>("CPU:1", "CPU:0");
}

TEST(GpuStrategy, TheDefaultMirroredStrategyUsesEveryGpu) {
  REQUIRE_GPU();
  mirrored_strategy all;
  EXPECT_EQ(all.num_replicas_in_sync(), detail::gpu::count());
}

TEST(GpuStrategy, EveryCollectiveKindOfGpuReplicasRunsOnNccl) {
  REQUIRE_GPU();
  std::vector<std::string> devices;
  for (int i = 0; i < detail::gpu::count(); ++i)
    devices.push_back("GPU:" + std::to_string(i));
  mirrored_strategy gpus(devices);
  const auto n = static_cast<int>(devices.size());
  auto v = gpus.run([n](replica_context& ctx) {
    const int id = ctx.replica_id_in_sync_group();
    // Replica i holds i + 1 rows of [i, i]: a ragged all_gather along axis 0.
    std::vector<int64_t> rows(static_cast<size_t>(2 * (id + 1)), id);
    auto mine = tensor::from<int64_t>(rows, {id + 1, 2}, ctx.device());
    auto gathered = ctx.all_gather(mine, 0);
    EXPECT_EQ(gathered.device(), ctx.device());
    EXPECT_EQ(gathered.shape(), (shape_t{n * (n + 1) / 2, 2}));
    auto values = tensor::from<double>({1.0 * (id + 1), -2.0}, {2}, ctx.device());
    // NCCL averages in its own order (ncclAvg): equal to the host's mean up to rounding.
    auto mean = ctx.all_reduce(reduce_op::mean, values).to_vector<double>();
    EXPECT_NEAR(mean[0], (n + 1) / 2.0, 1e-12);
    EXPECT_NEAR(mean[1], -2.0, 1e-12);
    auto maxed = ctx.all_reduce(reduce_op::max, values);
    EXPECT_EQ(maxed.to_vector<double>(), (std::vector<double>{1.0 * n, -2.0}));
    auto from_last = ctx.broadcast(values, n - 1);
    EXPECT_EQ(from_last.to_vector<double>(), (std::vector<double>{1.0 * n, -2.0}));
    EXPECT_EQ(from_last.device(), ctx.device());
    return gathered;
  });
  std::vector<int64_t> expected;
  for (int i = 0; i < n; ++i)
    for (int r = 0; r < 2 * (i + 1); ++r)
      expected.push_back(i);
  for (const auto& t : v.values())
    EXPECT_EQ(t.to_vector<int64_t>(), expected);
}

TEST(GpuStrategy, ACollectiveIsQueuedOnTheReplicasStreamWithoutWaitingForIt) {
  REQUIRE_GPU();
  // A replica that waited for its stream before the collective would time out here (the stream
  // is held still until after the call returns).
  strategy_options opts;
  opts.collective_timeout = std::chrono::seconds(5);
  mirrored_strategy gpus({"GPU:0"}, opts);
  auto v = gpus.run([](replica_context& ctx) {
    auto x = tensor::from<float>({1, 2, 3}, {3}, ctx.device());
    auto stream = static_cast<cudaStream_t>(detail::gpu::current_stream());
    test::stream_blocker blocker{stream};
    auto sum = ctx.all_reduce(reduce_op::sum, x);
    auto gathered = ctx.all_gather(x, 0);
    // Both calls came back while the stream is still held: they are queued behind the blocker.
    EXPECT_EQ(cudaStreamQuery(stream), cudaErrorNotReady);
    blocker.release();
    ctx.synchronize();
    EXPECT_EQ(cudaStreamQuery(stream), cudaSuccess);
    EXPECT_EQ(gathered.to_vector<float>(), (std::vector<float>{1, 2, 3}));
    return sum;
  });
  EXPECT_EQ(v.values().front().to_vector<float>(), (std::vector<float>{1, 2, 3}));
}

TEST(GpuStrategy, AHostReadWaitsForTheCollectivesQueuedBeforeIt) {
  REQUIRE_GPU();
  mirrored_strategy gpus({"GPU:0"});
  auto v = gpus.run([](replica_context& ctx) {
    auto x = tensor::from<int32_t>({5, -7}, {2}, ctx.device());
    std::vector<int32_t> seen;
    for (int i = 0; i < 50; ++i)
      x = ctx.all_reduce(reduce_op::max, x);
    seen = x.to_vector<int32_t>(); // no synchronize(): the read itself waits for the 50 calls
    EXPECT_EQ(seen, (std::vector<int32_t>{5, -7}));
    return x;
  });
  EXPECT_EQ(v.values().front().to_vector<int32_t>(), (std::vector<int32_t>{5, -7}));
}

TEST(GpuStrategy, IntegerMeanOfGpuReplicasIsFloat64AsOnTheHost) {
  REQUIRE_GPU();
  mirrored_strategy gpus({"GPU:0"});
  auto v = gpus.run([](replica_context& ctx) {
    auto mean = ctx.all_reduce(reduce_op::mean, tensor::from<int32_t>({3, 4}, {2}, ctx.device()));
    EXPECT_EQ(mean.dtype(), dtype::float64);
    EXPECT_EQ(mean.device(), ctx.device());
    return mean;
  });
  EXPECT_EQ(v.values()[0].to_vector<double>(), (std::vector<double>{3, 4}));
}

TEST(GpuCrossDeviceOps, ReduceAndBroadcastReachGpuDestinations) {
  REQUIRE_GPU();
  mirrored_strategy s({"CPU:0", "CPU:1"});
  const auto& ops = s.cross_device_ops();
  auto v = per_replica<tensor>({tensor::from<float>({1, 2}), tensor::from<float>({3, 4})});
  auto reduced = ops.reduce("SUM", v, {"GPU:0", "CPU:1"});
  ASSERT_EQ(reduced.values().size(), 2u);
  EXPECT_TRUE(reduced.values()[0].on_gpu());
  EXPECT_EQ(reduced.values()[0].device(), "GPU:0");
  EXPECT_EQ(reduced.values()[0].to_vector<float>(), (std::vector<float>{4, 6}));
  EXPECT_FALSE(reduced.values()[1].on_gpu());
  auto sent = ops.broadcast(tensor::from<int64_t>({7, 8}), {"GPU:0"});
  EXPECT_EQ(sent.values()[0].device(), "GPU:0");
  EXPECT_EQ(sent.values()[0].to_vector<int64_t>(), (std::vector<int64_t>{7, 8}));
}

// -- the public view of the GPUs (consort/device.hpp) --------------------------------------------

TEST(GpuDevices, NumGpusAndTheReasonForNoneAgreeWithTheRuntime) {
  // Runs with and without a GPU: the count is the runtime's, and a count of 0 always says why.
  EXPECT_EQ(num_gpus(), detail::gpu::count());
  if (num_gpus() == 0)
    EXPECT_FALSE(gpus_unavailable_reason().empty());
  else
    EXPECT_EQ(gpus_unavailable_reason(), "");
  // A CUDA build has a stream for every thread (CUDA's per-thread default stream off replicas).
  EXPECT_NE(current_cuda_stream(), nullptr);
  EXPECT_EQ(current_cuda_stream(), detail::gpu::current_stream());
}

TEST(GpuDevices, AGpuReplicasCurrentStreamIsItsOwnAndNotTheCallersOne) {
  REQUIRE_GPU();
  void* outside = current_cuda_stream();
  mirrored_strategy gpus({"GPU:0"});
  std::vector<void*> inside;
  for (int step = 0; step < 2; ++step)
    gpus.run([&](replica_context&) {
      inside.push_back(current_cuda_stream());
      return tensor::scalar<float>(0);
    });
  ASSERT_EQ(inside.size(), 2u);
  EXPECT_NE(inside[0], nullptr);
  EXPECT_NE(inside[0], outside);   // the replica's stream, not CUDA's per-thread default one
  EXPECT_EQ(inside[0], inside[1]); // one stream for the replica's life
  EXPECT_EQ(current_cuda_stream(), outside);
}
