// custom_training_loop: the C++ twin of TensorFlow's tutorial "Custom training with
// tf.distribute.Strategy". A softmax classifier (one dense layer: 4 features -> 3 classes) is
// trained on a synthetic dataset with everything the tutorial uses: a strategy, a distributed
// dataset, variables created by the strategy, a step with a loss and its gradients (written by
// hand), an SGD optimizer that all-reduces them, `reduce(MEAN, axis 0)` of the per-example
// losses, and metrics kept in sync-on-read variables. docs/guide.md walks through it.
//
// In one process it runs on two CPU replicas (MirroredStrategy). Under a launcher (TF_CONFIG
// set), the same program runs as a MultiWorkerMirroredStrategy worker; the numbers it prints do
// not depend on the layout, up to float32 rounding in the last digits.
//
// Usage:
//   ./build/examples/custom_training_loop
//   tools/consort-launch -n 2 -- ./build/examples/custom_training_loop
//
// Expected output:
//   MirroredStrategy: 2 replicas in sync, global batch 64
//   epoch 1: loss 0.9945, accuracy 69.92%, test loss 0.8167, test accuracy 85.94%
//   epoch 2: loss 0.7192, accuracy 89.45%, test loss 0.6335, test accuracy 89.06%
//   epoch 3: loss 0.5708, accuracy 92.97%, test loss 0.5360, test accuracy 92.19%
//   epoch 4: loss 0.4917, accuracy 92.58%, test loss 0.4762, test accuracy 96.88%
//   epoch 5: loss 0.4420, accuracy 92.58%, test loss 0.4349, test accuracy 96.88%
//   variable dense/kernel float32[4, 3] ON_WRITE
//   variable dense/bias float32[3] ON_WRITE
//   variable train/loss float32[] ON_READ SUM
//   variable train/correct float32[] ON_READ SUM
//   variable train/count float32[] ON_READ SUM
//   variable test/loss float32[] ON_READ SUM
//   variable test/correct float32[] ON_READ SUM
//   variable test/count float32[] ON_READ SUM
//   variable dense/kernel/momentum float32[4, 3] ON_WRITE
//   variable dense/bias/momentum float32[3] ON_WRITE

#include <consort/consort.hpp>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

using namespace consort;

namespace {

constexpr int64_t features = 4;
constexpr int64_t classes = 3;
constexpr int64_t global_batch_size = 64;
constexpr int epochs = 5;

// -- the data: points of 4 features, labelled by a fixed linear rule ------------------------------

/// A deterministic value in [-1, 1) for (row, column, seed): no RNG state, the same bytes on every
/// worker.
float uniform(uint32_t row, uint32_t column, uint32_t seed) {
  uint32_t h = row * 2654435761u ^ (column + 1) * 40503u ^ seed * 2246822519u;
  h ^= h >> 15;
  h *= 2246822519u;
  h ^= h >> 13;
  return static_cast<float>(h % 20000u) / 10000.0f - 1.0f;
}

/// `rows` examples: {"x": float32[rows, 4], "y": int32[rows]}.
nest make_examples(uint32_t rows, uint32_t seed) {
  const float rule[classes][features] = {
      {1.0f, -0.5f, 0.2f, 0.0f}, {-0.6f, 1.0f, 0.0f, 0.4f}, {0.0f, -0.3f, -1.0f, 0.8f}};
  std::vector<float> x;
  std::vector<int32_t> y;
  for (uint32_t r = 0; r < rows; ++r) {
    float best = -1e30f;
    int32_t label = 0;
    std::vector<float> row;
    for (uint32_t k = 0; k < features; ++k)
      row.push_back(uniform(r, k, seed));
    for (int32_t c = 0; c < classes; ++c) {
      float score = 0;
      for (size_t k = 0; k < features; ++k)
        score += rule[c][k] * row[k];
      if (score > best) {
        best = score;
        label = c;
      }
    }
    x.insert(x.end(), row.begin(), row.end());
    y.push_back(label);
  }
  return nest::dict({{"x", tensor::from<float>(x, {static_cast<int64_t>(rows), features})},
                     {"y", tensor::from<int32_t>(y)}});
}

// -- the model: logits = x W + b, softmax cross-entropy -----------------------------------------

/// What a forward pass gives for a replica's rows.
struct forward_pass {
  std::vector<float> probabilities; // [rows, classes]
  std::vector<float> losses;        // [rows]: -log p(label)
  float correct = 0;
};

forward_pass forward(const tensor& x, const tensor& y, const tensor& kernel, const tensor& bias) {
  const auto rows = x.shape()[0];
  const float* xs = x.data<float>();
  const int32_t* labels = y.data<int32_t>();
  const float* w = kernel.data<float>();
  const float* b = bias.data<float>();
  forward_pass out;
  for (int64_t r = 0; r < rows; ++r) {
    float logits[classes];
    float top = -1e30f;
    int64_t predicted = 0;
    for (int64_t c = 0; c < classes; ++c) {
      logits[c] = b[c];
      for (int64_t k = 0; k < features; ++k)
        logits[c] += xs[r * features + k] * w[k * classes + c];
      if (logits[c] > top) {
        top = logits[c];
        predicted = c;
      }
    }
    float norm = 0;
    for (float& l : logits) {
      l = std::exp(l - top);
      norm += l;
    }
    for (float l : logits)
      out.probabilities.push_back(l / norm);
    out.losses.push_back(
        -std::log(out.probabilities[static_cast<size_t>(r * classes + labels[r])]));
    out.correct += predicted == labels[r] ? 1.0f : 0.0f;
  }
  return out;
}

float sum(const std::vector<float>& v) {
  float s = 0;
  for (float x : v)
    s += x;
  return s;
}

std::string format(const char* pattern, double value) {
  char text[32];
  std::snprintf(text, sizeof text, pattern, value);
  return text;
}

/// In one process: two CPU replicas (the tutorial's MirroredStrategy). Started by a launcher
/// (TF_CONFIG set): a worker of a MultiWorkerMirroredStrategy.
std::unique_ptr<strategy> make_strategy() {
  if (std::getenv("TF_CONFIG") != nullptr)
    return std::make_unique<multi_worker_mirrored_strategy>();
  return std::make_unique<mirrored_strategy>(std::vector<std::string>{"CPU:0", "CPU:1"});
}

} // namespace

int main() {
  auto strategy_ptr = make_strategy();
  strategy& strategy = *strategy_ptr;
  std::cout << strategy.name() << ": " << strategy.num_replicas_in_sync()
            << " replicas in sync, global batch " << global_batch_size << '\n';

  // The datasets: every global batch of 64 rows is split over the replicas of every worker.
  auto train_dataset = strategy.distribute_dataset(
      dataset::from_tensor_slices(make_examples(256, 1)).shuffle(256, 7).batch(global_batch_size));
  auto test_dataset = strategy.distribute_dataset(
      dataset::from_tensor_slices(make_examples(64, 2)).batch(global_batch_size));

  // The model's variables, created by the strategy: mirrored, one copy per replica.
  variable kernel = strategy.create_variable(
      "dense/kernel",
      tensor::from<float>(std::vector<float>(features * classes, 0.0f), {features, classes}));
  variable bias = strategy.create_variable("dense/bias", tensor::zeros(dtype::float32, {classes}));
  sgd optimizer({.learning_rate = 0.5, .momentum = 0.5});

  // The metrics (Keras's Mean and SparseCategoricalAccuracy): sync-on-read sums that each replica
  // updates on its own; read outside a step, each is the sum over every replica of every worker.
  auto metric = [&](const std::string& name) {
    return strategy.create_variable(name, tensor::scalar<float>(0.0f),
                                    {variable_synchronization::on_read, variable_aggregation::sum});
  };
  variable train_loss = metric("train/loss"), train_correct = metric("train/correct"),
           train_count = metric("train/count");
  variable test_loss = metric("test/loss"), test_correct = metric("test/correct"),
           test_count = metric("test/count");

  // The training step, run by every replica on its part of the global batch.
  auto train_step = [&](replica_context& ctx, const nest& batch) {
    const tensor& x = batch["x"].as_tensor();
    const tensor& y = batch["y"].as_tensor();
    const auto rows = x.shape()[0];
    auto pass = forward(x, y, ctx.read(kernel), ctx.read(bias));

    // The loss is the sum of the per-example losses over the *global* batch size (TF's
    // compute_average_loss), so its gradients are summed, not averaged, across replicas. Its
    // gradients: d loss / d logits = (p - onehot(y)) / global batch.
    std::vector<float> grad_kernel(features * classes, 0.0f), grad_bias(classes, 0.0f);
    const float* xs = x.data<float>();
    const int32_t* labels = y.data<int32_t>();
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < classes; ++c) {
        const float p = pass.probabilities[static_cast<size_t>(r * classes + c)];
        const float d = (p - (labels[r] == c ? 1.0f : 0.0f)) / global_batch_size;
        grad_bias[static_cast<size_t>(c)] += d;
        for (int64_t k = 0; k < features; ++k)
          grad_kernel[static_cast<size_t>(k * classes + c)] += xs[r * features + k] * d;
      }
    optimizer.apply_gradients(ctx, {{tensor::from<float>(grad_kernel, {features, classes}), kernel},
                                    {tensor::from<float>(grad_bias, {classes}), bias}});

    ctx.assign_add(train_loss, tensor::scalar<float>(sum(pass.losses)));
    ctx.assign_add(train_correct, tensor::scalar<float>(pass.correct));
    ctx.assign_add(train_count, tensor::scalar<float>(static_cast<float>(rows)));
    return tensor::from<float>(pass.losses, {rows}); // the per-example losses
  };

  auto test_step = [&](replica_context& ctx, const nest& batch) {
    const tensor& x = batch["x"].as_tensor();
    auto pass = forward(x, batch["y"].as_tensor(), ctx.read(kernel), ctx.read(bias));
    ctx.assign_add(test_loss, tensor::scalar<float>(sum(pass.losses)));
    ctx.assign_add(test_correct, tensor::scalar<float>(pass.correct));
    ctx.assign_add(test_count, tensor::scalar<float>(static_cast<float>(x.shape()[0])));
    return tensor::scalar<float>(0.0f);
  };

  for (int epoch = 1; epoch <= epochs; ++epoch) {
    double total_loss = 0;
    int batches = 0;
    for (per_replica<nest> batch : train_dataset) {
      per_replica<tensor> losses = strategy.run(train_step, batch);
      // MEAN along axis 0: the mean over the global batch's examples, wherever they ran.
      total_loss += strategy.reduce("MEAN", losses, 0).item<float>();
      ++batches;
    }
    for (per_replica<nest> batch : test_dataset)
      strategy.run(test_step, batch);

    const float count = train_count.value().item<float>();
    const float test_n = test_count.value().item<float>();
    std::cout << "epoch " << epoch << ": loss " << format("%.4f", total_loss / batches)
              << ", accuracy "
              << format("%.2f", 100.0 * train_correct.value().item<float>() / count)
              << "%, test loss " << format("%.4f", test_loss.value().item<float>() / test_n)
              << ", test accuracy "
              << format("%.2f", 100.0 * test_correct.value().item<float>() / test_n) << "%\n";
    for (variable* v :
         {&train_loss, &train_correct, &train_count, &test_loss, &test_correct, &test_count})
      v->assign(tensor::scalar<float>(0.0f)); // reset the metrics
  }

  // What a checkpoint saves: every variable by name, in creation order (the optimizer's momentum
  // slots were made on its first step); strategy.variable_values() gives their values.
  for (const variable& v : strategy.variables()) {
    std::cout << "variable " << v.name() << " " << to_string(v.dtype()) << to_string(v.shape())
              << " " << to_string(v.synchronization());
    if (v.synchronization() == variable_synchronization::on_read)
      std::cout << " " << to_string(v.aggregation());
    std::cout << '\n';
  }
  return 0;
}
