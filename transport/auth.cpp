// HMAC-SHA256, nonces and constant-time comparison over OpenSSL's libcrypto (see auth.hpp).

#include "transport/auth.hpp"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <climits>
#include <cstdio>
#include <cstdlib>

#include <sys/random.h>

namespace consort::transport::auth {

namespace {

[[noreturn]] void die(const char* what) {
  std::fprintf(stderr, "consort: %s failed; cannot authenticate connections\n", what);
  std::abort();
}

} // namespace

mac sha256_of(std::span<const std::byte> data) {
  mac out{};
  unsigned int n = 0;
  if (EVP_Digest(data.data(), data.size(), reinterpret_cast<unsigned char*>(out.data()), &n,
                 EVP_sha256(), nullptr) != 1 ||
      n != out.size())
    die("EVP_Digest(SHA-256)");
  return out;
}

mac hmac_sha256(std::span<const std::byte> key, std::span<const std::byte> message) {
  mac out{};
  unsigned int n = 0;
  // HMAC() wants a non-null key pointer even for an empty key.
  static const unsigned char empty_key = 0;
  const void* k = key.empty() ? static_cast<const void*>(&empty_key) : key.data();
  if (key.size() > static_cast<std::size_t>(INT_MAX) ||
      HMAC(EVP_sha256(), k, static_cast<int>(key.size()),
           reinterpret_cast<const unsigned char*>(message.data()), message.size(),
           reinterpret_cast<unsigned char*>(out.data()), &n) == nullptr ||
      n != out.size())
    die("HMAC-SHA256");
  return out;
}

std::vector<std::byte> random_bytes(std::size_t n) {
  std::vector<std::byte> out(n);
  if (n == 0)
    return out;
  if (n <= static_cast<std::size_t>(INT_MAX) &&
      RAND_bytes(reinterpret_cast<unsigned char*>(out.data()), static_cast<int>(n)) == 1)
    return out;
  std::size_t got = 0;
  while (got < n) {
    auto r = ::getrandom(out.data() + got, n - got, 0);
    if (r <= 0)
      die("RAND_bytes and getrandom");
    got += static_cast<std::size_t>(r);
  }
  return out;
}

bool equal(std::span<const std::byte> a, std::span<const std::byte> b) noexcept {
  return a.size() == b.size() && CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

// -- transcript -----------------------------------------------------------------------------------

transcript::transcript(std::string_view label) {
  text(label);
}

transcript& transcript::u32(uint32_t v) {
  for (int i = 0; i < 4; ++i)
    buf_.push_back(static_cast<std::byte>((v >> (8 * i)) & 0xffu));
  return *this;
}

transcript& transcript::u64(uint64_t v) {
  for (int i = 0; i < 8; ++i)
    buf_.push_back(static_cast<std::byte>((v >> (8 * i)) & 0xffu));
  return *this;
}

transcript& transcript::bytes(std::span<const std::byte> data) {
  u32(static_cast<uint32_t>(data.size()));
  buf_.insert(buf_.end(), data.begin(), data.end());
  return *this;
}

transcript& transcript::text(std::string_view text) {
  return bytes(std::as_bytes(std::span(text.data(), text.size())));
}

mac transcript::sign(std::string_view secret) const {
  return hmac_sha256(std::as_bytes(std::span(secret.data(), secret.size())), buf_);
}

bool transcript::verify(std::string_view secret, std::span<const std::byte> proof) const {
  auto expected = sign(secret);
  return equal(expected, proof);
}

} // namespace consort::transport::auth
