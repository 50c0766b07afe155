// What a peer cannot make a worker do, through the transports' own entry points: allocate beyond
// the configured bounds, make a reader traverse more than the frame it sent, or hold a handshake
// open past its deadline, alone or with 500 connections at once. (tcp_test.cpp and
// membership_test.cpp check the refusals themselves; this file checks the bounds around them.)
//
// Allocation bounds are measured: this test binary replaces the global operator new/delete with
// malloc/free plus counters (the largest single allocation and the peak of the live bytes while
// a test watches). Nothing sleeps: every wait is on a socket, an operation or a log line, with a
// deadline.

#include "transport/membership/codec.hpp" // to craft frames for the raw peers
#include "transport/tcp/wire.hpp"

#include "support/time_scale.hpp"
#include "support/transport_helpers.hpp"

#include <consort/error.hpp>
#include <consort/reduce_op.hpp>
#include <consort/tensor.hpp>
#include <consort/transport/algorithms.hpp>
#include <consort/transport/membership.hpp>
#include <consort/transport/pair.hpp>
#include <consort/transport/tcp.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <future>
#include <memory>
#include <new>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include <arpa/inet.h>
#include <malloc.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

// -- allocation counters -------------------------------------------------------------------------

namespace {

/// Counts allocations while `watching` is set. Lock-free: operator new runs on every thread.
struct allocation_counters {
  std::atomic<bool> watching{false};
  std::atomic<std::size_t> largest{0};
  std::atomic<long long> live{0};
  std::atomic<long long> peak{0};

  void on_new(void* p, std::size_t n) noexcept {
    if (!watching.load(std::memory_order_relaxed))
      return;
    auto seen = largest.load(std::memory_order_relaxed);
    while (n > seen && !largest.compare_exchange_weak(seen, n, std::memory_order_relaxed)) {
    }
    auto now = live.fetch_add(static_cast<long long>(malloc_usable_size(p))) +
               static_cast<long long>(malloc_usable_size(p));
    auto top = peak.load(std::memory_order_relaxed);
    while (now > top && !peak.compare_exchange_weak(top, now, std::memory_order_relaxed)) {
    }
  }

  void on_delete(void* p) noexcept {
    if (watching.load(std::memory_order_relaxed))
      live.fetch_sub(static_cast<long long>(malloc_usable_size(p)));
  }
};

allocation_counters counters;

} // namespace

// Replacements of the global allocation functions (the array and sized forms of libstdc++ call
// these). Memory allocated before a test watches and freed while it does lowers `live`: the peak
// is the growth of the heap, which is what a bound must hold.
void* operator new(std::size_t n) {
  void* p = std::malloc(n == 0 ? 1 : n);
  if (!p)
    throw std::bad_alloc();
  counters.on_new(p, n);
  return p;
}

// GCC sees malloc'ed memory handed out by operator new and freed here: by design in a replacement.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
#endif
void operator delete(void* p) noexcept {
  if (!p)
    return;
  counters.on_delete(p);
  std::free(p);
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

void operator delete(void* p, std::size_t) noexcept {
  ::operator delete(p);
}

namespace {

using namespace std::chrono_literals;
using consort::errc;
using consort::test::has_error;
using consort::test::log_capture;
using consort::test::text_of;
namespace transport = consort::transport;
namespace tcp = consort::transport::tcp;
namespace wire = consort::transport::tcp::wire;
namespace membership = consort::transport::membership;
namespace codec = consort::transport::membership::codec;
using bytes = std::vector<std::byte>;
using std::chrono::milliseconds;
using transport::clock;

constexpr uint64_t test_group = 11;

transport::deadline in(milliseconds ms) {
  return clock::now() + ms;
}

/// What the process allocated between its construction and `stop()`.
class allocation_watch {
public:
  allocation_watch() {
    counters.largest = 0;
    counters.live = 0;
    counters.peak = 0;
    counters.watching = true;
  }
  ~allocation_watch() { stop(); }

  void stop() { counters.watching = false; }

  /// The largest single allocation.
  std::size_t largest() const { return counters.largest; }

  /// How far the heap grew, in bytes.
  long long peak_growth() const { return counters.peak; }

private:
  allocation_watch(const allocation_watch&) = delete;
  allocation_watch& operator=(const allocation_watch&) = delete;
};

// -- hand-made Cap'n Proto -----------------------------------------------------------------------

/// A struct pointer (Cap'n Proto encoding spec): offset in words from the end of the pointer.
uint64_t struct_ptr(int32_t offset, uint16_t data_words, uint16_t pointers) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(offset) << 2)) |
         (static_cast<uint64_t>(data_words) << 32) | (static_cast<uint64_t>(pointers) << 48);
}

/// A list pointer; `size` is the element count, or the word count of an inline-composite list
/// (element size code 7), whose first word is then a tag: struct_ptr(count, data, pointers).
uint64_t list_ptr(int32_t offset, uint32_t size_code, uint32_t size) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(offset) << 2) | 1u) |
         (static_cast<uint64_t>(size_code | (size << 3)) << 32);
}

/// A far pointer to `offset` words into segment `segment`.
uint64_t far_ptr(uint32_t offset, uint32_t segment) {
  return (static_cast<uint64_t>(offset) << 3) | 2u | (static_cast<uint64_t>(segment) << 32);
}

void put_u32(bytes& out, uint32_t v) {
  for (int i = 0; i < 4; ++i)
    out.push_back(static_cast<std::byte>((v >> (8 * i)) & 0xff));
}

void put_u64(bytes& out, uint64_t v) {
  put_u32(out, static_cast<uint32_t>(v));
  put_u32(out, static_cast<uint32_t>(v >> 32));
}

/// A one-segment message body: the segment table (which may lie about the segment count and
/// size), then the words.
bytes message_body(const std::vector<uint64_t>& words, uint32_t segments_minus_one = 0,
                   std::optional<uint32_t> announced_words = {}) {
  bytes out;
  put_u32(out, segments_minus_one);
  put_u32(out, announced_words.value_or(static_cast<uint32_t>(words.size())));
  for (auto w : words)
    put_u64(out, w);
  return out;
}

/// `body` behind its u32 length prefix.
bytes framed(const bytes& body) {
  bytes out(wire::prefix_bytes + body.size());
  for (std::size_t i = 0; i < wire::prefix_bytes; ++i)
    out[i] = static_cast<std::byte>((body.size() >> (8 * i)) & 0xff);
  std::copy(body.begin(), body.end(), out.begin() + wire::prefix_bytes);
  return out;
}

/// A hostile frame head (a hello or a frame header: the readers see only the root's data) and the
/// reason a reader gives for it.
struct hostile_head {
  std::string name;
  bytes body;
  std::string reason;
};

void PrintTo(const hostile_head& h, std::ostream* os) {
  *os << h.name;
}

std::vector<hostile_head> hostile_heads() {
  const std::vector<uint64_t> seven_words(7, 0);
  auto with_root = [&](uint64_t root) {
    auto words = seven_words;
    words[0] = root;
    return words;
  };
  return {
      // The root claims 60 words of data in a segment of 7.
      {"RootStructLargerThanTheFrame", message_body(with_root(struct_ptr(0, 60, 0))),
       "out-of-bounds"},
      // The segment table announces 2^32 - 1 words: nothing may be allocated for it.
      {"SegmentOfFourGigawords", message_body(seven_words, 0, 0xffffffffu),
       "not a valid Cap'n Proto message"},
      // 1001 segments: their table alone is longer than the frame.
      {"ThousandSegments", message_body(seven_words, 1000), "not a valid Cap'n Proto message"},
      // A root that is a list of 2^29 - 1 elements rather than a struct.
      {"RootIsAHugeList", message_body(with_root(list_ptr(0, 2, (1u << 29) - 1))),
       "not a valid Cap'n Proto message"},
      // A root far pointer whose landing pad is itself: following it must not loop.
      {"RootFarPointerToItself", message_body(with_root(far_ptr(0, 0))),
       "not a valid Cap'n Proto message"},
  };
}

/// The hostile membership frames, by name: views whose members lists would decode into far more
/// memory than the frame holds.
struct hostile_membership {
  std::string name;
  bytes frame;
  std::string reason;
};

void PrintTo(const hostile_membership& h, std::ostream* os) {
  *os << h.name;
}

/// The words of a MembershipMessage holding a View whose members list (inline composite) starts
/// at word 9, with `count` elements of `data` data words and `pointers` pointers.
std::vector<uint64_t> view_words(uint32_t count, uint16_t data, uint16_t pointers) {
  return {
      struct_ptr(0, 1, 1), // 0: root -> MembershipMessage (1 data word, 1 pointer)
      2,                   // 1: its union discriminant: view
      struct_ptr(0, 2, 4), // 2: -> View (epoch, groupId; members, ncclUniqueId, nonce, authProof)
      3,
      4,                                                      // 3-4: epoch, group id
      list_ptr(3, 7, count * (data + pointers)),              // 5: members -> word 9
      0,                                                      // 6: ncclUniqueId
      0,                                                      // 7: nonce
      0,                                                      // 8: authProof
      struct_ptr(static_cast<int32_t>(count), data, pointers) // 9: the list's tag
  };
}

std::vector<hostile_membership> hostile_membership_frames() {
  std::vector<hostile_membership> out;
  // 60000 members of zero size, in a frame of 80 bytes: Cap'n Proto charges each element one
  // word of traversal, and the limit is the frame's own words.
  out.push_back(
      {"ZeroSizedMembers", framed(message_body(view_words(60000, 0, 0))), "traversal limit"});
  // The same with enough padding to pass the traversal limit: the decoded members (100 bytes
  // and more each) would outgrow codec::max_decoded_ratio times the frame.
  {
    auto words = view_words(2000, 0, 0);
    words.resize(words.size() + 2000, 0);
    out.push_back({"ZeroSizedMembersPastTheTraversalLimit", framed(message_body(words)),
                   "the view's 2000 members would take"});
  }
  // 64 members whose devices pointers all point at one list of 100 devices: every member would
  // copy the whole list (aliasing is legal Cap'n Proto), 64 times the bytes sent.
  {
    constexpr uint32_t members = 64, devices = 100;
    auto words = view_words(members, 1, 3);
    auto first_member = words.size(); // 10
    auto shared = first_member + 4 * members;
    for (uint32_t i = 0; i < members; ++i) {
      auto at = first_member + 4 * i;
      auto devices_ptr = at + 3; // data word, task, address, devices
      words.push_back(i);        // rank
      words.push_back(0);        // task
      words.push_back(0);        // address
      words.push_back(list_ptr(static_cast<int32_t>(shared - devices_ptr - 1), 7, 3 * devices));
    }
    words.push_back(struct_ptr(devices, 2, 1)); // the shared list's tag: Device has 2 + 1 words
    for (uint32_t d = 0; d < devices; ++d) {
      words.push_back(0); // kind
      words.push_back(d); // memoryBytes
      words.push_back(0); // name
    }
    out.push_back({"MembersSharingOneDeviceList", framed(message_body(words)), "traversal limit"});
  }
  return out;
}

// -- raw peers -----------------------------------------------------------------------------------

/// A plain socket that plays rank 1 of a group of 2 towards a real rank 0, or a hostile client.
class raw_peer : public consort::test::raw_socket {
public:
  explicit raw_peer(uint16_t port) : raw_socket("127.0.0.1", port) {}
  explicit raw_peer(const std::string& address) : raw_socket(address) {}

  void hello(uint32_t rank, uint32_t size) {
    wire::hello h;
    h.rank = rank;
    h.size = size;
    h.group_id = test_group;
    write(wire::encode_hello(h));
  }

  bool read_hello() {
    std::byte prefix[wire::prefix_bytes];
    if (!read_exact(prefix))
      return false;
    uint32_t length = 0;
    if (!wire::decode_length(std::span<const std::byte, 4>(prefix, 4), length).empty())
      return false;
    bytes body(length);
    wire::hello h;
    return read_exact(body) && wire::decode_hello(body, h).empty();
  }

  void header(uint64_t tag, uint64_t payload_bytes, uint32_t sender) {
    wire::header h;
    h.sender_rank = sender;
    h.tag = tag;
    h.payload_bytes = payload_bytes;
    std::array<std::byte, wire::max_head_bytes> head{};
    write(std::span(head.data(), wire::encode_header(h, head)));
  }

  /// Reads one membership message (the chief's challenge); false when none arrives.
  bool read_message() {
    std::byte prefix[codec::prefix_bytes];
    if (!read_exact(prefix))
      return false;
    uint32_t length = 0;
    if (!codec::decode_length(std::span<const std::byte, 4>(prefix, 4), 1 << 20, length).empty())
      return false;
    bytes body(length);
    codec::message m;
    return read_exact(body) && codec::decode(body, 1 << 20, m).empty();
  }

  /// Sends `data` one byte at a time, waiting up to `gap` after each for the other end to close;
  /// returns whether it did.
  bool trickle(std::span<const std::byte> data, milliseconds gap) {
    for (auto b : data) {
      try {
        write(std::span(&b, 1));
      } catch (const boost::system::system_error&) {
        return true; // reset by the other end
      }
      if (closed_by_peer(gap))
        return true;
    }
    return closed_by_peer(gap);
  }
};

/// A plain POSIX client socket to 127.0.0.1 (no io_context each: the flood test opens 500).
class plain_client {
public:
  explicit plain_client(uint16_t port) : fd_(::socket(AF_INET, SOCK_STREAM, 0)) {
    if (fd_ < 0)
      return;
    sockaddr_in to{};
    to.sin_family = AF_INET;
    to.sin_port = htons(port);
    to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::connect(fd_, reinterpret_cast<const sockaddr*>(&to), sizeof to) != 0) {
      ::close(fd_);
      fd_ = -1;
    }
  }
  ~plain_client() {
    if (fd_ >= 0)
      ::close(fd_);
  }
  plain_client(const plain_client&) = delete;
  plain_client& operator=(const plain_client&) = delete;

  bool connected() const { return fd_ >= 0; }

  /// Whether the other end closes the connection by `until`.
  bool closed_by(clock::time_point until) {
    std::byte buf[256];
    for (;;) {
      auto left = std::chrono::duration_cast<milliseconds>(until - clock::now()).count();
      if (left <= 0)
        return false;
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, static_cast<int>(left)) <= 0)
        continue;
      if (::recv(fd_, buf, sizeof buf, 0) <= 0)
        return true;
    }
  }

private:
  int fd_ = -1;
};

// -- TCP contexts --------------------------------------------------------------------------------

using context_ptr = std::shared_ptr<tcp::context>;
using tweak_fn = std::function<void(tcp::mesh_options&)>;

tcp::mesh_options mesh_options_for(int rank, int size, log_capture& log) {
  tcp::mesh_options opts;
  opts.rank = rank;
  opts.size = size;
  opts.listen_address = "127.0.0.1:0";
  opts.group_id = test_group;
  opts.connect_timeout = 20s;
  opts.handshake_timeout = 200ms;
  opts.log = log.sink();
  return opts;
}

context_ptr listen_ok(const tcp::mesh_options& opts) {
  auto ctx = tcp::listen(opts);
  if (!ctx) {
    ADD_FAILURE() << "listen of rank " << opts.rank << ": " << text_of(ctx.error());
    return nullptr;
  }
  return *ctx;
}

/// Rank 0 of a group of 2 whose rank 1 is `peer`, a raw socket that shook hands properly.
struct raw_pair {
  explicit raw_pair(log_capture& log, const tweak_fn& tweak = {}) {
    auto opts = mesh_options_for(0, 2, log);
    if (tweak)
      tweak(opts);
    ctx = listen_ok(opts);
    if (!ctx)
      return;
    auto connected = std::async(std::launch::async, [this] {
      return ctx->connect({ctx->listen_address(), "127.0.0.1:1"});
    });
    peer = std::make_unique<raw_peer>(ctx->port());
    peer->hello(1, 2);
    EXPECT_TRUE(peer->read_hello());
    auto err = connected.get();
    EXPECT_FALSE(err) << text_of(err);
    ok = !err;
  }

  context_ptr ctx;
  std::unique_ptr<raw_peer> peer;
  bool ok = false;
};

// -- allocation bounds: TCP ----------------------------------------------------------------------

TEST(TcpBoundsTest, AFrameAnnouncingMoreThanMaxPayloadBytesIsRefusedWithoutAllocatingIt) {
  log_capture log;
  constexpr std::size_t bound = std::size_t{1} << 20;
  raw_pair p(log, [&](tcp::mesh_options& o) { o.max_payload_bytes = bound; });
  ASSERT_TRUE(p.ok);
  bytes got(8);
  auto pending = p.ctx->to(1).recv(5, got);
  allocation_watch watch;
  p.peer->header(5, std::size_t{64} << 20, 1);
  EXPECT_TRUE(has_error(pending->wait(in(10s)), errc::peer_lost,
                        {"rank 1", "exceeds max_payload_bytes (1048576)"}));
  EXPECT_TRUE(p.peer->closed_by_peer());
  EXPECT_TRUE(log.wait_for({"closing the connection to rank 1", "exceeds max_payload_bytes"}))
      << log.all();
  watch.stop();
  EXPECT_LT(watch.largest(), bound);
  EXPECT_LT(watch.peak_growth(), static_cast<long long>(bound));
}

TEST(TcpBoundsTest, EarlyMessagesOfAPeerNeverHoldMoreThanMaxStashBytes) {
  log_capture log;
  constexpr std::size_t stash = std::size_t{1} << 20, message = 400 << 10;
  raw_pair p(log, [&](tcp::mesh_options& o) { o.max_stash_bytes = stash; });
  ASSERT_TRUE(p.ok);
  bytes payload(message, std::byte{7});
  allocation_watch watch;
  // Two early messages fit (800 KiB); the header of a third is refused before its bytes are read.
  for (uint64_t tag = 1; tag <= 2; ++tag) {
    p.peer->header(tag, message, 1);
    p.peer->write(payload);
  }
  p.peer->header(3, message, 1);
  EXPECT_TRUE(p.peer->closed_by_peer());
  EXPECT_TRUE(log.wait_for({"closing the connection to rank 1", "stash is full", "tag 3",
                            "409600 bytes", "max_stash_bytes 1048576"}))
      << log.all();
  watch.stop();
  EXPECT_LE(watch.largest(), message);
  // The two stashed messages, plus what the I/O path needs besides (logs, operations).
  EXPECT_LT(watch.peak_growth(), static_cast<long long>(2 * message + (128 << 10)));
}

// -- allocation bounds: membership ---------------------------------------------------------------

membership::options chief_options(int workers, log_capture& log) {
  membership::options opts;
  for (int i = 0; i < workers; ++i)
    opts.tasks.push_back({"worker", i});
  opts.rank = 0;
  opts.chief_address = "127.0.0.1:0";
  opts.address = "127.0.0.1:21000";
  opts.devices = {{"CPU:0", false, 0}};
  opts.rendezvous_timeout = 20s;
  opts.missing_log_interval = 10s;
  opts.handshake_timeout = 200ms;
  opts.log = log.sink();
  return opts;
}

/// A chief of 2 workers whose rendezvous runs (and waits for worker 1) while the test pokes it.
struct waiting_chief {
  explicit waiting_chief(log_capture& log,
                         const std::function<void(membership::options&)>& tweak = {}) {
    auto opts = chief_options(2, log);
    if (tweak)
      tweak(opts);
    auto started = membership::service::start(opts);
    EXPECT_TRUE(started) << text_of(started.error());
    if (!started)
      return;
    svc = std::move(*started);
    rendezvous = std::async(std::launch::async, [this] { return svc->rendezvous(); });
  }
  ~waiting_chief() {
    if (svc)
      svc->leave("the test is over"); // the pending rendezvous fails with `shutdown`
    if (rendezvous.valid())
      rendezvous.wait();
  }

  std::unique_ptr<membership::service> svc;
  std::future<caf::expected<membership::view>> rendezvous;
};

TEST(MembershipBoundsTest, AFrameOverMaxMessageBytesIsRefusedWithoutAllocatingIt) {
  log_capture log;
  constexpr std::size_t bound = 4096;
  waiting_chief chief(log, [&](membership::options& o) { o.max_message_bytes = bound; });
  ASSERT_TRUE(chief.svc);
  raw_peer peer(chief.svc->listen_address());
  ASSERT_TRUE(peer.read_message()); // the challenge
  allocation_watch watch;
  peer.write_u32(65536);
  EXPECT_TRUE(peer.closed_by_peer());
  EXPECT_TRUE(
      log.wait_for({"closed the connection from 127.0.0.1:" + std::to_string(peer.local_port()),
                    "frame length 65536 is outside [16, 4096]"}))
      << log.all();
  watch.stop();
  EXPECT_LE(watch.largest(), bound);
}

class MembershipHostileFrameTest : public ::testing::TestWithParam<hostile_membership> {};

TEST_P(MembershipHostileFrameTest, IsRefusedWithALoggedReasonAndNoLargeAllocation) {
  const auto& bad = GetParam();
  log_capture log;
  waiting_chief chief(log);
  ASSERT_TRUE(chief.svc);
  raw_peer peer(chief.svc->listen_address());
  ASSERT_TRUE(peer.read_message()); // the challenge
  allocation_watch watch;
  peer.write(bad.frame);
  EXPECT_TRUE(peer.closed_by_peer());
  EXPECT_TRUE(
      log.wait_for({"closed the connection from 127.0.0.1:" + std::to_string(peer.local_port()),
                    "malformed message", bad.reason}))
      << log.all();
  watch.stop();
  // The frame is copied twice (read buffer, aligned words) and decoded into at most
  // codec::max_decoded_ratio times its size: nothing grows with what it announces.
  auto frame_bytes = static_cast<long long>(bad.frame.size());
  EXPECT_LE(watch.largest(), codec::max_decoded_ratio * bad.frame.size());
  EXPECT_LT(watch.peak_growth(), static_cast<long long>(codec::max_decoded_ratio) * frame_bytes +
                                     3 * frame_bytes + (64 << 10));
}

INSTANTIATE_TEST_SUITE_P(Frames, MembershipHostileFrameTest,
                         ::testing::ValuesIn(hostile_membership_frames()),
                         [](const ::testing::TestParamInfo<hostile_membership>& info) {
                           return info.param.name;
                         });

TEST(MembershipCodecBoundsTest, OurOwnLargestFramesDecodeWithinTheRatio) {
  // A view as large as a 1 MiB frame allows, with the smallest members and devices our encoder
  // writes: the decoded size limit must never refuse what a real chief sends.
  codec::view_message v;
  v.view.epoch = 1;
  v.view.group_id = 2;
  for (int r = 0; r < 3000; ++r) {
    membership::member m;
    m.rank = r;
    m.task = {"w", r};
    m.devices.push_back({"", false, 0});
    v.view.members.push_back(m);
  }
  auto frame = codec::encode(v);
  ASSERT_LE(frame.size(), std::size_t{1} << 20);
  codec::message out;
  EXPECT_EQ(codec::decode(std::span(frame).subspan(codec::prefix_bytes), 1 << 20, out), "");
  codec::join j;
  j.devices.assign(codec::max_devices, membership::device_info{});
  frame = codec::encode(j);
  EXPECT_EQ(codec::decode(std::span(frame).subspan(codec::prefix_bytes), 1 << 20, out), "");
}

TEST(MembershipCodecBoundsTest, TextWithANulByteIsMalformed) {
  // Our encoder takes std::string::c_str(): a NUL inside a text would not survive a re-encoding,
  // and every C-string use of the field would see less than the decoded string holds.
  codec::leave l{1, 2, "shutdown"};
  auto frame = codec::encode(l);
  auto at = std::search(frame.begin(), frame.end(), "shutdown", "shutdown" + 8,
                        [](std::byte b, char c) { return b == static_cast<std::byte>(c); });
  ASSERT_NE(at, frame.end());
  at[4] = std::byte{0}; // "shut\0own"
  codec::message out;
  EXPECT_EQ(codec::decode(std::span(frame).subspan(codec::prefix_bytes), 1024, out),
            "the reason has a NUL byte at offset 4");
}

// -- hostile frame heads -------------------------------------------------------------------------

class TcpHostileHelloTest : public ::testing::TestWithParam<hostile_head> {};

TEST_P(TcpHostileHelloTest, IsRefusedWithALoggedReasonAndNoLargeAllocation) {
  const auto& bad = GetParam();
  log_capture log;
  auto ctx = listen_ok(mesh_options_for(0, 2, log));
  ASSERT_TRUE(ctx);
  raw_peer peer(ctx->port());
  allocation_watch watch;
  peer.write(framed(bad.body));
  EXPECT_TRUE(peer.closed_by_peer());
  EXPECT_TRUE(
      log.wait_for({"refused the connection from 127.0.0.1:" + std::to_string(peer.local_port()),
                    "malformed hello", bad.reason}))
      << log.all();
  watch.stop();
  EXPECT_LE(watch.largest(), std::size_t{4096});
}

INSTANTIATE_TEST_SUITE_P(Heads, TcpHostileHelloTest, ::testing::ValuesIn(hostile_heads()),
                         [](const ::testing::TestParamInfo<hostile_head>& info) {
                           return info.param.name;
                         });

class TcpHostileHeaderTest : public ::testing::TestWithParam<hostile_head> {};

TEST_P(TcpHostileHeaderTest, BreaksTheConnectionWithPeerLostAndNoLargeAllocation) {
  const auto& bad = GetParam();
  log_capture log;
  raw_pair p(log);
  ASSERT_TRUE(p.ok);
  bytes got(8);
  auto pending = p.ctx->to(1).recv(5, got);
  allocation_watch watch;
  p.peer->write(framed(bad.body));
  EXPECT_TRUE(has_error(pending->wait(in(10s)), errc::peer_lost, {"rank 1", bad.reason}));
  EXPECT_TRUE(p.peer->closed_by_peer());
  watch.stop();
  EXPECT_LE(watch.largest(), std::size_t{4096});
}

INSTANTIATE_TEST_SUITE_P(Heads, TcpHostileHeaderTest, ::testing::ValuesIn(hostile_heads()),
                         [](const ::testing::TestParamInfo<hostile_head>& info) {
                           return info.param.name;
                         });

// -- half-open handshakes ------------------------------------------------------------------------

TEST(TcpBoundsTest, AHelloThatTricklesInIsClosedAtTheHandshakeDeadline) {
  // The deadline counts from the accept, not from the last byte: a peer that sends one byte at a
  // time cannot hold the connection open.
  log_capture log;
  auto ctx = listen_ok(mesh_options_for(0, 2, log));
  ASSERT_TRUE(ctx);
  auto start = clock::now();
  raw_peer peer(ctx->port());
  wire::hello h;
  h.rank = 1;
  h.size = 2;
  h.group_id = test_group;
  EXPECT_TRUE(peer.trickle(wire::encode_hello(h), 40ms));
  auto took = clock::now() - start;
  EXPECT_GE(took, 200ms);
  EXPECT_LT(took, consort::test::scaled(5s));
  EXPECT_TRUE(
      log.wait_for({"refused the connection from 127.0.0.1:" + std::to_string(peer.local_port()),
                    "timed out waiting for the hello's", "(200 ms)"}))
      << log.all();
}

TEST(MembershipBoundsTest, AJoinThatTricklesInIsClosedAtTheHandshakeDeadline) {
  log_capture log;
  waiting_chief chief(log);
  ASSERT_TRUE(chief.svc);
  auto start = clock::now();
  raw_peer peer(chief.svc->listen_address());
  ASSERT_TRUE(peer.read_message()); // the challenge
  codec::join j;
  j.task = {"worker", 1};
  j.address = "127.0.0.1:21001";
  j.devices = {{"CPU:0", false, 0}};
  EXPECT_TRUE(peer.trickle(codec::encode(j), 40ms));
  auto took = clock::now() - start;
  EXPECT_GE(took, 200ms);
  EXPECT_LT(took, consort::test::scaled(5s));
  EXPECT_TRUE(
      log.wait_for({"closed the connection from 127.0.0.1:" + std::to_string(peer.local_port()),
                    "no valid Join within 200 ms"}))
      << log.all();
}

/// Raises the soft limit of open descriptors to at least `want`; false when the hard limit is
/// lower.
bool ensure_descriptors(rlim_t want) {
  rlimit lim{};
  if (::getrlimit(RLIMIT_NOFILE, &lim) != 0)
    return false;
  if (lim.rlim_cur >= want)
    return true;
  if (lim.rlim_max != RLIM_INFINITY && lim.rlim_max < want)
    return false;
  lim.rlim_cur = want;
  return ::setrlimit(RLIMIT_NOFILE, &lim) == 0;
}

TEST(TcpBoundsTest, FiveHundredSilentConnectionsAreClosedAndTheRealPeersStillFormTheMesh) {
  constexpr int flood = 500, ranks = 3;
  // The flood's sockets, their accepted ends, and the mesh's: 2 * 500 plus a margin.
  if (!ensure_descriptors(2 * flood + 256))
    GTEST_SKIP() << "the hard limit of open descriptors is below " << 2 * flood + 256;
  log_capture log;
  std::vector<context_ptr> ctxs(ranks);
  std::vector<std::string> addresses(ranks);
  for (int r = 0; r < ranks; ++r) {
    ctxs[r] = listen_ok(mesh_options_for(r, ranks, log));
    ASSERT_TRUE(ctxs[r]);
    addresses[r] = ctxs[r]->listen_address();
  }
  // Rank 0 accepts ranks 1 and 2: the flood arrives there before they do.
  std::vector<std::unique_ptr<plain_client>> clients;
  for (int i = 0; i < flood; ++i) {
    clients.push_back(std::make_unique<plain_client>(ctxs[0]->port()));
    ASSERT_TRUE(clients.back()->connected()) << "connection " << i << " of the flood";
  }
  std::vector<std::future<caf::error>> connected;
  for (int r = 0; r < ranks; ++r)
    connected.push_back(
        std::async(std::launch::async, [&, r] { return ctxs[r]->connect(addresses); }));
  for (int r = 0; r < ranks; ++r) {
    auto err = connected[r].get();
    ASSERT_FALSE(err) << "rank " << r << ": " << text_of(err) << "\n" << log.all();
  }
  // Every connection of the flood is closed: at once beyond the handshakes rank 0 admits, at the
  // handshake deadline within them.
  auto until = clock::now() + 10s;
  for (int i = 0; i < flood; ++i)
    ASSERT_TRUE(clients[i]->closed_by(until)) << "connection " << i << " of the flood is open";
  EXPECT_TRUE(log.wait_for({"connections are already in their handshake"})) << log.all();
  EXPECT_TRUE(log.wait_for({"timed out waiting for the hello's length prefix (200 ms)"}))
      << log.all();
  // A collective over the mesh gives the right result.
  constexpr std::size_t count = 1000;
  std::vector<std::vector<float>> data(ranks);
  std::vector<caf::error> errors(ranks);
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) {
    data[r].assign(count, static_cast<float>(r + 1));
    threads.emplace_back([&, r] {
      errors[r] = transport::all_reduce(ctxs[r], data[r].data(), count, consort::dtype::float32,
                                        consort::reduce_op::sum);
    });
  }
  for (auto& t : threads)
    t.join();
  for (int r = 0; r < ranks; ++r) {
    EXPECT_FALSE(errors[r]) << "rank " << r << ": " << text_of(errors[r]);
    EXPECT_EQ(std::count(data[r].begin(), data[r].end(), 6.0f), static_cast<long>(count))
        << "rank " << r;
  }
}

} // namespace
