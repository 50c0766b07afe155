// Forming an shm group (include/consort/transport/shm.hpp): the probe of unavailable_reason, the
// in-process group of make_group, and connect, where rank 0 creates the segment under a name
// derived from the group's secret and announces it over a bootstrap context, and every other rank
// maps it and says whether it could.

#include "transport/auth.hpp"
#include "transport/shm/shm_impl.hpp"

#include <algorithm>
#include <cstring>
#include <span>

#include <sys/mman.h>
#include <unistd.h>

namespace consort::transport::shm {

using namespace impl;

namespace {

/// Tags of `connect`'s exchange over the bootstrap context.
constexpr uint64_t tag_name = 0x5348'4d00'0000'0000;
constexpr uint64_t tag_mapped = tag_name + 1;
constexpr uint64_t tag_go = tag_name + 2;
/// The longest message of that exchange.
constexpr std::size_t max_message = 1024;

std::string hex(std::span<const std::byte> bytes, std::size_t max_chars) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (auto b : bytes) {
    out += digits[static_cast<unsigned>(b) >> 4];
    out += digits[static_cast<unsigned>(b) & 15];
  }
  return out.substr(0, max_chars);
}

/// The segment name of a group: an HMAC under the secret over the group, the size and rank 0's
/// nonce, so that only members can name it and each run gets a new one.
std::string segment_name(const options& opts, int size, std::span<const std::byte> nonce) {
  auth::transcript t("consort-shm-v1");
  t.u64(opts.group_id).u64(opts.epoch).u32(static_cast<uint32_t>(size)).bytes(nonce);
  auto mac = t.sign(opts.secret);
  return "/consort-" + hex(mac, 32);
}

// Messages of connect's exchange: a status byte (0: ok, 1: failed) and then the nonce or the
// failure's text.

std::vector<std::byte> message(uint8_t status, std::span<const std::byte> rest) {
  std::vector<std::byte> m(1 + rest.size());
  m[0] = std::byte{status};
  if (!rest.empty())
    std::memcpy(m.data() + 1, rest.data(), rest.size());
  return m;
}

std::span<const std::byte> text_bytes(const std::string& s) {
  return std::span<const std::byte>{reinterpret_cast<const std::byte*>(s.data()), s.size()};
}

/// The failure's text of message `m` of `n` bytes.
std::string failure_of(const std::vector<std::byte>& m, std::size_t n) {
  return std::string{reinterpret_cast<const char*>(m.data() + 1), n - 1};
}

/// connect on rank 0: creates the segment, announces it, collects whether every rank mapped it,
/// unlinks it and says whether to go on.
caf::expected<context_ptr> connect_first(context& bootstrap, const options& opts, deadline until) {
  const int size = bootstrap.size();
  auto nonce = auth::random_bytes(16);
  auto name = segment_name(opts, size, nonce);
  auto seg = create_segment(name, size, opts.ring_bytes);
  auto first =
      seg ? message(0, nonce) : message(1, text_bytes(to_consort_error(seg.error(), "").what()));
  std::vector<operation_ptr> sends;
  for (int p = 1; p < size; ++p)
    sends.push_back(bootstrap.to(p).send(tag_name, {const_bytes{first}}));
  if (auto err = wait_all(sends, until)) {
    shm_unlink(name.c_str());
    return err;
  }
  if (!seg)
    return seg.error();
  // Every rank answers whether it mapped the segment.
  std::string failures;
  caf::error transport_error;
  for (int p = 1; p < size; ++p) {
    std::vector<std::byte> answer(max_message);
    auto op = bootstrap.to(p).recv_at_most(tag_mapped, answer);
    if (auto err = op->wait(until)) {
      transport_error = err;
      break;
    }
    if (op->message_bytes() < 1 || answer[0] != std::byte{0})
      failures += " rank " + std::to_string(p) + ": " +
                  failure_of(answer, std::max<std::size_t>(op->message_bytes(), 1));
  }
  shm_unlink(name.c_str());
  if (transport_error)
    return transport_error;
  auto go = failures.empty() ? message(0, {}) : message(1, text_bytes(failures));
  sends.clear();
  for (int p = 1; p < size; ++p)
    sends.push_back(bootstrap.to(p).send(tag_go, {const_bytes{go}}));
  if (auto err = wait_all(sends, until))
    return err;
  if (!failures.empty())
    return make_caf_error(errc::peer_lost,
                          "shm transport: not every rank could map the segment:" + failures);
  return context_ptr{make_context(*seg, 0, opts)};
}

/// connect on the other ranks: maps the segment rank 0 announced, says whether it could, and
/// waits for rank 0's word to go on.
caf::expected<context_ptr> connect_other(context& bootstrap, const options& opts, deadline until) {
  const int size = bootstrap.size();
  const int rank = bootstrap.rank();
  std::vector<std::byte> first(max_message);
  auto op = bootstrap.to(0).recv_at_most(tag_name, first);
  if (auto err = op->wait(until))
    return err;
  if (op->message_bytes() < 1 || first[0] != std::byte{0})
    return make_caf_error(errc::peer_lost,
                          "shm transport: rank 0 could not create the segment: " +
                              failure_of(first, std::max<std::size_t>(op->message_bytes(), 1)));
  if (op->message_bytes() != 17)
    return make_caf_error(errc::peer_lost, "shm transport: rank 0 sent a malformed segment "
                                           "announcement (" +
                                               std::to_string(op->message_bytes()) + " bytes)");
  auto name = segment_name(opts, size, std::span<const std::byte>{first.data() + 1, 16});
  auto seg = open_segment(name, size, opts.ring_bytes);
  auto answer =
      seg ? message(0, {}) : message(1, text_bytes(to_consort_error(seg.error(), "").what()));
  if (auto err = bootstrap.to(0).send(tag_mapped, {const_bytes{answer}})->wait(until))
    return err;
  std::vector<std::byte> go(max_message);
  auto go_op = bootstrap.to(0).recv_at_most(tag_go, go);
  if (auto err = go_op->wait(until))
    return err;
  if (!seg)
    return seg.error();
  if (go_op->message_bytes() < 1 || go[0] != std::byte{0})
    return make_caf_error(errc::peer_lost,
                          "shm transport: not every rank could map the segment:" +
                              failure_of(go, std::max<std::size_t>(go_op->message_bytes(), 1)));
  return context_ptr{make_context(*seg, rank, opts)};
}

} // namespace

std::string unavailable_reason() {
  auto nonce = auth::random_bytes(16);
  std::string name = "/consort-probe-" + std::to_string(getpid()) + "-" + hex(nonce, 16);
  auto seg = create_segment(name, 2, min_ring_bytes);
  shm_unlink(name.c_str());
  if (!seg)
    return to_consort_error(seg.error(), "").what();
  return {};
}

std::vector<context_ptr> make_group(int size, const options& opts) {
  if (auto err = check_options(opts, size))
    throw to_consort_error(err, "shm::make_group");
  auto nonce = auth::random_bytes(16);
  auto name = segment_name(opts, size, nonce);
  auto first = create_segment(name, size, opts.ring_bytes);
  if (!first)
    throw to_consort_error(first.error(), "shm::make_group");
  // Every rank maps the segment on its own, as ranks in other processes do.
  std::vector<segment_ptr> maps{*first};
  for (int r = 1; r < size; ++r) {
    auto seg = open_segment(name, size, opts.ring_bytes);
    if (!seg) {
      shm_unlink(name.c_str());
      throw to_consort_error(seg.error(), "shm::make_group");
    }
    maps.push_back(*seg);
  }
  shm_unlink(name.c_str());
  std::vector<context_ptr> group;
  for (int r = 0; r < size; ++r)
    group.push_back(make_context(maps[static_cast<std::size_t>(r)], r, opts));
  return group;
}

caf::expected<context_ptr> connect(context& bootstrap, const options& opts) {
  if (auto err = check_options(opts, bootstrap.size()))
    return err;
  const auto until = clock::now() + opts.connect_timeout;
  if (bootstrap.rank() == 0)
    return connect_first(bootstrap, opts, until);
  return connect_other(bootstrap, opts, until);
}

} // namespace consort::transport::shm
