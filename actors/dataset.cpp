#include "device/nest_paths.hpp"

#include <consort/dataset.hpp>
#include <consort/error.hpp>
#include <consort/ops.hpp>

#include <algorithm>
#include <numeric>
#include <random>

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

void dataset::require_unbatched(const char* call) const {
  if (is_batched())
    throw_error(errc::invalid_argument,
                std::string{call} + ": the dataset is already batched (batch_size " +
                    std::to_string(*batch_size_) + "); apply " + call +
                    " to the elements, before batch, as a training loop does");
}

std::vector<int64_t> dataset::order() const {
  if (order_)
    return *order_;
  std::vector<int64_t> out(static_cast<size_t>(rows_));
  std::iota(out.begin(), out.end(), int64_t{0});
  return out;
}

namespace {

/// tf.data's shuffle buffer over `in`, drawn from `seed`.
std::vector<int64_t> shuffled(const std::vector<int64_t>& in, int64_t buffer_size, uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::vector<int64_t> out;
  out.reserve(in.size());
  const auto fill = std::min(in.size(), static_cast<size_t>(buffer_size));
  std::vector<int64_t> buffer(in.begin(), in.begin() + static_cast<std::ptrdiff_t>(fill));
  size_t next = fill;
  while (!buffer.empty()) {
    // gen() % size: the same draw on every platform (std::uniform_int_distribution is not).
    const auto j = static_cast<size_t>(gen() % buffer.size());
    out.push_back(buffer[j]);
    if (next < in.size()) {
      buffer[j] = in[next++];
    } else {
      buffer[j] = buffer.back();
      buffer.pop_back();
    }
  }
  return out;
}

/// The seed of epoch `epoch` of a repeated shuffle (epoch 0 keeps the given seed).
uint64_t epoch_seed(uint64_t seed, int64_t epoch) {
  return epoch == 0 ? seed : seed ^ (0x9e3779b97f4a7c15ULL * static_cast<uint64_t>(epoch));
}

} // namespace

dataset dataset::shuffle(int64_t buffer_size, uint64_t seed) const {
  require_unbatched("shuffle");
  if (buffer_size < 1)
    throw_error(errc::invalid_argument,
                "shuffle: buffer_size must be >= 1; got " + std::to_string(buffer_size));
  dataset out = *this;
  auto input = std::make_shared<const std::vector<int64_t>>(order());
  out.order_ = std::make_shared<const std::vector<int64_t>>(shuffled(*input, buffer_size, seed));
  out.shuffle_ = shuffle_state{std::move(input), buffer_size, seed};
  return out;
}

dataset dataset::repeat(int64_t count) const {
  require_unbatched("repeat");
  if (count < 1)
    throw_error(errc::invalid_argument,
                "repeat: count must be >= 1; got " + std::to_string(count) +
                    " (tf.data's endless repeat() has no in-memory equivalent: give the epochs)");
  std::vector<int64_t> out;
  const auto once = order();
  out.reserve(once.size() * static_cast<size_t>(count));
  for (int64_t epoch = 0; epoch < count; ++epoch) {
    // A shuffle reshuffles every epoch, as tf.data's reshuffle_each_iteration does by default.
    const auto again = epoch > 0 && shuffle_ ? shuffled(*shuffle_->input, shuffle_->buffer_size,
                                                        epoch_seed(shuffle_->seed, epoch))
                                             : once;
    out.insert(out.end(), again.begin(), again.end());
  }
  dataset result = *this;
  result.order_ = std::make_shared<const std::vector<int64_t>>(std::move(out));
  result.shuffle_.reset();
  return result;
}

dataset dataset::take(int64_t count) const {
  require_unbatched("take");
  if (count < 0)
    throw_error(errc::invalid_argument, "take: count must be >= 0; got " + std::to_string(count));
  auto all = order();
  all.resize(std::min(all.size(), static_cast<size_t>(count)));
  dataset out = *this;
  out.order_ = std::make_shared<const std::vector<int64_t>>(std::move(all));
  out.shuffle_.reset();
  return out;
}

dataset dataset::shard(int64_t num_shards, int64_t index) const {
  require_unbatched("shard");
  if (num_shards < 1 || index < 0 || index >= num_shards)
    throw_error(errc::invalid_argument, "shard: needs num_shards >= 1 and index in 0.." +
                                            std::to_string(num_shards - 1) + "; got num_shards " +
                                            std::to_string(num_shards) + ", index " +
                                            std::to_string(index));
  std::vector<int64_t> kept;
  const auto all = order();
  for (size_t i = static_cast<size_t>(index); i < all.size(); i += static_cast<size_t>(num_shards))
    kept.push_back(all[i]);
  dataset out = *this;
  out.order_ = std::make_shared<const std::vector<int64_t>>(std::move(kept));
  out.shuffle_.reset();
  return out;
}

dataset dataset::map(element_function fn) const {
  require_unbatched("map");
  if (!fn)
    throw_error(errc::invalid_argument, "map needs a function; got an empty one");
  dataset out = *this;
  out.maps_.push_back(std::move(fn));
  return out;
}

int64_t dataset::cardinality() const noexcept {
  const auto n = num_rows();
  if (!batch_size_)
    return n;
  auto bs = *batch_size_;
  return drop_remainder_ ? n / bs : (n + bs - 1) / bs;
}

namespace {

/// Row `row` of every leaf of `source`, without the sliced axis (as tf.data yields an element).
nest row_of(const nest& source, int64_t row) {
  return map_structure(source, [&](const tensor& t) {
    auto row_shape = t.shape();
    row_shape.erase(row_shape.begin());
    return t.slice(row, row + 1).reshape(std::move(row_shape));
  });
}

/// `element` with a new axis 0 of extent 1.
nest with_batch_axis(const nest& element) {
  return map_structure(element, [](const tensor& t) {
    auto shape = t.shape();
    shape.insert(shape.begin(), 1);
    return t.reshape(std::move(shape));
  });
}

} // namespace

nest dataset::element(int64_t i) const {
  auto out = row_of(elements_, source_row(i));
  for (const auto& fn : maps_)
    out = fn(out);
  return out;
}

nest dataset::get(int64_t index) const {
  if (index < 0 || index >= cardinality())
    throw_error(errc::out_of_range,
                std::string{is_batched() ? "batch" : "element"} + " index " +
                    std::to_string(index) + " is out of range: the dataset has " +
                    std::to_string(cardinality()) + (is_batched() ? " batches" : " elements"));
  if (!batch_size_)
    return element(index);
  auto begin = index * *batch_size_;
  return rows(begin, std::min(begin + *batch_size_, num_rows()));
}

nest dataset::rows(int64_t begin, int64_t end) const {
  if (begin < 0 || end < begin || end > num_rows())
    throw_error(errc::out_of_range, "rows [" + std::to_string(begin) + ", " + std::to_string(end) +
                                        ") are out of range: the dataset has " +
                                        std::to_string(num_rows()) + " elements");
  if (maps_.empty()) {
    // Contiguous source rows: a view, no copy (the common, unshuffled case).
    bool contiguous = true;
    for (int64_t i = begin + 1; contiguous && i < end; ++i)
      contiguous = source_row(i) == source_row(i - 1) + 1;
    if (contiguous) {
      const auto first = begin < end ? source_row(begin) : 0;
      return map_structure(elements_,
                           [&](const tensor& t) { return t.slice(first, first + (end - begin)); });
    }
  }
  if (begin == end) {
    // No element: the structure of a mapped element with extent 0 along the batch axis.
    auto sample = rows_ > 0 ? with_batch_axis(element(0)) : elements_;
    return map_structure(sample, [](const tensor& t) { return t.slice(0, 0); });
  }
  std::vector<nest> parts;
  parts.reserve(static_cast<size_t>(end - begin));
  for (int64_t i = begin; i < end; ++i)
    parts.push_back(maps_.empty()
                        ? map_structure(elements_,
                                        [&](const tensor& t) {
                                          return t.slice(source_row(i), source_row(i) + 1);
                                        })
                        : with_batch_axis(element(i)));
  return concat_components(parts, 0);
}

// -- input_context --------------------------------------------------------------------------------

input_context::input_context(int num_input_pipelines, int input_pipeline_id,
                             int num_replicas_in_sync)
    : num_input_pipelines_(num_input_pipelines), input_pipeline_id_(input_pipeline_id),
      num_replicas_in_sync_(num_replicas_in_sync) {
  if (num_input_pipelines < 1 || num_replicas_in_sync < 1 || input_pipeline_id < 0 ||
      input_pipeline_id >= num_input_pipelines)
    throw_error(errc::invalid_argument,
                "input_context needs num_input_pipelines >= 1, input_pipeline_id in 0..pipelines-1 "
                "and num_replicas_in_sync >= 1; got " +
                    std::to_string(num_input_pipelines) + ", " + std::to_string(input_pipeline_id) +
                    ", " + std::to_string(num_replicas_in_sync));
}

int64_t input_context::get_per_replica_batch_size(int64_t global_batch_size) const {
  if (global_batch_size < 0 || global_batch_size % num_replicas_in_sync_ != 0)
    throw_error(errc::invalid_argument, "The `global_batch_size` " +
                                            std::to_string(global_batch_size) +
                                            " is not divisible by `num_replicas_in_sync` " +
                                            std::to_string(num_replicas_in_sync_));
  return global_batch_size / num_replicas_in_sync_;
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

std::vector<int64_t> split_batch_across_workers(int64_t rows, int num_parts) {
  if (num_parts < 1)
    throw_error(errc::invalid_argument, "split_batch_across_workers needs at least one part; got " +
                                            std::to_string(num_parts));
  if (rows < 0)
    throw_error(errc::invalid_argument,
                "split_batch_across_workers: the row count must be >= 0; got " +
                    std::to_string(rows));
  // TF's legacy RebatchDataset (rebatch_dataset_op.cc): parts of ceil(rows / n) rows in order.
  const int64_t per_part = (rows + num_parts - 1) / num_parts;
  std::vector<int64_t> out(static_cast<size_t>(num_parts));
  for (auto& share : out) {
    share = std::min(per_part, rows);
    rows -= share;
  }
  return out;
}

std::vector<row_range> replica_rows(int64_t rows, int64_t batch_size, int num_workers,
                                    int replicas_per_worker) {
  if (num_workers < 1 || replicas_per_worker < 1)
    throw_error(errc::invalid_argument,
                "replica_rows needs at least one worker and one replica a worker; got " +
                    std::to_string(num_workers) + " x " + std::to_string(replicas_per_worker));
  if (rows < 0 || rows > batch_size)
    throw_error(errc::invalid_argument, "replica_rows: a batch of size " +
                                            std::to_string(batch_size) + " cannot hold " +
                                            std::to_string(rows) + " rows (expected 0.." +
                                            std::to_string(batch_size) + ")");
  // One worker: TF's rebatch by the full batch's shares; several: the legacy rebatch over every
  // replica that TF's data sharding rewrites it to, then every W-th part for each worker.
  const int parts = num_workers * replicas_per_worker;
  const auto sizes = num_workers == 1 ? split_batch(rows, parts, batch_size)
                                      : split_batch_across_workers(rows, parts);
  std::vector<row_range> by_part(sizes.size());
  int64_t next = 0;
  for (size_t k = 0; k < sizes.size(); ++k) {
    by_part[k] = {next, next + sizes[k]};
    next += sizes[k];
  }
  // Part k goes to local replica k / W of worker k % W: replica id w * D + i takes part i * W + w.
  std::vector<row_range> out(by_part.size());
  for (int w = 0; w < num_workers; ++w)
    for (int i = 0; i < replicas_per_worker; ++i)
      out[static_cast<size_t>(w * replicas_per_worker + i)] =
          by_part[static_cast<size_t>(i * num_workers + w)];
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

distributed_dataset distributed_dataset::from_per_replica_batches(dataset source,
                                                                  int local_replicas) {
  if (!source.is_batched())
    throw_error(errc::invalid_argument,
                "distribute_datasets_from_function: the input function must return a batched "
                "dataset: call .batch(ctx.get_per_replica_batch_size(global_batch_size))");
  if (local_replicas < 1)
    throw_error(errc::invalid_argument, "distribute_datasets_from_function needs at least one "
                                        "local replica; got " +
                                            std::to_string(local_replicas));
  distributed_dataset out;
  out.source_ = std::move(source);
  out.per_replica_batches_for_ = local_replicas;
  return out;
}

int64_t distributed_dataset::cardinality() const noexcept {
  if (per_replica_batches_for_ == 0)
    return source_.cardinality();
  return (source_.cardinality() + per_replica_batches_for_ - 1) / per_replica_batches_for_;
}

per_replica<nest> distributed_dataset::get(int64_t index) const {
  if (index < 0 || index >= cardinality())
    throw_error(errc::out_of_range, "global batch index " + std::to_string(index) +
                                        " is out of range: the dataset has " +
                                        std::to_string(cardinality()) + " batches");
  if (per_replica_batches_for_ > 0) {
    // Step `index` gives local replica i batch index * R + i; past the end, an empty batch.
    std::vector<nest> parts;
    for (int i = 0; i < per_replica_batches_for_; ++i) {
      const auto batch = index * per_replica_batches_for_ + i;
      parts.push_back(batch < source_.cardinality()
                          ? source_.get(batch)
                          : source_.rows(source_.num_rows(), source_.num_rows()));
    }
    return per_replica<nest>{std::move(parts)};
  }
  const int64_t bs = *source_.batch_size();
  const int64_t begin = index * bs;
  const int64_t end = std::min(begin + bs, source_.num_rows());
  const auto ranges = replica_rows(end - begin, bs, num_workers_, num_replicas_ / num_workers_);
  std::vector<nest> parts;
  parts.reserve(local_replica_ids_.size());
  for (int id : local_replica_ids_) {
    const auto& r = ranges[static_cast<size_t>(id)];
    parts.push_back(source_.rows(begin + r.begin, begin + r.end));
  }
  return per_replica<nest>{std::move(parts)};
}

} // namespace consort
