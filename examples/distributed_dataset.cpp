// distributed_dataset: feeding replicas from a dataset. `dataset::from_tensor_slices` slices
// features and labels along axis 0, `batch(6)` groups the rows into global batches, and
// `strategy.distribute_dataset` splits every global batch over the replicas as evenly as possible
// in replica order. With 11 rows, batches of 6 and 2 replicas, the last global batch has 5 rows,
// so the replicas get 3/3 and then 3/2 rows. Each step sums its labels with all_reduce.
//
// Usage:
//   ./build/examples/distributed_dataset
//
// Expected output:
//   11 rows, batch(6) -> 2 global batches over 2 replicas
//   batch 0: replica rows 3/3, labels {0, 1, 2} / {3, 4, 5}, label sum 15
//   batch 1: replica rows 3/2, labels {6, 7, 8} / {9, 10}, label sum 40
//   rows seen by all replicas: 11

#include <consort/consort.hpp>

#include <cstdint>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

using namespace consort;

namespace {

/// "{6, 7, 8}"
std::string join(const std::vector<int32_t>& values) {
  std::string out = "{";
  for (size_t i = 0; i < values.size(); ++i) {
    out += i > 0 ? ", " : "";
    out += std::to_string(values[i]);
  }
  return out + "}";
}

} // namespace

int main() {
  mirrored_strategy strategy({"CPU:0", "CPU:1"});

  // 11 examples: a feature row of 2 floats and an integer label each.
  std::vector<float> features;
  std::vector<int32_t> labels;
  for (int32_t i = 0; i < 11; ++i) {
    features.insert(features.end(), {0.5f * i, -0.5f * i});
    labels.push_back(i);
  }
  auto ds = dataset::from_tensor_slices(nest::dict({{"x", tensor::from<float>(features, {11, 2})},
                                                    {"y", tensor::from<int32_t>(labels)}}))
                .batch(6);
  distributed_dataset dist = strategy.distribute_dataset(ds);
  std::cout << ds.num_rows() << " rows, batch(" << *ds.batch_size() << ") -> " << dist.cardinality()
            << " global batches over " << strategy.num_replicas_in_sync() << " replicas\n";

  int64_t index = 0;
  int64_t rows_seen = 0;
  for (per_replica<nest> batch : dist) {
    // Each replica sees only its sub-batch: {"x": [rows, 2], "y": [rows]}.
    auto out = strategy.run(
        [](replica_context& ctx, const nest& b) {
          const tensor& y = b["y"].as_tensor();
          int64_t sum = 0;
          for (int32_t v : y.to_vector<int32_t>())
            sum += v;
          return nest::dict({{"rows", tensor::scalar<int64_t>(b["x"].as_tensor().shape()[0])},
                             {"label_sum", ctx.all_reduce("SUM", tensor::scalar<int64_t>(sum))}});
        },
        batch);
    std::cout << "batch " << index++ << ": replica rows ";
    for (size_t i = 0; i < out.size(); ++i)
      std::cout << (i > 0 ? "/" : "") << out[i]["rows"].as_tensor().item<int64_t>();
    std::cout << ", labels ";
    for (size_t i = 0; i < batch.size(); ++i)
      std::cout << (i > 0 ? " / " : "") << join(batch[i]["y"].as_tensor().to_vector<int32_t>());
    std::cout << ", label sum " << out[0]["label_sum"].as_tensor().item<int64_t>() << '\n';
    rows_seen += strategy.reduce("SUM", out, std::nullopt)["rows"].as_tensor().item<int64_t>();
  }
  std::cout << "rows seen by all replicas: " << rows_seen << '\n';
  return rows_seen == 11 ? 0 : 1;
}
