// libFuzzer target: the membership codec (transport/membership/codec.hpp), fed as a peer sends
// frames: the first input byte picks the reader's max_message_bytes, the rest is a length prefix
// and a Cap'n Proto message. Besides "no crash, no sanitizer report", it checks properties a
// reader relies on:
//   - decode_length accepts exactly the lengths in [16, max_message_bytes] that are whole words;
//   - every decode succeeds or gives a non-empty reason, and no exception escapes;
//   - a decoded message keeps the codec's limits (fields, members, devices, lost ranks), and its
//     decoded size is bounded by the frame's (codec::max_decoded_ratio);
//   - a decoded message re-encodes to a frame that decodes to the same message.
// Run by tools/fuzz.sh; seeds come from make_seeds.

#include "transport/membership/codec.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <iterator>
#include <span>
#include <string>
#include <type_traits>
#include <variant>
#include <vector>

namespace {

namespace codec = consort::transport::membership::codec;
namespace membership = consort::transport::membership;

[[noreturn]] void fail(const char* what, const std::string& detail = {}) {
  std::fprintf(stderr, "membership_codec_fuzz: property violated: %s %s\n", what, detail.c_str());
  std::abort();
}

void check(bool ok, const char* what, const std::string& detail = {}) {
  if (!ok)
    fail(what, detail);
}

// -- equality and limits of decoded messages ------------------------------------------------------

bool same(const codec::join& a, const codec::join& b) {
  return a.task == b.task && a.address == b.address && a.devices == b.devices &&
         a.version == b.version && a.nonce == b.nonce && a.auth_proof == b.auth_proof &&
         a.pid == b.pid && a.cluster_digest == b.cluster_digest && a.cluster == b.cluster;
}
bool same(const codec::refusal& a, const codec::refusal& b) {
  return a.task == b.task && a.reason == b.reason;
}
bool same(const codec::view_message& a, const codec::view_message& b) {
  return a.view == b.view && a.auth_proof == b.auth_proof;
}
bool same(const codec::heartbeat& a, const codec::heartbeat& b) {
  return a.epoch == b.epoch && a.rank == b.rank && a.sequence == b.sequence;
}
bool same(const codec::leave& a, const codec::leave& b) {
  return a.epoch == b.epoch && a.rank == b.rank && a.reason == b.reason;
}
bool same(const codec::abort& a, const codec::abort& b) {
  return a.epoch == b.epoch && a.cause == b.cause && a.lost_ranks == b.lost_ranks;
}
bool same(const codec::challenge& a, const codec::challenge& b) {
  return a.nonce == b.nonce;
}

bool same(const codec::message& a, const codec::message& b) {
  if (a.index() != b.index())
    return false;
  return std::visit([&](const auto& x) { return same(x, std::get<std::decay_t<decltype(x)>>(b)); },
                    a);
}

/// The heap bytes that the decoded message holds (element arrays, texts and data).
struct footprint {
  std::size_t bytes = 0;

  void text(const std::string& s) {
    check(s.size() <= codec::max_field_bytes, "a text over max_field_bytes");
    bytes += s.size();
  }
  void data(const std::vector<std::byte>& d) {
    check(d.size() <= codec::max_field_bytes, "a data field over max_field_bytes");
    bytes += d.size();
  }
  void devices(const std::vector<membership::device_info>& ds) {
    check(ds.size() <= codec::max_devices, "a device list over max_devices");
    bytes += ds.size() * sizeof(membership::device_info);
    for (const auto& d : ds)
      text(d.name);
  }

  void operator()(const codec::join& m) {
    text(m.task.type);
    text(m.address);
    devices(m.devices);
    data(m.nonce);
    data(m.auth_proof);
  }
  void operator()(const codec::refusal& m) {
    text(m.task.type);
    text(m.reason);
  }
  void operator()(const codec::view_message& m) {
    check(m.view.members.size() <= codec::max_members, "a view over max_members");
    bytes += m.view.members.size() * sizeof(membership::member);
    for (const auto& member : m.view.members) {
      check(member.rank >= 0 && member.task.index >= 0, "a negative rank or task index");
      text(member.task.type);
      text(member.address);
      devices(member.devices);
    }
    data(m.view.nccl_unique_id);
    data(m.auth_proof);
  }
  void operator()(const codec::heartbeat&) {}
  void operator()(const codec::leave& m) { text(m.reason); }
  void operator()(const codec::abort& m) {
    check(m.lost_ranks.size() <= codec::max_members, "an abort over max_members lost ranks");
    bytes += m.lost_ranks.size() * sizeof(uint32_t);
    text(m.cause);
  }
  void operator()(const codec::challenge& m) { data(m.nonce); }
};

// -- properties ----------------------------------------------------------------------------------

/// decode on `body` with the reader limit `max`, and the properties of a decoded message.
void decode_properties(std::span<const std::byte> body, std::size_t max) {
  codec::message m;
  auto why = codec::decode(body, max, m);
  if (body.size() > max)
    check(!why.empty(), "decode accepted a frame over max_message_bytes");
  if (!why.empty())
    return;
  footprint fp;
  std::visit(fp, m);
  check(fp.bytes <= codec::max_decoded_ratio * body.size(),
        "the decoded message outgrows its frame:",
        std::to_string(fp.bytes) + " bytes from a frame of " + std::to_string(body.size()));
  auto frame = codec::encode(m);
  check(frame.size() >= codec::prefix_bytes + codec::min_message_bytes,
        "encode wrote a short frame");
  // A canonical encoding may be larger than a packed input (say, short struct sections that the
  // reader fills with defaults): read it back with a limit that admits it.
  auto again_max = std::max(max, frame.size() - codec::prefix_bytes);
  uint32_t length = 0;
  why = codec::decode_length(std::span<const std::byte, codec::prefix_bytes>(frame.data(), 4),
                             again_max, length);
  check(why.empty(), "the length of a re-encoded message is refused:", why);
  check(length + codec::prefix_bytes == frame.size(), "the prefix does not match the frame size");
  codec::message back;
  why = codec::decode(std::span(frame).subspan(codec::prefix_bytes), again_max, back);
  check(why.empty(), "a re-encoded message does not decode:", why);
  check(same(m, back), "a re-encoded message decodes to another message:", codec::kind_of(m));
}

void one_input(std::span<const std::byte> data) {
  if (data.empty())
    return;
  // Readers run with limits from 1 KiB (the least the service allows) to the 1 MiB default.
  static constexpr std::size_t limits[] = {1024, 4096, 65536, std::size_t{1} << 20};
  auto max = limits[static_cast<unsigned>(data[0]) % std::size(limits)];
  data = data.subspan(1);
  decode_properties(data, max);
  if (data.size() < codec::prefix_bytes)
    return;
  uint32_t length = 0;
  auto why = codec::decode_length(
      std::span<const std::byte, codec::prefix_bytes>(data.data(), codec::prefix_bytes), max,
      length);
  bool acceptable = length >= codec::min_message_bytes && length <= max && length % 8 == 0;
  check(why.empty() == acceptable, "decode_length is wrong about length", std::to_string(length));
  if (!why.empty() || data.size() - codec::prefix_bytes < length)
    return;
  decode_properties(data.subspan(codec::prefix_bytes, length), max);
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
