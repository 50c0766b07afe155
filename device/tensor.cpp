#include "device/gpu.hpp"
#include "device/host_memory.hpp"

#include <consort/device.hpp>
#include <consort/error.hpp>
#include <consort/tensor.hpp>

#include <algorithm>
#include <charconv>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <utility>
#include <vector>

#include <sys/mman.h>

namespace consort {

// -- dtype and shape helpers ----------------------------------------------------------------------

const char* to_string(dtype t) noexcept {
  switch (t) {
  case dtype::float32:
    return "float32";
  case dtype::float64:
    return "float64";
  case dtype::int32:
    return "int32";
  case dtype::int64:
    return "int64";
  case dtype::uint8:
    return "uint8";
  case dtype::boolean:
    return "bool";
  case dtype::float16:
    return "float16";
  case dtype::bfloat16:
    return "bfloat16";
  }
  return "unknown_dtype";
}

size_t size_of(dtype t) noexcept {
  switch (t) {
  case dtype::float32:
  case dtype::int32:
    return 4;
  case dtype::float64:
  case dtype::int64:
    return 8;
  case dtype::uint8:
  case dtype::boolean:
    return 1;
  case dtype::float16:
  case dtype::bfloat16:
    return 2;
  }
  return 0;
}

std::string to_string(const shape_t& shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i > 0)
      out += ", ";
    out += std::to_string(shape[i]);
  }
  out += ']';
  return out;
}

void shape_t::check_index(size_t i) const {
  if (i >= size_)
    throw std::out_of_range("shape_t::at: index " + std::to_string(i) + " of a shape of rank " +
                            std::to_string(size_));
}

void shape_t::grow(size_t at_least) {
  const size_t capacity = std::max(at_least, size_t{2} * inline_rank);
  auto* heap = new int64_t[capacity];
  const auto* from = data();
  for (size_t i = 0; i < size_; ++i)
    heap[i] = from[i];
  release();
  heap_ = heap;
  capacity_ = static_cast<uint32_t>(capacity);
}

int64_t num_elements(const shape_t& shape) noexcept {
  int64_t n = 1;
  for (auto extent : shape)
    n *= extent;
  return n;
}

// -- storage --------------------------------------------------------------------------------------

/// The bytes of a tensor: up to a cache line in the storage itself (one heap block for the
/// storage and its bytes: a scalar or a small collective's result costs one allocation, not two),
/// else a host block (device/host_memory.hpp: 64-byte aligned, from the process-wide cache from
/// 64 KiB on, huge pages from 2 MiB on), or GPU memory. Freed when the last tensor referring to it
/// goes away.
struct tensor::storage {
  static constexpr size_t inline_bytes = 64;

  /// `bytes` of host memory (`data` is never null), zero-filled when `zeroed`.
  /// @throws error(invalid_argument) when memory is exhausted.
  storage(size_t bytes, bool zeroed) : size(bytes) {
    if (bytes <= inline_bytes) {
      // The first 64-byte boundary in the inline bytes: the storage is a plain heap block (which
      // malloc's per-thread cache serves), aligned to less than that.
      const auto at = reinterpret_cast<uintptr_t>(inline_raw);
      data = inline_raw + ((64 - at % 64) % 64);
      if (zeroed)
        std::memset(data, 0, bytes);
      return;
    }
    block = zeroed ? detail::host_block::zeroed(bytes) : detail::host_block(bytes);
    data = block.data();
  }

  /// `bytes` of memory on GPU `index` (device memory: never touched by the host).
  storage(int index, size_t bytes, bool zeroed)
      : data(static_cast<std::byte*>(detail::gpu::allocate(index, bytes, zeroed))), size(bytes),
        gpu(index) {}

  ~storage() {
    if (gpu >= 0)
      detail::gpu::release(gpu, data, size);
  }

  storage(const storage&) = delete;
  storage& operator=(const storage&) = delete;

  detail::host_block block;  // host memory beyond `inline_bytes` (empty otherwise)
  std::byte* data = nullptr; // the first byte
  size_t size = 0;           // bytes requested
  int gpu = -1;              // the GPU holding the bytes, or -1 for host memory
  /// A small tensor's bytes, from the first 64-byte boundary in here (as a host block's).
  std::byte inline_raw[inline_bytes + 63];
};

namespace {

void check_extents(const shape_t& shape, const char* what) {
  for (auto extent : shape)
    if (extent < 0)
      throw_error(errc::invalid_argument, std::string{what} + ": shape " + to_string(shape) +
                                              " has a negative extent; extents must be >= 0");
}

/// Parses `device` and returns its canonical spelling; a GPU must exist in this process.
/// @throws error(unsupported) for a GPU in a build without CUDA, error(unknown_device) for a GPU
/// that is not there (naming how many there are, or why there are none).
std::string canonical_device(const std::string& device) {
  // Already canonical "CPU:<index>" (the default, and every label a tensor carries): as it is,
  // without the parse (a vector and lower-cased copies; it was a tenth of a small all-reduce).
  if (device.size() > 4 && device.size() <= 13 && device.compare(0, 4, "CPU:") == 0 &&
      (device[4] != '0' || device.size() == 5) &&
      std::all_of(device.begin() + 4, device.end(), [](char c) { return c >= '0' && c <= '9'; }))
    return device;
  auto spec = parse_device(device);
  if (spec.kind == device_kind::gpu) {
    if (!detail::gpu::built())
      throw_error(errc::unsupported, "cannot place a tensor on \"" + device +
                                         "\": GPU tensors need CUDA support, which this build "
                                         "lacks");
    detail::gpu::require(spec.index);
  }
  return spec.to_string();
}

template <class T>
T read_as(const void* p, dtype type) {
  switch (type) {
  case dtype::float32:
    return static_cast<T>(*static_cast<const float*>(p));
  case dtype::float64:
    return static_cast<T>(*static_cast<const double*>(p));
  case dtype::int32:
    return static_cast<T>(*static_cast<const int32_t*>(p));
  case dtype::int64:
    return static_cast<T>(*static_cast<const int64_t*>(p));
  case dtype::uint8:
    return static_cast<T>(*static_cast<const uint8_t*>(p));
  case dtype::boolean:
    return static_cast<T>(*static_cast<const uint8_t*>(p) != 0);
  case dtype::float16:
    return static_cast<T>(static_cast<float>(*static_cast<const float16_t*>(p)));
  case dtype::bfloat16:
    return static_cast<T>(static_cast<float>(*static_cast<const bfloat16_t*>(p)));
  }
  return T{};
}

template <class T>
void append_number(std::string& out, T value) {
  char buf[64];
  auto [end, ec] = std::to_chars(buf, buf + sizeof(buf), value);
  out.append(buf, ec == std::errc{} ? end : buf);
}

void append_element(std::string& out, const std::byte* p, dtype type) {
  switch (type) {
  case dtype::float32:
    append_number(out, *reinterpret_cast<const float*>(p));
    break;
  case dtype::float64:
    append_number(out, *reinterpret_cast<const double*>(p));
    break;
  case dtype::int32:
    append_number(out, *reinterpret_cast<const int32_t*>(p));
    break;
  case dtype::int64:
    append_number(out, *reinterpret_cast<const int64_t*>(p));
    break;
  case dtype::uint8:
    append_number(out, static_cast<unsigned>(*reinterpret_cast<const uint8_t*>(p)));
    break;
  case dtype::boolean:
    out += *reinterpret_cast<const uint8_t*>(p) != 0 ? "true" : "false";
    break;
  case dtype::float16:
    append_number(out, static_cast<float>(*reinterpret_cast<const float16_t*>(p)));
    break;
  case dtype::bfloat16:
    append_number(out, static_cast<float>(*reinterpret_cast<const bfloat16_t*>(p)));
    break;
  }
}

} // namespace

// -- tensor ---------------------------------------------------------------------------------------

tensor tensor::allocate(consort::dtype type, shape_t shape, const std::string& device, bool zeroed,
                        const char* what) {
  check_extents(shape, what);
  tensor t;
  t.device_ = canonical_device(device);
  t.type_ = type;
  t.shape_ = std::move(shape);
  const int gpu = detail::gpu::index_of(t.device_);
  t.storage_ = gpu >= 0 ? std::make_shared<storage>(gpu, t.num_bytes(), zeroed)
                        : std::make_shared<storage>(t.num_bytes(), zeroed);
  return t;
}

tensor tensor::zeros(consort::dtype type, shape_t shape, std::string device) {
  return allocate(type, std::move(shape), device, true, "tensor::zeros");
}

tensor tensor::empty(consort::dtype type, shape_t shape, std::string device) {
  return allocate(type, std::move(shape), device, false, "tensor::empty");
}

const void* tensor::raw_data() const noexcept {
  return storage_ ? storage_->data + offset_ : nullptr;
}

void* tensor::raw_mutable_data() {
  if (!storage_)
    throw_error(errc::invalid_argument,
                "cannot write to a default-constructed tensor: it has no storage");
  if (storage_.use_count() > 1) {
    // Someone else sees these bytes: give this tensor a private copy of its own view first, so
    // that a tensor already handed out never changes under its holder.
    const int gpu = storage_->gpu;
    auto fresh = gpu >= 0 ? std::make_shared<storage>(gpu, num_bytes(), false)
                          : std::make_shared<storage>(num_bytes(), false);
    if (gpu >= 0)
      detail::gpu::copy(fresh->data, gpu, storage_->data + offset_, gpu, num_bytes());
    else if (num_bytes() > 0)
      std::memcpy(fresh->data, storage_->data + offset_, num_bytes());
    storage_ = std::move(fresh);
    offset_ = 0;
  }
  return storage_->data + offset_;
}

template <class T>
T tensor::item() const {
  if (!valid() || num_elements() != 1)
    throw_error(errc::shape_mismatch,
                "item() needs a tensor with exactly one element; got " +
                    (valid() ? std::string{consort::to_string(type_)} + consort::to_string(shape_) +
                                   " with " + std::to_string(num_elements()) + " elements"
                             : std::string{"a default-constructed tensor"}));
  if (on_gpu())
    return to("CPU:0").item<T>();
  if constexpr (std::is_same_v<T, bool>)
    return read_as<double>(raw_data(), type_) != 0;
  else
    return read_as<T>(raw_data(), type_);
}

template float tensor::item<float>() const;
template double tensor::item<double>() const;
template int32_t tensor::item<int32_t>() const;
template int64_t tensor::item<int64_t>() const;
template uint8_t tensor::item<uint8_t>() const;
template bool tensor::item<bool>() const;
template float16_t tensor::item<float16_t>() const;
template bfloat16_t tensor::item<bfloat16_t>() const;

tensor tensor::slice(int64_t begin, int64_t end) const {
  if (!valid() || rank() == 0)
    throw_error(errc::out_of_range,
                "slice needs a tensor of rank >= 1; got " +
                    (valid() ? "a scalar " + std::string{consort::to_string(type_)} + "[]"
                             : std::string{"a default-constructed tensor"}));
  if (begin < 0 || end < begin || end > shape_[0])
    throw_error(errc::out_of_range, "slice [" + std::to_string(begin) + ", " + std::to_string(end) +
                                        ") is out of range for shape " +
                                        consort::to_string(shape_) +
                                        ": need 0 <= begin <= end <= " + std::to_string(shape_[0]));
  tensor out = *this;
  int64_t row_elements = 1;
  for (size_t axis = 1; axis < shape_.size(); ++axis)
    row_elements *= shape_[axis];
  auto row_bytes = static_cast<size_t>(row_elements) * size_of(type_);
  out.offset_ = offset_ + static_cast<size_t>(begin) * row_bytes;
  out.shape_[0] = end - begin;
  return out;
}

tensor tensor::reshape(shape_t shape) const {
  // One extent may be -1, as in TF: it takes whatever the others leave.
  int inferred = -1;
  int64_t known = 1;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] == -1 && inferred < 0) {
      inferred = static_cast<int>(i);
      continue;
    }
    if (shape[i] < 0)
      throw_error(errc::invalid_argument, "reshape to " + consort::to_string(shape) +
                                              ": extents must be >= 0, with at most one -1");
    known *= shape[i];
  }
  if (inferred >= 0) {
    if (known == 0 || num_elements() % known != 0)
      throw_error(errc::shape_mismatch, "cannot reshape " + consort::to_string(shape_) + " (" +
                                            std::to_string(num_elements()) + " elements) to " +
                                            consort::to_string(shape));
    shape[static_cast<size_t>(inferred)] = num_elements() / known;
    known = num_elements();
  }
  if (known != num_elements())
    throw_error(errc::shape_mismatch, "cannot reshape " + consort::to_string(shape_) + " (" +
                                          std::to_string(num_elements()) + " elements) to " +
                                          consort::to_string(shape) + " (" + std::to_string(known) +
                                          " elements): element counts must be equal");
  tensor out = *this;
  out.shape_ = std::move(shape);
  return out;
}

bool tensor::on_gpu() const noexcept {
  return storage_ != nullptr && storage_->gpu >= 0;
}

tensor tensor::to(const std::string& device) const {
  auto target = canonical_device(device);
  const int to_gpu = detail::gpu::index_of(target);
  const int from_gpu = storage_ ? storage_->gpu : -1;
  // Host memory is shared by every CPU device, and a GPU's memory by its own name: relabel.
  if (!valid() || to_gpu == from_gpu) {
    tensor out = *this;
    out.device_ = std::move(target);
    return out;
  }
  tensor out = empty(type_, shape_, target);
  detail::gpu::copy(out.storage_->data, to_gpu, raw_data(), from_gpu, num_bytes());
  return out;
}

tensor tensor::clone() const {
  if (!valid())
    return *this;
  tensor out = empty(type_, shape_, device_);
  if (on_gpu())
    detail::gpu::copy(out.storage_->data, storage_->gpu, raw_data(), storage_->gpu, num_bytes());
  else if (num_bytes() > 0)
    std::memcpy(out.storage_->data, raw_data(), num_bytes());
  return out;
}

bool operator==(const tensor& a, const tensor& b) {
  if (a.valid() != b.valid())
    return false;
  if (!a.valid())
    return true;
  if (a.type_ != b.type_ || a.shape_ != b.shape_)
    return false;
  if (a.on_gpu() || b.on_gpu())
    return a.to("CPU:0") == b.to("CPU:0");
  return a.num_bytes() == 0 || std::memcmp(a.raw_data(), b.raw_data(), a.num_bytes()) == 0;
}

std::string tensor::to_string(size_t max_elements) const {
  if (!valid())
    return "tensor(invalid)";
  if (on_gpu())
    return to("CPU:0").to_string(max_elements) + " on " + device_;
  std::string out = consort::to_string(type_);
  out += consort::to_string(shape_);
  out += '{';
  auto n = static_cast<size_t>(num_elements());
  auto elem = size_of(type_);
  auto* p = static_cast<const std::byte*>(raw_data());
  for (size_t i = 0; i < n && i < max_elements; ++i) {
    if (i > 0)
      out += ", ";
    append_element(out, p + i * elem, type_);
  }
  if (n > max_elements)
    out += max_elements > 0 ? ", ..." : "...";
  out += '}';
  return out;
}

void tensor::check_count(int64_t count, const shape_t& shape) {
  check_extents(shape, "tensor::from");
  if (count != consort::num_elements(shape))
    throw_error(errc::shape_mismatch, "tensor::from got " + std::to_string(count) +
                                          " values for shape " + consort::to_string(shape) +
                                          ", which holds " +
                                          std::to_string(consort::num_elements(shape)));
}

void tensor::check_type(consort::dtype expected) const {
  if (expected != type_)
    throw_error(errc::dtype_mismatch, "tensor of dtype " + std::string{consort::to_string(type_)} +
                                          " accessed as " + consort::to_string(expected));
}

} // namespace consort
