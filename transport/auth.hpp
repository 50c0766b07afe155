#pragma once

// Shared-secret authentication of connections (docs/multi_worker.md, "Authentication"): HMAC-SHA256
// from OpenSSL's libcrypto, fresh nonces from its random generator, constant-time comparison, and
// `transcript`, the unambiguous MAC input of a handshake. Used by the membership service
// (transport/membership) and the TCP mesh (transport/tcp). Internal to the library: no public
// header includes OpenSSL.

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

namespace consort::transport::auth {

/// Bytes of a SHA-256 digest and of an HMAC-SHA256 proof.
inline constexpr std::size_t mac_bytes = 32;

/// Bytes of every nonce this library makes.
inline constexpr std::size_t nonce_bytes = 32;

/// The shortest and longest nonce accepted from a peer.
inline constexpr std::size_t min_nonce_bytes = 16;
inline constexpr std::size_t max_nonce_bytes = 64;

/// A SHA-256 digest or an HMAC-SHA256 proof.
using mac = std::array<std::byte, mac_bytes>;

/// The SHA-256 digest of `data`.
mac sha256_of(std::span<const std::byte> data);

/// HMAC-SHA256 of `message` under `key` (RFC 2104).
mac hmac_sha256(std::span<const std::byte> key, std::span<const std::byte> message);

/// `n` bytes from OpenSSL's CSPRNG (RAND_bytes), or from the kernel (getrandom) should it fail.
/// Aborts the process when neither can deliver: a predictable nonce would void every proof.
std::vector<std::byte> random_bytes(std::size_t n);

/// Whether `a` and `b` are equal; for equal sizes in a time independent of their contents
/// (CRYPTO_memcmp).
bool equal(std::span<const std::byte> a, std::span<const std::byte> b) noexcept;

/// The input of one proof: a label naming the protocol, its version and the prover's role, then
/// fields, each either of fixed width (little-endian integers) or prefixed with its length (u32),
/// so that no two different field lists give the same bytes.
///
/// Thread safety: not thread-safe (a value type).
class transcript {
public:
  /// Starts with `label` (length-prefixed), e.g. "consort-mesh-v1|acceptor".
  explicit transcript(std::string_view label);

  transcript& u32(uint32_t v);
  transcript& u64(uint64_t v);

  /// `data`, prefixed with its length.
  transcript& bytes(std::span<const std::byte> data);

  /// The bytes of `text`, prefixed with their length.
  transcript& text(std::string_view text);

  /// HMAC-SHA256 of the transcript under `secret`.
  mac sign(std::string_view secret) const;

  /// Whether `proof` is the HMAC of the transcript under `secret` (compared in constant time).
  bool verify(std::string_view secret, std::span<const std::byte> proof) const;

private:
  std::vector<std::byte> buf_;
};

} // namespace consort::transport::auth
