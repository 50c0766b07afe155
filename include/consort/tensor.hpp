#pragma once

#include <consort/error.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

namespace consort {

/// Element types of a tensor.
enum class dtype : uint8_t { float32, float64, int32, int64, uint8, boolean };

/// Returns "float32", "float64", "int32", "int64", "uint8" or "bool".
const char* to_string(dtype t) noexcept;

/// Size of one element of `t` in bytes.
size_t size_of(dtype t) noexcept;

/// True for float32 and float64.
constexpr bool is_floating(dtype t) noexcept {
  return t == dtype::float32 || t == dtype::float64;
}

/// Maps a C++ element type to its dtype (`dtype_of<float>` is float32).
template <class T>
struct dtype_traits;
template <>
struct dtype_traits<float> {
  static constexpr dtype value = dtype::float32;
};
template <>
struct dtype_traits<double> {
  static constexpr dtype value = dtype::float64;
};
template <>
struct dtype_traits<int32_t> {
  static constexpr dtype value = dtype::int32;
};
template <>
struct dtype_traits<int64_t> {
  static constexpr dtype value = dtype::int64;
};
template <>
struct dtype_traits<uint8_t> {
  static constexpr dtype value = dtype::uint8;
};
template <>
struct dtype_traits<bool> {
  static constexpr dtype value = dtype::boolean;
};
template <class T>
inline constexpr dtype dtype_of = dtype_traits<T>::value;

/// A shape: one extent per axis, outermost first. `{}` is a scalar.
using shape_t = std::vector<int64_t>;

/// Formats a shape as "[2, 3]".
std::string to_string(const shape_t& shape);

/// Number of elements of `shape` (1 for a scalar).
int64_t num_elements(const shape_t& shape) noexcept;

/// A dense, row-major, n-dimensional array on one device.
///
/// Storage is reference counted and shared between copies, so passing a tensor between actors
/// copies no bytes. A tensor is immutable once it has been shared: `mutable_data` copies the
/// storage first when anyone else holds it (copy-on-write), so a published tensor never changes.
/// A default-constructed tensor is an empty float32 scalar placeholder (`valid()` is false).
///
/// Thread safety: distinct tensor objects may be used from different threads even when they
/// share storage; one tensor object must not be mutated concurrently.
class tensor {
public:
  // -- constructors -----------------------------------------------------------------------------

  tensor() = default;

  /// A tensor of `shape` with zero-initialised elements of `type`, placed on `device`.
  /// @throws error(invalid_argument) on a negative extent.
  static tensor zeros(consort::dtype type, shape_t shape, std::string device = "CPU:0");

  /// A tensor of `shape` whose elements are unspecified until written; for outputs that a
  /// kernel overwrites completely (it saves the zero-fill pass over large buffers).
  static tensor empty(consort::dtype type, shape_t shape, std::string device = "CPU:0");

  /// A rank-0 tensor holding `value`.
  template <class T>
  static tensor scalar(T value, std::string device = "CPU:0") {
    tensor t = zeros(dtype_of<T>, {});
    std::memcpy(t.raw_mutable_data(), &value, sizeof(T));
    return device == "CPU:0" ? t : t.to(device);
  }

  /// A tensor of `shape` holding `values` in row-major order.
  /// @throws error(shape_mismatch) when `values.size()` differs from the element count of `shape`.
  template <class T>
  static tensor from(const std::vector<T>& values, shape_t shape, std::string device = "CPU:0") {
    check_count(static_cast<int64_t>(values.size()), shape);
    tensor t = zeros(dtype_of<T>, std::move(shape));
    if constexpr (std::is_same_v<T, bool>) {
      auto* out = static_cast<uint8_t*>(t.raw_mutable_data());
      for (size_t i = 0; i < values.size(); ++i)
        out[i] = values[i] ? 1 : 0;
    } else if (!values.empty()) {
      std::memcpy(t.raw_mutable_data(), values.data(), values.size() * sizeof(T));
    }
    // Built in host memory, then copied once to a GPU (to() only relabels between CPU devices).
    return device == "CPU:0" ? t : t.to(device);
  }

  /// A rank-1 tensor holding `values`.
  template <class T>
  static tensor from(const std::vector<T>& values) {
    return from(values, shape_t{static_cast<int64_t>(values.size())});
  }

  // -- properties -------------------------------------------------------------------------------

  /// False only for a default-constructed tensor.
  bool valid() const noexcept { return storage_ != nullptr; }

  /// The element type.
  consort::dtype dtype() const noexcept { return type_; }
  const shape_t& shape() const noexcept { return shape_; }
  int64_t rank() const noexcept { return static_cast<int64_t>(shape_.size()); }
  int64_t num_elements() const noexcept { return consort::num_elements(shape_); }
  size_t num_bytes() const noexcept { return static_cast<size_t>(num_elements()) * size_of(type_); }
  /// The device this tensor lives on, as a canonical device string ("CPU:0", "GPU:1").
  const std::string& device() const noexcept { return device_; }

  /// True when the bytes live in GPU memory: raw_data() and data() are then device pointers (for
  /// kernels and NCCL), and to_vector, item, to_string and == copy the bytes to the host first.
  bool on_gpu() const noexcept;

  /// True when both tensors share the same bytes (same storage and offset).
  bool shares_storage_with(const tensor& other) const noexcept {
    return storage_ == other.storage_ && offset_ == other.offset_;
  }

  // -- element access ---------------------------------------------------------------------------

  /// Read-only pointer to the first element.
  const void* raw_data() const noexcept;

  /// Typed read-only pointer.
  /// @throws error(dtype_mismatch) when `T` is not this tensor's element type.
  template <class T>
  const T* data() const {
    check_type(dtype_of<T>);
    return static_cast<const T*>(raw_data());
  }

  /// Writable pointer; copies the storage first if it is shared (copy-on-write).
  void* raw_mutable_data();

  template <class T>
  T* mutable_data() {
    check_type(dtype_of<T>);
    return static_cast<T*>(raw_mutable_data());
  }

  /// Copies the elements out in row-major order.
  /// @throws error(dtype_mismatch) when `T` is not this tensor's element type.
  template <class T>
  std::vector<T> to_vector() const {
    check_type(dtype_of<T>);
    if (on_gpu())
      return to("CPU:0").to_vector<T>();
    auto n = static_cast<size_t>(num_elements());
    std::vector<T> out(n);
    if constexpr (std::is_same_v<T, bool>) {
      auto* in = static_cast<const uint8_t*>(raw_data());
      for (size_t i = 0; i < n; ++i)
        out[i] = in[i] != 0;
    } else if (n > 0) {
      std::memcpy(out.data(), raw_data(), n * sizeof(T));
    }
    return out;
  }

  /// The single element of a tensor with one element, converted to `T`.
  /// @throws error(shape_mismatch) when the tensor does not have exactly one element.
  template <class T>
  T item() const;

  // -- views and copies -------------------------------------------------------------------------

  /// Rows `[begin, end)` along axis 0, sharing storage (no copy).
  /// @throws error(out_of_range) on a rank-0 tensor or bad bounds.
  tensor slice(int64_t begin, int64_t end) const;

  /// The same bytes with another shape of equal element count (no copy).
  tensor reshape(shape_t shape) const;

  /// This tensor on `device`. Host memory is shared by every CPU device, so between CPU devices
  /// (and to the GPU it is already on) this only relabels; between the host and a GPU, or two
  /// GPUs, it copies (ordered on the calling thread's stream, returning once the bytes are there).
  /// @throws error(unsupported) for a GPU device in a build without CUDA, error(unknown_device)
  /// for a name that is not a device or a GPU this process does not have.
  tensor to(const std::string& device) const;

  /// A deep copy with storage of its own.
  tensor clone() const;

  /// Element-wise equality of dtype, shape and bytes.
  friend bool operator==(const tensor& a, const tensor& b);
  friend bool operator!=(const tensor& a, const tensor& b) { return !(a == b); }

  /// "float32[2, 3]{1, 2, 3, ...}" with at most `max_elements` values.
  std::string to_string(size_t max_elements = 8) const;

private:
  struct storage;

  /// The storage behind `zeros` and `empty`; `what` names the caller in errors.
  static tensor allocate(consort::dtype type, shape_t shape, const std::string& device, bool zeroed,
                         const char* what);
  static void check_count(int64_t count, const shape_t& shape);
  void check_type(consort::dtype expected) const;

  std::shared_ptr<storage> storage_;
  size_t offset_ = 0;
  consort::dtype type_ = consort::dtype::float32;
  shape_t shape_;
  std::string device_ = "CPU:0";
};

extern template float tensor::item<float>() const;
extern template double tensor::item<double>() const;
extern template int32_t tensor::item<int32_t>() const;
extern template int64_t tensor::item<int64_t>() const;
extern template uint8_t tensor::item<uint8_t>() const;
extern template bool tensor::item<bool>() const;

} // namespace consort
