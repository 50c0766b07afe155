#pragma once

#include <consort/error.hpp>

#include <cstddef>
#include <string>
#include <utility>
#include <vector>

namespace consort {

/// One value per local replica, in replica-id order (tf.distribute's `PerReplica`).
/// Component `i` belongs to the i-th replica of this worker.
template <class T>
class per_replica {
public:
  using value_type = T;

  per_replica() = default;
  explicit per_replica(std::vector<T> values) : values_(std::move(values)) {}

  size_t size() const noexcept { return values_.size(); }
  bool empty() const noexcept { return values_.empty(); }

  /// Component of local replica `index`. @throws error(out_of_range).
  const T& operator[](size_t index) const {
    if (index >= values_.size())
      throw_error(errc::out_of_range, "per_replica index " + std::to_string(index) +
                                          " is out of range: the value has " +
                                          std::to_string(values_.size()) + " components");
    return values_[index];
  }

  const std::vector<T>& values() const noexcept { return values_; }
  std::vector<T>& values() noexcept { return values_; }
  auto begin() const noexcept { return values_.begin(); }
  auto end() const noexcept { return values_.end(); }

private:
  std::vector<T> values_;
};

template <class T>
struct is_per_replica : std::false_type {};
template <class T>
struct is_per_replica<per_replica<T>> : std::true_type {};
template <class T>
inline constexpr bool is_per_replica_v = is_per_replica<std::decay_t<T>>::value;

} // namespace consort
