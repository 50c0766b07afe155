// Tests of the TCP transport: many ranks in one process over loopback, one thread per rank, on
// ephemeral ports; raw sockets play broken or hostile peers. Nothing sleeps: every wait is on an
// operation, a future or a log line, with a deadline.

#include "transport/tcp/wire.hpp" // to craft frames for the raw peers

#include "support/time_scale.hpp"
#include "support/transport_helpers.hpp"

#include <consort/error.hpp>
#include <consort/transport/algorithms.hpp>
#include <consort/transport/pair.hpp>
#include <consort/transport/tcp.hpp>

#include <caf/atom.hpp>
#include <caf/error.hpp>
#include <caf/message.hpp>

#include <utility> // Boost 1.74's Asio needs <utility> before it on C++20

#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/write.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <poll.h>
#include <sys/socket.h>

namespace {

using namespace std::chrono_literals;
using consort::errc;
using consort::test::has_error;
using consort::test::log_capture;
using consort::test::text_of;
namespace transport = consort::transport;
namespace tcp = consort::transport::tcp;
namespace wire = consort::transport::tcp::wire;
namespace asio = boost::asio;
using bytes = std::vector<std::byte>;
using transport::clock;

constexpr uint64_t test_group = 7;

transport::deadline in(std::chrono::milliseconds ms) {
  return clock::now() + ms;
}

// -- data ----------------------------------------------------------------------------------------

/// Bytes that differ with the message (`seed`) and the position.
bytes pattern(std::size_t size, uint64_t seed) {
  bytes out(size);
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (std::size_t i = 0; i < size; ++i) {
    if (i % 8 == 0)
      x = x * 6364136223846793005ull + 1442695040888963407ull;
    out[i] = static_cast<std::byte>(x >> (8 * (i % 8)));
  }
  return out;
}

transport::send_parts parts_of(const bytes& b) {
  return {transport::const_bytes(b)};
}

// -- logs ----------------------------------------------------------------------------------------

// -- meshes --------------------------------------------------------------------------------------

using tweak_fn = std::function<void(tcp::mesh_options&)>;
using context_ptr = std::shared_ptr<tcp::context>;

tcp::mesh_options options(int rank, int size) {
  tcp::mesh_options opts;
  opts.rank = rank;
  opts.size = size;
  opts.listen_address = "127.0.0.1:0";
  opts.group_id = test_group;
  opts.connect_timeout = 20s;
  return opts;
}

/// Runs `fn(rank)` on one thread per rank and joins them.
void run_ranks(int n, const std::function<void(int)>& fn) {
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back(fn, r);
  for (auto& t : threads)
    t.join();
}

context_ptr listen_rank(int rank, int size, const tweak_fn& tweak = {}) {
  auto opts = options(rank, size);
  if (tweak)
    tweak(opts);
  auto ctx = tcp::listen(opts);
  if (!ctx) {
    ADD_FAILURE() << "listen of rank " << rank << ": " << text_of(ctx.error());
    return nullptr;
  }
  return *ctx;
}

/// A group of `n` connected contexts on ephemeral loopback ports (two-phase start).
std::vector<context_ptr> make_mesh(int n, const tweak_fn& tweak = {}) {
  std::vector<context_ptr> ctxs(n);
  std::vector<std::string> addresses(n);
  for (int r = 0; r < n; ++r) {
    ctxs[r] = listen_rank(r, n, tweak);
    if (!ctxs[r])
      return {};
    addresses[r] = ctxs[r]->listen_address();
  }
  std::vector<caf::error> errors(n);
  run_ranks(n, [&](int r) { errors[r] = ctxs[r]->connect(addresses); });
  for (int r = 0; r < n; ++r)
    EXPECT_FALSE(errors[r]) << "rank " << r << ": " << text_of(errors[r]);
  return ctxs;
}

/// Sends `size` bytes from `a` to `b` and back (tag `tag`) and checks them.
void round_trip(transport::context& a, transport::context& b, uint64_t tag, std::size_t size) {
  auto out = pattern(size, tag);
  bytes at_b(size), back(size);
  auto r1 = b.to(a.rank()).recv(tag, at_b);
  auto s1 = a.to(b.rank()).send(tag, parts_of(out));
  ASSERT_FALSE(s1->wait(in(10s)));
  ASSERT_FALSE(r1->wait(in(10s)));
  EXPECT_EQ(at_b, out);
  auto r2 = a.to(b.rank()).recv(tag, back);
  auto s2 = b.to(a.rank()).send(tag, parts_of(at_b));
  ASSERT_FALSE(s2->wait(in(10s)));
  ASSERT_FALSE(r2->wait(in(10s)));
  EXPECT_EQ(back, out);
}

// -- raw peers -----------------------------------------------------------------------------------

/// A plain socket that plays a broken or hostile peer.
class raw_peer : public consort::test::raw_socket {
public:
  explicit raw_peer(uint16_t port) : raw_socket("127.0.0.1", port) {}

  void hello(uint32_t rank, uint32_t size, uint64_t group = test_group, uint16_t version = 1) {
    wire::hello h;
    h.version = version;
    h.rank = rank;
    h.size = size;
    h.group_id = group;
    write(wire::encode_hello(h));
  }

  /// Reads the peer's reply hello; false when none arrives.
  bool read_hello(wire::hello& h) {
    std::byte prefix[4];
    if (!read_exact(prefix))
      return false;
    uint32_t length = 0;
    if (!wire::decode_length(std::span<const std::byte, 4>(prefix, 4), length).empty())
      return false;
    bytes body(length);
    return read_exact(body) && wire::decode_hello(body, h).empty();
  }

  void header(uint64_t tag, uint64_t payload_bytes, uint32_t sender, uint16_t version = 1) {
    wire::header h;
    h.version = version;
    h.sender_rank = sender;
    h.tag = tag;
    h.payload_bytes = payload_bytes;
    std::array<std::byte, wire::max_head_bytes> head{};
    auto n = wire::encode_header(h, head);
    write(std::span(head.data(), n));
  }

  /// An abort frame that carries `code` and `reason`, as a rank that aborts sends it.
  void abort_frame(uint32_t sender, errc code, const std::string& reason) {
    std::string payload(1, static_cast<char>(code));
    payload += reason;
    wire::header h;
    h.sender_rank = sender;
    h.kind = wire::frame_kind::abort;
    h.payload_bytes = payload.size();
    std::array<std::byte, wire::max_head_bytes> head{};
    auto n = wire::encode_header(h, head);
    // One write, as the transport sends it: a second small one could wait for Nagle, and the
    // reset of the close that follows would discard it.
    bytes frame(head.begin(), head.begin() + static_cast<std::ptrdiff_t>(n));
    auto body = std::as_bytes(std::span(payload));
    frame.insert(frame.end(), body.begin(), body.end());
    write(frame);
  }
};

/// Rank 0 of a group of 2 whose rank 1 is a raw socket that has completed the handshake.
struct rank_and_raw_peer {
  context_ptr ctx; // null (and a failure added) when the handshake did not complete
  std::unique_ptr<raw_peer> peer;
};

rank_and_raw_peer connect_raw_peer() {
  rank_and_raw_peer out;
  auto ctx = listen_rank(0, 2);
  if (!ctx)
    return out;
  auto connected = std::async(std::launch::async, [ctx] {
    return ctx->connect({ctx->listen_address(), "127.0.0.1:1"});
  });
  out.peer = std::make_unique<raw_peer>(ctx->port());
  out.peer->hello(1, 2);
  wire::hello reply;
  if (!out.peer->read_hello(reply) || reply.rank != 0) {
    ADD_FAILURE() << "rank 0 did not answer the raw peer's hello";
    return out;
  }
  if (auto err = connected.get()) {
    ADD_FAILURE() << "rank 0 did not connect to the raw peer: " << text_of(err);
    return out;
  }
  out.ctx = std::move(ctx);
  return out;
}

// -- frame heads ---------------------------------------------------------------------------------

TEST(TcpWireTest, FrameHeaderRoundTripsThroughItsEncoding) {
  wire::header h;
  h.sender_rank = 3;
  h.tag = 0x0123456789abcdefull;
  h.payload_bytes = uint64_t{1} << 33;
  std::array<std::byte, wire::max_head_bytes> head{};
  auto n = wire::encode_header(h, head);
  ASSERT_GT(n, wire::prefix_bytes);
  uint32_t length = 0;
  ASSERT_EQ(wire::decode_length(std::span<const std::byte, 4>(head.data(), 4), length), "");
  EXPECT_EQ(length + wire::prefix_bytes, n);
  wire::header back;
  ASSERT_EQ(wire::decode_header(std::span(head.data() + 4, length), back), "");
  EXPECT_EQ(back.version, wire::protocol_version);
  EXPECT_EQ(back.sender_rank, 3u);
  EXPECT_EQ(back.tag, h.tag);
  EXPECT_EQ(back.payload_bytes, h.payload_bytes);
}

TEST(TcpWireTest, LengthsOutsideTheBoundsAreRejectedBeforeAnyRead) {
  auto check = [](uint32_t v) {
    std::byte b[4];
    for (int i = 0; i < 4; ++i)
      b[i] = static_cast<std::byte>((v >> (8 * i)) & 0xff);
    uint32_t length = 0;
    return wire::decode_length(std::span<const std::byte, 4>(b, 4), length);
  };
  EXPECT_NE(check(0), "");
  EXPECT_NE(check(8), "");
  EXPECT_NE(check(wire::max_header_bytes + 8), "");
  EXPECT_NE(check(0xffffffffu), "");
  EXPECT_NE(check(44), ""); // not whole words
  EXPECT_EQ(check(16), "");
  EXPECT_EQ(check(wire::max_header_bytes), "");
}

TEST(TcpWireTest, TrailingBytesAfterTheHeaderAreMalformed) {
  std::array<std::byte, wire::max_head_bytes> head{};
  auto n = wire::encode_header(wire::header{}, head);
  bytes body(head.begin() + 4, head.begin() + n);
  body.resize(body.size() + 8);
  wire::header back;
  EXPECT_NE(wire::decode_header(body, back).find("trailing"), std::string::npos);
}

// -- exchanges among all ranks -------------------------------------------------------------------

// -- collective algorithms over real sockets ------------------------------------------------------

/// The ring all-reduce over TCP, where early chunks go through the pair's stash (the in-memory
/// transport has none): a small window (3 chunks) and small chunks, so that the first step's sends
/// are paced and chunks arrive before their receives; and the dispatcher with its defaults.
/// int32 SUM (wrapping), int32 MAX and float32 SUM of integers (exact), against a sequential
/// reduction.
class TcpAllReduceTest : public ::testing::TestWithParam<std::tuple<int, std::size_t>> {};

TEST_P(TcpAllReduceTest, RingAndDispatcherMatchASequentialReduction) {
  const auto [n, count] = GetParam();
  auto ctxs = make_mesh(n);
  ASSERT_EQ(ctxs.size(), static_cast<std::size_t>(n));
  auto value = [](int r, std::size_t i) {
    return static_cast<int32_t>((i * 2654435761u + static_cast<std::size_t>(r) * 40503u) %
                                1000003u) -
           500000;
  };
  struct variant {
    consort::dtype type;
    consort::reduce_op op;
    bool ring; // the ring with a small window, else the dispatcher with the defaults
  };
  const std::vector<variant> variants{{consort::dtype::int32, consort::reduce_op::sum, true},
                                      {consort::dtype::int32, consort::reduce_op::max, true},
                                      {consort::dtype::float32, consort::reduce_op::sum, true},
                                      {consort::dtype::int32, consort::reduce_op::sum, false}};
  uint64_t tag = 1;
  for (const auto& v : variants) {
    SCOPED_TRACE(std::string{consort::to_string(v.type)} + " " + consort::to_string(v.op) +
                 (v.ring ? " ring" : " dispatcher"));
    // Every rank's input as int32 (also the float32 values: integers below 2^24, exact sums).
    std::vector<std::vector<int32_t>> in(static_cast<std::size_t>(n), std::vector<int32_t>(count));
    for (int r = 0; r < n; ++r)
      for (std::size_t i = 0; i < count; ++i)
        in[static_cast<std::size_t>(r)][i] = value(r, i);
    std::vector<int64_t> want(count);
    for (std::size_t i = 0; i < count; ++i) {
      int64_t acc = in[0][i];
      for (int r = 1; r < n; ++r) {
        const int64_t x = in[static_cast<std::size_t>(r)][i];
        acc = v.op == consort::reduce_op::max ? std::max(acc, x) : acc + x;
      }
      want[i] = acc;
    }
    std::vector<std::vector<std::byte>> data(static_cast<std::size_t>(n),
                                             std::vector<std::byte>(count * 4));
    for (int r = 0; r < n; ++r)
      for (std::size_t i = 0; i < count; ++i) {
        const auto x = in[static_cast<std::size_t>(r)][i];
        if (v.type == consort::dtype::float32) {
          const float f = static_cast<float>(x);
          std::memcpy(data[static_cast<std::size_t>(r)].data() + i * 4, &f, 4);
        } else {
          std::memcpy(data[static_cast<std::size_t>(r)].data() + i * 4, &x, 4);
        }
      }
    transport::algorithm_options opts;
    opts.tag = tag++;
    if (v.ring) {
      opts.chunk_bytes = 4096;
      opts.window_bytes = 3 * 4096;
    }
    std::vector<caf::error> errors(static_cast<std::size_t>(n));
    run_ranks(n, [&](int r) {
      auto* p = data[static_cast<std::size_t>(r)].data();
      errors[static_cast<std::size_t>(r)] =
          v.ring ? transport::ring_all_reduce(ctxs[static_cast<std::size_t>(r)], p, count, v.type,
                                              v.op, opts)
                       .run()
                 : transport::all_reduce(ctxs[static_cast<std::size_t>(r)], p, count, v.type, v.op,
                                         opts);
    });
    for (int r = 0; r < n; ++r) {
      ASSERT_FALSE(errors[static_cast<std::size_t>(r)])
          << "rank " << r << ": " << text_of(errors[static_cast<std::size_t>(r)]);
      std::size_t wrong = 0;
      for (std::size_t i = 0; i < count; ++i) {
        int64_t got = 0;
        if (v.type == consort::dtype::float32) {
          float f = 0;
          std::memcpy(&f, data[static_cast<std::size_t>(r)].data() + i * 4, 4);
          got = static_cast<int64_t>(f);
        } else {
          int32_t x = 0;
          std::memcpy(&x, data[static_cast<std::size_t>(r)].data() + i * 4, 4);
          got = x;
        }
        wrong += got != want[i];
      }
      EXPECT_EQ(wrong, 0u) << "rank " << r << ": " << wrong << " of " << count << " wrong";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(RanksAndCounts, TcpAllReduceTest,
                         ::testing::Combine(::testing::Values(2, 3),
                                            ::testing::Values(std::size_t{0}, std::size_t{7},
                                                              std::size_t{1001},
                                                              (std::size_t{1} << 18) + 3)),
                         [](const auto& info) {
                           return std::to_string(std::get<0>(info.param)) + "Ranks" +
                                  std::to_string(std::get<1>(info.param)) + "Elements";
                         });

class TcpMeshTest : public ::testing::TestWithParam<int> {};

TEST_P(TcpMeshTest, EveryRankExchangesMessagesOfEverySizeWithEveryOtherRank) {
  const int n = GetParam();
  auto ctxs = make_mesh(n);
  ASSERT_EQ(ctxs.size(), static_cast<std::size_t>(n));
  const std::vector<std::size_t> sizes{0, 1, 7, 4099, 65537, (1u << 20) + 3};
  run_ranks(n, [&](int r) {
    auto& ctx = *ctxs[r];
    EXPECT_EQ(ctx.rank(), r);
    EXPECT_EQ(ctx.size(), n);
    std::vector<bytes> out, got;
    std::vector<transport::operation_ptr> ops;
    out.reserve(n * sizes.size());
    got.reserve(n * sizes.size());
    for (int peer = 0; peer < n; ++peer) {
      if (peer == r)
        continue;
      for (std::size_t i = 0; i < sizes.size(); ++i) {
        got.emplace_back(sizes[i]);
        ops.push_back(ctx.to(peer).recv(i, got.back()));
        out.push_back(pattern(sizes[i], (r * 16 + peer) * 16 + i));
        ops.push_back(ctx.to(peer).send(i, parts_of(out.back())));
      }
    }
    auto err = transport::wait_all(ops, in(60s));
    EXPECT_FALSE(err) << "rank " << r << ": " << text_of(err);
    std::size_t k = 0;
    for (int peer = 0; peer < n; ++peer) {
      if (peer == r)
        continue;
      for (std::size_t i = 0; i < sizes.size(); ++i, ++k)
        EXPECT_TRUE(got[k] == pattern(sizes[i], (peer * 16 + r) * 16 + i))
            << "rank " << r << " from rank " << peer << ", " << sizes[i] << " bytes";
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, TcpMeshTest, ::testing::Range(1, 9));

TEST(TcpTest, ConnectMeshFormsAGroupFromKnownAddresses) {
  // connect_mesh needs every address in advance: take two free ports from the kernel first.
  std::vector<std::string> addresses;
  {
    asio::io_context io;
    std::vector<asio::ip::tcp::acceptor> probes;
    for (int r = 0; r < 2; ++r) {
      probes.emplace_back(io, asio::ip::tcp::endpoint(asio::ip::make_address("127.0.0.1"), 0));
      addresses.push_back("127.0.0.1:" + std::to_string(probes.back().local_endpoint().port()));
    }
  }
  std::vector<context_ptr> ctxs(2);
  run_ranks(2, [&](int r) {
    auto opts = options(r, 2);
    opts.listen_address.clear();
    opts.addresses = addresses;
    auto ctx = tcp::connect_mesh(opts);
    ASSERT_TRUE(ctx) << text_of(ctx.error());
    ctxs[r] = *ctx;
  });
  ASSERT_TRUE(ctxs[0] && ctxs[1]);
  EXPECT_EQ(ctxs[1]->listen_address(), addresses[1]);
  round_trip(*ctxs[0], *ctxs[1], 3, 1000);
}

TEST(TcpTest, ConnectRetriesUntilALateRankStartsListening) {
  // Rank 0's port is taken from the kernel and left unbound until rank 1 has been refused.
  std::string address0;
  {
    asio::io_context io;
    asio::ip::tcp::acceptor probe(io, {asio::ip::make_address("127.0.0.1"), 0});
    address0 = "127.0.0.1:" + std::to_string(probe.local_endpoint().port());
  }
  log_capture log;
  auto r1 = listen_rank(1, 2, [&](tcp::mesh_options& o) { o.log = log.sink(); });
  ASSERT_TRUE(r1);
  auto r1_connected = std::async(std::launch::async, [&] {
    return r1->connect({address0, r1->listen_address()});
  });
  ASSERT_TRUE(log.wait_for({"rank 1", "cannot reach rank 0 at " + address0, "refused"}))
      << log.all();
  auto r0 = listen_rank(0, 2, [&](tcp::mesh_options& o) { o.listen_address = address0; });
  ASSERT_TRUE(r0);
  EXPECT_FALSE(r0->connect({address0, r1->listen_address()}));
  EXPECT_FALSE(r1_connected.get());
  round_trip(*r0, *r1, 1, 100);
}

TEST(TcpTest, Transfers64MiBEachWayAtOnce) {
  auto ctxs = make_mesh(2);
  ASSERT_EQ(ctxs.size(), 2u);
  constexpr std::size_t size = std::size_t{64} << 20;
  run_ranks(2, [&](int r) {
    auto peer = 1 - r;
    auto out = pattern(size, 100 + r);
    bytes got(size);
    auto recv = ctxs[r]->to(peer).recv(9, got);
    auto send = ctxs[r]->to(peer).send(9, parts_of(out));
    EXPECT_FALSE(send->wait(in(60s)));
    EXPECT_FALSE(recv->wait(in(60s)));
    EXPECT_TRUE(got == pattern(size, 100 + peer)) << "rank " << r;
  });
}

TEST(TcpTest, A64MiBMessageThatArrivesBeforeItsReceiveIsKeptUntilPosted) {
  auto ctxs = make_mesh(2);
  ASSERT_EQ(ctxs.size(), 2u);
  constexpr std::size_t size = std::size_t{64} << 20;
  auto big = pattern(size, 5);
  bytes marker{std::byte{1}};
  auto s1 = ctxs[0]->to(1).send(1, parts_of(big));
  auto s2 = ctxs[0]->to(1).send(2, parts_of(marker));
  // Messages of a pair arrive in order: once tag 2 is here, tag 1 is in the stash.
  bytes got_marker(1);
  ASSERT_FALSE(ctxs[1]->to(0).recv(2, got_marker)->wait(in(60s)));
  bytes got(size);
  auto recv = ctxs[1]->to(0).recv(1, got);
  EXPECT_TRUE(recv->done()); // served from the stash when posted
  EXPECT_FALSE(recv->wait(in(1s)));
  EXPECT_TRUE(got == big);
  EXPECT_FALSE(s1->wait(in(10s)));
  EXPECT_FALSE(s2->wait(in(10s)));
}

// -- matching ------------------------------------------------------------------------------------

TEST(TcpTest, ReceivesMatchTagsInAnyOrderAndSameTagMessagesInSendOrder) {
  auto ctxs = make_mesh(2);
  ASSERT_EQ(ctxs.size(), 2u);
  auto& a = ctxs[0]->to(1);
  auto& b = ctxs[1]->to(0);
  // Tags 10, 11, 12 posted in reverse order of their sends; tag 20 three times.
  std::vector<bytes> out;
  for (int i = 0; i < 6; ++i)
    out.push_back(pattern(100 + i, i));
  bytes got12(102), got11(101);
  auto r12 = b.recv(12, got12);
  auto r11 = b.recv(11, got11);
  std::vector<transport::operation_ptr> sends;
  sends.push_back(a.send(10, parts_of(out[0])));
  sends.push_back(a.send(11, parts_of(out[1])));
  sends.push_back(a.send(12, parts_of(out[2])));
  for (int i = 3; i < 6; ++i)
    sends.push_back(a.send(20, parts_of(out[i])));
  ASSERT_FALSE(transport::wait_all(sends, in(10s)));
  ASSERT_FALSE(r12->wait(in(10s)));
  ASSERT_FALSE(r11->wait(in(10s)));
  // Tag 10 and two of tag 20 were stashed; posted now, they keep their order.
  bytes got20a(103), got20b(104), got20c(105), got10(100);
  auto r20a = b.recv(20, got20a);
  auto r20b = b.recv(20, got20b);
  auto r20c = b.recv(20, got20c);
  auto r10 = b.recv(10, got10);
  ASSERT_FALSE(transport::wait_all({r20a, r20b, r20c, r10}, in(10s)));
  EXPECT_EQ(got10, out[0]);
  EXPECT_EQ(got11, out[1]);
  EXPECT_EQ(got12, out[2]);
  EXPECT_EQ(got20a, out[3]);
  EXPECT_EQ(got20b, out[4]);
  EXPECT_EQ(got20c, out[5]);
}

TEST(TcpTest, ReceivePostedBeforeTheSendGetsTheMessage) {
  auto ctxs = make_mesh(2);
  ASSERT_EQ(ctxs.size(), 2u);
  bytes got(1000);
  auto recv = ctxs[1]->to(0).recv(5, got);
  EXPECT_FALSE(recv->done());
  auto out = pattern(1000, 5);
  auto send = ctxs[0]->to(1).send(5, parts_of(out));
  EXPECT_FALSE(send->wait(in(10s)));
  EXPECT_FALSE(recv->wait(in(10s)));
  EXPECT_EQ(got, out);
}

TEST(TcpTest, SendGathersItsPartsIntoOneMessage) {
  auto ctxs = make_mesh(2);
  ASSERT_EQ(ctxs.size(), 2u);
  auto a = pattern(3, 1), b = bytes{}, c = pattern(70000, 2);
  bytes whole(a);
  whole.insert(whole.end(), c.begin(), c.end());
  bytes got(whole.size());
  auto recv = ctxs[1]->to(0).recv(1, got);
  auto send = ctxs[0]->to(1).send(
      1, {transport::const_bytes(a), transport::const_bytes(b), transport::const_bytes(c)});
  EXPECT_FALSE(send->wait(in(10s)));
  EXPECT_FALSE(recv->wait(in(10s)));
  EXPECT_EQ(got, whole);
}

TEST(TcpTest, ReceiveOfTheWrongSizeFailsAndDropsOnlyThatMessage) {
  auto ctxs = make_mesh(2);
  ASSERT_EQ(ctxs.size(), 2u);
  auto& a = ctxs[0]->to(1);
  auto& b = ctxs[1]->to(0);
  // Posted before arrival: the reader drops the payload.
  bytes small(8);
  auto early = b.recv(1, small);
  auto ten = pattern(10, 1);
  ASSERT_FALSE(a.send(1, parts_of(ten))->wait(in(10s)));
  EXPECT_TRUE(has_error(early->wait(in(10s)), errc::invalid_argument,
                        {"tag 1", "rank 0", "8 bytes", "10 bytes", "dropped"}));
  // Posted after arrival (served from the stash).
  auto twelve = pattern(12, 2);
  auto marker = pattern(1, 3);
  ASSERT_FALSE(a.send(2, parts_of(twelve))->wait(in(10s)));
  ASSERT_FALSE(a.send(3, parts_of(marker))->wait(in(10s)));
  bytes got_marker(1);
  ASSERT_FALSE(b.recv(3, got_marker)->wait(in(10s)));
  bytes large(16);
  EXPECT_TRUE(has_error(b.recv(2, large)->wait(in(10s)), errc::invalid_argument,
                        {"tag 2", "16 bytes", "12 bytes"}));
  // The stream is intact.
  round_trip(*ctxs[0], *ctxs[1], 4, 333);
}

TEST(TcpTest, RecvAtMostTakesAnySmallerMessageAndSaysItsSize) {
  auto ctxs = make_mesh(2);
  ASSERT_EQ(ctxs.size(), 2u);
  auto& a = ctxs[0]->to(1);
  auto& b = ctxs[1]->to(0);
  // Posted before arrival: read straight into the buffer.
  bytes into(64);
  auto posted = b.recv_at_most(1, into);
  EXPECT_EQ(posted->message_bytes(), 0u) << "nothing received yet";
  auto ten = pattern(10, 1);
  ASSERT_FALSE(a.send(1, parts_of(ten))->wait(in(10s)));
  ASSERT_FALSE(posted->wait(in(10s)));
  EXPECT_EQ(posted->message_bytes(), 10u);
  EXPECT_TRUE(std::equal(ten.begin(), ten.end(), into.begin()));
  // Posted after arrival (served from the stash): equal size, smaller, empty, larger.
  auto sixty_four = pattern(64, 2);
  auto three = pattern(3, 3);
  auto sixty_five = pattern(65, 4);
  auto marker = pattern(1, 5);
  auto s64 = a.send(2, parts_of(sixty_four));
  ASSERT_FALSE(s64->wait(in(10s)));
  EXPECT_EQ(s64->message_bytes(), 64u) << "a send's message_bytes is its size";
  ASSERT_FALSE(a.send(2, parts_of(three))->wait(in(10s)));
  ASSERT_FALSE(a.send(2, {})->wait(in(10s)));
  ASSERT_FALSE(a.send(2, parts_of(sixty_five))->wait(in(10s)));
  ASSERT_FALSE(a.send(3, parts_of(marker))->wait(in(10s)));
  bytes got_marker(1);
  ASSERT_FALSE(b.recv(3, got_marker)->wait(in(10s))); // everything before it has arrived
  auto equal = b.recv_at_most(2, into);
  ASSERT_FALSE(equal->wait(in(10s)));
  EXPECT_EQ(equal->message_bytes(), 64u);
  EXPECT_EQ(into, sixty_four);
  auto smaller = b.recv_at_most(2, into);
  ASSERT_FALSE(smaller->wait(in(10s)));
  EXPECT_EQ(smaller->message_bytes(), 3u);
  EXPECT_TRUE(std::equal(three.begin(), three.end(), into.begin()));
  auto empty = b.recv_at_most(2, into);
  ASSERT_FALSE(empty->wait(in(10s)));
  EXPECT_EQ(empty->message_bytes(), 0u);
  EXPECT_TRUE(has_error(b.recv_at_most(2, into)->wait(in(10s)), errc::invalid_argument,
                        {"tag 2", "at most 64 bytes", "65 bytes", "dropped"}));
  // Posted before a message that is too large: the reader drops it; the stream is intact.
  auto too_small = b.recv_at_most(4, {into.data(), 8});
  auto nine = pattern(9, 6);
  ASSERT_FALSE(a.send(4, parts_of(nine))->wait(in(10s)));
  EXPECT_TRUE(has_error(too_small->wait(in(10s)), errc::invalid_argument,
                        {"tag 4", "at most 8 bytes", "9 bytes"}));
  round_trip(*ctxs[0], *ctxs[1], 4, 333);
}

TEST(TcpTest, ConcurrentSendsAndReceivesOnOnePairFromManyThreads) {
  auto ctxs = make_mesh(2);
  ASSERT_EQ(ctxs.size(), 2u);
  constexpr int threads = 4;
  constexpr int messages = 200;
  run_ranks(2 * threads, [&](int t) {
    bool sender = t < threads;
    int lane = t % threads;
    for (int m = 0; m < messages; ++m) {
      uint64_t tag = lane * 1000 + m;
      auto size = static_cast<std::size_t>(1 + (m * 37) % 5000);
      if (sender) {
        auto out = pattern(size, tag);
        auto err = ctxs[0]->to(1).send(tag, parts_of(out))->wait(in(30s));
        ASSERT_FALSE(err) << text_of(err);
      } else {
        bytes got(size);
        auto err = ctxs[1]->to(0).recv(tag, got)->wait(in(30s));
        ASSERT_FALSE(err) << text_of(err);
        ASSERT_EQ(got, pattern(size, tag));
      }
    }
  });
}

// -- deadlines and failures ----------------------------------------------------------------------

TEST(TcpTest, ReceiveWithoutSenderTimesOutNamingPeerAndTagAndStaysPosted) {
  auto ctxs = make_mesh(2);
  ASSERT_EQ(ctxs.size(), 2u);
  bytes got(16);
  auto recv = ctxs[0]->to(1).recv(42, got);
  auto start = clock::now();
  auto err = recv->wait(start + 100ms);
  auto took = clock::now() - start;
  EXPECT_TRUE(has_error(err, errc::collective_timeout, {"tag 42", "rank 1", "16 bytes"}));
  EXPECT_GE(took, 100ms);
  EXPECT_LT(took, consort::test::scaled(2s));
  EXPECT_FALSE(recv->done());
  // Still posted: a late message completes it.
  auto out = pattern(16, 42);
  EXPECT_FALSE(ctxs[1]->to(0).send(42, parts_of(out))->wait(in(10s)));
  EXPECT_FALSE(recv->wait(in(10s)));
  EXPECT_EQ(got, out);
}

TEST(TcpTest, PeerThatGoesAwayFailsPendingAndLaterOperationsWithPeerLost) {
  log_capture log;
  auto ctxs = make_mesh(3, [&](tcp::mesh_options& o) { o.log = log.sink(); });
  ASSERT_EQ(ctxs.size(), 3u);
  bytes got(8);
  auto pending = ctxs[0]->to(2).recv(1, got);
  ctxs[2].reset(); // rank 2 goes away: its connections close
  EXPECT_TRUE(has_error(pending->wait(in(10s)), errc::peer_lost,
                        {"recv of tag 1", "rank 2", "closed the connection"}));
  auto later_send = ctxs[0]->to(2).send(2, parts_of(got));
  EXPECT_TRUE(later_send->done());
  EXPECT_TRUE(has_error(later_send->wait(in(1s)), errc::peer_lost, {"send of tag 2", "rank 2"}));
  auto later_recv = ctxs[1]->to(2).recv(3, got);
  EXPECT_TRUE(has_error(later_recv->wait(in(10s)), errc::peer_lost, {"rank 2"}));
  EXPECT_TRUE(log.wait_for({"rank 0", "closing the connection to rank 2"})) << log.all();
  // The survivors go on.
  round_trip(*ctxs[0], *ctxs[1], 4, 1000);
}

TEST(TcpTest, SendToAPeerThatStopsReadingFailsWithPeerLostWhenItCloses) {
  // Rank 1 is a raw socket that completes the handshake, never reads, then closes.
  auto [ctx, peer] = connect_raw_peer();
  ASSERT_TRUE(ctx);
  auto big = pattern(std::size_t{64} << 20, 1);
  auto send = ctx->to(1).send(1, parts_of(big));
  EXPECT_TRUE(has_error(send->wait(in(200ms)), errc::collective_timeout,
                        {"send of tag 1", "rank 1", "did not complete"}));
  peer->close();
  EXPECT_TRUE(has_error(send->wait(in(10s)), errc::peer_lost, {"send of tag 1", "rank 1"}));
}

// A peer aborts while this rank is in the middle of a send to it, and closes without reading it
// (its kernel resets the connection). The abort frame is ahead of the reset: whichever of the
// write (broken pipe) and the read sees the end first, the send fails with the code and reason
// the peer's abort carried, not with a bare broken pipe. Both orders happen; the loop meets both.
TEST(TcpTest, ASendCutOffByThePeersAbortFailsWithTheCauseTheAbortCarried) {
  for (int round = 0; round < 8; ++round) {
    auto [ctx, peer] = connect_raw_peer();
    ASSERT_TRUE(ctx);
    auto big = pattern(std::size_t{16} << 20, 2);
    auto send = ctx->to(1).send(2, parts_of(big));
    ASSERT_TRUE(has_error(send->wait(in(50ms)), errc::collective_timeout, {"send of tag 2"}))
        << "the peer reads nothing, so the send is still under way";
    peer->abort_frame(1, errc::collective_mismatch, "rank 1 called all_gather, rank 0 all_reduce");
    peer->close(); // unread bytes: the kernel answers with a reset
    EXPECT_TRUE(has_error(send->wait(in(10s)), errc::collective_mismatch,
                          {"send of tag 2", "rank 1 aborted the group",
                           "rank 1 called all_gather, rank 0 all_reduce"}))
        << "round " << round;
  }
}

TEST(TcpTest, AbortFailsPendingOperationsAtOnceAndEveryLaterOne) {
  auto ctxs = make_mesh(2);
  ASSERT_EQ(ctxs.size(), 2u);
  bytes got(8), peer_got(8);
  auto pending = ctxs[0]->to(1).recv(1, got);
  auto peer_pending = ctxs[1]->to(0).recv(1, peer_got);
  auto waited = std::async(std::launch::async, [&] { return pending->wait(in(30s)); });
  auto start = clock::now();
  ctxs[0]->abort("membership lost rank 7");
  ASSERT_EQ(waited.wait_for(10s), std::future_status::ready);
  EXPECT_LT(clock::now() - start, consort::test::scaled(1s));
  EXPECT_TRUE(
      has_error(waited.get(), errc::peer_lost, {"recv of tag 1", "membership lost rank 7"}));
  auto later_recv = ctxs[0]->to(1).recv(2, got);
  auto later_send = ctxs[0]->to(1).send(2, parts_of(got));
  EXPECT_TRUE(later_recv->done());
  EXPECT_TRUE(later_send->done());
  EXPECT_TRUE(has_error(later_recv->wait(in(1s)), errc::peer_lost, {"membership lost rank 7"}));
  EXPECT_TRUE(has_error(later_send->wait(in(1s)), errc::peer_lost, {"membership lost rank 7"}));
  // The peer learns at once too: the aborted context shut its connections down.
  EXPECT_TRUE(has_error(peer_pending->wait(in(10s)), errc::peer_lost, {"rank 0"}));
}

TEST(TcpTest, AbortFailsAReceiveWhosePayloadIsHalfRead) {
  // Rank 1 is a raw socket that sends 10 of the 100 bytes it announces, then stalls.
  auto [ctx, peer] = connect_raw_peer();
  ASSERT_TRUE(ctx);
  bytes got(100);
  auto recv = ctx->to(1).recv(5, got);
  peer->header(5, 100, 1);
  peer->write(pattern(10, 5));
  // Wait until the 10 bytes are in (the timeout message counts them), then abort.
  auto until = in(10s);
  caf::error err;
  do {
    err = recv->wait(in(20ms));
  } while (clock::now() < until && text_of(err).find("10 of 100 bytes") == std::string::npos);
  ASSERT_TRUE(has_error(err, errc::collective_timeout, {"tag 5", "10 of 100 bytes received"}));
  ctx->abort("test abort");
  EXPECT_TRUE(recv->done());
  EXPECT_TRUE(has_error(recv->wait(in(1s)), errc::peer_lost,
                        {"recv of tag 5", "after 10 of 100 bytes", "test abort"}));
  EXPECT_TRUE(peer->closed_by_peer());
}

TEST(TcpTest, DestroyingAContextFailsItsPendingOperations) {
  auto ctxs = make_mesh(2);
  ASSERT_EQ(ctxs.size(), 2u);
  bytes got(8);
  auto pending = ctxs[0]->to(1).recv(1, got);
  ctxs[0].reset();
  EXPECT_TRUE(pending->done());
  EXPECT_TRUE(has_error(pending->wait(in(1s)), errc::peer_lost, {"destroyed"}));
}

TEST(TcpTest, SendLargerThanTheMaximumPayloadIsRefused) {
  auto ctxs = make_mesh(2, [](tcp::mesh_options& o) { o.max_payload_bytes = 1000; });
  ASSERT_EQ(ctxs.size(), 2u);
  auto out = pattern(1001, 1);
  EXPECT_TRUE(has_error(ctxs[0]->to(1).send(1, parts_of(out))->wait(in(1s)), errc::invalid_argument,
                        {"1001 bytes", "max_payload_bytes"}));
  round_trip(*ctxs[0], *ctxs[1], 2, 1000);
}

TEST(TcpTest, EarlyMessagesBeyondTheStashLimitBreakTheConnectionNamingThePeer) {
  log_capture log;
  auto ctxs = make_mesh(3, [&](tcp::mesh_options& o) {
    o.log = log.sink();
    o.max_stash_bytes = 1 << 20;
  });
  ASSERT_EQ(ctxs.size(), 3u);
  auto out = pattern((1 << 20) + 1, 1);
  auto send = ctxs[0]->to(1).send(1, parts_of(out));
  bytes got(8);
  auto recv = ctxs[1]->to(0).recv(2, got);
  EXPECT_TRUE(has_error(recv->wait(in(10s)), errc::peer_lost, {"rank 0", "stash is full"}));
  EXPECT_TRUE(log.wait_for({"rank 1", "rank 0", "stash is full", "1048577 bytes"})) << log.all();
  // Other pairs are unaffected.
  round_trip(*ctxs[1], *ctxs[2], 3, 5000);
}

// -- forming the mesh ----------------------------------------------------------------------------

TEST(TcpTest, ConnectFailsAfterItsDeadlineNamingTheMissingRanks) {
  // A port nobody listens on: take one from the kernel and close it.
  std::string dead;
  {
    asio::io_context io;
    asio::ip::tcp::acceptor probe(io, {asio::ip::make_address("127.0.0.1"), 0});
    dead = "127.0.0.1:" + std::to_string(probe.local_endpoint().port());
  }
  auto ctx = listen_rank(1, 3, [](tcp::mesh_options& o) { o.connect_timeout = 300ms; });
  ASSERT_TRUE(ctx);
  auto start = clock::now();
  auto err = ctx->connect({dead, ctx->listen_address(), "127.0.0.1:9"});
  EXPECT_LT(clock::now() - start, consort::test::scaled(5s));
  EXPECT_TRUE(has_error(err, errc::collective_timeout,
                        {"rank 0 at " + dead, "refused", "rank 2", "has not connected"}));
  // Operations of the missing pairs fail rather than wait.
  bytes got(1);
  EXPECT_TRUE(has_error(ctx->to(0).recv(1, got)->wait(in(1s)), errc::peer_lost, {"rank 0"}));
}

TEST(TcpTest, PeersOfAnotherGroupAreRefusedWithALoggedReason) {
  log_capture log;
  auto a = listen_rank(0, 2, [&](tcp::mesh_options& o) {
    o.log = log.sink();
    o.connect_timeout = 500ms;
  });
  auto b = listen_rank(1, 2, [&](tcp::mesh_options& o) {
    o.group_id = 99;
    o.connect_timeout = 500ms;
  });
  ASSERT_TRUE(a && b);
  std::vector<std::string> addresses{a->listen_address(), b->listen_address()};
  std::vector<caf::error> errors(2);
  std::vector<context_ptr> ctxs{a, b};
  run_ranks(2, [&](int r) { errors[r] = ctxs[r]->connect(addresses); });
  EXPECT_TRUE(has_error(errors[0], errc::collective_timeout, {"rank 1", "group 99"}));
  EXPECT_TRUE(has_error(errors[1], errc::collective_timeout, {"rank 0"}));
  EXPECT_TRUE(log.wait_for({"refused the connection", "group 99", "expected group 7"}))
      << log.all();
}

// -- malformed traffic ---------------------------------------------------------------------------

/// A malformed first frame (hello) and the reason the listening rank logs for it.
struct bad_hello {
  std::string name;
  std::function<void(raw_peer&)> send;
  std::string reason;
};

void PrintTo(const bad_hello& bad, std::ostream* os) {
  *os << bad.name;
}

class TcpBadHelloTest : public ::testing::TestWithParam<bad_hello> {};

TEST_P(TcpBadHelloTest, ConnectionIsClosedWithALoggedReasonAndTheMeshStillForms) {
  const auto& bad = GetParam();
  log_capture log;
  auto tweak = [&](tcp::mesh_options& o) {
    o.log = log.sink();
    o.handshake_timeout = 300ms;
  };
  auto r0 = listen_rank(0, 2, tweak);
  ASSERT_TRUE(r0);
  // The hostile client arrives while rank 0 waits for rank 1.
  auto r0_connected = std::async(std::launch::async, [&] {
    return r0->connect({r0->listen_address(), "127.0.0.1:1"});
  });
  {
    raw_peer peer(r0->port());
    bad.send(peer);
    EXPECT_TRUE(peer.closed_by_peer()) << bad.name;
    EXPECT_TRUE(log.wait_for(
        {"refused the connection from 127.0.0.1:" + std::to_string(peer.local_port()), bad.reason}))
        << log.all();
  }
  auto r1 = listen_rank(1, 2, tweak);
  ASSERT_TRUE(r1);
  ASSERT_FALSE(r1->connect({r0->listen_address(), r1->listen_address()}));
  ASSERT_FALSE(r0_connected.get());
  round_trip(*r0, *r1, 1, 4096);
}

bytes ff_bytes(std::size_t n) {
  return bytes(n, std::byte{0xff});
}

INSTANTIATE_TEST_SUITE_P(
    Malformed, TcpBadHelloTest,
    ::testing::Values(
        bad_hello{"TruncatedPrefix",
                  [](raw_peer& p) {
                    p.write(bytes{std::byte{40}, std::byte{0}});
                    p.shutdown_write();
                  },
                  "truncated hello: the connection ended after 2 of 4 bytes"},
        bad_hello{"TruncatedBody",
                  [](raw_peer& p) {
                    auto hello = wire::encode_hello(wire::hello{1, 1, 2, test_group, 0, {}, {}});
                    hello.resize(hello.size() - 5);
                    p.write(hello);
                  },
                  "timed out waiting for the hello's header"},
        bad_hello{"OversizedLength", [](raw_peer& p) { p.write_u32(0xffffffffu); },
                  "header length 4294967295 is outside"},
        bad_hello{"LengthNotAMultipleOfEight", [](raw_peer& p) { p.write_u32(20); },
                  "not a multiple of 8"},
        bad_hello{"GarbageCapnProto",
                  [](raw_peer& p) {
                    p.write_u32(64);
                    p.write(ff_bytes(64));
                  },
                  "not a valid Cap'n Proto message"},
        bad_hello{"WrongVersion", [](raw_peer& p) { p.hello(1, 2, test_group, 9); },
                  "protocol version 9"},
        bad_hello{"WrongGroup", [](raw_peer& p) { p.hello(1, 2, 12345); }, "group 12345"},
        bad_hello{"WrongSize", [](raw_peer& p) { p.hello(1, 5); }, "a group of 5 ranks"},
        bad_hello{"RankOutOfRange", [](raw_peer& p) { p.hello(2, 2); }, "outside [0, 2)"},
        bad_hello{"ClaimsTheListenersRank", [](raw_peer& p) { p.hello(0, 2); }, "claims this rank"},
        bad_hello{"Silent", [](raw_peer&) {}, "timed out"}),
    [](const ::testing::TestParamInfo<bad_hello>& info) { return info.param.name; });

/// A malformed frame on an established connection and what the receiving rank reports.
struct bad_frame {
  std::string name;
  std::function<void(raw_peer&)> send;
  std::string reason;
};

void PrintTo(const bad_frame& bad, std::ostream* os) {
  *os << bad.name;
}

class TcpBadFrameTest : public ::testing::TestWithParam<bad_frame> {};

TEST_P(TcpBadFrameTest, ConnectionIsClosedWithPeerLostWhileTheOtherPeersGoOn) {
  // Ranks 0 and 1 are real; rank 2 is a raw socket that shakes hands properly with both and
  // then sends rank 0 a malformed frame.
  const auto& bad = GetParam();
  log_capture log;
  std::vector<context_ptr> ctxs(2);
  for (int r = 0; r < 2; ++r) {
    ctxs[r] = listen_rank(r, 3, [&](tcp::mesh_options& o) { o.log = log.sink(); });
    ASSERT_TRUE(ctxs[r]);
  }
  std::vector<std::string> addresses{ctxs[0]->listen_address(), ctxs[1]->listen_address(),
                                     "127.0.0.1:1"};
  std::vector<std::future<caf::error>> connected;
  for (int r = 0; r < 2; ++r)
    connected.push_back(
        std::async(std::launch::async, [&, r] { return ctxs[r]->connect(addresses); }));
  raw_peer to0(ctxs[0]->port()), to1(ctxs[1]->port());
  wire::hello reply;
  to0.hello(2, 3);
  ASSERT_TRUE(to0.read_hello(reply));
  to1.hello(2, 3);
  ASSERT_TRUE(to1.read_hello(reply));
  for (auto& c : connected) {
    auto err = c.get();
    ASSERT_FALSE(err) << text_of(err);
  }
  round_trip(*ctxs[0], *ctxs[1], 1, 10000);
  bytes got(100);
  auto pending = ctxs[0]->to(2).recv(5, got);
  bad.send(to0);
  EXPECT_TRUE(has_error(pending->wait(in(10s)), errc::peer_lost, {"rank 2", bad.reason}));
  EXPECT_TRUE(to0.closed_by_peer());
  EXPECT_TRUE(log.wait_for({"rank 0", "closing the connection to rank 2", bad.reason}))
      << log.all();
  // Rank 0 goes on serving its real peer, and rank 2's other connection is untouched.
  round_trip(*ctxs[0], *ctxs[1], 2, 100000);
  to1.header(6, 3, 2);
  to1.write(pattern(3, 6));
  bytes from2(3);
  EXPECT_FALSE(ctxs[1]->to(2).recv(6, from2)->wait(in(10s)));
  EXPECT_EQ(from2, pattern(3, 6));
  // A stray connection after the mesh formed is refused too.
  raw_peer stray(ctxs[1]->port());
  stray.hello(2, 3);
  EXPECT_TRUE(stray.closed_by_peer());
  EXPECT_TRUE(log.wait_for({"rank 1", "refused the connection", "already connected"})) << log.all();
}

INSTANTIATE_TEST_SUITE_P(
    Malformed, TcpBadFrameTest,
    ::testing::Values(
        bad_frame{"TruncatedPayload",
                  [](raw_peer& p) {
                    p.header(5, 100, 2);
                    p.write(pattern(10, 0));
                    p.shutdown_write();
                  },
                  "truncated frame: the connection ended after 10 of 100 bytes"},
        bad_frame{"TruncatedHeader",
                  [](raw_peer& p) {
                    p.write_u32(40);
                    p.write(bytes(8));
                    p.shutdown_write();
                  },
                  "truncated frame"},
        bad_frame{"OversizedLength", [](raw_peer& p) { p.write_u32(0xffffffffu); },
                  "malformed frame: header length 4294967295"},
        bad_frame{"GarbageCapnProto",
                  [](raw_peer& p) {
                    p.write_u32(64);
                    p.write(ff_bytes(64));
                  },
                  "not a valid Cap'n Proto message"},
        bad_frame{"WrongVersion", [](raw_peer& p) { p.header(5, 100, 2, 3); },
                  "protocol version 3"},
        bad_frame{"OversizedPayload", [](raw_peer& p) { p.header(5, uint64_t{1} << 40, 2); },
                  "exceeds max_payload_bytes"},
        bad_frame{"WrongSender", [](raw_peer& p) { p.header(5, 100, 1); }, "sender rank 1"}),
    [](const ::testing::TestParamInfo<bad_frame>& info) { return info.param.name; });

} // namespace
