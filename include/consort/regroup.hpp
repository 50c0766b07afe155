#pragma once

#include <consort/nest.hpp>
#include <consort/per_replica.hpp>
#include <consort/tensor.hpp>

#include <cstddef>
#include <string>
#include <vector>

namespace consort {

/// The result of `strategy::run` in tf.distribute's shape: the structure every replica returned,
/// with a per_replica value at each leaf (TF's `regroup`), so that `out["loss"]` reads as in TF.
///
/// `run` keeps returning `per_replica<nest>` (one whole structure per replica, which is what
/// `reduce`, `gather` and `local_results` take); `regroup(v)` gives this view of it. Indexing
/// goes down every replica's structure at once; a leaf converts to `per_replica<tensor>`.
///
/// Thread safety: an immutable value.
class regrouped {
public:
  /// @throws error(structure_mismatch) naming two replicas when their structures differ.
  explicit regrouped(per_replica<nest> values);

  bool is_leaf() const noexcept;
  bool is_list() const noexcept;
  bool is_dict() const noexcept;
  /// Items of a list or dict (0 for a leaf).
  size_t size() const noexcept;
  /// The keys of a dict, in order. @throws error(structure_mismatch) when it is not a dict.
  std::vector<std::string> keys() const;

  /// Item `index` of a list, or the value at `key` of a dict, on every replica.
  /// @throws error(structure_mismatch) for the wrong kind, error(out_of_range) for a missing item.
  regrouped operator[](size_t index) const;
  regrouped operator[](int index) const { return (*this)[static_cast<size_t>(index)]; }
  regrouped operator[](const std::string& key) const;
  regrouped operator[](const char* key) const { return (*this)[std::string{key}]; }

  /// The per-replica tensors of a leaf. @throws error(structure_mismatch) when it is not a leaf.
  per_replica<tensor> leaf() const;
  operator per_replica<tensor>() const { return leaf(); } // NOLINT(google-explicit-constructor)

  /// Every replica's (sub)structure, as `run` returns it.
  const per_replica<nest>& values() const noexcept { return values_; }

private:
  regrouped(per_replica<nest> values, std::string path);
  std::string path_;
  per_replica<nest> values_;
};

/// `regrouped(value)`: tf.distribute's shape of `run`'s result.
inline regrouped regroup(per_replica<nest> value) {
  return regrouped(std::move(value));
}

} // namespace consort
