#pragma once

// The shm transport's rings and frames: a message is a 24-byte frame header (tag, size, kind) and
// its bytes, streamed through the single-producer single-consumer byte ring of an ordered pair of
// ranks (segment.hpp); a ring_view copies bytes in and out of one ring, wrapping around its end.
// Header-only: all of it is on the hot path.

#include "transport/shm/segment.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace consort::transport::shm::impl {

/// The largest message a frame may announce (as the TCP transport's default).
constexpr uint64_t max_message_bytes = uint64_t{1} << 30;
/// The largest reason a goodbye frame may carry.
constexpr uint64_t max_goodbye_bytes = 4096;

enum frame_kind : uint32_t { data_frame = 1, goodbye_frame = 2 };

struct frame_header {
  uint64_t tag;
  uint64_t bytes;
  uint32_t kind;
  uint32_t reserved;
};
static_assert(sizeof(frame_header) == 24);

/// Whether a peer may have written `h`: a known kind, and no more bytes than that kind may have.
inline bool valid_frame(const frame_header& h) {
  return (h.kind == data_frame || h.kind == goodbye_frame) && h.bytes <= max_message_bytes &&
         (h.kind != goodbye_frame || h.bytes <= max_goodbye_bytes);
}

/// One ring's producer or consumer view.
struct ring_view {
  ring_control* control = nullptr;
  std::byte* bytes = nullptr;
  uint64_t capacity = 0;

  /// Copies `n` bytes from `src` into the ring at position `pos` (wrapping).
  void put(uint64_t pos, const std::byte* src, std::size_t n) const {
    auto at = static_cast<std::size_t>(pos & (capacity - 1));
    auto first = std::min<std::size_t>(n, capacity - at);
    std::memcpy(bytes + at, src, first);
    if (first < n)
      std::memcpy(bytes, src + first, n - first);
  }

  /// Copies `n` bytes at position `pos` of the ring (wrapping) to `dst`.
  void get(uint64_t pos, std::byte* dst, std::size_t n) const {
    auto at = static_cast<std::size_t>(pos & (capacity - 1));
    auto first = std::min<std::size_t>(n, capacity - at);
    std::memcpy(dst, bytes + at, first);
    if (first < n)
      std::memcpy(dst + first, bytes, n - first);
  }
};

} // namespace consort::transport::shm::impl
