#include "support/expect_error.hpp"

#include <consort/dataset.hpp>

#include <gtest/gtest.h>

#include <numeric>
#include <vector>

using consort::dataset;
using consort::distributed_dataset;
using consort::errc;
using consort::nest;
using consort::shape_t;
using consort::split_batch;
using consort::tensor;
using consort::test::fails_with;

namespace {

/// `rows` rows of features [rows, 2] (row r holds 2r, 2r+1) and labels [rows] (row r holds r).
nest features_and_labels(int32_t rows) {
  std::vector<int32_t> x(static_cast<size_t>(rows) * 2);
  std::iota(x.begin(), x.end(), 0);
  std::vector<int32_t> y(static_cast<size_t>(rows));
  std::iota(y.begin(), y.end(), 0);
  return nest::dict({{"x", tensor::from<int32_t>(x, {rows, 2})}, {"y", tensor::from<int32_t>(y)}});
}

std::vector<int32_t> labels(const nest& batch) {
  return batch["y"].as_tensor().to_vector<int32_t>();
}

} // namespace

// -- split_batch ----------------------------------------------------------------------------------

TEST(DatasetTest, SplitBatchIsAsEvenAsPossibleInReplicaOrder) {
  EXPECT_EQ(split_batch(6, 2), (std::vector<int64_t>{3, 3}));
  EXPECT_EQ(split_batch(5, 2), (std::vector<int64_t>{3, 2}));
  EXPECT_EQ(split_batch(1, 2), (std::vector<int64_t>{1, 0}));
  EXPECT_EQ(split_batch(7, 3), (std::vector<int64_t>{3, 2, 2}));
  EXPECT_EQ(split_batch(0, 3), (std::vector<int64_t>{0, 0, 0}));
  EXPECT_EQ(split_batch(8, 1), (std::vector<int64_t>{8}));
}

TEST(DatasetTest, APartialBatchFillsEachReplicasFullShareInReplicaOrderAsTFDoes) {
  // TF's rebatch: a global batch of 8 over 2 replicas is 4 + 4, and a last batch of 6 is divided
  // into [0, 1, 2, 3] and [4, 5], not 3/3.
  EXPECT_EQ(split_batch(6, 2, 8), (std::vector<int64_t>{4, 2}));
  EXPECT_EQ(split_batch(1, 2, 8), (std::vector<int64_t>{1, 0}));
  EXPECT_EQ(split_batch(0, 2, 8), (std::vector<int64_t>{0, 0}));
  EXPECT_EQ(split_batch(8, 2, 8), (std::vector<int64_t>{4, 4}));
  // 8 over 3 is 3 + 3 + 2; 7 rows fill 3, 3, 1 and 4 rows 3, 1, 0.
  EXPECT_EQ(split_batch(7, 3, 8), (std::vector<int64_t>{3, 3, 1}));
  EXPECT_EQ(split_batch(4, 3, 8), (std::vector<int64_t>{3, 1, 0}));
  EXPECT_TRUE(fails_with([] { split_batch(9, 2, 8); }, errc::invalid_argument,
                         {"a batch of size 8 cannot hold 9 rows", "0..8"}));
  EXPECT_TRUE(fails_with([] { split_batch(-1, 2, 8); }, errc::invalid_argument, {"-1 rows"}));
}

TEST(DatasetTest, SplitBatchRejectsNoReplicasAndNegativeBatches) {
  EXPECT_TRUE(fails_with([] { split_batch(4, 0); }, errc::invalid_argument, {"replica", "0"}));
  EXPECT_TRUE(fails_with([] { split_batch(-1, 2); }, errc::invalid_argument, {"-1"}));
}

// -- dataset --------------------------------------------------------------------------------------

TEST(DatasetTest, FromTensorSlicesYieldsRowsWithoutTheSlicedAxis) {
  auto ds = dataset::from_tensor_slices(features_and_labels(3));
  EXPECT_FALSE(ds.is_batched());
  EXPECT_EQ(ds.num_rows(), 3);
  EXPECT_EQ(ds.cardinality(), 3);
  auto element = ds.get(1);
  EXPECT_EQ(element["x"].as_tensor(), tensor::from<int32_t>({2, 3}));
  EXPECT_EQ(element["y"].as_tensor().shape(), shape_t{});
  EXPECT_EQ(element["y"].as_tensor().item<int32_t>(), 1);
}

TEST(DatasetTest, FromTensorSlicesOfASingleTensor) {
  auto ds = dataset::from_tensor_slices(tensor::from<float>({1, 2, 3}));
  EXPECT_EQ(ds.cardinality(), 3);
  EXPECT_EQ(ds.get(2).as_tensor().item<float>(), 3.f);
}

TEST(DatasetTest, FromTensorSlicesRejectsMismatchedLeadingExtentsNamingBothLeaves) {
  auto bad =
      nest::dict({{"a", tensor::from<int32_t>({1, 2, 3})}, {"b", tensor::from<int32_t>({1, 2})}});
  EXPECT_TRUE(fails_with([&] { dataset::from_tensor_slices(bad); }, errc::shape_mismatch,
                         {"leaf [\"a\"]", "leaf [\"b\"]", "[3]", "[2]", "axis 0"}));
  auto bad_list = nest::list({tensor::from<int32_t>({1}), tensor::from<int32_t>({1, 2})});
  EXPECT_TRUE(fails_with([&] { dataset::from_tensor_slices(bad_list); }, errc::shape_mismatch,
                         {"leaf [0]", "leaf [1]"}));
}

TEST(DatasetTest, FromTensorSlicesRejectsScalarsAndEmptyStructures) {
  EXPECT_TRUE(fails_with(
      [] {
        dataset::from_tensor_slices(nest::list({tensor::from<int32_t>({1}), tensor::scalar(1)}));
      },
      errc::invalid_argument, {"leaf [1]", "scalar", "rank >= 1"}));
  EXPECT_TRUE(fails_with([] { dataset::from_tensor_slices(nest{}); }, errc::invalid_argument,
                         {"at least one tensor"}));
}

TEST(DatasetTest, BatchGroupsRowsAndKeepsAPartialLastBatch) {
  auto ds = dataset::from_tensor_slices(features_and_labels(10)).batch(4);
  EXPECT_TRUE(ds.is_batched());
  EXPECT_EQ(ds.batch_size(), 4);
  EXPECT_EQ(ds.cardinality(), 3);
  EXPECT_EQ(labels(ds.get(0)), (std::vector<int32_t>{0, 1, 2, 3}));
  EXPECT_EQ(labels(ds.get(2)), (std::vector<int32_t>{8, 9}));
  EXPECT_EQ(ds.get(2)["x"].as_tensor().shape(), (shape_t{2, 2}));
}

TEST(DatasetTest, BatchCanDropThePartialLastBatch) {
  auto ds = dataset::from_tensor_slices(features_and_labels(10)).batch(4, true);
  EXPECT_EQ(ds.cardinality(), 2);
  EXPECT_TRUE(fails_with([&] { ds.get(2); }, errc::out_of_range, {"index 2", "2 batches"}));
}

TEST(DatasetTest, BatchesShareStorageWithTheSource) {
  auto source = features_and_labels(6);
  auto ds = dataset::from_tensor_slices(source).batch(3);
  auto second = ds.get(1)["y"].as_tensor();
  EXPECT_EQ(static_cast<const int32_t*>(second.raw_data()),
            source["y"].as_tensor().data<int32_t>() + 3);
}

TEST(DatasetTest, BatchRejectsNonPositiveSizesAndRebatching) {
  auto ds = dataset::from_tensor_slices(features_and_labels(4));
  EXPECT_TRUE(fails_with([&] { ds.batch(0); }, errc::invalid_argument, {"batch_size", "0"}));
  EXPECT_TRUE(
      fails_with([&] { ds.batch(2).batch(2); }, errc::invalid_argument, {"already batched"}));
}

TEST(DatasetTest, GetAndRowsRejectOutOfRangeIndices) {
  auto ds = dataset::from_tensor_slices(features_and_labels(4));
  EXPECT_TRUE(fails_with([&] { ds.get(4); }, errc::out_of_range, {"4", "4 elements"}));
  EXPECT_TRUE(fails_with([&] { ds.get(-1); }, errc::out_of_range, {"-1"}));
  EXPECT_TRUE(fails_with([&] { ds.rows(3, 5); }, errc::out_of_range, {"[3, 5)", "4 rows"}));
  EXPECT_EQ(labels(ds.rows(1, 3)), (std::vector<int32_t>{1, 2}));
}

// -- distributed_dataset --------------------------------------------------------------------------

TEST(DatasetTest, DistributingAnUnbatchedDatasetFails) {
  auto ds = dataset::from_tensor_slices(features_and_labels(4));
  EXPECT_TRUE(fails_with(
      [&] {
        distributed_dataset(ds, 2, {0, 1});
      },
      errc::invalid_argument,
      {"distribute_dataset needs a batched dataset: call "
       ".batch(global_batch_size) first"}));
}

TEST(DatasetTest, DistributedDatasetRejectsBadReplicaCountsAndIds) {
  auto ds = dataset::from_tensor_slices(features_and_labels(4)).batch(2);
  EXPECT_TRUE(fails_with([&] { distributed_dataset(ds, 0, {0}); }, errc::invalid_argument,
                         {"num_replicas_in_sync"}));
  EXPECT_TRUE(fails_with(
      [&] {
        distributed_dataset(ds, 2, {0, 2});
      },
      errc::invalid_argument, {"replica id 2", "0..1"}));
  EXPECT_TRUE(fails_with([&] { distributed_dataset(ds, 2, {}); }, errc::invalid_argument,
                         {"at least one local replica"}));
}

TEST(DatasetTest, EachGlobalBatchIsSplitEvenlyAcrossReplicas) {
  // 11 rows in global batches of 6: the first splits 3/3, the partial last (5 rows) fills 3, then
  // 2.
  auto ds = dataset::from_tensor_slices(features_and_labels(11)).batch(6);
  distributed_dataset dist(ds, 2, {0, 1});
  ASSERT_EQ(dist.cardinality(), 2);
  auto first = dist.get(0);
  ASSERT_EQ(first.size(), 2u);
  EXPECT_EQ(labels(first[0]), (std::vector<int32_t>{0, 1, 2}));
  EXPECT_EQ(labels(first[1]), (std::vector<int32_t>{3, 4, 5}));
  auto last = dist.get(1);
  EXPECT_EQ(labels(last[0]), (std::vector<int32_t>{6, 7, 8}));
  EXPECT_EQ(labels(last[1]), (std::vector<int32_t>{9, 10}));
  EXPECT_EQ(last[1]["x"].as_tensor(), tensor::from<int32_t>({18, 19, 20, 21}, {2, 2}));
}

TEST(DatasetTest, ThePartialLastBatchGoesToTheFirstReplicasFirst) {
  // 14 rows in global batches of 8 over 2 replicas: 4/4, then the last 6 rows as 4/2.
  auto ds = dataset::from_tensor_slices(features_and_labels(14)).batch(8);
  distributed_dataset dist(ds, 2, {0, 1});
  auto last = dist.get(1);
  EXPECT_EQ(labels(last[0]), (std::vector<int32_t>{8, 9, 10, 11}));
  EXPECT_EQ(labels(last[1]), (std::vector<int32_t>{12, 13}));
}

TEST(DatasetTest, AReplicaWithoutRowsGetsAnEmptyBatch) {
  // 3 rows in batches of 2: the last global batch has 1 row for 2 replicas.
  auto ds = dataset::from_tensor_slices(features_and_labels(3)).batch(2);
  distributed_dataset dist(ds, 2, {0, 1});
  auto last = dist.get(1);
  EXPECT_EQ(labels(last[0]), (std::vector<int32_t>{2}));
  EXPECT_EQ(last[1]["x"].as_tensor().shape(), (shape_t{0, 2}));
  EXPECT_EQ(last[1]["y"].as_tensor().shape(), (shape_t{0}));
}

TEST(DatasetTest, LocalReplicaIdsPickTheirOwnChunks) {
  // 8 rows, one global batch over 4 replicas; this worker holds replicas 2 and 3.
  auto ds = dataset::from_tensor_slices(features_and_labels(8)).batch(8);
  distributed_dataset dist(ds, 4, {2, 3});
  auto parts = dist.get(0);
  ASSERT_EQ(parts.size(), 2u);
  EXPECT_EQ(labels(parts[0]), (std::vector<int32_t>{4, 5}));
  EXPECT_EQ(labels(parts[1]), (std::vector<int32_t>{6, 7}));
}

TEST(DatasetTest, IterationVisitsEveryGlobalBatchInOrder) {
  auto ds = dataset::from_tensor_slices(features_and_labels(5)).batch(2);
  distributed_dataset dist(ds, 2, {0, 1});
  std::vector<int32_t> seen;
  int64_t batches = 0;
  for (auto parts : dist) {
    ++batches;
    for (const auto& part : parts)
      for (auto label : labels(part))
        seen.push_back(label);
  }
  EXPECT_EQ(batches, 3);
  EXPECT_EQ(seen, (std::vector<int32_t>{0, 1, 2, 3, 4}));
  EXPECT_TRUE(fails_with([&] { dist.get(3); }, errc::out_of_range, {"3", "3 batches"}));
}

TEST(DatasetTest, DroppedRemainderNeverReachesTheReplicas) {
  auto ds = dataset::from_tensor_slices(features_and_labels(5)).batch(2, true);
  distributed_dataset dist(ds, 2, {0, 1});
  EXPECT_EQ(dist.cardinality(), 2);
  EXPECT_EQ(labels(dist.get(1)[1]), (std::vector<int32_t>{3}));
}

TEST(DatasetTest, WithSeveralWorkersSubBatchesAreInterleavedAcrossWorkers) {
  // 2 workers x 2 replicas: part k of a global batch goes to local replica k / 2 of worker k % 2,
  // as TF's rebatch-then-shard does. Worker 1 holds replica ids 2 and 3.
  auto ds = dataset::from_tensor_slices(features_and_labels(13)).batch(8);
  distributed_dataset worker0(ds, 4, {0, 1}, 2);
  distributed_dataset worker1(ds, 4, {2, 3}, 2);
  // 8 rows: parts of 2 rows: [0,1] [2,3] [4,5] [6,7].
  auto a = worker0.get(0);
  auto b = worker1.get(0);
  EXPECT_EQ(labels(a[0]), (std::vector<int32_t>{0, 1}));
  EXPECT_EQ(labels(b[0]), (std::vector<int32_t>{2, 3}));
  EXPECT_EQ(labels(a[1]), (std::vector<int32_t>{4, 5}));
  EXPECT_EQ(labels(b[1]), (std::vector<int32_t>{6, 7}));
  // The partial last batch of 5 rows fills the parts of 2 in part order (2/2/1/0, as TF's
  // rebatch), then goes to the workers as the full batches do.
  a = worker0.get(1);
  b = worker1.get(1);
  EXPECT_EQ(labels(a[0]), (std::vector<int32_t>{8, 9}));   // part 0
  EXPECT_EQ(labels(b[0]), (std::vector<int32_t>{10, 11})); // part 1
  EXPECT_EQ(labels(a[1]), (std::vector<int32_t>{12}));     // part 2
  EXPECT_EQ(labels(b[1]), (std::vector<int32_t>{}));       // part 3
}

TEST(DatasetTest, ReplicasMustSpreadEvenlyOverWorkers) {
  auto ds = dataset::from_tensor_slices(features_and_labels(4)).batch(2);
  EXPECT_TRUE(fails_with([&] { distributed_dataset(ds, 4, {0}, 3); }, errc::invalid_argument,
                         {"4 replicas in sync cannot be spread over 3 workers"}));
  EXPECT_TRUE(fails_with([&] { distributed_dataset(ds, 4, {0}, 0); }, errc::invalid_argument,
                         {"over 0 workers"}));
}
