#pragma once

// The TCP transport's frame format (schemas/frame.capnp) behind plain structs, so that only
// wire.cpp sees Cap'n Proto:
//
//   u32 little-endian length L | L bytes: Cap'n Proto flat array (Hello, Auth or FrameHeader) |
//   payload
//
// Every decode bounds what it reads: L is checked before anything is read into a fixed buffer,
// the message is read with a small traversal and nesting limit, and a malformed frame gives a
// reason (for the log and the error) rather than an exception.

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace consort::transport::tcp::wire {

/// The protocol version this build speaks (schemas::PROTOCOL_VERSION; checked in wire.cpp).
inline constexpr uint16_t protocol_version = 1;

/// Bytes of the length prefix.
inline constexpr std::size_t prefix_bytes = 4;

/// The largest header (hello or frame header) a reader accepts; a longer one is malformed.
inline constexpr std::size_t max_header_bytes = 512;

/// The longest nonce or proof a decoded Hello or Auth may carry; a longer one is malformed.
inline constexpr std::size_t max_data_bytes = 64;

/// The longest refusal text of an Auth; encode_auth truncates longer ones, decode rejects them.
inline constexpr std::size_t max_refusal_bytes = 256;

/// Room for the prefix and an encoded FrameHeader (4 + 40 bytes today).
inline constexpr std::size_t max_head_bytes = 64;

/// The fields of schemas::Hello that the transport uses.
struct hello {
  uint16_t version = protocol_version;
  uint32_t rank = 0;
  uint32_t size = 0;
  uint64_t group_id = 0;
  uint64_t epoch = 0;
  std::vector<std::byte> nonce;      // at most max_data_bytes
  std::vector<std::byte> auth_proof; // at most max_data_bytes
};

/// The fields of schemas::Auth, the connector's proof of the shared secret.
struct auth {
  uint16_t version = protocol_version;
  std::vector<std::byte> proof; // at most max_data_bytes
  std::string refusal;          // at most max_refusal_bytes
};

/// schemas::FrameKind: a message, or a control frame that ends the connection.
enum class frame_kind : uint16_t { data = 0, goodbye = 1, abort = 2 };

/// The largest payload of a control frame (goodbye, abort): a reason, not data.
inline constexpr std::size_t max_control_bytes = 1024;

/// The fields of schemas::FrameHeader.
struct header {
  uint16_t version = protocol_version;
  uint32_t sender_rank = 0;
  uint64_t tag = 0;
  uint64_t payload_bytes = 0;
  frame_kind kind = frame_kind::data;
};

/// Writes the prefix and the encoded `h` to `out`; returns the bytes written.
std::size_t encode_header(const header& h, std::span<std::byte, max_head_bytes> out);

/// The prefix and the encoded `h`.
std::vector<std::byte> encode_hello(const hello& h);

/// Reads the length prefix at `prefix`; returns an empty string when the length is acceptable,
/// else why not.
std::string decode_length(std::span<const std::byte, prefix_bytes> prefix, uint32_t& length);

/// Decodes a header of `body.size()` (a length accepted by decode_length); returns an empty
/// string on success, else what was wrong. Checks that the kind is known and that a control
/// frame's payload is at most max_control_bytes; does not check the other field values.
std::string decode_header(std::span<const std::byte> body, header& out);

/// Decodes a hello, like decode_header; a nonce or proof longer than max_data_bytes is malformed.
std::string decode_hello(std::span<const std::byte> body, hello& out);

/// The prefix and the encoded `a` (its refusal truncated to max_refusal_bytes).
std::vector<std::byte> encode_auth(const auth& a);

/// Decodes an Auth, like decode_hello; a refusal longer than max_refusal_bytes is malformed.
std::string decode_auth(std::span<const std::byte> body, auth& out);

} // namespace consort::transport::tcp::wire
