#pragma once

#include <consort/nest.hpp>
#include <consort/per_replica.hpp>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

namespace consort {

/// An in-memory dataset (a small `tf.data.Dataset`): the slices of a nest of tensors along
/// axis 0, in an order that `shuffle`, `repeat`, `take` and `shard` may change, mapped by `map`,
/// and optionally batched.
///
/// The element transformations (`shuffle`, `repeat`, `take`, `shard`, `map`) apply to elements,
/// so they come before `batch` (each throws error(invalid_argument) on a batched dataset, which
/// tf.data would allow); that is the order a training loop writes them in. Elements that stay
/// contiguous in the source are batched without a copy; a shuffled or mapped batch is assembled.
/// With a seed, the order is the same on every run and every layout.
///
/// Thread safety: a dataset is an immutable value (`map`'s function must be safe to call from
/// several threads when several readers use the dataset at once).
class dataset {
public:
  /// A function of one element (a nest without the sliced axis) to one element.
  using element_function = std::function<nest(const nest&)>;

  /// Slices every leaf of `elements` along axis 0. Every leaf must have rank >= 1 and the same
  /// extent along axis 0. @throws error(shape_mismatch) / error(invalid_argument) otherwise.
  static dataset from_tensor_slices(nest elements);

  /// Groups consecutive elements into batches of `batch_size`; the last batch may be smaller
  /// unless `drop_remainder`. @throws error(invalid_argument) when batch_size < 1 or the dataset
  /// is already batched.
  dataset batch(int64_t batch_size, bool drop_remainder = false) const;

  /// The elements in a random order drawn from `seed` with tf.data's buffer semantics: a buffer
  /// of `buffer_size` elements is filled in order, and each output is drawn uniformly from it and
  /// replaced by the next input (a buffer as large as the dataset gives a uniform shuffle).
  /// The same seed gives the same order. A `repeat` right after it (maps aside) reshuffles every
  /// epoch, as tf.data's default `reshuffle_each_iteration` does, from seeds derived from `seed`.
  /// @throws error(invalid_argument) when buffer_size < 1 or the dataset is batched.
  dataset shuffle(int64_t buffer_size, uint64_t seed) const;
  /// The elements `count` times over. tf.data's `repeat()` without a count is endless; an
  /// in-memory dataset needs a count. @throws error(invalid_argument) when count < 1 or batched.
  dataset repeat(int64_t count) const;
  /// The first `count` elements (all of them when there are fewer).
  /// @throws error(invalid_argument) when count < 0 or batched.
  dataset take(int64_t count) const;
  /// Every `num_shards`-th element from element `index` on (tf.data's `shard`, which
  /// `distribute_datasets_from_function`'s input functions use with their input_context).
  /// @throws error(invalid_argument) when num_shards < 1, index is not in 0..num_shards-1, or
  ///         the dataset is batched.
  dataset shard(int64_t num_shards, int64_t index) const;
  /// Applies `fn` to every element (after the earlier maps). Every element `fn` returns must have
  /// the same structure, dtypes and shapes, so that elements batch.
  /// @throws error(invalid_argument) when `fn` is empty or the dataset is batched.
  dataset map(element_function fn) const;

  /// True after `batch`.
  bool is_batched() const noexcept { return batch_size_.has_value(); }
  /// The batch size given to `batch`, if any.
  std::optional<int64_t> batch_size() const noexcept { return batch_size_; }
  /// Number of elements (unbatched) or batches (batched).
  int64_t cardinality() const noexcept;
  /// Element or batch `index`; a batch of contiguous, unmapped elements shares storage with the
  /// source (no copy). @throws error(out_of_range).
  nest get(int64_t index) const;

  /// Number of elements before batching.
  int64_t num_rows() const noexcept {
    return order_ ? static_cast<int64_t>(order_->size()) : rows_;
  }
  /// Elements `[begin, end)` before batching, stacked along a new axis 0 (a batch of them).
  /// @throws error(out_of_range).
  nest rows(int64_t begin, int64_t end) const;

private:
  /// Source row of element `i`.
  int64_t source_row(int64_t i) const noexcept {
    return order_ ? (*order_)[static_cast<size_t>(i)] : i;
  }
  /// Element `i`, mapped.
  nest element(int64_t i) const;
  void require_unbatched(const char* call) const;
  std::vector<int64_t> order() const;

  nest elements_;
  int64_t rows_ = 0;
  /// The source rows of the elements, in order; null: every row once, in order.
  std::shared_ptr<const std::vector<int64_t>> order_;
  std::vector<element_function> maps_;
  /// The last shuffle, while nothing but maps came after it: `repeat` reshuffles each epoch.
  struct shuffle_state {
    std::shared_ptr<const std::vector<int64_t>> input;
    int64_t buffer_size = 1;
    uint64_t seed = 0;
  };
  std::optional<shuffle_state> shuffle_;
  std::optional<int64_t> batch_size_;
  bool drop_remainder_ = false;
};

/// tf.distribute's `InputContext`: what an input function of `distribute_datasets_from_function`
/// knows of the input pipelines (one per worker) and the replicas.
class input_context {
public:
  /// @throws error(invalid_argument) when a count is < 1 or the id is not in 0..pipelines-1.
  input_context(int num_input_pipelines = 1, int input_pipeline_id = 0,
                int num_replicas_in_sync = 1);

  /// The number of input pipelines: one per worker.
  int num_input_pipelines() const noexcept { return num_input_pipelines_; }
  /// This pipeline's id: the worker's rank.
  int input_pipeline_id() const noexcept { return input_pipeline_id_; }
  /// Replicas over all workers.
  int num_replicas_in_sync() const noexcept { return num_replicas_in_sync_; }
  /// `global_batch_size / num_replicas_in_sync`.
  /// @throws error(invalid_argument) when the global batch does not divide evenly, as TF does.
  int64_t get_per_replica_batch_size(int64_t global_batch_size) const;

private:
  int num_input_pipelines_;
  int input_pipeline_id_;
  int num_replicas_in_sync_;
};

/// How a global batch of `global_batch` rows splits over `num_replicas` replicas: as evenly as
/// possible in replica order (6 over 2 -> 3/3, 5 over 2 -> 3/2, 1 over 2 -> 1/0). Returns the
/// row count of each replica.
std::vector<int64_t> split_batch(int64_t global_batch, int num_replicas);

/// How `rows` rows of a batch of `batch_size` split over `num_replicas` replicas, as TF's
/// rebatching does: each replica's share of a full batch (`split_batch(batch_size, n)`) is filled
/// in replica order, so a partial last batch leaves the last replicas short or empty (6 rows of a
/// batch of 8 over 2 -> 4/2; 1 row -> 1/0). A full batch splits as `split_batch(rows, n)`.
/// @throws error(invalid_argument) when `rows` is not in 0..batch_size.
std::vector<int64_t> split_batch(int64_t rows, int num_replicas, int64_t batch_size);

/// How `rows` rows of one global batch split over the `num_parts` replicas of several workers, as
/// TF's MultiWorkerMirroredStrategy does with a dataset that every worker reads whole: its data
/// auto-sharding turns the rebatch into the legacy RebatchDataset over all the replicas, whose
/// parts hold ceil(rows / num_parts) rows each, filled in part order, so that the last parts may be
/// short or empty. Full and partial batches alike: 6 over 2 -> 3/3, 8 over 3 -> 3/3/2, 6 over 3
/// -> 2/2/2, 6 over 4 -> 2/2/2/0, 4 over 3 -> 2/2/0.
/// @throws error(invalid_argument) when num_parts < 1 or rows < 0.
std::vector<int64_t> split_batch_across_workers(int64_t rows, int num_parts);

/// Rows [begin, end) of a global batch.
struct row_range {
  int64_t begin = 0;
  int64_t end = 0;
  int64_t size() const noexcept { return end - begin; }
  friend bool operator==(const row_range&, const row_range&) = default;
};

/// The rows that each replica takes of a global batch of `batch_size` holding `rows` rows (fewer
/// in a partial last batch) under `distribute_dataset`, with `num_workers` workers of
/// `replicas_per_worker` replicas each, indexed by replica id (worker w's local replica i has id
/// w * replicas_per_worker + i):
/// - one worker: `split_batch(rows, replicas_per_worker, batch_size)`, contiguous in replica
///   order (6 rows of a batch of 8 over 2 replicas -> [0, 4) and [4, 6));
/// - W > 1 workers: part k of `split_batch_across_workers(rows, W * D)` goes to local replica
///   k / W of worker k % W (TF's shard by worker after the rebatch), so replica (worker w, local i)
///   takes part i * W + w (6 rows over 2 x 1 -> [0, 3) and [3, 6)).
/// @throws error(invalid_argument) when a count is < 1 or `rows` is not in 0..batch_size.
std::vector<row_range> replica_rows(int64_t rows, int64_t batch_size, int num_workers,
                                    int replicas_per_worker);

/// A dataset whose every global batch is split across replicas (`distribute_dataset`): replica r
/// takes rows `replica_rows(rows, batch_size, W, D)[r]` of each global batch. With one worker the
/// parts are `split_batch(rows, n, batch_size)` in replica order; with W workers of D replicas
/// each they are `split_batch_across_workers(rows, W * D)`, interleaved across workers as TF's
/// rebatch-then-shard pipeline does: part k goes to local replica k / W of worker k % W.
class distributed_dataset {
public:
  /// @throws error(invalid_argument) when `source` is not batched, when a replica id is out of
  ///         range, or when `num_workers` does not divide `num_replicas_in_sync`.
  distributed_dataset(dataset source, int num_replicas_in_sync, std::vector<int> local_replica_ids,
                      int num_workers = 1);

  /// The dataset of one worker's input function (`distribute_datasets_from_function`): it is
  /// batched by the per-replica batch size, and its batches go to the local replicas in turn, as
  /// TF does: step k gives local replica i batch `k * local_replicas + i`. In the last step,
  /// replicas past the dataset's end get an empty batch (extent 0 along axis 0).
  /// @throws error(invalid_argument) when `source` is not batched or `local_replicas` < 1.
  static distributed_dataset from_per_replica_batches(dataset source, int local_replicas);

  /// Number of global batches (steps).
  int64_t cardinality() const noexcept;

  /// The per-replica sub-batches of global batch `index`, one per local replica; replicas left
  /// without rows get an empty batch (extent 0 along axis 0).
  per_replica<nest> get(int64_t index) const;

  class iterator {
  public:
    iterator(const distributed_dataset* owner, int64_t index) : owner_(owner), index_(index) {}
    per_replica<nest> operator*() const { return owner_->get(index_); }
    iterator& operator++() {
      ++index_;
      return *this;
    }
    bool operator==(const iterator& other) const { return index_ == other.index_; }
    bool operator!=(const iterator& other) const { return index_ != other.index_; }

  private:
    const distributed_dataset* owner_;
    int64_t index_;
  };

  iterator begin() const { return {this, 0}; }
  iterator end() const { return {this, cardinality()}; }

private:
  distributed_dataset() = default;

  dataset source_;
  int num_replicas_ = 1;
  std::vector<int> local_replica_ids_;
  int num_workers_ = 1;
  /// Set by from_per_replica_batches: the source holds per-replica batches for this many local
  /// replicas.
  int per_replica_batches_for_ = 0;
};

} // namespace consort
