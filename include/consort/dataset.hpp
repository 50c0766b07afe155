#pragma once

#include <consort/nest.hpp>
#include <consort/per_replica.hpp>

#include <cstdint>
#include <optional>
#include <vector>

namespace consort {

/// An in-memory dataset (a small `tf.data.Dataset`): the slices of a nest of tensors along
/// axis 0, optionally batched.
///
/// Thread safety: a dataset is an immutable value.
class dataset {
public:
  /// Slices every leaf of `elements` along axis 0. Every leaf must have rank >= 1 and the same
  /// extent along axis 0. @throws error(shape_mismatch) / error(invalid_argument) otherwise.
  static dataset from_tensor_slices(nest elements);

  /// Groups consecutive elements into batches of `batch_size`; the last batch may be smaller
  /// unless `drop_remainder`. @throws error(invalid_argument) when batch_size < 1 or the dataset
  /// is already batched.
  dataset batch(int64_t batch_size, bool drop_remainder = false) const;

  /// True after `batch`.
  bool is_batched() const noexcept { return batch_size_.has_value(); }
  /// The batch size given to `batch`, if any.
  std::optional<int64_t> batch_size() const noexcept { return batch_size_; }
  /// Number of elements (unbatched) or batches (batched).
  int64_t cardinality() const noexcept;
  /// Element or batch `index`; batches share storage with the source (no copy).
  /// @throws error(out_of_range).
  nest get(int64_t index) const;

  /// Number of rows (slices) in the source.
  int64_t num_rows() const noexcept { return rows_; }
  /// Rows `[begin, end)` of every leaf, sharing storage.
  nest rows(int64_t begin, int64_t end) const;

private:
  nest elements_;
  int64_t rows_ = 0;
  std::optional<int64_t> batch_size_;
  bool drop_remainder_ = false;
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

/// A dataset whose every global batch is split across replicas (`distribute_dataset`).
///
/// With one worker, replica r takes the r-th part of `split_batch(rows, n, batch_size)`
/// (contiguous rows in replica order; a partial last batch fills the parts in order, as TF does).
/// With W workers of D replicas each, the parts are interleaved across workers as TF's
/// rebatch-then-shard pipeline does: part k goes to local replica k / W of worker k % W, so
/// replica (worker w, local i) takes part i * W + w.
class distributed_dataset {
public:
  /// @throws error(invalid_argument) when `source` is not batched, when a replica id is out of
  ///         range, or when `num_workers` does not divide `num_replicas_in_sync`.
  distributed_dataset(dataset source, int num_replicas_in_sync, std::vector<int> local_replica_ids,
                      int num_workers = 1);

  /// Number of global batches.
  int64_t cardinality() const noexcept { return source_.cardinality(); }

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
  dataset source_;
  int num_replicas_;
  std::vector<int> local_replica_ids_;
  int num_workers_ = 1;
};

} // namespace consort
