#pragma once

#include <consort/tensor.hpp>

#include <initializer_list>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <variant>
#include <vector>

namespace consort {

/// A nested structure of tensors, as `tf.nest` sees one: a tensor (a leaf), a list of nests, or
/// a string-keyed map of nests. Maps keep their keys sorted, so `flatten` visits leaves in the
/// same order as `tf.nest.flatten` (lists in order, dicts by sorted key).
///
/// Thread safety: like `tensor`, a nest is a value; copies share tensor storage.
class nest {
public:
  using list_type = std::vector<nest>;
  using dict_type = std::map<std::string, nest>;

  // -- constructors -----------------------------------------------------------------------------

  /// An empty list.
  nest() : value_(list_type{}) {}

  /// A leaf. Implicit, so a tensor can be passed wherever a nest is expected.
  nest(tensor t) : value_(std::move(t)) {} // NOLINT(google-explicit-constructor)

  /// A list of nests.
  static nest list(list_type items);
  static nest list(std::initializer_list<nest> items) { return list(list_type(items)); }

  /// A map of nests.
  static nest dict(dict_type items);
  static nest dict(std::initializer_list<std::pair<const std::string, nest>> items) {
    return dict(dict_type(items));
  }

  // -- observers --------------------------------------------------------------------------------

  bool is_tensor() const noexcept { return std::holds_alternative<tensor>(value_); }
  bool is_list() const noexcept { return std::holds_alternative<list_type>(value_); }
  bool is_dict() const noexcept { return std::holds_alternative<dict_type>(value_); }

  /// The leaf. @throws error(structure_mismatch) when this is not a tensor.
  const tensor& as_tensor() const;
  /// @throws error(structure_mismatch) when this is not a list.
  const list_type& as_list() const;
  /// @throws error(structure_mismatch) when this is not a dict.
  const dict_type& as_dict() const;

  /// Number of children of a list or dict; 1 for a tensor.
  size_t size() const noexcept;

  /// Child `index` of a list. @throws error(out_of_range) or error(structure_mismatch).
  const nest& operator[](size_t index) const;
  /// Same, for an `int` index (so that `n[0]` is not taken for a null `const char*` key).
  const nest& operator[](int index) const { return (*this)[static_cast<size_t>(index)]; }
  /// Child `key` of a dict. @throws error(out_of_range) or error(structure_mismatch).
  const nest& operator[](const std::string& key) const;
  const nest& operator[](const char* key) const { return (*this)[std::string{key}]; }

  /// Number of leaves.
  size_t num_leaves() const noexcept;

  /// A readable rendering, e.g. `{"a": float32[2], "b": [int32[], int32[]]}`.
  std::string to_string() const;

  /// The structure alone, with leaves written as "T", e.g. `{"a": T, "b": [T, T]}`.
  std::string structure_string() const;

  friend bool operator==(const nest& a, const nest& b);
  friend bool operator!=(const nest& a, const nest& b) { return !(a == b); }

private:
  std::variant<tensor, list_type, dict_type> value_;
};

/// The leaves of `value` in `tf.nest.flatten` order.
std::vector<tensor> flatten(const nest& value);

/// Rebuilds `structure` with its leaves replaced, in order, by `leaves`.
/// @throws error(structure_mismatch) when the leaf count differs.
nest pack_as(const nest& structure, const std::vector<tensor>& leaves);

/// Returns an empty string when `a` and `b` have the same structure, else a description of the
/// first difference with its path, e.g. `at ["b"][1]: expected a tensor, got a list of 2`.
std::string compare_structure(const nest& a, const nest& b);

/// @throws error(structure_mismatch) with `compare_structure`'s description when they differ.
void assert_same_structure(const nest& a, const nest& b);

/// Applies `fn` to every leaf, keeping the structure.
template <class F>
nest map_structure(const nest& value, F&& fn) {
  auto leaves = flatten(value);
  for (auto& leaf : leaves)
    leaf = fn(leaf);
  return pack_as(value, leaves);
}

} // namespace consort
