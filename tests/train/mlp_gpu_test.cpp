// The training demo's GPU form (examples/train/mlp_gpu.cpp, mlp_kernels.cu, and train_on on GPU
// replicas), checked against its host form. Label gpu: the tests that need a GPU skip without
// one, saying why; the argument checks run everywhere (also in a build without CUDA).

#include "support/expect_error.hpp"
#include "trainer.hpp"

#include <consort/config.hpp>

#if CONSORT_WITH_CUDA
#include "mlp_kernels.hpp"
#endif

#include <consort/consort.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

using namespace consort;
using namespace consort::train;

namespace {

#define REQUIRE_GPU()                                                                              \
  do {                                                                                             \
    if (num_gpus() == 0)                                                                           \
      GTEST_SKIP() << "no GPU: " << gpus_unavailable_reason();                                     \
  } while (false)

nest on(const nest& value, const std::string& device) {
  return map_structure(value, [&](const tensor& t) { return t.to(device); });
}

const dataset_tensors& data() {
  static const dataset_tensors d = [] {
    synthetic_options o;
    o.examples = 300;
    return make_dataset(o);
  }();
  return d;
}

/// The largest difference between two float32 tensors relative to the larger magnitude, at least
/// `floor` (max_relative_difference's measure, for one pair).
double relative_difference(const tensor& a, const tensor& b, double floor = 1e-3) {
  auto va = a.to_vector<float>();
  auto vb = b.to_vector<float>();
  EXPECT_EQ(va.size(), vb.size());
  double worst = 0;
  for (size_t i = 0; i < va.size() && i < vb.size(); ++i) {
    double scale = std::max({std::fabs(double(va[i])), std::fabs(double(vb[i])), floor});
    worst = std::max(worst, std::fabs(double(va[i]) - double(vb[i])) / scale);
  }
  return worst;
}

/// |a - b|_2 / max(|a|_2, |b|_2) for two float32 tensors (--verify's normwise measure).
double normwise_difference(const tensor& a, const tensor& b) {
  return largest_difference(a, b).normwise;
}

// A model with every GEMM shape off the kernels' 64 x 64 tiles: 300 rows, 16 -> 70 -> 70 -> 4.
const mlp_shape odd_shape{16, 70, 4, 2};

/// Ten steps of odd_shape's model on 300 rows in global batches of 64.
train_options ten_steps_off_the_tiles() {
  train_options o;
  o.steps = 10;
  o.global_batch = 64;
  o.examples = 300;
  o.hidden = 70;
  o.layers = 2;
  return o;
}

} // namespace

// -- argument checks (any machine) ---------------------------------------------------------------

TEST(MlpGpu, ForwardBackwardRefusesHostTensorsAndANullTotals) {
  auto params = init_params(odd_shape, 1);
  EXPECT_TRUE(test::fails_with([&] { forward_backward_gpu(params, data().x, data().y, nullptr); },
                               errc::invalid_argument,
                               {"forward_backward_gpu", "x is on CPU:0", "expected a GPU"}));
  EXPECT_TRUE(test::fails_with([&] { forward_backward_gpu(params, tensor{}, data().y, nullptr); },
                               errc::invalid_argument, {"x is a default-constructed tensor"}));
  EXPECT_TRUE(test::fails_with(
      [&] { forward_backward_gpu(nest::dict(nest::dict_type{}), data().x, data().y, nullptr); },
      errc::structure_mismatch, {"parameter \"w1\" is missing"}));
}

TEST(TrainOnGpus, AMixOfCpuAndGpuReplicasIsRefusedBeforeAnyStep) {
  REQUIRE_GPU();
  mirrored_strategy mixed({"CPU:0", "GPU:0"});
  train_options o;
  o.steps = 2;
  tracer off(false);
  EXPECT_TRUE(test::fails_with([&] { train_on(mixed, o, data(), off, 0); }, errc::invalid_argument,
                               {"all CPUs or all GPUs", "CPU:0, GPU:0"}));
}

// -- on a GPU ------------------------------------------------------------------------------------

TEST(MlpGpu, ForwardBackwardOnAGpuMatchesTheHostModel) {
  REQUIRE_GPU();
  auto params = init_params(odd_shape, 7);
  auto host = forward_backward(params, data().x, data().y);
  auto totals = tensor::zeros(dtype::float32, {3}, "GPU:0");
  auto grads = forward_backward_gpu(on(params, "GPU:0"), data().x.to("GPU:0"), data().y.to("GPU:0"),
                                    totals.mutable_data<float>());
  auto t = totals.to_vector<float>();
  EXPECT_NEAR(t[0], host.loss_sum.item<float>(), 1e-5 * std::fabs(host.loss_sum.item<float>()));
  EXPECT_EQ(t[1], host.correct.item<float>());
  EXPECT_EQ(t[2], 300.f);
  ASSERT_TRUE(grads.is_dict());
  for (const auto& [key, g] : host.grads.as_dict()) {
    ASSERT_TRUE(grads.as_dict().count(key)) << key;
    const tensor& mine = grads[key].as_tensor();
    EXPECT_TRUE(mine.on_gpu()) << key;
    EXPECT_LE(relative_difference(mine, g.as_tensor()), 1e-4) << key;
  }
}

TEST(MlpGpu, ForwardBackwardOnAGpuGivesTheSameBytesEveryCallAndWithSlots) {
  REQUIRE_GPU();
  auto params = on(init_params(odd_shape, 3), "GPU:0");
  auto x = data().x.to("GPU:0");
  auto y = data().y.to("GPU:0");
  auto totals_a = tensor::zeros(dtype::float32, {3}, "GPU:0");
  auto totals_b = tensor::zeros(dtype::float32, {3}, "GPU:0");
  auto a = forward_backward_gpu(params, x, y, totals_a.mutable_data<float>());
  // The same gradients written into caller memory: one flat buffer, layer by layer.
  std::vector<tensor> slots_w;
  std::vector<tensor> slots_b;
  std::vector<int> order;
  auto b = forward_backward_gpu(
      params, x, y, totals_b.mutable_data<float>(),
      [&](int layer) {
        const auto& w = params[weight_key(layer)].as_tensor();
        slots_w.push_back(tensor::zeros(dtype::float32, w.shape(), "GPU:0"));
        slots_b.push_back(tensor::zeros(dtype::float32, {w.shape()[1]}, "GPU:0"));
        return gradient_slot{slots_w.back().mutable_data<float>(),
                             slots_b.back().mutable_data<float>()};
      },
      [&](int layer, const tensor& w, const tensor& bias) {
        EXPECT_FALSE(w.valid());
        EXPECT_FALSE(bias.valid());
        order.push_back(layer);
      });
  EXPECT_EQ(order, (std::vector<int>{3, 2, 1}));
  EXPECT_EQ(b.size(), 0u);
  EXPECT_EQ(totals_a, totals_b);
  for (int layer = 3; layer >= 1; --layer) {
    EXPECT_EQ(a[weight_key(layer)].as_tensor(), slots_w[static_cast<size_t>(3 - layer)]);
    EXPECT_EQ(a[bias_key(layer)].as_tensor(), slots_b[static_cast<size_t>(3 - layer)]);
  }
}

TEST(MlpGpu, AnEmptyBatchGivesZerosAndABadLabelANanLoss) {
  REQUIRE_GPU();
  auto params = on(init_params(odd_shape, 3), "GPU:0");
  auto totals = tensor::from<float>({9, 9, 9}, {3}, "GPU:0");
  auto none = forward_backward_gpu(params, data().x.slice(0, 0).to("GPU:0"),
                                   data().y.slice(0, 0).to("GPU:0"), totals.mutable_data<float>());
  EXPECT_EQ(totals.to_vector<float>(), (std::vector<float>{0, 0, 0}));
  for (const auto& [key, g] : none.as_dict())
    for (float v : g.as_tensor().to_vector<float>())
      ASSERT_EQ(v, 0.f) << key;
  auto labels = data().y.slice(0, 4).to_vector<int32_t>();
  labels[2] = 4; // classes are 0..3
  forward_backward_gpu(params, data().x.slice(0, 4).to("GPU:0"),
                       tensor::from<int32_t>(labels, {4}, "GPU:0"), totals.mutable_data<float>());
  EXPECT_TRUE(std::isnan(totals.to_vector<float>()[0]));
}

TEST(TrainOnGpus, OneGpuReplicaTrainsAsOneCpuReplicaWithinTheGpuTolerance) {
  REQUIRE_GPU();
  train_options o = ten_steps_off_the_tiles();
  o.snapshot_step = 1;
  tracer off(false);
  one_device_strategy gpu("GPU:0");
  one_device_strategy cpu("CPU:0");
  auto a = train_on(gpu, o, data(), off, 0);
  auto b = train_on(cpu, o, data(), off, 0);
  ASSERT_EQ(a.curve.loss.size(), 10u);
  EXPECT_LT(a.curve.loss.back(), a.curve.loss.front());
  // --verify's kernel check: one step, normwise per tensor (elementwise, single gradients are
  // ill-conditioned across devices: a ReLU whose input is within rounding of zero flips).
  EXPECT_LE(largest_difference(a.snapshot, b.snapshot).normwise, verify_tolerance_gpu);
  EXPECT_GT(largest_difference(a.snapshot, a.params).normwise, verify_tolerance_gpu);
  // A second GPU run is the data-parallel check's reference: the same bytes.
  auto again = train_on(gpu, o, data(), off, 0);
  EXPECT_EQ(max_relative_difference(a.params, again.params), 0.0);
  for (const auto& leaf : flatten(a.params))
    EXPECT_FALSE(leaf.on_gpu());
  for (size_t s = 0; s < 10; ++s)
    EXPECT_NEAR(a.curve.loss[s], b.curve.loss[s], 1e-3 * b.curve.loss[s]) << "step " << s;
  // Bucketing (one all-reduce per tensor) changes no bit on the GPU either.
  auto per_tensor = o;
  per_tensor.bucket_bytes = 0;
  auto c = train_on(gpu, per_tensor, data(), off, 0);
  EXPECT_EQ(max_relative_difference(a.params, c.params), 0.0);
}

TEST(TrainOnGpus, TheModelLivesInTheVariablesOnTheGpuAndTheMetricsAreEachEpochs) {
  REQUIRE_GPU();
  const train_options o = ten_steps_off_the_tiles(); // epochs of 5 steps, the last of 44 rows
  tracer off(false);
  one_device_strategy gpu("GPU:0");
  auto r = train_on(gpu, o, data(), off, 0);
  // Every parameter's copy is on the GPU and is the result (the update ran there, in place).
  ASSERT_EQ(gpu.variables().size(), 7u);
  for (const auto& v : gpu.variables()) {
    const auto copies = gpu.local_results(v);
    ASSERT_EQ(copies.size(), 1u);
    EXPECT_TRUE(copies[0].on_gpu()) << v.name();
    if (v.name().rfind("metrics/", 0) == 0)
      continue;
    EXPECT_EQ(copies[0].to_vector<float>(), r.params[v.name()].as_tensor().to_vector<float>())
        << v.name();
  }
  // The metrics of each epoch, added on the GPU step by step: the row-weighted mean of its steps.
  ASSERT_EQ(r.curve.epoch_end, (std::vector<int64_t>{5, 10}));
  const std::vector<double> rows = {64, 64, 64, 64, 44};
  for (size_t e = 0; e < 2; ++e) {
    double loss = 0, accuracy = 0, n = 0;
    for (size_t i = 0; i < 5; ++i) {
      loss += r.curve.loss[5 * e + i] * rows[i];
      accuracy += r.curve.accuracy[5 * e + i] * rows[i];
      n += rows[i];
    }
    EXPECT_NEAR(r.curve.epoch_loss[e], loss / n, 1e-5 * loss / n) << "epoch " << e;
    EXPECT_NEAR(r.curve.epoch_accuracy[e], accuracy / n, 1e-6) << "epoch " << e;
  }
  // Reset after the last epoch.
  EXPECT_EQ(gpu.variables()[6].value().to_vector<float>(), (std::vector<float>{0, 0, 0}));
}

// -- the GEMM backends ----------------------------------------------------------------------------

TEST(GemmBackend, NamesWhatTheGpuFormRuns) {
  const std::string backend = gpu_gemm_backend();
#if CONSORT_WITH_CUDA
  EXPECT_TRUE(backend.rfind("cuBLAS (", 0) == 0 ||
              backend.rfind("consort's tiled kernel (no cuBLAS: ", 0) == 0)
      << backend;
#else
  EXPECT_EQ(backend, "none (built without CUDA)");
#endif
}

// Run by its own CTest registration with CONSORT_CUBLAS naming a file that is not there (and left
// out of the discovered tests, which run without it): the tiled kernel is kept, saying why.
TEST(GemmBackendEnv, KeepsTheTiledKernelAndNamesTheLibraryItCouldNotLoad) {
  const char* setting = std::getenv("CONSORT_CUBLAS");
  ASSERT_NE(setting, nullptr) << "tests/train/CMakeLists.txt runs this with CONSORT_CUBLAS set";
  const std::string backend = gpu_gemm_backend();
#if CONSORT_WITH_CUDA
  EXPECT_NE(backend.find("consort's tiled kernel (no cuBLAS: cannot load " + std::string{setting}),
            std::string::npos)
      << backend;
#else
  EXPECT_EQ(backend, "none (built without CUDA)");
#endif
}

#if CONSORT_WITH_CUDA
TEST(GemmBackend, CublasMatchesTheTiledKernelOnEveryTransposeAndEpilogue) {
  REQUIRE_GPU();
  if (kernels::gemm_cublas(0, nullptr, false, false, 0, 0, 0, nullptr, nullptr, nullptr, nullptr,
                           false, nullptr) != nullptr)
    GTEST_SKIP() << "no cuBLAS to compare: " << kernels::gemm_backend();
  // Shapes off every tile and warp size; operands stored as the kernels read them.
  const int64_t m = 70, n = 33, k = 45;
  auto values = [](int64_t count, float scale) {
    std::vector<float> v(static_cast<size_t>(count));
    for (size_t i = 0; i < v.size(); ++i)
      v[i] = scale * std::sin(0.37f * static_cast<float>(i) + 0.1f);
    return v;
  };
  auto a = tensor::from<float>(values(m * k, 1.f), {m * k}, "GPU:0");
  auto b = tensor::from<float>(values(k * n, 0.5f), {k * n}, "GPU:0");
  auto bias = tensor::from<float>(values(n, 0.2f), {n}, "GPU:0");
  auto mask = tensor::from<float>(values(m * n, 1.f), {m * n}, "GPU:0");
  for (bool ta : {false, true})
    for (bool tb : {false, true})
      for (bool epilogue : {false, true}) {
        auto tiled = tensor::zeros(dtype::float32, {m * n}, "GPU:0");
        auto cublas = tensor::zeros(dtype::float32, {m * n}, "GPU:0");
        const float* bp = epilogue ? bias.data<float>() : nullptr;
        const float* mp = epilogue ? mask.data<float>() : nullptr;
        void* stream = current_cuda_stream();
        ASSERT_EQ(kernels::gemm_tiled(0, stream, ta, tb, m, n, k, a.data<float>(), b.data<float>(),
                                      tiled.mutable_data<float>(), bp, epilogue, mp),
                  nullptr);
        ASSERT_EQ(kernels::gemm_cublas(0, stream, ta, tb, m, n, k, a.data<float>(), b.data<float>(),
                                       cublas.mutable_data<float>(), bp, epilogue, mp),
                  nullptr);
        // Two float32 summation orders: the whole product agrees to rounding (normwise), and no
        // element is off by more than rounding near zero allows (a wrong transpose or offset
        // would be off by O(1) in both). bench/README.md ("the H100 field run") has what an H100
        // measured.
        EXPECT_LE(normwise_difference(cublas, tiled), 1e-6)
            << "transpose_a " << ta << ", transpose_b " << tb << ", epilogue " << epilogue;
        EXPECT_LE(relative_difference(cublas, tiled), 1e-3)
            << "transpose_a " << ta << ", transpose_b " << tb << ", epilogue " << epilogue;
        if (!epilogue) {
          EXPECT_GT(relative_difference(tiled, tensor::zeros(dtype::float32, {m * n})), 0.5)
              << "the product is not all zeros";
        }
      }
}
#endif
