// libFuzzer target: the TCP transport's frame heads (transport/tcp/wire.hpp), fed as a peer sends
// them: a length prefix, then the Cap'n Proto head. Besides "no crash, no sanitizer report", it
// checks properties a reader relies on:
//   - decode_length accepts exactly the lengths in [16, max_header_bytes] that are whole words;
//   - every decode succeeds or gives a non-empty reason, and no exception escapes;
//   - a body over max_header_bytes is always refused;
//   - a decoded header (hello) re-encodes to a frame that decodes to the same fields.
// Run by tools/fuzz.sh; seeds come from make_seeds.

#include "transport/tcp/wire.hpp"

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <span>
#include <string>

namespace {

namespace wire = consort::transport::tcp::wire;

[[noreturn]] void fail(const char* what, const std::string& detail = {}) {
  std::fprintf(stderr, "wire_fuzz: property violated: %s %s\n", what, detail.c_str());
  std::abort();
}

void check(bool ok, const char* what, const std::string& detail = {}) {
  if (!ok)
    fail(what, detail);
}

/// The prefix of `frame` as decode_length takes it.
std::span<const std::byte, wire::prefix_bytes> prefix_of(std::span<const std::byte> frame) {
  return std::span<const std::byte, wire::prefix_bytes>(frame.data(), wire::prefix_bytes);
}

bool same(const wire::header& a, const wire::header& b) {
  return a.version == b.version && a.sender_rank == b.sender_rank && a.tag == b.tag &&
         a.payload_bytes == b.payload_bytes && a.kind == b.kind;
}

bool same(const wire::hello& a, const wire::hello& b) {
  return a.version == b.version && a.rank == b.rank && a.size == b.size &&
         a.group_id == b.group_id && a.epoch == b.epoch;
}

/// Decodes the body of a frame that `frame` (prefix included) holds whole; fails otherwise.
std::span<const std::byte> body_of(std::span<const std::byte> frame) {
  check(frame.size() > wire::prefix_bytes, "an encoder wrote no frame");
  uint32_t length = 0;
  auto why = wire::decode_length(prefix_of(frame), length);
  check(why.empty(), "the length of an encoded frame is refused:", why);
  check(length + wire::prefix_bytes == frame.size(), "the prefix does not match the frame size");
  return frame.subspan(wire::prefix_bytes);
}

/// decode_header on `body`, with the properties of a decoded header.
void header_properties(std::span<const std::byte> body) {
  wire::header h;
  auto why = wire::decode_header(body, h);
  if (body.size() > wire::max_header_bytes)
    check(!why.empty(), "decode_header accepted a body over max_header_bytes");
  if (!why.empty())
    return;
  std::array<std::byte, wire::max_head_bytes> head{};
  auto n = wire::encode_header(h, head);
  wire::header back;
  why = wire::decode_header(body_of(std::span<const std::byte>(head.data(), n)), back);
  check(why.empty(), "a re-encoded header does not decode:", why);
  check(same(h, back), "a re-encoded header decodes to other fields");
}

/// decode_hello on `body`, with the properties of a decoded hello.
void hello_properties(std::span<const std::byte> body) {
  wire::hello h;
  auto why = wire::decode_hello(body, h);
  if (body.size() > wire::max_header_bytes)
    check(!why.empty(), "decode_hello accepted a body over max_header_bytes");
  if (!why.empty())
    return;
  auto frame = wire::encode_hello(h);
  wire::hello back;
  why = wire::decode_hello(body_of(frame), back);
  check(why.empty(), "a re-encoded hello does not decode:", why);
  check(same(h, back), "a re-encoded hello decodes to other fields");
}

void one_input(std::span<const std::byte> data) {
  // The input as a whole body: decoders must check sizes themselves.
  header_properties(data);
  hello_properties(data);
  // The input as a frame: prefix, then a body of the announced length.
  if (data.size() < wire::prefix_bytes)
    return;
  uint32_t length = 0;
  auto why = wire::decode_length(prefix_of(data), length);
  bool acceptable = length >= 16 && length <= wire::max_header_bytes && length % 8 == 0;
  check(why.empty() == acceptable, "decode_length is wrong about length", std::to_string(length));
  if (!why.empty() || data.size() - wire::prefix_bytes < length)
    return;
  auto body = data.subspan(wire::prefix_bytes, length);
  header_properties(body);
  hello_properties(body);
}

} // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, std::size_t size) {
  try {
    one_input(std::span<const std::byte>(reinterpret_cast<const std::byte*>(data), size));
  } catch (const std::exception& e) {
    fail("an exception escaped:", e.what());
  } catch (...) {
    fail("an exception of an unknown type escaped");
  }
  return 0;
}
