// Cap'n Proto encoding and bounded decoding of membership messages (see codec.hpp).

#include "transport/membership/codec.hpp"

#include <schemas/membership.capnp.h>

#include <capnp/message.h>
#include <capnp/serialize.h>
#include <kj/exception.h>

#include <algorithm>
#include <cstring>
#include <exception>
#include <iterator>
#include <limits>

namespace consort::transport::membership::codec {

static_assert(protocol_version == schemas::MEMBERSHIP_VERSION,
              "codec::protocol_version must follow schemas/membership.capnp");

namespace {

constexpr std::size_t word_bytes = sizeof(capnp::word);

/// Reader limits: one traversal of the frame itself, nesting 16. The limit follows the frame's
/// length, not max_message_bytes: Cap'n Proto charges a list of zero-sized structs one word per
/// element, so a limit above the frame's words would let a tiny frame announce huge lists.
capnp::ReaderOptions reader_options(std::size_t frame_bytes) {
  capnp::ReaderOptions opts;
  opts.traversalLimitInWords = frame_bytes / word_bytes;
  opts.nestingLimit = 16;
  return opts;
}

void put_u32(std::byte* out, uint32_t v) {
  for (int i = 0; i < 4; ++i)
    out[i] = static_cast<std::byte>((v >> (8 * i)) & 0xffu);
}

// -- encoding ------------------------------------------------------------------------------------

kj::ArrayPtr<const kj::byte> bytes_of(const std::vector<std::byte>& data) {
  return kj::arrayPtr(reinterpret_cast<const kj::byte*>(data.data()), data.size());
}

void set_task(schemas::Task::Builder out, const consort::task_id& task) {
  out.setType(task.type);
  out.setIndex(static_cast<uint32_t>(task.index));
}

void set_devices(capnp::List<schemas::Device>::Builder out,
                 const std::vector<device_info>& devices) {
  for (std::size_t i = 0; i < devices.size(); ++i) {
    auto d = out[static_cast<unsigned>(i)];
    d.setName(devices[i].name);
    d.setKind(devices[i].gpu ? schemas::Device::Kind::GPU : schemas::Device::Kind::CPU);
    d.setMemoryBytes(devices[i].memory_bytes);
  }
}

struct encoder {
  schemas::MembershipMessage::Builder root;

  void operator()(const join& m) {
    auto out = root.initJoin();
    set_task(out.initTask(), m.task);
    out.setAddress(m.address);
    set_devices(out.initDevices(static_cast<unsigned>(m.devices.size())), m.devices);
    out.setProtocolVersion(m.version);
    out.setNonce(bytes_of(m.nonce));
    out.setAuthProof(bytes_of(m.auth_proof));
    out.setPid(m.pid);
    out.setClusterDigest(m.cluster_digest);
    out.setCluster(m.cluster);
    out.setStandbyAddress(m.standby_address);
    out.setSentNs(m.sent_ns);
  }

  void operator()(const refusal& m) {
    auto out = root.initRefusal();
    set_task(out.initTask(), m.task);
    out.setReason(m.reason);
  }

  void operator()(const view_message& m) {
    auto out = root.initView();
    out.setEpoch(m.view.epoch);
    out.setGroupId(m.view.group_id);
    auto members = out.initMembers(static_cast<unsigned>(m.view.members.size()));
    for (std::size_t i = 0; i < m.view.members.size(); ++i) {
      const auto& src = m.view.members[i];
      auto dst = members[static_cast<unsigned>(i)];
      dst.setRank(static_cast<uint32_t>(src.rank));
      set_task(dst.initTask(), src.task);
      dst.setAddress(src.address);
      set_devices(dst.initDevices(static_cast<unsigned>(src.devices.size())), src.devices);
      dst.setStandbyAddress(src.standby_address);
      dst.setPid(src.pid);
    }
    out.setNcclUniqueId(bytes_of(m.view.nccl_unique_id));
    out.setAuthProof(bytes_of(m.auth_proof));
    out.setSentNs(m.sent_ns);
    out.setJoinSentNs(m.join_sent_ns);
    out.setJoinReceivedNs(m.join_received_ns);
  }

  void operator()(const heartbeat& m) {
    auto out = root.initHeartbeat();
    out.setEpoch(m.epoch);
    out.setRank(m.rank);
    out.setSequence(m.sequence);
    out.setSentNs(m.sent_ns);
    out.setEchoSentNs(m.echo_sent_ns);
    out.setEchoReceivedNs(m.echo_received_ns);
  }

  void operator()(const leave& m) {
    auto out = root.initLeave();
    out.setEpoch(m.epoch);
    out.setRank(m.rank);
    out.setReason(m.reason);
  }

  void operator()(const abort& m) {
    auto out = root.initAbort();
    out.setEpoch(m.epoch);
    out.setCause(m.cause);
    auto ranks = out.initLostRanks(static_cast<unsigned>(m.lost_ranks.size()));
    for (std::size_t i = 0; i < m.lost_ranks.size(); ++i)
      ranks.set(static_cast<unsigned>(i), m.lost_ranks[i]);
    out.setAtBoundary(m.at_boundary);
  }

  void operator()(const challenge& m) { root.initChallenge().setNonce(bytes_of(m.nonce)); }
};

// -- decoding ------------------------------------------------------------------------------------

/// The memory a message being decoded may still take: max_decoded_ratio times its frame, charged
/// before each list, text or data field is copied.
struct budget {
  std::size_t left = 0;
  std::size_t frame_bytes = 0;

  /// Takes `count` items of `size` bytes for `what`; returns why not.
  std::string take(std::size_t count, std::size_t size, const std::string& what) {
    if (count > left / size)
      return what + " would take " + std::to_string(count * size) +
             " bytes decoded, over the limit of " + std::to_string(max_decoded_ratio) +
             " times the frame's " + std::to_string(frame_bytes) + " bytes";
    left -= count * size;
    return {};
  }
};

/// Copies a text field of at most max_field_bytes and no NUL byte; returns why not.
std::string copy_text(capnp::Text::Reader text, const char* what, budget& b, std::string& out) {
  if (text.size() > max_field_bytes)
    return std::string("the ") + what + " is " + std::to_string(text.size()) +
           " bytes long, over the limit of " + std::to_string(max_field_bytes);
  // Cap'n Proto text ends at its NUL; one inside would make this copy differ from what any C
  // string use of it (and our own encoder, which takes std::string::c_str()) sees.
  if (const void* nul = std::memchr(text.begin(), '\0', text.size()))
    return std::string("the ") + what + " has a NUL byte at offset " +
           std::to_string(static_cast<const char*>(nul) - text.begin());
  if (auto why = b.take(text.size(), 1, std::string("the ") + what); !why.empty())
    return why;
  out.assign(text.begin(), text.size());
  return {};
}

/// Copies a data field of at most max_field_bytes; returns why not.
std::string copy_data(capnp::Data::Reader data, const char* what, budget& b,
                      std::vector<std::byte>& out) {
  if (data.size() > max_field_bytes)
    return std::string("the ") + what + " is " + std::to_string(data.size()) +
           " bytes long, over the limit of " + std::to_string(max_field_bytes);
  if (auto why = b.take(data.size(), 1, std::string("the ") + what); !why.empty())
    return why;
  auto* p = reinterpret_cast<const std::byte*>(data.begin());
  out.assign(p, p + data.size());
  return {};
}

std::string copy_task(schemas::Task::Reader task, budget& b, consort::task_id& out) {
  if (auto why = copy_text(task.getType(), "task type", b, out.type); !why.empty())
    return why;
  auto index = task.getIndex();
  if (index > static_cast<uint32_t>(std::numeric_limits<int>::max()))
    return "the task index " + std::to_string(index) + " is out of range";
  out.index = static_cast<int>(index);
  return {};
}

std::string copy_devices(capnp::List<schemas::Device>::Reader devices, budget& b,
                         std::vector<device_info>& out) {
  if (devices.size() > max_devices)
    return "the list of " + std::to_string(devices.size()) + " devices is over the limit of " +
           std::to_string(max_devices);
  if (auto why = b.take(devices.size(), sizeof(device_info),
                        "the list of " + std::to_string(devices.size()) + " devices");
      !why.empty())
    return why;
  out.clear();
  out.reserve(devices.size());
  for (auto d : devices) {
    device_info info;
    if (auto why = copy_text(d.getName(), "device name", b, info.name); !why.empty())
      return why;
    info.gpu = d.getKind() == schemas::Device::Kind::GPU;
    info.memory_bytes = d.getMemoryBytes();
    out.push_back(std::move(info));
  }
  return {};
}

std::string read_message(schemas::MembershipMessage::Reader root, budget& b, message& out) {
  switch (root.which()) {
  case schemas::MembershipMessage::JOIN: {
    auto in = root.getJoin();
    join m;
    std::string why;
    if (why = copy_task(in.getTask(), b, m.task); !why.empty())
      return why;
    if (why = copy_text(in.getAddress(), "address", b, m.address); !why.empty())
      return why;
    if (why = copy_devices(in.getDevices(), b, m.devices); !why.empty())
      return why;
    m.version = in.getProtocolVersion();
    if (why = copy_data(in.getNonce(), "nonce", b, m.nonce); !why.empty())
      return why;
    if (why = copy_data(in.getAuthProof(), "authentication proof", b, m.auth_proof); !why.empty())
      return why;
    m.pid = in.getPid();
    m.cluster_digest = in.getClusterDigest();
    if (why = copy_text(in.getCluster(), "cluster", b, m.cluster); !why.empty())
      return why;
    if (why = copy_text(in.getStandbyAddress(), "standby address", b, m.standby_address);
        !why.empty())
      return why;
    m.sent_ns = in.getSentNs();
    out = std::move(m);
    return {};
  }
  case schemas::MembershipMessage::REFUSAL: {
    auto in = root.getRefusal();
    refusal m;
    std::string why;
    if (why = copy_task(in.getTask(), b, m.task); !why.empty())
      return why;
    if (why = copy_text(in.getReason(), "reason", b, m.reason); !why.empty())
      return why;
    out = std::move(m);
    return {};
  }
  case schemas::MembershipMessage::VIEW: {
    auto in = root.getView();
    view_message m;
    m.view.epoch = in.getEpoch();
    m.view.group_id = in.getGroupId();
    auto members = in.getMembers();
    if (members.size() > max_members)
      return "the view lists " + std::to_string(members.size()) + " members, over the limit of " +
             std::to_string(max_members);
    if (auto why = b.take(members.size(), sizeof(member),
                          "the view's " + std::to_string(members.size()) + " members");
        !why.empty())
      return why;
    m.view.members.reserve(members.size());
    std::string why;
    for (auto src : members) {
      member dst;
      auto rank = src.getRank();
      if (rank > static_cast<uint32_t>(std::numeric_limits<int>::max()))
        return "a member's rank " + std::to_string(rank) + " is out of range";
      dst.rank = static_cast<int>(rank);
      if (why = copy_task(src.getTask(), b, dst.task); !why.empty())
        return why;
      if (why = copy_text(src.getAddress(), "member address", b, dst.address); !why.empty())
        return why;
      if (why = copy_devices(src.getDevices(), b, dst.devices); !why.empty())
        return why;
      if (why =
              copy_text(src.getStandbyAddress(), "member standby address", b, dst.standby_address);
          !why.empty())
        return why;
      dst.pid = src.getPid();
      m.view.members.push_back(std::move(dst));
    }
    if (why = copy_data(in.getNcclUniqueId(), "NCCL unique id", b, m.view.nccl_unique_id);
        !why.empty())
      return why;
    if (why = copy_data(in.getAuthProof(), "authentication proof", b, m.auth_proof); !why.empty())
      return why;
    m.sent_ns = in.getSentNs();
    m.join_sent_ns = in.getJoinSentNs();
    m.join_received_ns = in.getJoinReceivedNs();
    out = std::move(m);
    return {};
  }
  case schemas::MembershipMessage::HEARTBEAT: {
    auto in = root.getHeartbeat();
    out = heartbeat{in.getEpoch(),  in.getRank(),       in.getSequence(),
                    in.getSentNs(), in.getEchoSentNs(), in.getEchoReceivedNs()};
    return {};
  }
  case schemas::MembershipMessage::LEAVE: {
    auto in = root.getLeave();
    leave m;
    m.epoch = in.getEpoch();
    m.rank = in.getRank();
    if (auto why = copy_text(in.getReason(), "reason", b, m.reason); !why.empty())
      return why;
    out = std::move(m);
    return {};
  }
  case schemas::MembershipMessage::ABORT: {
    auto in = root.getAbort();
    abort m;
    m.epoch = in.getEpoch();
    if (auto why = copy_text(in.getCause(), "cause", b, m.cause); !why.empty())
      return why;
    auto ranks = in.getLostRanks();
    if (ranks.size() > max_members)
      return "the abort lists " + std::to_string(ranks.size()) + " lost ranks, over the limit of " +
             std::to_string(max_members);
    if (auto why = b.take(ranks.size(), sizeof(uint32_t),
                          "the abort's " + std::to_string(ranks.size()) + " lost ranks");
        !why.empty())
      return why;
    m.lost_ranks.reserve(ranks.size());
    for (auto r : ranks)
      m.lost_ranks.push_back(r);
    m.at_boundary = in.getAtBoundary();
    out = std::move(m);
    return {};
  }
  case schemas::MembershipMessage::CHALLENGE: {
    challenge m;
    if (auto why = copy_data(root.getChallenge().getNonce(), "nonce", b, m.nonce); !why.empty())
      return why;
    out = std::move(m);
    return {};
  }
  }
  return "unknown message type " + std::to_string(static_cast<unsigned>(root.which())) +
         " (a newer protocol?)";
}

} // namespace

const char* kind_of(const message& m) noexcept {
  static constexpr const char* names[] = {"join",  "refusal", "view",     "heartbeat",
                                          "leave", "abort",   "challenge"};
  static_assert(std::size(names) == std::variant_size_v<message>);
  return names[m.index()];
}

std::vector<std::byte> encode(const message& m) {
  capnp::MallocMessageBuilder builder;
  std::visit(encoder{builder.initRoot<schemas::MembershipMessage>()}, m);
  auto words = capnp::messageToFlatArray(builder);
  auto body = words.asBytes();
  std::vector<std::byte> out(prefix_bytes + body.size());
  put_u32(out.data(), static_cast<uint32_t>(body.size()));
  std::memcpy(out.data() + prefix_bytes, body.begin(), body.size());
  return out;
}

std::string decode_length(std::span<const std::byte, prefix_bytes> prefix,
                          std::size_t max_message_bytes, uint32_t& length) {
  length = 0;
  for (int i = 3; i >= 0; --i)
    length = (length << 8) | static_cast<uint32_t>(prefix[i]);
  if (length < min_message_bytes || length > max_message_bytes)
    return "frame length " + std::to_string(length) + " is outside [" +
           std::to_string(min_message_bytes) + ", " + std::to_string(max_message_bytes) + "]";
  if (length % word_bytes != 0)
    return "frame length " + std::to_string(length) + " is not a multiple of 8";
  return {};
}

std::string decode(std::span<const std::byte> body, std::size_t max_message_bytes, message& out) {
  if (body.size() < min_message_bytes || body.size() > max_message_bytes ||
      body.size() % word_bytes != 0)
    return "a frame of " + std::to_string(body.size()) + " bytes";
  // Copied so that the words are aligned, whatever the alignment of `body`.
  std::vector<capnp::word> words(body.size() / word_bytes);
  std::memcpy(words.data(), body.data(), body.size());
  try {
    capnp::FlatArrayMessageReader reader(kj::arrayPtr(words.data(), words.size()),
                                         reader_options(body.size()));
    if (reader.getEnd() != words.data() + words.size())
      return "the frame has " +
             std::to_string((words.data() + words.size() - reader.getEnd()) * word_bytes) +
             " trailing bytes after its Cap'n Proto message";
    budget b{max_decoded_ratio * body.size(), body.size()};
    return read_message(reader.getRoot<schemas::MembershipMessage>(), b, out);
  } catch (const kj::Exception& e) {
    return "not a valid Cap'n Proto message: " + std::string(e.getDescription().cStr());
  } catch (const std::exception& e) {
    return std::string("not a valid Cap'n Proto message: ") + e.what();
  }
}

} // namespace consort::transport::membership::codec
