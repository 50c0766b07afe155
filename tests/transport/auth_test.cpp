// Tests of the authentication primitives (transport/auth.hpp) against published vectors.

#include "transport/auth.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <span>
#include <string>
#include <vector>

namespace {

namespace auth = consort::transport::auth;
using bytes = std::vector<std::byte>;

// -- bytes ---------------------------------------------------------------------------------------

std::string hex(std::span<const std::byte> data) {
  static constexpr char digits[] = "0123456789abcdef";
  std::string out;
  for (auto b : data) {
    out += digits[static_cast<unsigned>(b) >> 4];
    out += digits[static_cast<unsigned>(b) & 0xf];
  }
  return out;
}

bytes from_hex(const std::string& text) {
  bytes out;
  for (std::size_t i = 0; i + 1 < text.size(); i += 2)
    out.push_back(static_cast<std::byte>(std::stoi(text.substr(i, 2), nullptr, 16)));
  return out;
}

bytes from_text(const std::string& text) {
  bytes out(text.size());
  std::transform(text.begin(), text.end(), out.begin(),
                 [](char c) { return static_cast<std::byte>(c); });
  return out;
}

bytes to_bytes(const auth::mac& m) {
  return {m.begin(), m.end()};
}

// -- the primitives ------------------------------------------------------------------------------

TEST(AuthTest, Sha256MatchesTheFips180Vectors) {
  EXPECT_EQ(hex(auth::sha256_of(from_text(""))),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(hex(auth::sha256_of(from_text("abc"))),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(
      hex(auth::sha256_of(from_text("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"))),
      "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  EXPECT_EQ(hex(auth::sha256_of(from_text(std::string(1000000, 'a')))),
            "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

TEST(AuthTest, HmacMatchesTheRfc4231Vectors) {
  struct vector {
    bytes key;
    bytes data;
    std::string mac;
  };
  std::vector<vector> cases = {
      {bytes(20, std::byte{0x0b}), from_text("Hi There"),
       "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7"},
      {from_text("Jefe"), from_text("what do ya want for nothing?"),
       "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"},
      {bytes(20, std::byte{0xaa}), bytes(50, std::byte{0xdd}),
       "773ea91e36800e46854db8ebd09181a72959098b3ef8c122d9635514ced565fe"},
      {from_hex("0102030405060708090a0b0c0d0e0f10111213141516171819"), bytes(50, std::byte{0xcd}),
       "82558a389a443c0ea4cc819899f2083a85f0faa3e578f8077a2e3ff46729665b"},
      {bytes(131, std::byte{0xaa}),
       from_text("Test Using Larger Than Block-Size Key - Hash Key First"),
       "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54"},
      {bytes(131, std::byte{0xaa}),
       from_text("This is a test using a larger than block-size key and a larger than block-size "
                 "data. The key needs to be hashed before being used by the HMAC algorithm."),
       "9b09ffa71b942fcb27635fbcd5b0e944bfdc63644f0713938a7f51535c3a35e2"},
  };
  for (std::size_t i = 0; i < cases.size(); ++i)
    EXPECT_EQ(hex(auth::hmac_sha256(cases[i].key, cases[i].data)), cases[i].mac)
        << "RFC 4231 case " << i;
}

TEST(AuthTest, EqualComparesSizeAndEveryByte) {
  auto a = from_text("abcdef");
  EXPECT_TRUE(auth::equal(a, from_text("abcdef")));
  EXPECT_FALSE(auth::equal(a, from_text("abcdeg")));
  EXPECT_FALSE(auth::equal(a, from_text("abcde")));
  EXPECT_TRUE(auth::equal(bytes{}, bytes{}));
}

TEST(AuthTest, TranscriptsOfDifferentFieldsNeverCollide) {
  // The same bytes split differently between fields, or under another role, sign differently.
  auto split1 = auth::transcript("x").bytes(from_text("ab")).bytes(from_text("c")).sign("k");
  auto split2 = auth::transcript("x").bytes(from_text("a")).bytes(from_text("bc")).sign("k");
  auto role = auth::transcript("y").bytes(from_text("ab")).bytes(from_text("c")).sign("k");
  EXPECT_NE(split1, split2);
  EXPECT_NE(split1, role);
  auto t = auth::transcript("x").u64(7).text("worker");
  EXPECT_TRUE(t.verify("k", to_bytes(t.sign("k"))));
  EXPECT_FALSE(t.verify("other", to_bytes(t.sign("k"))));
  EXPECT_FALSE(t.verify("k", bytes(auth::mac_bytes)));
  EXPECT_FALSE(t.verify("k", bytes{}));
}

TEST(AuthTest, NoncesAreFreshAndOfTheRequestedSize) {
  auto a = auth::random_bytes(auth::nonce_bytes);
  auto b = auth::random_bytes(auth::nonce_bytes);
  EXPECT_EQ(a.size(), auth::nonce_bytes);
  EXPECT_NE(a, b);
  EXPECT_NE(a, bytes(auth::nonce_bytes));
}

} // namespace
