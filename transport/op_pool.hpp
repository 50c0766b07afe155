#pragma once

// The memory of transport operations (an operation and its shared_ptr's control block, one
// block, made with std::allocate_shared and `op_allocator`): each thread keeps up to `kept` freed
// blocks of each of a few sizes, for the next operations it makes, so that a collective's sends
// and receives reuse the blocks of the previous call's instead of taking new ones from the heap.
// A block freed on another thread (a progress or reader thread's) stays in that thread's cache.
// The shared-memory and TCP transports use it.

#include <cstddef>
#include <new>

namespace consort::transport::detail {

class op_blocks {
public:
  static void* take(std::size_t bytes) {
    auto& c = cache();
    for (auto& size : c.sizes)
      if (size.bytes == bytes && size.count > 0)
        return size.free[--size.count];
    return ::operator new(bytes);
  }

  static void give(void* p, std::size_t bytes) noexcept {
    auto& c = cache();
    for (auto& size : c.sizes) {
      if (size.count == 0 && size.bytes != bytes && !c.has(bytes))
        size.bytes = bytes; // an empty class takes the first size it is given
      if (size.bytes == bytes && size.count < kept) {
        size.free[size.count++] = p;
        return;
      }
    }
    ::operator delete(p);
  }

private:
  static constexpr int kept = 16;
  static constexpr int classes = 4;
  struct size_class {
    std::size_t bytes = 0;
    int count = 0;
    void* free[kept] = {};
  };
  struct thread_cache {
    size_class sizes[classes];
    bool has(std::size_t bytes) const noexcept {
      for (const auto& size : sizes)
        if (size.bytes == bytes)
          return true;
      return false;
    }
    ~thread_cache() {
      for (auto& size : sizes)
        while (size.count > 0)
          ::operator delete(size.free[--size.count]);
    }
  };
  static thread_cache& cache() {
    thread_local thread_cache c;
    return c;
  }
};

template <class T>
struct op_allocator {
  using value_type = T;
  op_allocator() noexcept = default;
  template <class U>
  op_allocator(const op_allocator<U>&) noexcept {} // NOLINT(google-explicit-constructor)
  T* allocate(std::size_t n) { return static_cast<T*>(op_blocks::take(n * sizeof(T))); }
  void deallocate(T* p, std::size_t n) noexcept { op_blocks::give(p, n * sizeof(T)); }
  template <class U>
  bool operator==(const op_allocator<U>&) const noexcept {
    return true;
  }
};

} // namespace consort::transport::detail
