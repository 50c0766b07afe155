// Cap'n Proto encoding and bounded decoding of the TCP transport's frame heads (see wire.hpp).

#include "transport/tcp/wire.hpp"

#include <schemas/frame.capnp.h>

#include <capnp/message.h>
#include <capnp/serialize.h>
#include <kj/exception.h>

#include <array>
#include <cstring>
#include <exception>

namespace consort::transport::tcp::wire {

static_assert(protocol_version == schemas::PROTOCOL_VERSION,
              "wire::protocol_version must follow schemas/frame.capnp");

namespace {

constexpr std::size_t word_bytes = sizeof(capnp::word);
constexpr std::size_t max_header_words = max_header_bytes / word_bytes;
// A segment table for one segment (8 bytes) plus at least the root pointer (8 bytes).
constexpr std::size_t min_header_bytes = 16;

/// Reader limits far below Cap'n Proto's defaults (64 Mi words, nesting 64): a head is tiny.
capnp::ReaderOptions reader_options() {
  capnp::ReaderOptions opts;
  opts.traversalLimitInWords = max_header_words;
  opts.nestingLimit = 4;
  return opts;
}

void put_u32(std::byte* out, uint32_t v) {
  for (int i = 0; i < 4; ++i)
    out[i] = static_cast<std::byte>((v >> (8 * i)) & 0xffu);
}

/// Writes `builder` (one segment) as prefix + flat array into `out`; returns the bytes written,
/// 0 when it does not fit.
std::size_t write_flat(capnp::MessageBuilder& builder, std::byte* out, std::size_t capacity) {
  auto segments = builder.getSegmentsForOutput();
  if (segments.size() != 1)
    return 0;
  auto words = segments[0].size();
  auto body = word_bytes + words * word_bytes;
  if (prefix_bytes + body > capacity)
    return 0;
  put_u32(out, static_cast<uint32_t>(body));
  put_u32(out + prefix_bytes, 0); // segment count - 1
  put_u32(out + prefix_bytes + 4, static_cast<uint32_t>(words));
  std::memcpy(out + prefix_bytes + word_bytes, segments[0].begin(), words * word_bytes);
  return prefix_bytes + body;
}

/// Runs `read(reader)` over `body` with the reader limits; returns why it failed, or "".
template <class Read>
std::string read_flat(std::span<const std::byte> body, Read&& read) {
  if (body.size() < min_header_bytes || body.size() > max_header_bytes ||
      body.size() % word_bytes != 0)
    return "a header of " + std::to_string(body.size()) + " bytes";
  // Copied so that the words are aligned, whatever the offset of `body` in a read buffer.
  std::array<capnp::word, max_header_words> words;
  std::memcpy(words.data(), body.data(), body.size());
  auto n = body.size() / word_bytes;
  try {
    capnp::FlatArrayMessageReader reader(kj::arrayPtr(words.data(), n), reader_options());
    if (reader.getEnd() != words.data() + n)
      return "the header has " + std::to_string((words.data() + n - reader.getEnd()) * word_bytes) +
             " trailing bytes after its Cap'n Proto message";
    return read(reader);
  } catch (const kj::Exception& e) {
    return "the header is not a valid Cap'n Proto message: " +
           std::string(e.getDescription().cStr());
  } catch (const std::exception& e) {
    return std::string("the header is not a valid Cap'n Proto message: ") + e.what();
  }
}

/// Copies a Data field of at most max_data_bytes into `out`; returns why not, or "".
std::string copy_data(capnp::Data::Reader in, const char* what, std::vector<std::byte>& out) {
  if (in.size() > max_data_bytes)
    return std::string("its ") + what + " has " + std::to_string(in.size()) + " bytes, at most " +
           std::to_string(max_data_bytes) + " are allowed";
  auto* p = reinterpret_cast<const std::byte*>(in.begin());
  out.assign(p, p + in.size());
  return {};
}

capnp::Data::Reader data_of(const std::vector<std::byte>& bytes) {
  return {reinterpret_cast<const kj::byte*>(bytes.data()), bytes.size()};
}

} // namespace

std::size_t encode_header(const header& h, std::span<std::byte, max_head_bytes> out) {
  // The builder's first segment is on the stack (it must start zeroed): no allocation per frame.
  std::array<capnp::word, 8> scratch{};
  capnp::MallocMessageBuilder builder(kj::arrayPtr(scratch.data(), scratch.size()));
  auto root = builder.initRoot<schemas::FrameHeader>();
  root.setVersion(h.version);
  root.setSenderRank(h.sender_rank);
  root.setTag(h.tag);
  root.setPayloadBytes(h.payload_bytes);
  root.setKind(static_cast<schemas::FrameKind>(h.kind));
  return write_flat(builder, out.data(), out.size());
}

std::vector<std::byte> encode_hello(const hello& h) {
  capnp::MallocMessageBuilder builder;
  auto root = builder.initRoot<schemas::Hello>();
  root.setVersion(h.version);
  root.setRank(h.rank);
  root.setSize(h.size);
  root.setGroupId(h.group_id);
  root.setEpoch(h.epoch);
  if (!h.nonce.empty())
    root.setNonce(data_of(h.nonce));
  if (!h.auth_proof.empty())
    root.setAuthProof(data_of(h.auth_proof));
  std::vector<std::byte> out(prefix_bytes + max_header_bytes);
  out.resize(write_flat(builder, out.data(), out.size()));
  return out;
}

std::string decode_length(std::span<const std::byte, prefix_bytes> prefix, uint32_t& length) {
  length = 0;
  for (int i = 3; i >= 0; --i)
    length = (length << 8) | static_cast<uint32_t>(prefix[i]);
  if (length < min_header_bytes || length > max_header_bytes)
    return "header length " + std::to_string(length) + " is outside [" +
           std::to_string(min_header_bytes) + ", " + std::to_string(max_header_bytes) + "]";
  if (length % word_bytes != 0)
    return "header length " + std::to_string(length) + " is not a multiple of 8";
  return {};
}

std::string decode_header(std::span<const std::byte> body, header& out) {
  return read_flat(body, [&](capnp::MessageReader& reader) -> std::string {
    auto root = reader.getRoot<schemas::FrameHeader>();
    out.version = root.getVersion();
    out.sender_rank = root.getSenderRank();
    out.tag = root.getTag();
    out.payload_bytes = root.getPayloadBytes();
    auto kind = static_cast<uint16_t>(root.getKind());
    if (kind > static_cast<uint16_t>(frame_kind::abort))
      return "unknown frame kind " + std::to_string(kind);
    out.kind = static_cast<frame_kind>(kind);
    if (out.kind != frame_kind::data && out.payload_bytes > max_control_bytes)
      return "a control frame with a payload of " + std::to_string(out.payload_bytes) +
             " bytes (at most " + std::to_string(max_control_bytes) + ")";
    return {};
  });
}

std::string decode_hello(std::span<const std::byte> body, hello& out) {
  return read_flat(body, [&](capnp::MessageReader& reader) -> std::string {
    auto root = reader.getRoot<schemas::Hello>();
    out.version = root.getVersion();
    out.rank = root.getRank();
    out.size = root.getSize();
    out.group_id = root.getGroupId();
    out.epoch = root.getEpoch();
    if (auto why = copy_data(root.getNonce(), "nonce", out.nonce); !why.empty())
      return why;
    return copy_data(root.getAuthProof(), "authentication proof", out.auth_proof);
  });
}

std::vector<std::byte> encode_auth(const auth& a) {
  capnp::MallocMessageBuilder builder;
  auto root = builder.initRoot<schemas::Auth>();
  root.setVersion(a.version);
  if (!a.proof.empty())
    root.setProof(data_of(a.proof));
  if (!a.refusal.empty()) {
    auto text = a.refusal.substr(0, max_refusal_bytes);
    root.setRefusal(capnp::Text::Reader(text.data(), text.size()));
  }
  std::vector<std::byte> out(prefix_bytes + max_header_bytes);
  out.resize(write_flat(builder, out.data(), out.size()));
  return out;
}

std::string decode_auth(std::span<const std::byte> body, auth& out) {
  return read_flat(body, [&](capnp::MessageReader& reader) -> std::string {
    auto root = reader.getRoot<schemas::Auth>();
    out.version = root.getVersion();
    if (auto why = copy_data(root.getProof(), "proof", out.proof); !why.empty())
      return why;
    auto refusal = root.getRefusal();
    if (refusal.size() > max_refusal_bytes)
      return "its refusal has " + std::to_string(refusal.size()) + " bytes, at most " +
             std::to_string(max_refusal_bytes) + " are allowed";
    out.refusal.assign(refusal.cStr(), refusal.size());
    return {};
  });
}

} // namespace consort::transport::tcp::wire
