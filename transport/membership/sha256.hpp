#pragma once

// SHA-256 (FIPS 180-4) and HMAC-SHA256 (RFC 2104), for the shared-secret proofs of cluster
// membership. No crypto library is available to the build (DESIGN.md §6), and these two are
// small; they are checked against the FIPS 180-4 and RFC 4231 test vectors
// (tests/transport/membership_test.cpp).

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

namespace consort::transport::membership::detail {

/// A SHA-256 digest.
using digest = std::array<std::byte, 32>;

/// An incremental SHA-256 hash.
///
/// Thread safety: not thread-safe (a value type).
class sha256 {
public:
  sha256() noexcept;

  /// Appends `data` to the message.
  void update(std::span<const std::byte> data) noexcept;

  /// Appends the bytes of `text`.
  void update(std::string_view text) noexcept;

  /// Pads the message and returns its digest. The hash must not be used afterwards.
  digest finish() noexcept;

private:
  void compress(const std::byte* block) noexcept;

  std::array<uint32_t, 8> state_;
  std::array<std::byte, 64> block_{};
  std::size_t block_used_ = 0;
  uint64_t total_bytes_ = 0;
};

/// The SHA-256 digest of `data`.
digest sha256_of(std::span<const std::byte> data) noexcept;

/// HMAC-SHA256 of `message` under `key` (RFC 2104; keys longer than 64 bytes are hashed first).
digest hmac_sha256(std::span<const std::byte> key, std::span<const std::byte> message) noexcept;

/// Whether `a` and `b` are equal, in a time that depends only on their sizes.
bool constant_time_equal(std::span<const std::byte> a, std::span<const std::byte> b) noexcept;

} // namespace consort::transport::membership::detail
