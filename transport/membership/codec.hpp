#pragma once

// The membership protocol's messages (schemas/membership.capnp) behind plain structs, so that only
// codec.cpp sees Cap'n Proto:
//
//   u32 little-endian length L | L bytes: Cap'n Proto flat array of one MembershipMessage
//
// Every decode bounds what it reads: L is checked against the frame limit before anything is
// allocated, the message is read with a traversal limit of L/8 words (the frame's own words) and
// a nesting limit of 16, and every list and text is checked against the limits below before it
// is copied. A malformed frame gives a reason (for the log and the error) rather than an
// exception.

#include <consort/cluster.hpp>
#include <consort/transport/membership.hpp>

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <variant>
#include <vector>

namespace consort::transport::membership::codec {

/// The membership protocol version of this build (schemas::MEMBERSHIP_VERSION; checked in
/// codec.cpp).
inline constexpr uint16_t protocol_version = 1;

/// Bytes of the length prefix.
inline constexpr std::size_t prefix_bytes = 4;

/// The smallest valid frame: a one-segment table (8 bytes) and the root pointer (8 bytes).
inline constexpr std::size_t min_message_bytes = 16;

/// The most members of a view a reader accepts.
inline constexpr std::size_t max_members = 65536;

/// The most devices of a worker a reader accepts.
inline constexpr std::size_t max_devices = 4096;

/// The longest text or data field a reader accepts, in bytes.
inline constexpr std::size_t max_field_bytes = 4096;

/// A decoded message holds at most this many times its frame's length in memory (its lists,
/// texts and data), so that a small frame cannot make a reader allocate a large structure. Our
/// own encoder's frames need less than half of it.
inline constexpr std::size_t max_decoded_ratio = 4;

/// schemas::Join.
struct join {
  consort::task_id task;
  std::string address;
  std::vector<device_info> devices;
  uint16_t version = protocol_version;
  std::vector<std::byte> nonce;
  std::vector<std::byte> auth_proof;
  uint32_t pid = 0;
  /// The digest of the cluster the worker was given (cluster_check.hpp); 0: none.
  uint64_t cluster_digest = 0;
  /// That cluster's list, as text, cut to fit the frame.
  std::string cluster;
  /// Elastic: where this worker would lead re-formations as the chief's successor; "" otherwise.
  std::string standby_address;
  /// The worker's wall clock when it sent the Join (ns; 0: not given).
  int64_t sent_ns = 0;
};

/// schemas::Refusal.
struct refusal {
  consort::task_id task;
  std::string reason;
};

/// schemas::View, with the proof of the chief for the receiving worker.
struct view_message {
  membership::view view;
  std::vector<std::byte> auth_proof;
  /// The chief's wall clock when it sent the view, and the receiving worker's Join: when it was
  /// sent and when the chief received it (ns; 0: none).
  int64_t sent_ns = 0;
  int64_t join_sent_ns = 0;
  int64_t join_received_ns = 0;
};

/// schemas::Heartbeat.
struct heartbeat {
  uint64_t epoch = 0;
  uint32_t rank = 0;
  uint64_t sequence = 0;
  int64_t sent_ns = 0;
  int64_t echo_sent_ns = 0;
  int64_t echo_received_ns = 0;
};

/// schemas::Leave.
struct leave {
  uint64_t epoch = 0;
  uint32_t rank = 0;
  std::string reason;
};

/// schemas::Abort.
struct abort {
  uint64_t epoch = 0;
  std::string cause;
  std::vector<uint32_t> lost_ranks;
  bool at_boundary = false;
};

/// schemas::Challenge.
struct challenge {
  std::vector<std::byte> nonce;
};

/// One MembershipMessage.
using message = std::variant<join, refusal, view_message, heartbeat, leave, abort, challenge>;

/// The name of the message's kind, as the schema spells it ("join", "view"...).
const char* kind_of(const message& m) noexcept;

/// The length prefix and the encoded `m`.
std::vector<std::byte> encode(const message& m);

/// Reads the length prefix at `prefix`; returns an empty string when the length is acceptable
/// (at most `max_message_bytes`), else why not.
std::string decode_length(std::span<const std::byte, prefix_bytes> prefix,
                          std::size_t max_message_bytes, uint32_t& length);

/// Decodes a frame body of a length accepted by `decode_length`; returns an empty string on
/// success, else what was wrong. Checks the bounds above, not the meaning of the fields.
std::string decode(std::span<const std::byte> body, std::size_t max_message_bytes, message& out);

} // namespace consort::transport::membership::codec
