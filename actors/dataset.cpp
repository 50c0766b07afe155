#include "device/nest_paths.hpp"

#include <consort/dataset.hpp>
#include <consort/error.hpp>

namespace consort {

// -- dataset --------------------------------------------------------------------------------------

dataset dataset::from_tensor_slices(nest elements) {
  auto leaves = detail::flatten_with_paths(elements);
  if (leaves.empty())
    throw_error(errc::invalid_argument,
                "from_tensor_slices needs at least one tensor; got " + elements.structure_string());
  for (const auto& [path, t] : leaves) {
    if (!t.valid())
      throw_error(errc::invalid_argument, "from_tensor_slices: " + detail::describe_leaf(path) +
                                              " is a default-constructed tensor");
    if (t.rank() == 0)
      throw_error(errc::invalid_argument,
                  "from_tensor_slices: " + detail::describe_leaf(path) +
                      " is a scalar; every tensor needs rank >= 1 to be sliced along axis 0");
  }
  const auto& [first_path, first] = leaves.front();
  for (const auto& [path, t] : leaves)
    if (t.shape()[0] != first.shape()[0])
      throw_error(errc::shape_mismatch,
                  "from_tensor_slices: " + detail::describe_leaf(path) + " has shape " +
                      to_string(t.shape()) + " but " + detail::describe_leaf(first_path) +
                      " has shape " + to_string(first.shape()) +
                      "; every tensor must have the same extent along axis 0");
  dataset out;
  out.rows_ = first.shape()[0];
  out.elements_ = std::move(elements);
  return out;
}

dataset dataset::batch(int64_t batch_size, bool drop_remainder) const {
  if (batch_size < 1)
    throw_error(errc::invalid_argument,
                "batch: batch_size must be >= 1; got " + std::to_string(batch_size));
  if (is_batched())
    throw_error(errc::invalid_argument, "batch: the dataset is already batched (batch_size " +
                                            std::to_string(*batch_size_) +
                                            "); batches of batches are not supported");
  dataset out = *this;
  out.batch_size_ = batch_size;
  out.drop_remainder_ = drop_remainder;
  return out;
}

int64_t dataset::cardinality() const noexcept {
  if (!batch_size_)
    return rows_;
  auto bs = *batch_size_;
  return drop_remainder_ ? rows_ / bs : (rows_ + bs - 1) / bs;
}

nest dataset::get(int64_t index) const {
  if (index < 0 || index >= cardinality())
    throw_error(errc::out_of_range,
                std::string{is_batched() ? "batch" : "element"} + " index " +
                    std::to_string(index) + " is out of range: the dataset has " +
                    std::to_string(cardinality()) + (is_batched() ? " batches" : " elements"));
  if (!batch_size_) {
    // One element: row `index` of every leaf, without the sliced axis (as tf.data yields it).
    return map_structure(elements_, [&](const tensor& t) {
      auto row_shape = t.shape();
      row_shape.erase(row_shape.begin());
      return t.slice(index, index + 1).reshape(std::move(row_shape));
    });
  }
  auto begin = index * *batch_size_;
  return rows(begin, std::min(begin + *batch_size_, rows_));
}

nest dataset::rows(int64_t begin, int64_t end) const {
  if (begin < 0 || end < begin || end > rows_)
    throw_error(errc::out_of_range, "rows [" + std::to_string(begin) + ", " + std::to_string(end) +
                                        ") are out of range: the dataset has " +
                                        std::to_string(rows_) + " rows");
  return map_structure(elements_, [&](const tensor& t) { return t.slice(begin, end); });
}

// -- splitting
// --------------------------------------------------------------------------------------

std::vector<int64_t> split_batch(int64_t global_batch, int num_replicas) {
  if (num_replicas < 1)
    throw_error(errc::invalid_argument,
                "split_batch needs at least one replica; got " + std::to_string(num_replicas));
  if (global_batch < 0)
    throw_error(errc::invalid_argument, "split_batch: the global batch size must be >= 0; got " +
                                            std::to_string(global_batch));
  std::vector<int64_t> out(static_cast<size_t>(num_replicas), global_batch / num_replicas);
  for (int64_t r = 0; r < global_batch % num_replicas; ++r)
    ++out[static_cast<size_t>(r)];
  return out;
}

std::vector<int64_t> split_batch(int64_t rows, int num_replicas, int64_t batch_size) {
  if (rows < 0 || rows > batch_size)
    throw_error(errc::invalid_argument, "split_batch: a batch of size " +
                                            std::to_string(batch_size) + " cannot hold " +
                                            std::to_string(rows) + " rows (expected 0.." +
                                            std::to_string(batch_size) + ")");
  // A full batch's shares; a partial batch fills them in replica order (TF's rebatch).
  auto out = split_batch(batch_size, num_replicas);
  for (auto& share : out) {
    share = std::min(share, rows);
    rows -= share;
  }
  return out;
}

distributed_dataset::distributed_dataset(dataset source, int num_replicas_in_sync,
                                         std::vector<int> local_replica_ids, int num_workers)
    : source_(std::move(source)), num_replicas_(num_replicas_in_sync),
      local_replica_ids_(std::move(local_replica_ids)), num_workers_(num_workers) {
  if (num_workers_ < 1 || num_replicas_in_sync % num_workers_ != 0)
    throw_error(errc::invalid_argument,
                "distribute_dataset: " + std::to_string(num_replicas_in_sync) +
                    " replicas in sync cannot be spread over " + std::to_string(num_workers) +
                    " workers; every worker has the same number of replicas");
  if (!source_.is_batched())
    throw_error(errc::invalid_argument, "distribute_dataset needs a batched dataset: call "
                                        ".batch(global_batch_size) first");
  if (num_replicas_ < 1)
    throw_error(errc::invalid_argument, "distribute_dataset needs num_replicas_in_sync >= 1; got " +
                                            std::to_string(num_replicas_));
  if (local_replica_ids_.empty())
    throw_error(errc::invalid_argument, "distribute_dataset needs at least one local replica id");
  for (int id : local_replica_ids_)
    if (id < 0 || id >= num_replicas_)
      throw_error(errc::invalid_argument,
                  "distribute_dataset: local replica id " + std::to_string(id) +
                      " is out of range for " + std::to_string(num_replicas_) +
                      " replicas in sync (valid: 0.." + std::to_string(num_replicas_ - 1) + ")");
}

per_replica<nest> distributed_dataset::get(int64_t index) const {
  if (index < 0 || index >= cardinality())
    throw_error(errc::out_of_range, "global batch index " + std::to_string(index) +
                                        " is out of range: the dataset has " +
                                        std::to_string(cardinality()) + " batches");
  const int64_t bs = *source_.batch_size();
  const int64_t begin = index * bs;
  const int64_t end = std::min(begin + bs, source_.num_rows());
  auto sizes = split_batch(end - begin, num_replicas_, bs);
  // offsets[r]: the first row of replica r's contiguous chunk of the global batch.
  std::vector<int64_t> offsets(sizes.size() + 1, begin);
  for (size_t r = 0; r < sizes.size(); ++r)
    offsets[r + 1] = offsets[r] + sizes[r];
  std::vector<nest> parts;
  parts.reserve(local_replica_ids_.size());
  const int per_worker = num_replicas_ / num_workers_;
  for (int id : local_replica_ids_) {
    // Part i * W + w for local replica i of worker w (the identity with one worker).
    auto part = static_cast<size_t>((id % per_worker) * num_workers_ + id / per_worker);
    parts.push_back(source_.rows(offsets[part], offsets[part + 1]));
  }
  return per_replica<nest>{std::move(parts)};
}

} // namespace consort
