#pragma once

#include <consort/error.hpp>

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <iterator>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

namespace consort {

/// Element types of a tensor. New types are appended, so that the numbers of the others never
/// change.
enum class dtype : uint8_t { float32, float64, int32, int64, uint8, boolean, float16, bfloat16 };

/// Returns "float32", "float64", "int32", "int64", "uint8", "bool", "float16" or "bfloat16".
const char* to_string(dtype t) noexcept;

/// Size of one element of `t` in bytes.
size_t size_of(dtype t) noexcept;

/// True for float32, float64, float16 and bfloat16.
constexpr bool is_floating(dtype t) noexcept {
  return t == dtype::float32 || t == dtype::float64 || t == dtype::float16 || t == dtype::bfloat16;
}

/// True for the 16-bit floating types (float16, bfloat16), which reductions accumulate in float32.
constexpr bool is_half(dtype t) noexcept {
  return t == dtype::float16 || t == dtype::bfloat16;
}

namespace detail {

/// `std::bit_cast`, also where this header is compiled as C++17 (nvcc compiles the CUDA kernels
/// as C++17, and they include this header).
template <class To, class From>
constexpr To bit_cast(const From& from) noexcept {
#if defined(__cpp_lib_bit_cast)
  return std::bit_cast<To>(from);
#else
  return __builtin_bit_cast(To, from);
#endif
}

/// The IEEE binary16 bits nearest to `f` (round to nearest, ties to even). Infinities stay
/// infinite, magnitudes from 65520 up become infinite, NaNs stay NaN (sign and the top ten
/// payload bits kept), and results below 2^-14 are subnormal.
constexpr uint16_t float_to_half_bits(float f) noexcept {
  const auto x = detail::bit_cast<uint32_t>(f);
  const auto sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t abs = x & 0x7fffffffu;
  if (abs > 0x7f800000u) { // NaN: keep the payload's top bits; never let it become infinity
    auto payload = static_cast<uint16_t>((abs >> 13) & 0x3ffu);
    return static_cast<uint16_t>(sign | 0x7c00u | (payload == 0 ? 0x200u : payload));
  }
  if (abs >= 0x47800000u) // 2^16 and up, infinity included
    return static_cast<uint16_t>(sign | 0x7c00u);
  if (abs >= 0x38800000u) { // a normal half: rebias the exponent, round off 13 mantissa bits
    uint32_t h = (abs - 0x38000000u) >> 13;
    const uint32_t rest = abs & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u) != 0))
      ++h; // a carry into the exponent is still right (up to 0x7c00, infinity)
    return static_cast<uint16_t>(sign | h);
  }
  // A subnormal half (or zero): the value in units of 2^-24 is m * 2^-shift.
  const int shift = 126 - static_cast<int>(abs >> 23);
  if (shift > 24)
    return sign; // below 2^-25 (half the smallest subnormal): rounds to zero
  const uint32_t m = (abs & 0x7fffffu) | 0x800000u;
  uint32_t h = m >> shift;
  const uint32_t rest = m & ((1u << shift) - 1u);
  const uint32_t halfway = 1u << (shift - 1);
  if (rest > halfway || (rest == halfway && (h & 1u) != 0))
    ++h; // may become 0x400, the smallest normal: the encoding follows on
  return static_cast<uint16_t>(sign | h);
}

/// The float of IEEE binary16 bits `h` (exact: every half is a float).
constexpr float half_bits_to_float(uint16_t h) noexcept {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0x1f)
    return detail::bit_cast<float>(sign | 0x7f800000u | (mantissa << 13));
  if (exponent == 0) {
    const float v = static_cast<float>(mantissa) * 5.9604644775390625e-8f; // m * 2^-24, exact
    return sign != 0 ? -v : v;
  }
  return detail::bit_cast<float>(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

/// The bfloat16 bits nearest to `f` (round to nearest, ties to even); NaNs stay NaN.
constexpr uint16_t float_to_bfloat16_bits(float f) noexcept {
  const auto x = detail::bit_cast<uint32_t>(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) {
    auto top = static_cast<uint16_t>(x >> 16);
    return (top & 0x7fu) == 0 ? static_cast<uint16_t>(top | 0x40u) : top;
  }
  const uint32_t rounding = 0x7fffu + ((x >> 16) & 1u);
  return static_cast<uint16_t>((x + rounding) >> 16);
}

/// The float of bfloat16 bits `b` (exact).
constexpr float bfloat16_bits_to_float(uint16_t b) noexcept {
  return detail::bit_cast<float>(static_cast<uint32_t>(b) << 16);
}

} // namespace detail

/// An IEEE binary16 number (`dtype::float16`): 1 sign, 5 exponent and 10 mantissa bits, as
/// torch.float16 and tf.float16. It only stores; arithmetic converts to float.
class float16_t {
public:
  constexpr float16_t() noexcept = default;
  /// The float16 nearest to `f` (ties to even).
  constexpr explicit float16_t(float f) noexcept : bits_(detail::float_to_half_bits(f)) {}
  /// The number whose bits are `bits`.
  static constexpr float16_t from_bits(uint16_t bits) noexcept {
    float16_t h;
    h.bits_ = bits;
    return h;
  }
  constexpr uint16_t bits() const noexcept { return bits_; }
  /// The exact float value.
  constexpr explicit operator float() const noexcept { return detail::half_bits_to_float(bits_); }
  /// Compares the values, as floats do (NaN equals nothing, -0 equals +0).
  friend constexpr bool operator==(float16_t a, float16_t b) noexcept {
    return static_cast<float>(a) == static_cast<float>(b);
  }

private:
  uint16_t bits_ = 0;
};

/// A bfloat16 number (`dtype::bfloat16`): float32's 8 exponent bits with 7 mantissa bits, as
/// torch.bfloat16 and tf.bfloat16. It only stores; arithmetic converts to float.
class bfloat16_t {
public:
  constexpr bfloat16_t() noexcept = default;
  /// The bfloat16 nearest to `f` (ties to even).
  constexpr explicit bfloat16_t(float f) noexcept : bits_(detail::float_to_bfloat16_bits(f)) {}
  /// The number whose bits are `bits`.
  static constexpr bfloat16_t from_bits(uint16_t bits) noexcept {
    bfloat16_t h;
    h.bits_ = bits;
    return h;
  }
  constexpr uint16_t bits() const noexcept { return bits_; }
  /// The exact float value.
  constexpr explicit operator float() const noexcept {
    return detail::bfloat16_bits_to_float(bits_);
  }
  /// Compares the values, as floats do (NaN equals nothing, -0 equals +0).
  friend constexpr bool operator==(bfloat16_t a, bfloat16_t b) noexcept {
    return static_cast<float>(a) == static_cast<float>(b);
  }

private:
  uint16_t bits_ = 0;
};

static_assert(sizeof(float16_t) == 2 && std::is_trivially_copyable_v<float16_t>);
static_assert(sizeof(bfloat16_t) == 2 && std::is_trivially_copyable_v<bfloat16_t>);

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
template <>
struct dtype_traits<float16_t> {
  static constexpr dtype value = dtype::float16;
};
template <>
struct dtype_traits<bfloat16_t> {
  static constexpr dtype value = dtype::bfloat16;
};
template <class T>
inline constexpr dtype dtype_of = dtype_traits<T>::value;

/// A shape: one extent per axis, outermost first. `{}` is a scalar.
///
/// A sequence of int64_t with the interface of `std::vector<int64_t>` (and conversions to and from
/// it) whose first `inline_rank` extents live in the object itself: a shape of rank up to
/// `inline_rank` is copied without a heap allocation, so copying a tensor (which the engine does on
/// every collective call) allocates nothing. Higher ranks go to the heap.
class shape_t {
public:
  using value_type = int64_t;
  using size_type = size_t;
  using difference_type = std::ptrdiff_t;
  using reference = int64_t&;
  using const_reference = const int64_t&;
  using pointer = int64_t*;
  using const_pointer = const int64_t*;
  using iterator = int64_t*;
  using const_iterator = const int64_t*;
  using reverse_iterator = std::reverse_iterator<iterator>;
  using const_reverse_iterator = std::reverse_iterator<const_iterator>;

  /// The most extents held without a heap allocation.
  static constexpr size_t inline_rank = 6;

  shape_t() noexcept {}
  explicit shape_t(size_t n) { assign(n, 0); }
  shape_t(size_t n, int64_t value) { assign(n, value); }
  shape_t(std::initializer_list<int64_t> extents) { assign(extents.begin(), extents.end()); }
  template <class It, std::enable_if_t<!std::is_integral_v<It>, int> = 0>
  shape_t(It first, It last) {
    assign(first, last);
  }
  /// From a vector of extents (implicit, as the shape once was that vector).
  shape_t(const std::vector<int64_t>& extents) { // NOLINT(google-explicit-constructor)
    assign(extents.begin(), extents.end());
  }
  shape_t(const shape_t& other) { assign(other.begin(), other.end()); }
  shape_t(shape_t&& other) noexcept { take(other); }
  ~shape_t() { release(); }

  shape_t& operator=(const shape_t& other) {
    if (this != &other)
      assign(other.begin(), other.end());
    return *this;
  }
  shape_t& operator=(shape_t&& other) noexcept {
    if (this != &other) {
      release();
      take(other);
    }
    return *this;
  }
  shape_t& operator=(std::initializer_list<int64_t> extents) {
    assign(extents.begin(), extents.end());
    return *this;
  }

  /// The extents as a vector.
  operator std::vector<int64_t>() const { // NOLINT(google-explicit-constructor)
    return std::vector<int64_t>(begin(), end());
  }

  // -- element access

  int64_t* data() noexcept { return on_heap() ? heap_ : inline_; }
  const int64_t* data() const noexcept { return on_heap() ? heap_ : inline_; }
  int64_t& operator[](size_t i) noexcept { return data()[i]; }
  const int64_t& operator[](size_t i) const noexcept { return data()[i]; }
  int64_t& at(size_t i) {
    check_index(i);
    return data()[i];
  }
  const int64_t& at(size_t i) const {
    check_index(i);
    return data()[i];
  }
  int64_t& front() noexcept { return data()[0]; }
  const int64_t& front() const noexcept { return data()[0]; }
  int64_t& back() noexcept { return data()[size_ - 1]; }
  const int64_t& back() const noexcept { return data()[size_ - 1]; }

  // -- iterators

  iterator begin() noexcept { return data(); }
  const_iterator begin() const noexcept { return data(); }
  const_iterator cbegin() const noexcept { return data(); }
  iterator end() noexcept { return data() + size_; }
  const_iterator end() const noexcept { return data() + size_; }
  const_iterator cend() const noexcept { return data() + size_; }
  reverse_iterator rbegin() noexcept { return reverse_iterator(end()); }
  const_reverse_iterator rbegin() const noexcept { return const_reverse_iterator(end()); }
  reverse_iterator rend() noexcept { return reverse_iterator(begin()); }
  const_reverse_iterator rend() const noexcept { return const_reverse_iterator(begin()); }

  // -- capacity

  bool empty() const noexcept { return size_ == 0; }
  size_t size() const noexcept { return size_; }
  size_t capacity() const noexcept { return capacity_; }
  void reserve(size_t n) {
    if (n > capacity_)
      grow(n);
  }

  // -- modifiers

  void clear() noexcept { size_ = 0; }
  void push_back(int64_t extent) {
    if (size_ == capacity_)
      grow(capacity_ * 2);
    data()[size_++] = extent;
  }
  int64_t& emplace_back(int64_t extent) {
    push_back(extent);
    return back();
  }
  void pop_back() noexcept { --size_; }
  void resize(size_t n, int64_t value = 0) {
    reserve(n);
    for (size_t i = size_; i < n; ++i)
      data()[i] = value;
    size_ = static_cast<uint32_t>(n);
  }
  void assign(size_t n, int64_t value) {
    clear();
    resize(n, value);
  }
  template <class It, std::enable_if_t<!std::is_integral_v<It>, int> = 0>
  void assign(It first, It last) {
    clear();
    for (; first != last; ++first)
      push_back(static_cast<int64_t>(*first));
  }
  void assign(std::initializer_list<int64_t> extents) { assign(extents.begin(), extents.end()); }
  iterator insert(const_iterator pos, int64_t extent) {
    const auto at = static_cast<size_t>(pos - begin());
    push_back(extent);
    auto* p = data();
    for (size_t i = size_ - 1; i > at; --i)
      p[i] = p[i - 1];
    p[at] = extent;
    return p + at;
  }
  iterator erase(const_iterator pos) { return erase(pos, pos + 1); }
  iterator erase(const_iterator first, const_iterator last) {
    auto* p = data();
    const auto from = static_cast<size_t>(first - p);
    const auto to = static_cast<size_t>(last - p);
    for (size_t i = to; i < size_; ++i)
      p[from + i - to] = p[i];
    size_ = static_cast<uint32_t>(size_ - (to - from));
    return p + from;
  }
  void swap(shape_t& other) noexcept {
    shape_t tmp = std::move(other);
    other = std::move(*this);
    *this = std::move(tmp);
  }

  friend bool operator==(const shape_t& a, const shape_t& b) noexcept {
    if (a.size_ != b.size_)
      return false;
    for (size_t i = 0; i < a.size_; ++i)
      if (a[i] != b[i])
        return false;
    return true;
  }
  friend bool operator!=(const shape_t& a, const shape_t& b) noexcept { return !(a == b); }
  /// Lexicographic, as std::vector's.
  friend bool operator<(const shape_t& a, const shape_t& b) noexcept {
    for (size_t i = 0; i < a.size_ && i < b.size_; ++i)
      if (a[i] != b[i])
        return a[i] < b[i];
    return a.size_ < b.size_;
  }

private:
  bool on_heap() const noexcept { return capacity_ > inline_rank; }
  void check_index(size_t i) const;
  void grow(size_t at_least);
  void release() noexcept {
    if (on_heap())
      delete[] heap_;
  }
  /// Takes `other`'s extents and leaves it an empty inline shape.
  void take(shape_t& other) noexcept {
    size_ = other.size_;
    capacity_ = other.capacity_;
    if (other.on_heap())
      heap_ = other.heap_;
    else
      for (size_t i = 0; i < size_; ++i)
        inline_[i] = other.inline_[i];
    other.size_ = 0;
    other.capacity_ = inline_rank;
  }

  uint32_t size_ = 0;
  uint32_t capacity_ = inline_rank;
  union {
    int64_t inline_[inline_rank];
    int64_t* heap_;
  };
};

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
extern template float16_t tensor::item<float16_t>() const;
extern template bfloat16_t tensor::item<bfloat16_t>() const;

} // namespace consort
