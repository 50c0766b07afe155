// SHA-256 and HMAC-SHA256 (see sha256.hpp).

#include "transport/membership/sha256.hpp"

#include <algorithm>
#include <cstring>

namespace consort::transport::membership::detail {

namespace {

// FIPS 180-4 §4.2.2: the first 32 bits of the fractional parts of the cube roots of the first 64
// primes.
constexpr std::array<uint32_t, 64> round_constants = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
};

// FIPS 180-4 §5.3.3: the initial hash value.
constexpr std::array<uint32_t, 8> initial_state = {
    0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19,
};

constexpr std::size_t block_bytes = 64;

constexpr uint32_t rotr(uint32_t x, int n) noexcept {
  return (x >> n) | (x << (32 - n));
}

uint32_t load_be32(const std::byte* p) noexcept {
  return (static_cast<uint32_t>(p[0]) << 24) | (static_cast<uint32_t>(p[1]) << 16) |
         (static_cast<uint32_t>(p[2]) << 8) | static_cast<uint32_t>(p[3]);
}

void store_be32(std::byte* p, uint32_t v) noexcept {
  for (int i = 0; i < 4; ++i)
    p[i] = static_cast<std::byte>(v >> (24 - 8 * i));
}

} // namespace

sha256::sha256() noexcept : state_(initial_state) {}

void sha256::compress(const std::byte* block) noexcept {
  // FIPS 180-4 §6.2.2: the message schedule, then 64 rounds.
  std::array<uint32_t, 64> w;
  for (int t = 0; t < 16; ++t)
    w[t] = load_be32(block + 4 * t);
  for (int t = 16; t < 64; ++t) {
    auto s0 = rotr(w[t - 15], 7) ^ rotr(w[t - 15], 18) ^ (w[t - 15] >> 3);
    auto s1 = rotr(w[t - 2], 17) ^ rotr(w[t - 2], 19) ^ (w[t - 2] >> 10);
    w[t] = w[t - 16] + s0 + w[t - 7] + s1;
  }
  auto [a, b, c, d, e, f, g, h] = state_;
  for (int t = 0; t < 64; ++t) {
    auto big_s1 = rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25);
    auto ch = (e & f) ^ (~e & g);
    auto t1 = h + big_s1 + ch + round_constants[t] + w[t];
    auto big_s0 = rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22);
    auto maj = (a & b) ^ (a & c) ^ (b & c);
    auto t2 = big_s0 + maj;
    h = g;
    g = f;
    f = e;
    e = d + t1;
    d = c;
    c = b;
    b = a;
    a = t1 + t2;
  }
  state_[0] += a;
  state_[1] += b;
  state_[2] += c;
  state_[3] += d;
  state_[4] += e;
  state_[5] += f;
  state_[6] += g;
  state_[7] += h;
}

void sha256::update(std::span<const std::byte> data) noexcept {
  total_bytes_ += data.size();
  auto* p = data.data();
  auto left = data.size();
  if (block_used_ > 0) {
    auto n = std::min(left, block_bytes - block_used_);
    std::memcpy(block_.data() + block_used_, p, n);
    block_used_ += n;
    p += n;
    left -= n;
    if (block_used_ < block_bytes)
      return;
    compress(block_.data());
    block_used_ = 0;
  }
  for (; left >= block_bytes; p += block_bytes, left -= block_bytes)
    compress(p);
  if (left > 0) {
    std::memcpy(block_.data(), p, left);
    block_used_ = left;
  }
}

void sha256::update(std::string_view text) noexcept {
  update(std::as_bytes(std::span(text.data(), text.size())));
}

digest sha256::finish() noexcept {
  // FIPS 180-4 §5.1.1: a 1 bit, zeros up to 56 mod 64 bytes, then the bit length (u64 BE).
  auto bit_length = total_bytes_ * 8;
  std::array<std::byte, block_bytes + 8> pad{};
  pad[0] = std::byte{0x80};
  auto pad_bytes = (block_used_ < 56 ? 56 - block_used_ : 120 - block_used_);
  for (int i = 0; i < 8; ++i)
    pad[pad_bytes + i] = static_cast<std::byte>(bit_length >> (56 - 8 * i));
  auto total = total_bytes_;
  update(std::span<const std::byte>(pad.data(), pad_bytes + 8));
  total_bytes_ = total;
  digest out;
  for (int i = 0; i < 8; ++i)
    store_be32(out.data() + 4 * i, state_[i]);
  return out;
}

digest sha256_of(std::span<const std::byte> data) noexcept {
  sha256 h;
  h.update(data);
  return h.finish();
}

digest hmac_sha256(std::span<const std::byte> key, std::span<const std::byte> message) noexcept {
  // RFC 2104: H((K ^ opad) || H((K ^ ipad) || message)), K padded (or first hashed) to a block.
  std::array<std::byte, block_bytes> k{};
  if (key.size() > block_bytes) {
    auto hashed = sha256_of(key);
    std::copy(hashed.begin(), hashed.end(), k.begin());
  } else {
    std::copy(key.begin(), key.end(), k.begin());
  }
  std::array<std::byte, block_bytes> ipad, opad;
  for (std::size_t i = 0; i < block_bytes; ++i) {
    ipad[i] = k[i] ^ std::byte{0x36};
    opad[i] = k[i] ^ std::byte{0x5c};
  }
  sha256 inner;
  inner.update(ipad);
  inner.update(message);
  auto inner_digest = inner.finish();
  sha256 outer;
  outer.update(opad);
  outer.update(inner_digest);
  return outer.finish();
}

bool constant_time_equal(std::span<const std::byte> a, std::span<const std::byte> b) noexcept {
  if (a.size() != b.size())
    return false;
  // Accumulates every difference: no early exit that would reveal where the first one is.
  std::byte diff{0};
  for (std::size_t i = 0; i < a.size(); ++i)
    diff |= a[i] ^ b[i];
  // volatile: keep the compiler from turning the loop back into an early-exit comparison.
  volatile auto result = static_cast<unsigned>(diff);
  return result == 0;
}

} // namespace consort::transport::membership::detail
