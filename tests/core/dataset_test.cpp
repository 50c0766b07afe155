#include "support/expect_error.hpp"

#include <consort/dataset.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <ostream>
#include <vector>

namespace consort {
// gtest prints a row_range as [begin, end).
void PrintTo(const row_range& r, std::ostream* os) {
  *os << '[' << r.begin << ", " << r.end << ')';
}
} // namespace consort

using consort::dataset;
using consort::distributed_dataset;
using consort::errc;
using consort::input_context;
using consort::nest;
using consort::replica_rows;
using consort::row_range;
using consort::shape_t;
using consort::split_batch;
using consort::split_batch_across_workers;
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

TEST(DatasetTest, AcrossWorkersABatchSplitsIntoPartsOfCeilRowsAsTFsLegacyRebatch) {
  // TF's data sharding rewrites the rebatch to the legacy RebatchDataset over all W x D replicas:
  // parts of ceil(rows / parts) rows, in part order, full batches and partial ones alike.
  EXPECT_EQ(split_batch_across_workers(8, 2), (std::vector<int64_t>{4, 4}));
  EXPECT_EQ(split_batch_across_workers(6, 2), (std::vector<int64_t>{3, 3}));
  EXPECT_EQ(split_batch_across_workers(3, 2), (std::vector<int64_t>{2, 1}));
  EXPECT_EQ(split_batch_across_workers(8, 3), (std::vector<int64_t>{3, 3, 2}));
  EXPECT_EQ(split_batch_across_workers(6, 3), (std::vector<int64_t>{2, 2, 2}));
  EXPECT_EQ(split_batch_across_workers(6, 4), (std::vector<int64_t>{2, 2, 2, 0}));
  EXPECT_EQ(split_batch_across_workers(5, 4), (std::vector<int64_t>{2, 2, 1, 0}));
  // Where it differs from the even split: 4 over 3 is 2/2/0 (split_batch: 2/1/1).
  EXPECT_EQ(split_batch_across_workers(4, 3), (std::vector<int64_t>{2, 2, 0}));
  EXPECT_EQ(split_batch_across_workers(8, 6), (std::vector<int64_t>{2, 2, 2, 2, 0, 0}));
  EXPECT_EQ(split_batch_across_workers(1, 3), (std::vector<int64_t>{1, 0, 0}));
  EXPECT_EQ(split_batch_across_workers(0, 2), (std::vector<int64_t>{0, 0}));
  EXPECT_TRUE(fails_with([] { split_batch_across_workers(4, 0); }, errc::invalid_argument,
                         {"at least one part", "0"}));
  EXPECT_TRUE(fails_with([] { split_batch_across_workers(-1, 2); }, errc::invalid_argument,
                         {">= 0", "-1"}));
}

TEST(DatasetTest, ReplicaRowsOfRange14Batch8MatchTFAcrossWorkersAndWithinOne) {
  // range(14).batch(8): a full batch of 8 rows, then a partial one of 6. Replica ids are
  // worker-major (worker w's local replica i is w * D + i).
  using ranges = std::vector<row_range>;
  // One worker of 2 replicas keeps the full batch's shares, filled in order: 4/2.
  EXPECT_EQ(replica_rows(8, 8, 1, 2), (ranges{{0, 4}, {4, 8}}));
  EXPECT_EQ(replica_rows(6, 8, 1, 2), (ranges{{0, 4}, {4, 6}}));
  // 2 x 1 (strategy_common_test.py): the chief [0..3] then [8, 9, 10], the worker [4..7] then
  // [11, 12, 13].
  EXPECT_EQ(replica_rows(8, 8, 2, 1), (ranges{{0, 4}, {4, 8}}));
  EXPECT_EQ(replica_rows(6, 8, 2, 1), (ranges{{0, 3}, {3, 6}}));
  // 2 x 2: parts of 2 rows; worker 0 takes parts 0 and 2, worker 1 parts 1 and 3.
  EXPECT_EQ(replica_rows(8, 8, 2, 2), (ranges{{0, 2}, {4, 6}, {2, 4}, {6, 8}}));
  EXPECT_EQ(replica_rows(6, 8, 2, 2), (ranges{{0, 2}, {4, 6}, {2, 4}, {6, 6}}));
  // 3 x 1: 3/3/2, then 2/2/2.
  EXPECT_EQ(replica_rows(8, 8, 3, 1), (ranges{{0, 3}, {3, 6}, {6, 8}}));
  EXPECT_EQ(replica_rows(6, 8, 3, 1), (ranges{{0, 2}, {2, 4}, {4, 6}}));
  // 3 x 2: six parts, of 2 rows (the last two empty), then of 1 row.
  EXPECT_EQ(replica_rows(8, 8, 3, 2), (ranges{{0, 2}, {6, 8}, {2, 4}, {8, 8}, {4, 6}, {8, 8}}));
  EXPECT_EQ(replica_rows(6, 8, 3, 2), (ranges{{0, 1}, {3, 4}, {1, 2}, {4, 5}, {2, 3}, {5, 6}}));
}

TEST(DatasetTest, ReplicaRowsRejectsBadCountsAndRows) {
  EXPECT_TRUE(fails_with([] { replica_rows(4, 8, 0, 1); }, errc::invalid_argument,
                         {"at least one worker", "0 x 1"}));
  EXPECT_TRUE(fails_with([] { replica_rows(4, 8, 2, 0); }, errc::invalid_argument, {"2 x 0"}));
  EXPECT_TRUE(fails_with([] { replica_rows(9, 8, 2, 1); }, errc::invalid_argument,
                         {"a batch of size 8 cannot hold 9 rows", "0..8"}));
  EXPECT_TRUE(fails_with([] { replica_rows(-1, 8, 1, 2); }, errc::invalid_argument, {"-1 rows"}));
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
  EXPECT_TRUE(fails_with([&] { ds.rows(3, 5); }, errc::out_of_range, {"[3, 5)", "4 elements"}));
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

TEST(DatasetTest, APartialBatchSplitsEvenlyAcrossWorkersAsTFsMultiWorkerStrategyDoes) {
  // range(14).batch(8) over 2 workers x 1 replica (strategy_common_test.py,
  // testSimpleInputFromDatasetLastPartialBatch): the chief gets [8, 9, 10] and the worker
  // [11, 12, 13] in the second step, not 4/2.
  auto ds = dataset::from_tensor_slices(features_and_labels(14)).batch(8);
  distributed_dataset chief(ds, 2, {0}, 2);
  distributed_dataset worker(ds, 2, {1}, 2);
  EXPECT_EQ(labels(chief.get(0)[0]), (std::vector<int32_t>{0, 1, 2, 3}));
  EXPECT_EQ(labels(worker.get(0)[0]), (std::vector<int32_t>{4, 5, 6, 7}));
  EXPECT_EQ(labels(chief.get(1)[0]), (std::vector<int32_t>{8, 9, 10}));
  EXPECT_EQ(labels(worker.get(1)[0]), (std::vector<int32_t>{11, 12, 13}));
  EXPECT_EQ(worker.get(1)[0]["x"].as_tensor(),
            tensor::from<int32_t>({22, 23, 24, 25, 26, 27}, {3, 2}));
  // 3 workers x 1: 3/3/2, then 2/2/2.
  std::vector<std::vector<int32_t>> first;
  std::vector<std::vector<int32_t>> second;
  for (int w = 0; w < 3; ++w) {
    distributed_dataset dist(ds, 3, {w}, 3);
    first.push_back(labels(dist.get(0)[0]));
    second.push_back(labels(dist.get(1)[0]));
  }
  EXPECT_EQ(first, (std::vector<std::vector<int32_t>>{{0, 1, 2}, {3, 4, 5}, {6, 7}}));
  EXPECT_EQ(second, (std::vector<std::vector<int32_t>>{{8, 9}, {10, 11}, {12, 13}}));
}

TEST(DatasetTest, ReplicasMustSpreadEvenlyOverWorkers) {
  auto ds = dataset::from_tensor_slices(features_and_labels(4)).batch(2);
  EXPECT_TRUE(fails_with([&] { distributed_dataset(ds, 4, {0}, 3); }, errc::invalid_argument,
                         {"4 replicas in sync cannot be spread over 3 workers"}));
  EXPECT_TRUE(fails_with([&] { distributed_dataset(ds, 4, {0}, 0); }, errc::invalid_argument,
                         {"over 0 workers"}));
}

// -- element transformations
// -----------------------------------------------------------------------

namespace {

std::vector<int32_t> all_labels(const dataset& ds) {
  std::vector<int32_t> out;
  for (int64_t i = 0; i < ds.cardinality(); ++i)
    for (auto label : ds.is_batched()
                          ? labels(ds.get(i))
                          : std::vector<int32_t>{ds.get(i)["y"].as_tensor().item<int32_t>()})
      out.push_back(label);
  return out;
}

std::vector<int32_t> iota(int32_t n) {
  std::vector<int32_t> out(static_cast<size_t>(n));
  std::iota(out.begin(), out.end(), 0);
  return out;
}

} // namespace

TEST(DatasetTest, ShuffleWithASeedIsARepeatablePermutation) {
  auto ds = dataset::from_tensor_slices(features_and_labels(10));
  auto a = all_labels(ds.shuffle(10, 7));
  EXPECT_EQ(a, all_labels(ds.shuffle(10, 7))); // the same seed, the same order
  EXPECT_NE(a, all_labels(ds.shuffle(10, 8))); // another seed, another order
  EXPECT_NE(a, iota(10));
  auto sorted = a;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_EQ(sorted, iota(10));
  // A buffer of one keeps the order.
  EXPECT_EQ(all_labels(ds.shuffle(1, 7)), iota(10));
}

TEST(DatasetTest, ShuffleDrawsFromABufferAsTfDataDoes) {
  // With a buffer of 3, output k is one of inputs 0..k+2 (the buffer holds 3 inputs at a time).
  auto out = all_labels(dataset::from_tensor_slices(features_and_labels(50)).shuffle(3, 1));
  for (size_t k = 0; k < out.size(); ++k)
    EXPECT_LE(out[k], static_cast<int32_t>(k) + 2) << "output " << k;
}

TEST(DatasetTest, ABatchOfShuffledElementsKeepsEveryLeafsRowsTogether) {
  auto ds = dataset::from_tensor_slices(features_and_labels(9)).shuffle(9, 5).batch(4);
  ASSERT_EQ(ds.cardinality(), 3);
  std::vector<int32_t> seen;
  for (int64_t b = 0; b < 3; ++b) {
    auto batch = ds.get(b);
    auto y = labels(batch);
    auto x = batch["x"].as_tensor().to_vector<int32_t>();
    ASSERT_EQ(x.size(), y.size() * 2);
    for (size_t i = 0; i < y.size(); ++i) {
      EXPECT_EQ(x[2 * i], 2 * y[i]); // row r of x holds 2r, 2r+1
      EXPECT_EQ(x[2 * i + 1], 2 * y[i] + 1);
      seen.push_back(y[i]);
    }
  }
  EXPECT_EQ(labels(ds.get(2)).size(), 1u);
  std::sort(seen.begin(), seen.end());
  EXPECT_EQ(seen, iota(9));
}

TEST(DatasetTest, RepeatGivesEveryEpochAndReshufflesEachOne) {
  auto ds = dataset::from_tensor_slices(features_and_labels(4));
  EXPECT_EQ(all_labels(ds.repeat(2)), (std::vector<int32_t>{0, 1, 2, 3, 0, 1, 2, 3}));
  auto twice = all_labels(ds.shuffle(4, 11).repeat(3));
  ASSERT_EQ(twice.size(), 12u);
  std::vector<int32_t> e0(twice.begin(), twice.begin() + 4),
      e1(twice.begin() + 4, twice.begin() + 8);
  EXPECT_EQ(e0, all_labels(ds.shuffle(4, 11)));
  EXPECT_NE(e0, e1) << "tf.data reshuffles every epoch by default";
  std::sort(e1.begin(), e1.end());
  EXPECT_EQ(e1, iota(4));
  EXPECT_EQ(twice, all_labels(ds.shuffle(4, 11).repeat(3))); // and repeatably so
  // A batch may span the end of an epoch.
  EXPECT_EQ(labels(ds.repeat(2).batch(3).get(1)), (std::vector<int32_t>{3, 0, 1}));
}

TEST(DatasetTest, TakeAndShardSelectElements) {
  auto ds = dataset::from_tensor_slices(features_and_labels(10));
  EXPECT_EQ(all_labels(ds.take(3)), (std::vector<int32_t>{0, 1, 2}));
  EXPECT_EQ(ds.take(100).cardinality(), 10);
  EXPECT_EQ(ds.take(0).cardinality(), 0);
  EXPECT_EQ(all_labels(ds.shard(3, 1)), (std::vector<int32_t>{1, 4, 7}));
  EXPECT_EQ(all_labels(ds.shard(3, 0).take(2)), (std::vector<int32_t>{0, 3}));
  // A sharded batch is assembled from non-contiguous rows.
  EXPECT_EQ(ds.shard(2, 1).batch(2).get(1)["x"].as_tensor(),
            tensor::from<int32_t>({10, 11, 14, 15}, {2, 2}));
}

TEST(DatasetTest, MapAppliesToEveryElementBeforeBatching) {
  auto ds = dataset::from_tensor_slices(features_and_labels(5)).map([](const nest& e) {
    auto y = e["y"].as_tensor().item<int32_t>();
    return nest::dict(
        {{"y", tensor::scalar<int32_t>(10 * y)}, {"odd", tensor::scalar<int32_t>(y % 2)}});
  });
  EXPECT_EQ(ds.get(3)["y"].as_tensor().item<int32_t>(), 30);
  auto batch = ds.batch(2).get(1);
  EXPECT_EQ(labels(batch), (std::vector<int32_t>{20, 30}));
  EXPECT_EQ(batch["odd"].as_tensor().to_vector<int32_t>(), (std::vector<int32_t>{0, 1}));
  // A mapped dataset's empty batch has the mapped structure.
  auto empty = ds.rows(5, 5);
  EXPECT_EQ(empty["odd"].as_tensor().shape(), (shape_t{0}));
}

TEST(DatasetTest, ElementTransformationsNeedAnUnbatchedDatasetAndValidArguments) {
  auto ds = dataset::from_tensor_slices(features_and_labels(4));
  auto batched = ds.batch(2);
  EXPECT_TRUE(fails_with([&] { batched.shuffle(4, 1); }, errc::invalid_argument,
                         {"shuffle: the dataset is already batched", "before batch"}));
  EXPECT_TRUE(fails_with([&] { batched.repeat(2); }, errc::invalid_argument, {"repeat"}));
  EXPECT_TRUE(fails_with([&] { batched.map([](const nest& e) { return e; }); },
                         errc::invalid_argument, {"map"}));
  EXPECT_TRUE(fails_with([&] { ds.shuffle(0, 1); }, errc::invalid_argument, {"buffer_size", "0"}));
  EXPECT_TRUE(fails_with([&] { ds.repeat(0); }, errc::invalid_argument, {"give the epochs"}));
  EXPECT_TRUE(fails_with([&] { ds.take(-1); }, errc::invalid_argument, {"-1"}));
  EXPECT_TRUE(
      fails_with([&] { ds.shard(2, 2); }, errc::invalid_argument, {"index in 0..1", "index 2"}));
  EXPECT_TRUE(fails_with([&] { ds.map(nullptr); }, errc::invalid_argument, {"empty"}));
}

// -- input_context and per-replica batches --------------------------------------------------------

TEST(DatasetTest, InputContextGivesThePerReplicaBatchSizeOnlyWhenItDivides) {
  input_context ctx(2, 1, 4);
  EXPECT_EQ(ctx.num_input_pipelines(), 2);
  EXPECT_EQ(ctx.input_pipeline_id(), 1);
  EXPECT_EQ(ctx.num_replicas_in_sync(), 4);
  EXPECT_EQ(ctx.get_per_replica_batch_size(64), 16);
  EXPECT_TRUE(fails_with([&] { ctx.get_per_replica_batch_size(10); }, errc::invalid_argument,
                         {"`global_batch_size` 10 is not divisible by `num_replicas_in_sync` 4"}));
  EXPECT_TRUE(fails_with([] { input_context(2, 2, 4); }, errc::invalid_argument, {"2, 2, 4"}));
  EXPECT_TRUE(fails_with([] { input_context(1, 0, 0); }, errc::invalid_argument, {"1, 0, 0"}));
}

TEST(DatasetTest, PerReplicaBatchesGoToTheLocalReplicasInTurn) {
  // 5 per-replica batches of 2 over 2 local replicas: steps (0, 1), (2, 3), (4, empty).
  auto ds = dataset::from_tensor_slices(features_and_labels(10)).batch(2);
  auto dist = distributed_dataset::from_per_replica_batches(ds, 2);
  ASSERT_EQ(dist.cardinality(), 3);
  EXPECT_EQ(labels(dist.get(1)[0]), (std::vector<int32_t>{4, 5}));
  EXPECT_EQ(labels(dist.get(1)[1]), (std::vector<int32_t>{6, 7}));
  EXPECT_EQ(labels(dist.get(2)[0]), (std::vector<int32_t>{8, 9}));
  EXPECT_EQ(dist.get(2)[1]["x"].as_tensor().shape(), (shape_t{0, 2}));
  EXPECT_TRUE(fails_with(
      [] {
        distributed_dataset::from_per_replica_batches(
            dataset::from_tensor_slices(features_and_labels(2)), 2);
      },
      errc::invalid_argument, {"must return a batched dataset"}));
}
