#include "mlp.hpp"
#include "support/expect_error.hpp"

#include <consort/ops.hpp>
#include <consort/reduce_op.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iostream>
#include <map>
#include <optional>
#include <string>
#include <vector>

using consort::dtype;
using consort::errc;
using consort::flatten;
using consort::nest;
using consort::shape_t;
using consort::tensor;
using consort::test::fails_with;
using namespace consort::train;

namespace {

/// FNV-1a over the bytes of `t`: a fingerprint that changes with any bit.
uint64_t fnv1a(const tensor& t) {
  const auto* bytes = static_cast<const unsigned char*>(t.raw_data());
  uint64_t hash = 0xcbf29ce484222325ULL;
  for (size_t i = 0; i < t.num_bytes(); ++i) {
    hash ^= bytes[i];
    hash *= 0x100000001b3ULL;
  }
  return hash;
}

/// `loss_sum` of `params` on (x, y), in float64.
double loss_of(const nest& params, const tensor& x, const tensor& y) {
  return forward_backward(params, x, y).loss_sum.item<double>();
}

/// `params` with element `index` of leaf `key` replaced by `value`.
nest with_element(const nest& params, const std::string& key, int64_t index, float value) {
  auto dict = params.as_dict();
  tensor t = dict.at(key).as_tensor().clone();
  t.mutable_data<float>()[index] = value;
  dict[key] = t;
  return nest::dict(dict);
}

/// Asserts |a - b| <= rel * max(|a|, |b|) + abs for every element.
void expect_close(const tensor& a, const tensor& b, double rel, double abs,
                  const std::string& what) {
  ASSERT_EQ(a.shape(), b.shape()) << what;
  auto av = a.to_vector<float>();
  auto bv = b.to_vector<float>();
  for (size_t i = 0; i < av.size(); ++i) {
    double tolerance = rel * std::max(std::abs(av[i]), std::abs(bv[i])) + abs;
    EXPECT_NEAR(av[i], bv[i], tolerance) << what << " element " << i;
  }
}

/// The element-wise SUM of gradient nests, as a SUM all-reduce over replicas produces it.
nest sum_of(const std::vector<nest>& parts) {
  return consort::reduce_components(consort::reduce_op::sum, parts, std::nullopt);
}

/// Fraction of rows of (x, y) that `params` classifies correctly.
double accuracy(const nest& params, const tensor& x, const tensor& y) {
  auto predicted = predict(params, x).to_vector<int32_t>();
  auto labels = y.to_vector<int32_t>();
  int64_t hits = 0;
  for (size_t i = 0; i < labels.size(); ++i)
    hits += predicted[i] == labels[i] ? 1 : 0;
  return static_cast<double>(hits) / static_cast<double>(labels.size());
}

/// A linear softmax classifier trained by the same SGD schedule, as the baseline the synthetic
/// problem must defeat; returns its accuracy on (test_x, test_y).
double linear_baseline_accuracy(const tensor& x, const tensor& y, const tensor& test_x,
                                const tensor& test_y, int classes, int64_t batch, int steps,
                                double learning_rate) {
  const auto features = static_cast<size_t>(x.shape()[1]);
  const auto k_count = static_cast<size_t>(classes);
  std::vector<double> w(features * k_count), b(k_count);
  auto xs = x.to_vector<float>();
  auto ys = y.to_vector<int32_t>();
  auto logits_of = [&](const float* row) {
    std::vector<double> logits(b);
    for (size_t f = 0; f < features; ++f)
      for (size_t k = 0; k < k_count; ++k)
        logits[k] += row[f] * w[f * k_count + k];
    return logits;
  };
  const auto rows = static_cast<int64_t>(ys.size());
  for (int step = 0; step < steps; ++step) {
    std::vector<double> gw(w.size()), gb(b.size());
    const int64_t begin = (step * batch) % rows;
    for (int64_t n = begin; n < std::min(begin + batch, rows); ++n) {
      const float* row = xs.data() + n * static_cast<int64_t>(features);
      auto logits = logits_of(row);
      double top = *std::max_element(logits.begin(), logits.end());
      double sum = 0.0;
      for (double l : logits)
        sum += std::exp(l - top);
      for (size_t k = 0; k < k_count; ++k) {
        double d = std::exp(logits[k] - top) / sum - (static_cast<int32_t>(k) == ys[n] ? 1 : 0);
        gb[k] += d;
        for (size_t f = 0; f < features; ++f)
          gw[f * k_count + k] += row[f] * d;
      }
    }
    for (size_t i = 0; i < w.size(); ++i)
      w[i] -= learning_rate * gw[i] / static_cast<double>(batch);
    for (size_t k = 0; k < k_count; ++k)
      b[k] -= learning_rate * gb[k] / static_cast<double>(batch);
  }
  auto txs = test_x.to_vector<float>();
  auto tys = test_y.to_vector<int32_t>();
  int64_t hits = 0;
  for (size_t n = 0; n < tys.size(); ++n) {
    auto logits = logits_of(txs.data() + n * features);
    hits += std::max_element(logits.begin(), logits.end()) - logits.begin() == tys[n] ? 1 : 0;
  }
  return static_cast<double>(hits) / static_cast<double>(tys.size());
}

} // namespace

// -- make_dataset ---------------------------------------------------------------------------------

TEST(MlpTest, MakeDatasetHasTheRequestedShapesAndLabelsInRange) {
  auto data = make_dataset({.examples = 1000, .features = 9, .classes = 5, .seed = 7});
  EXPECT_EQ(data.x.dtype(), dtype::float32);
  EXPECT_EQ(data.x.shape(), (shape_t{1000, 9}));
  EXPECT_EQ(data.y.dtype(), dtype::int32);
  EXPECT_EQ(data.y.shape(), (shape_t{1000}));
  std::vector<int> counts(5);
  for (int32_t label : data.y.to_vector<int32_t>()) {
    ASSERT_GE(label, 0);
    ASSERT_LT(label, 5);
    ++counts[static_cast<size_t>(label)];
  }
  for (int count : counts) // 200 expected per class
    EXPECT_GT(count, 150);
  for (float v : data.x.to_vector<float>())
    ASSERT_TRUE(std::isfinite(v));
  auto structure = data.as_nest();
  EXPECT_EQ(structure["x"].as_tensor(), data.x);
  EXPECT_EQ(structure["y"].as_tensor(), data.y);
}

TEST(MlpTest, MakeDatasetGivesTheSameBytesForTheSameSeed) {
  synthetic_options options;
  auto a = make_dataset(options);
  auto b = make_dataset(options);
  EXPECT_EQ(a.x, b.x);
  EXPECT_EQ(a.y, b.y);
  options.seed = 43;
  auto c = make_dataset(options);
  EXPECT_NE(a.x, c.x);
  EXPECT_NE(a.y, c.y);
}

TEST(MlpTest, MakeDatasetMatchesItsRecordedFingerprint) {
  // Recorded once; the generator uses no libm or <random>, so any machine reproduces them. A
  // change here changes every training run of the demo: update the values deliberately.
  auto data = make_dataset({});
  auto x = data.x.to_vector<float>();
  EXPECT_EQ(data.y.to_vector<int32_t>()[0], 1);
  EXPECT_EQ(x[0], 0x1.2fabe2p-2f); // 0.296554118
  EXPECT_EQ(x[1], 0x1.78f75ep-1f); // 0.736262262
  EXPECT_EQ(fnv1a(data.x), 0xd406965095e66bfdULL);
  EXPECT_EQ(fnv1a(data.y), 0x0814cbbc6b1758e4ULL);
}

TEST(MlpTest, MakeDatasetOfZeroExamplesIsEmpty) {
  auto data = make_dataset({.examples = 0});
  EXPECT_EQ(data.x.shape(), (shape_t{0, 16}));
  EXPECT_EQ(data.y.shape(), (shape_t{0}));
}

TEST(MlpTest, MakeDatasetRejectsBadOptions) {
  EXPECT_TRUE(fails_with([] { make_dataset({.examples = -1}); }, errc::invalid_argument,
                         {"examples >= 0", "-1"}));
  EXPECT_TRUE(fails_with([] { make_dataset({.features = 1}); }, errc::invalid_argument,
                         {"features >= 2", "features 1"}));
  EXPECT_TRUE(fails_with([] { make_dataset({.classes = 1}); }, errc::invalid_argument,
                         {"classes >= 2", "classes 1"}));
}

// -- init_params ----------------------------------------------------------------------------------

TEST(MlpTest, InitParamsIsDeterministicAndScaled) {
  mlp_shape shape{.inputs = 6, .hidden = 10, .classes = 4};
  nest params = init_params(shape, 1);
  EXPECT_EQ(params.structure_string(), init_params(shape, 2).structure_string());
  EXPECT_EQ(params, init_params(shape, 1));
  EXPECT_NE(params, init_params(shape, 2));
  EXPECT_EQ(params["w1"].as_tensor().shape(), (shape_t{6, 10}));
  EXPECT_EQ(params["b1"].as_tensor().shape(), (shape_t{10}));
  EXPECT_EQ(params["w2"].as_tensor().shape(), (shape_t{10, 4}));
  EXPECT_EQ(params["b2"].as_tensor().shape(), (shape_t{4}));
  for (const auto& leaf : flatten(params))
    EXPECT_EQ(leaf.dtype(), dtype::float32);
  EXPECT_EQ(params["b1"].as_tensor(), tensor::zeros(dtype::float32, {10}));
  EXPECT_EQ(params["b2"].as_tensor(), tensor::zeros(dtype::float32, {4}));
  auto within = [](const tensor& t, double limit) {
    auto v = t.to_vector<float>();
    auto [lo, hi] = std::minmax_element(v.begin(), v.end());
    // Bounded by the limit and spread over most of it.
    return *lo >= -limit && *hi <= limit && *hi - *lo > limit;
  };
  EXPECT_TRUE(within(params["w1"].as_tensor(), std::sqrt(6.0 / 6)));
  EXPECT_TRUE(within(params["w2"].as_tensor(), std::sqrt(6.0 / 14)));
  auto s = shape_of(params);
  EXPECT_EQ(s.inputs, 6);
  EXPECT_EQ(s.hidden, 10);
  EXPECT_EQ(s.classes, 4);
}

TEST(MlpTest, InitParamsOfSeveralLayersDrawsEachMatrixInOrder) {
  mlp_shape shape{.inputs = 6, .hidden = 10, .classes = 4, .layers = 3};
  nest params = init_params(shape, 1);
  EXPECT_EQ(params.size(), 8u);
  EXPECT_EQ(params["w1"].as_tensor().shape(), (shape_t{6, 10}));
  EXPECT_EQ(params["w2"].as_tensor().shape(), (shape_t{10, 10}));
  EXPECT_EQ(params["w3"].as_tensor().shape(), (shape_t{10, 10}));
  EXPECT_EQ(params["w4"].as_tensor().shape(), (shape_t{10, 4}));
  EXPECT_EQ(params["b4"].as_tensor(), tensor::zeros(dtype::float32, {4}));
  // One stream, w1 first: the first layer equals the one-hidden-layer model's (and torch_ddp.py
  // draws the same numbers).
  EXPECT_EQ(params["w1"].as_tensor(),
            init_params({.inputs = 6, .hidden = 10, .classes = 4}, 1)["w1"].as_tensor());
  EXPECT_NE(params["w2"].as_tensor(), params["w3"].as_tensor());
  auto s = shape_of(params);
  EXPECT_EQ(s.inputs, 6);
  EXPECT_EQ(s.hidden, 10);
  EXPECT_EQ(s.classes, 4);
  EXPECT_EQ(s.layers, 3);
  auto w2 = params["w2"].as_tensor().to_vector<float>();
  auto [lo, hi] = std::minmax_element(w2.begin(), w2.end());
  EXPECT_GE(*lo, -std::sqrt(6.0 / 10));
  EXPECT_LE(*hi, std::sqrt(6.0 / 10));
}

TEST(MlpTest, InitParamsRejectsEmptyLayers) {
  EXPECT_TRUE(
      fails_with([] { init_params({.inputs = 3, .hidden = 4, .classes = 2, .layers = 0}, 1); },
                 errc::invalid_argument, {"layers 0"}));
  EXPECT_TRUE(fails_with([] { init_params({.inputs = 3, .hidden = 0, .classes = 2}, 1); },
                         errc::invalid_argument, {"hidden 0"}));
}

// -- forward_backward -----------------------------------------------------------------------------

TEST(MlpTest, ForwardBackwardMatchesATinyCaseComputedByHand) {
  // One input, one hidden unit, two classes: hidden = relu(x - 0.5), logits = (h, -h) + (0, 1).
  nest params = nest::dict({{"w1", tensor::from<float>({1.0f}, {1, 1})},
                            {"b1", tensor::from<float>({-0.5f})},
                            {"w2", tensor::from<float>({1.0f, -1.0f}, {1, 2})},
                            {"b2", tensor::from<float>({0.0f, 1.0f})}});
  // Row 0: x = 2.5, h = 2, logits (2, -1), label 0: correct, loss = log(1 + e^-3).
  // Row 1: x = 0.0, h = 0 (ReLU off), logits (0, 1), label 0: wrong, loss = log(1 + e).
  auto x = tensor::from<float>({2.5f, 0.0f}, {2, 1});
  auto y = tensor::from<int32_t>({0, 0});
  auto result = forward_backward(params, x, y);
  const double loss0 = std::log1p(std::exp(-3.0));
  const double loss1 = std::log1p(std::exp(1.0));
  EXPECT_NEAR(result.loss_sum.item<double>(), loss0 + loss1, 1e-6);
  EXPECT_EQ(result.correct.item<float>(), 1.0f);
  EXPECT_EQ(result.loss_sum.shape(), shape_t{});
  EXPECT_EQ(result.correct.shape(), shape_t{});
  // dlogits = softmax - one_hot(0) = (p0 - 1, p1) = (-p1, p1): row 0 with p1 = 1 / (1 + e^3),
  // row 1 with q1 = e / (1 + e). Only row 0 reaches the first layer (row 1's ReLU is off).
  const double p1 = 1.0 / (1.0 + std::exp(3.0));
  const double q1 = std::exp(1.0) / (1.0 + std::exp(1.0));
  const double d0[2] = {-p1, p1};
  const double d1[2] = {-q1, q1};
  auto gb2 = result.grads["b2"].as_tensor().to_vector<float>();
  EXPECT_NEAR(gb2[0], d0[0] + d1[0], 1e-6);
  EXPECT_NEAR(gb2[1], d0[1] + d1[1], 1e-6);
  auto gw2 = result.grads["w2"].as_tensor().to_vector<float>();
  EXPECT_NEAR(gw2[0], 2.0 * d0[0], 1e-6);
  EXPECT_NEAR(gw2[1], 2.0 * d0[1], 1e-6);
  const double dh = d0[0] * 1.0 + d0[1] * -1.0; // back through w2 = (1, -1): -2 p1
  EXPECT_NEAR(result.grads["b1"].as_tensor().item<double>(), dh, 1e-6);
  EXPECT_NEAR(result.grads["w1"].as_tensor().item<double>(), 2.5 * dh, 1e-6);
}

TEST(MlpTest, ForwardBackwardOfUniformLogitsCostsLogClassesPerExample) {
  mlp_shape shape{.inputs = 3, .hidden = 4, .classes = 5};
  nest zero = consort::map_structure(
      init_params(shape, 3), [](const tensor& t) { return tensor::zeros(t.dtype(), t.shape()); });
  auto data = make_dataset({.examples = 8, .features = 3, .classes = 5});
  auto result = forward_backward(zero, data.x, data.y);
  EXPECT_NEAR(result.loss_sum.item<double>(), 8 * std::log(5.0), 1e-5);
}

TEST(MlpTest, ForwardBackwardGradientsMatchCentralDifferences) {
  mlp_shape shape{.inputs = 5, .hidden = 7, .classes = 3};
  // Non-zero biases, so that their gradients are checked away from the trivial point too.
  nest params = init_params(shape, 11);
  params = with_element(params, "b1", 2, 0.3f);
  params = with_element(params, "b2", 1, -0.2f);
  auto data = make_dataset({.examples = 6, .features = 5, .classes = 3, .seed = 5});
  auto grads = forward_backward(params, data.x, data.y).grads;
  const float eps = 1e-3f;
  for (const char* key : {"w1", "b1", "w2", "b2"}) {
    const tensor& p = params[key].as_tensor();
    auto analytic = grads[key].as_tensor().to_vector<float>();
    ASSERT_EQ(static_cast<int64_t>(analytic.size()), p.num_elements());
    for (int64_t i = 0; i < p.num_elements(); ++i) {
      const float v = p.data<float>()[i];
      const float up = v + eps;
      const float down = v - eps;
      const double numeric = (loss_of(with_element(params, key, i, up), data.x, data.y) -
                              loss_of(with_element(params, key, i, down), data.x, data.y)) /
                             (static_cast<double>(up) - static_cast<double>(down));
      EXPECT_NEAR(analytic[static_cast<size_t>(i)], numeric, 1e-2 * std::abs(numeric) + 2e-3)
          << key << "[" << i << "]";
    }
  }
}

TEST(MlpTest, ADeepModelsGradientsMatchCentralDifferences) {
  mlp_shape shape{.inputs = 5, .hidden = 6, .classes = 3, .layers = 3};
  auto data = make_dataset({.examples = 9, .features = 5, .classes = 3, .seed = 4});
  // Biases of 0.05, not 0: with zero biases, a row whose units below are all off meets the
  // ReLU's kink exactly (pre-activation 0), where the one-sided derivative and the central
  // difference disagree.
  auto dict = init_params(shape, 12).as_dict();
  for (auto& [key, leaf] : dict)
    if (key[0] == 'b')
      leaf = tensor::from<float>(
          std::vector<float>(static_cast<size_t>(leaf.as_tensor().num_elements()), 0.05f),
          leaf.as_tensor().shape());
  nest params = nest::dict(dict);
  auto grads = forward_backward(params, data.x, data.y).grads;
  EXPECT_EQ(grads.structure_string(), params.structure_string());
  const float eps = 2e-3f;
  for (const auto& key : {"w1", "b2", "w3", "w4", "b4"}) {
    auto values = params[key].as_tensor().to_vector<float>();
    auto analytic = grads[key].as_tensor().to_vector<float>();
    for (size_t i = 0; i < values.size(); i += 3) {
      auto plus = with_element(params, key, static_cast<int64_t>(i), values[i] + eps);
      auto minus = with_element(params, key, static_cast<int64_t>(i), values[i] - eps);
      double numeric =
          (loss_of(plus, data.x, data.y) - loss_of(minus, data.x, data.y)) / (2.0 * eps);
      EXPECT_NEAR(analytic[i], numeric, 2e-2 * std::abs(numeric) + 5e-3) << key << "[" << i << "]";
    }
  }
}

TEST(MlpTest, ForwardBackwardHandsOverEachLayersGradientsFromTheOutputDown) {
  mlp_shape shape{.inputs = 16, .hidden = 7, .classes = 4, .layers = 2};
  auto data = make_dataset({.examples = 10});
  nest params = init_params(shape, 3);
  std::vector<int> order;
  std::map<std::string, tensor> seen;
  auto result =
      forward_backward(params, data.x, data.y, [&](int layer, const tensor& gw, const tensor& gb) {
        order.push_back(layer);
        seen[weight_key(layer)] = gw;
        seen[bias_key(layer)] = gb;
      });
  EXPECT_EQ(order, (std::vector<int>{3, 2, 1}));
  for (const auto& [key, grad] : result.grads.as_dict())
    EXPECT_EQ(seen.at(key), grad.as_tensor()) << key;
}

TEST(MlpTest, ForwardBackwardWritesIntoTheCallersSlotsTheSameBytes) {
  mlp_shape shape{.inputs = 16, .hidden = 24, .classes = 4, .layers = 2};
  auto data = make_dataset({.examples = 40});
  nest params = init_params(shape, 5);
  auto expected = forward_backward(params, data.x, data.y);
  // One flat buffer, each gradient at a 64-byte boundary, as the trainer's buckets lay them out.
  std::map<std::string, std::pair<size_t, size_t>> where; // key -> (offset, elements)
  size_t end = 0;
  for (int l = shape.layers + 1; l >= 1; --l)
    for (const auto& key : {weight_key(l), bias_key(l)}) {
      end = (end + 15) / 16 * 16;
      auto n = static_cast<size_t>(params[key].as_tensor().num_elements());
      where[key] = {end, n};
      end += n;
    }
  std::vector<float> flat(end + 16, -1.0f);
  float* base = flat.data() + (16 - reinterpret_cast<uintptr_t>(flat.data()) % 64 / 4) % 16;
  std::vector<int> asked;
  std::vector<int> handed;
  auto result = forward_backward(
      params, data.x, data.y,
      [&](int layer, const tensor& gw, const tensor& gb) {
        handed.push_back(layer);
        EXPECT_FALSE(gw.valid()); // the gradients are in the slots
        EXPECT_FALSE(gb.valid());
      },
      [&](int layer) {
        asked.push_back(layer);
        return gradient_slot{base + where[weight_key(layer)].first,
                             base + where[bias_key(layer)].first};
      });
  EXPECT_EQ(asked, (std::vector<int>{3, 2, 1}));
  EXPECT_EQ(handed, asked);
  EXPECT_TRUE(result.grads.as_dict().empty());
  EXPECT_EQ(result.loss_sum, expected.loss_sum);
  EXPECT_EQ(result.correct, expected.correct);
  for (const auto& [key, grad] : expected.grads.as_dict()) {
    auto want = grad.as_tensor().to_vector<float>();
    auto [offset, n] = where[key];
    ASSERT_EQ(want.size(), n) << key;
    EXPECT_EQ(0, std::memcmp(want.data(), base + offset, n * sizeof(float))) << key;
  }
}

TEST(MlpTest, ForwardBackwardRefusesASlotWithoutMemory) {
  mlp_shape shape{.inputs = 16, .hidden = 8, .classes = 4};
  auto data = make_dataset({.examples = 4});
  nest params = init_params(shape, 5);
  std::vector<float> w(16 * 8);
  EXPECT_TRUE(fails_with(
      [&] {
        forward_backward(params, data.x, data.y, {}, [&](int) {
          return gradient_slot{w.data(), nullptr};
        });
      },
      errc::invalid_argument, {"gradient slot of layer 2 has a null pointer"}));
}

TEST(MlpTest, ForwardBackwardOfAnEmptyBatchIsZero) {
  mlp_shape shape{.inputs = 5, .hidden = 7, .classes = 3};
  nest params = init_params(shape, 1);
  auto result = forward_backward(params, tensor::zeros(dtype::float32, {0, 5}),
                                 tensor::zeros(dtype::int32, {0}));
  EXPECT_EQ(result.loss_sum, tensor::scalar(0.0f));
  EXPECT_EQ(result.correct, tensor::scalar(0.0f));
  EXPECT_EQ(result.grads.structure_string(), params.structure_string());
  for (const auto& [key, grad] : result.grads.as_dict())
    EXPECT_EQ(grad.as_tensor(), tensor::zeros(dtype::float32, params[key].as_tensor().shape()))
        << key;
}

TEST(MlpTest, ForwardBackwardOfABatchIsTheSumOverItsParts) {
  // The property the data-parallel demo relies on: replicas compute on sub-batches, a SUM
  // all-reduce adds their results, and that equals one pass over the whole global batch.
  mlp_shape shape{.inputs = 16, .hidden = 12, .classes = 4};
  nest params = init_params(shape, 9);
  auto data = make_dataset({.examples = 37});
  auto whole = forward_backward(params, data.x, data.y);
  for (int64_t split : {0, 1, 18, 36, 37}) {
    SCOPED_TRACE("split at row " + std::to_string(split));
    auto a = forward_backward(params, data.x.slice(0, split), data.y.slice(0, split));
    auto b = forward_backward(params, data.x.slice(split, 37), data.y.slice(split, 37));
    expect_close(whole.loss_sum,
                 tensor::scalar(a.loss_sum.item<float>() + b.loss_sum.item<float>()), 1e-5, 0,
                 "loss_sum");
    EXPECT_EQ(whole.correct.item<float>(), a.correct.item<float>() + b.correct.item<float>());
    nest summed = sum_of({a.grads, b.grads});
    for (const auto& [key, grad] : whole.grads.as_dict())
      expect_close(grad.as_tensor(), summed[key].as_tensor(), 1e-5, 1e-6, key);
  }
}

TEST(MlpTest, ForwardBackwardRejectsMismatchedInputs) {
  nest params = init_params({.inputs = 4, .hidden = 3, .classes = 2}, 1);
  auto x = tensor::zeros(dtype::float32, {2, 4});
  auto y = tensor::zeros(dtype::int32, {2});
  EXPECT_TRUE(fails_with(
      [&] {
        forward_backward(params, tensor::zeros(dtype::float32, {2, 5}), y);
      },
      errc::shape_mismatch, {"[N, 4]", "[2, 5]"}));
  EXPECT_TRUE(fails_with([&] { forward_backward(params, tensor::zeros(dtype::float32, {8}), y); },
                         errc::shape_mismatch, {"[N, 4]", "[8]"}));
  EXPECT_TRUE(fails_with([&] { forward_backward(params, x, tensor::zeros(dtype::int32, {3})); },
                         errc::shape_mismatch, {"y must have shape [2]", "[3]"}));
  EXPECT_TRUE(fails_with(
      [&] {
        forward_backward(params, tensor::zeros(dtype::float64, {2, 4}), y);
      },
      errc::dtype_mismatch, {"x must be float32", "float64"}));
  EXPECT_TRUE(fails_with([&] { forward_backward(params, x, tensor::zeros(dtype::int64, {2})); },
                         errc::dtype_mismatch, {"y must be int32", "int64"}));
  EXPECT_TRUE(fails_with(
      [&] {
        forward_backward(params, x, tensor::from<int32_t>({0, 2}));
      },
      errc::invalid_argument, {"label 2", "row 1", "[0, 2)"}));
  EXPECT_TRUE(fails_with(
      [&] {
        forward_backward(params, x, tensor::from<int32_t>({-1, 0}));
      },
      errc::invalid_argument, {"label -1", "row 0"}));
}

TEST(MlpTest, ForwardBackwardRejectsMalformedParameters) {
  nest params = init_params({.inputs = 4, .hidden = 3, .classes = 2}, 1);
  auto x = tensor::zeros(dtype::float32, {2, 4});
  auto y = tensor::zeros(dtype::int32, {2});
  auto without_b2 = params.as_dict();
  without_b2.erase("b2");
  EXPECT_TRUE(fails_with([&] { forward_backward(nest::dict(without_b2), x, y); },
                         errc::structure_mismatch, {"\"b2\"", "init_params"}));
  EXPECT_TRUE(fails_with([&] { forward_backward(nest::list({x}), x, y); }, errc::structure_mismatch,
                         {"exactly the keys"}));
  auto wrong_b1 = params.as_dict();
  wrong_b1["b1"] = tensor::zeros(dtype::float32, {4});
  EXPECT_TRUE(fails_with([&] { forward_backward(nest::dict(wrong_b1), x, y); },
                         errc::shape_mismatch, {"each bl [columns of wl]", "b1 [4]"}));
  auto extra = params.as_dict();
  extra["w3"] = tensor::zeros(dtype::float32, {2, 2});
  EXPECT_TRUE(fails_with([&] { forward_backward(nest::dict(extra), x, y); },
                         errc::structure_mismatch, {"\"b3\" is missing"}));
  extra["b3"] = tensor::zeros(dtype::float32, {2});
  extra["bias"] = tensor::zeros(dtype::float32, {2});
  EXPECT_TRUE(fails_with([&] { forward_backward(nest::dict(extra), x, y); },
                         errc::structure_mismatch, {"unexpected keys"}));
  auto not_square = init_params({.inputs = 4, .hidden = 3, .classes = 2, .layers = 2}, 1).as_dict();
  not_square["w2"] = tensor::zeros(dtype::float32, {3, 5});
  not_square["b2"] = tensor::zeros(dtype::float32, {5});
  EXPECT_TRUE(fails_with([&] { forward_backward(nest::dict(not_square), x, y); },
                         errc::shape_mismatch, {"w2..wL [hidden, hidden]", "w2 [3, 5]"}));
  auto wrong_type = params.as_dict();
  wrong_type["w2"] = tensor::zeros(dtype::float64, {3, 2});
  EXPECT_TRUE(fails_with([&] { forward_backward(nest::dict(wrong_type), x, y); },
                         errc::dtype_mismatch, {"\"w2\"", "float64"}));
}

// -- predict --------------------------------------------------------------------------------------

TEST(MlpTest, PredictAgreesWithForwardBackwardsCorrectCount) {
  nest params = init_params({.inputs = 16, .hidden = 8, .classes = 4}, 4);
  auto data = make_dataset({.examples = 50});
  auto predicted = predict(params, data.x);
  EXPECT_EQ(predicted.dtype(), dtype::int32);
  EXPECT_EQ(predicted.shape(), (shape_t{50}));
  EXPECT_DOUBLE_EQ(accuracy(params, data.x, data.y) * 50,
                   forward_backward(params, data.x, data.y).correct.item<double>());
}

// -- sgd_update -----------------------------------------------------------------------------------

TEST(MlpTest, SgdUpdateStepsAgainstTheMeanGradientWithoutTouchingSharedCopies) {
  nest params = nest::dict(
      {{"a", tensor::from<float>({1.0f, 2.0f})}, {"b", tensor::from<float>({0.5f}, {1, 1})}});
  nest published = params; // shares storage, as parameters sent to replicas do
  nest grads = nest::dict(
      {{"a", tensor::from<float>({4.0f, -8.0f})}, {"b", tensor::from<float>({2.0f}, {1, 1})}});
  sgd_update(params, grads, 0.5, 4); // p -= 0.5 * g / 4
  EXPECT_EQ(params["a"].as_tensor(), tensor::from<float>({0.5f, 3.0f}));
  EXPECT_EQ(params["b"].as_tensor(), tensor::from<float>({0.25f}, {1, 1}));
  EXPECT_EQ(published["a"].as_tensor(), tensor::from<float>({1.0f, 2.0f}));
  EXPECT_EQ(published["b"].as_tensor(), tensor::from<float>({0.5f}, {1, 1}));
}

TEST(MlpTest, SgdUpdateOfParametersNobodyElseHoldsIsInPlace) {
  nest params = nest::dict(
      {{"a", tensor::from<float>({1.0f, 2.0f})}, {"b", tensor::from<float>({0.5f}, {1, 1})}});
  const void* a_before = params["a"].as_tensor().raw_data();
  const void* b_before = params["b"].as_tensor().raw_data();
  nest grads = nest::dict(
      {{"a", tensor::from<float>({4.0f, -8.0f})}, {"b", tensor::from<float>({2.0f}, {1, 1})}});
  sgd_update(params, grads, 0.5, 4);
  EXPECT_EQ(params["a"].as_tensor(), tensor::from<float>({0.5f, 3.0f}));
  EXPECT_EQ(params["a"].as_tensor().raw_data(), a_before);
  EXPECT_EQ(params["b"].as_tensor().raw_data(), b_before);
  // A bad pair is found before any leaf changes: the parameters stay as they were.
  nest bad = nest::dict(
      {{"a", tensor::from<float>({1.0f, 1.0f})}, {"b", tensor::from<float>({1.0f, 1.0f})}});
  EXPECT_THROW(sgd_update(params, bad, 0.5, 1), consort::error);
  EXPECT_EQ(params["a"].as_tensor(), tensor::from<float>({0.5f, 3.0f}));
  EXPECT_EQ(params["b"].as_tensor(), tensor::from<float>({0.25f}, {1, 1}));
}

TEST(MlpTest, SgdUpdateRejectsMismatchesAndAnEmptyGlobalBatch) {
  nest params = init_params({.inputs = 2, .hidden = 2, .classes = 2}, 1);
  nest grads = params;
  EXPECT_TRUE(fails_with([&] { sgd_update(params, grads, 0.1, 0); }, errc::invalid_argument,
                         {"global_batch must be >= 1", "got 0"}));
  auto missing = grads.as_dict();
  missing.erase("w1");
  EXPECT_TRUE(fails_with([&] { sgd_update(params, nest::dict(missing), 0.1, 1); },
                         errc::structure_mismatch, {}));
  auto reshaped = grads.as_dict();
  reshaped["b1"] = tensor::zeros(dtype::float32, {3});
  EXPECT_TRUE(fails_with([&] { sgd_update(params, nest::dict(reshaped), 0.1, 1); },
                         errc::shape_mismatch, {"[2]", "[3]"}));
  auto retyped = grads.as_dict();
  retyped["b1"] = tensor::zeros(dtype::float64, {2});
  EXPECT_TRUE(fails_with([&] { sgd_update(params, nest::dict(retyped), 0.1, 1); },
                         errc::dtype_mismatch, {"float64"}));
}

// -- training -------------------------------------------------------------------------------------

TEST(MlpTest, DataParallelSgdLearnsTheSyntheticProblemThatDefeatsALinearModel) {
  // Two "replicas" per step, each on its half of the global batch; their gradient sums are
  // added as a SUM all-reduce would, then divided by the global batch in sgd_update.
  constexpr int64_t train_rows = 4096;
  constexpr int64_t test_rows = 1024;
  constexpr int64_t batch = 64;
  constexpr int steps = 600;
  constexpr double learning_rate = 0.2;
  auto all = make_dataset({.examples = train_rows + test_rows});
  auto x = all.x.slice(0, train_rows);
  auto y = all.y.slice(0, train_rows);
  auto test_x = all.x.slice(train_rows, train_rows + test_rows);
  auto test_y = all.y.slice(train_rows, train_rows + test_rows);

  nest params = init_params({.inputs = 16, .hidden = 32, .classes = 4}, 1);
  const double initial = accuracy(params, test_x, test_y);
  for (int step = 0; step < steps; ++step) {
    const int64_t begin = (step * batch) % train_rows;
    const int64_t mid = begin + batch / 2;
    const int64_t end = begin + batch;
    auto a = forward_backward(params, x.slice(begin, mid), y.slice(begin, mid));
    auto b = forward_backward(params, x.slice(mid, end), y.slice(mid, end));
    sgd_update(params, sum_of({a.grads, b.grads}), learning_rate, batch);
  }
  const double trained = accuracy(params, test_x, test_y);
  const double linear =
      linear_baseline_accuracy(x, y, test_x, test_y, 4, batch, steps, learning_rate);
  std::cout << "accuracy: initial " << initial << ", MLP " << trained << ", linear " << linear
            << "\n";
  EXPECT_GT(trained, 0.8);
  EXPECT_LT(linear, trained - 0.15);
}
