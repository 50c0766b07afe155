// Tests of authenticated connections (docs/multi_worker.md, "Authentication"): the primitives
// against published vectors; the mesh handshake with a shared secret (matching, wrong and
// one-sided secrets, a replayed handshake, a reflected proof, a proof relayed from another
// group); and strangers on every kind of port (mesh and membership) while a collective runs on
// the real mesh. Raw sockets play the strangers; where they hold the secret they compute the
// proofs from the protocol as documented, independently of the library's code. Nothing sleeps:
// every wait is on a future, an operation or a log line, with a deadline.

#include "transport/auth.hpp"
#include "transport/membership/codec.hpp" // to craft membership messages
#include "transport/tcp/wire.hpp"         // to craft mesh frames

#include "support/transport_helpers.hpp"

#include <consort/error.hpp>
#include <consort/transport/algorithms.hpp>
#include <consort/transport/membership.hpp>
#include <consort/transport/tcp.hpp>

#include <utility> // Boost 1.74's Asio needs <utility> before it on C++20

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/write.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include <poll.h>

namespace {

using namespace std::chrono_literals;
using consort::errc;
using consort::test::has_error;
using consort::test::log_capture;
using consort::test::text_of;
namespace transport = consort::transport;
namespace tcp = consort::transport::tcp;
namespace wire = consort::transport::tcp::wire;
namespace auth = consort::transport::auth;
namespace membership = consort::transport::membership;
namespace codec = consort::transport::membership::codec;
namespace asio = boost::asio;
using asio_tcp = boost::asio::ip::tcp;
using bytes = std::vector<std::byte>;
using context_ptr = std::shared_ptr<tcp::context>;
using std::chrono::milliseconds;

constexpr uint64_t test_group = 7;
const std::string test_secret = "a shared secret of the test cluster";

transport::deadline in(milliseconds ms) {
  return transport::clock::now() + ms;
}

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

// -- the protocol, as docs/multi_worker.md states it ---------------------------------------------

/// The mesh proof of `role` ("acceptor" or "connector") for the given connection.
bytes mesh_proof(const std::string& secret, const std::string& role, uint64_t group, uint64_t epoch,
                 uint32_t size, uint32_t connector, uint32_t acceptor, const bytes& connector_nonce,
                 const bytes& acceptor_nonce) {
  return to_bytes(auth::transcript("consort-mesh-v1|" + role)
                      .u64(group)
                      .u64(epoch)
                      .u32(size)
                      .u32(connector)
                      .u32(acceptor)
                      .bytes(connector_nonce)
                      .bytes(acceptor_nonce)
                      .sign(secret));
}

// -- meshes --------------------------------------------------------------------------------------

using tweak_fn = std::function<void(tcp::mesh_options&)>;

tcp::mesh_options mesh_options_for(int rank, int size, const std::string& secret) {
  tcp::mesh_options opts;
  opts.rank = rank;
  opts.size = size;
  opts.listen_address = "127.0.0.1:0";
  opts.group_id = test_group;
  opts.epoch = 1;
  opts.secret = secret;
  opts.connect_timeout = 20s;
  opts.handshake_timeout = 5s;
  return opts;
}

context_ptr listen_rank(tcp::mesh_options opts) {
  auto ctx = tcp::listen(opts);
  if (!ctx) {
    ADD_FAILURE() << "listen of rank " << opts.rank << ": " << text_of(ctx.error());
    return nullptr;
  }
  return *ctx;
}

/// Runs `fn(rank)` on one thread per rank and joins them.
void run_ranks(int n, const std::function<void(int)>& fn) {
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back(fn, r);
  for (auto& t : threads)
    t.join();
}

/// Connects every context to `addresses` at once; the errors by rank.
std::vector<caf::error> connect_all(const std::vector<context_ptr>& ctxs,
                                    const std::vector<std::string>& addresses) {
  std::vector<caf::error> errors(ctxs.size());
  run_ranks(static_cast<int>(ctxs.size()),
            [&](int r) { errors[static_cast<std::size_t>(r)] = ctxs[r]->connect(addresses); });
  return errors;
}

/// Sends a message from `a` to `b` and checks it arrives intact.
void expect_message(transport::context& a, transport::context& b, uint64_t tag) {
  bytes out = from_text("message " + std::to_string(tag)), got(out.size());
  auto r = b.to(a.rank()).recv(tag, got);
  auto s = a.to(b.rank()).send(tag, {transport::const_bytes(out)});
  ASSERT_FALSE(s->wait(in(10s)));
  ASSERT_FALSE(r->wait(in(10s)));
  EXPECT_EQ(got, out);
}

// -- raw peers -----------------------------------------------------------------------------------

/// Splits off the first length-prefixed frame of `data` (prefix included); nothing when `data`
/// does not hold a whole one.
std::optional<bytes> take_frame(bytes& data) {
  if (data.size() < 4)
    return std::nullopt;
  uint32_t length = 0;
  for (int i = 3; i >= 0; --i)
    length = (length << 8) | static_cast<uint32_t>(data[static_cast<std::size_t>(i)]);
  if (data.size() < 4 + static_cast<std::size_t>(length))
    return std::nullopt;
  bytes frame(data.begin(), data.begin() + 4 + length);
  data.erase(data.begin(), data.begin() + 4 + length);
  return frame;
}

/// A plain socket that speaks the mesh handshake by hand.
class mesh_stranger : public consort::test::raw_socket {
public:
  using raw_socket::raw_socket;

  /// Sends a hello of rank `rank` of the test group.
  void hello(uint32_t rank, uint32_t size, const bytes& nonce, uint64_t group = test_group) {
    wire::hello h;
    h.rank = rank;
    h.size = size;
    h.group_id = group;
    h.epoch = 1;
    h.nonce = nonce;
    write(wire::encode_hello(h));
  }

  /// Reads one frame's body; false when none arrives.
  bool read_body(bytes& body) {
    std::byte prefix[4];
    if (!read_exact(prefix))
      return false;
    uint32_t length = 0;
    if (!wire::decode_length(std::span<const std::byte, 4>(prefix, 4), length).empty())
      return false;
    body.resize(length);
    return read_exact(body);
  }

  bool read_hello(wire::hello& h) {
    bytes body;
    return read_body(body) && wire::decode_hello(body, h).empty();
  }

  void send_auth(const bytes& proof) {
    wire::auth a;
    a.proof = proof;
    write(wire::encode_auth(a));
  }
};

/// A plain socket that speaks the membership protocol by hand.
class membership_stranger : public consort::test::raw_socket {
public:
  using raw_socket::raw_socket;

  bool read(codec::message& out) {
    std::byte prefix[codec::prefix_bytes];
    if (!read_exact(prefix))
      return false;
    uint32_t length = 0;
    if (!codec::decode_length(std::span<const std::byte, 4>(prefix, 4), 1 << 20, length).empty())
      return false;
    bytes body(length);
    return read_exact(body) && codec::decode(body, 1 << 20, out).empty();
  }
};

/// Accepts one connection on `acceptor` within `timeout`; false when none comes.
bool accept_within(asio_tcp::acceptor& acceptor, asio_tcp::socket& socket, milliseconds timeout) {
  pollfd p{acceptor.native_handle(), POLLIN, 0};
  if (::poll(&p, 1, static_cast<int>(timeout.count())) <= 0)
    return false;
  acceptor.accept(socket);
  return true;
}

/// A TCP proxy for one connection to `target` that records what the client sends: the bytes of
/// a real handshake, for replaying. It runs its own I/O thread; destroying it closes both ends.
///
/// Thread safety: `address` and `recorded` may be called from any thread.
class recording_proxy {
public:
  explicit recording_proxy(const std::string& target)
      : acceptor_(io_, {asio::ip::make_address("127.0.0.1"), 0}), client_(io_), server_(io_) {
    auto colon = target.rfind(':');
    target_ = {asio::ip::make_address(target.substr(0, colon)),
               static_cast<uint16_t>(std::stoi(target.substr(colon + 1)))};
    acceptor_.async_accept(client_, [this](const boost::system::error_code& ec) {
      if (ec)
        return;
      server_.async_connect(target_, [this](const boost::system::error_code& ec) {
        if (ec) {
          boost::system::error_code ignored;
          client_.close(ignored);
          return;
        }
        pump(client_, server_, up_, true);
        pump(server_, client_, down_, false);
      });
    });
    thread_ = std::thread([this] { io_.run(); });
  }

  ~recording_proxy() {
    io_.stop();
    thread_.join();
  }

  std::string address() const {
    return "127.0.0.1:" + std::to_string(acceptor_.local_endpoint().port());
  }

  /// The first `frames` whole frames the client sent, once they have arrived (within `timeout`).
  std::optional<std::vector<bytes>> recorded(std::size_t frames, milliseconds timeout = 10s) {
    std::unique_lock lock(mu_);
    std::optional<std::vector<bytes>> out;
    cv_.wait_for(lock, timeout, [&] {
      auto rest = recorded_;
      std::vector<bytes> got;
      while (got.size() < frames)
        if (auto f = take_frame(rest))
          got.push_back(std::move(*f));
        else
          return false;
      out = std::move(got);
      return true;
    });
    return out;
  }

private:
  void pump(asio_tcp::socket& from, asio_tcp::socket& to, std::array<std::byte, 65536>& buf,
            bool record) {
    from.async_read_some(
        asio::buffer(buf),
        [this, &from, &to, &buf, record](const boost::system::error_code& ec, std::size_t n) {
          if (ec) {
            boost::system::error_code ignored;
            to.shutdown(asio_tcp::socket::shutdown_send, ignored);
            return;
          }
          if (record) {
            std::lock_guard lock(mu_);
            recorded_.insert(recorded_.end(), buf.begin(),
                             buf.begin() + static_cast<std::ptrdiff_t>(n));
            cv_.notify_all();
          }
          asio::async_write(
              to, asio::buffer(buf.data(), n),
              [this, &from, &to, &buf, record](const boost::system::error_code& ec, std::size_t) {
                if (!ec)
                  pump(from, to, buf, record);
              });
        });
  }

  asio::io_context io_;
  asio_tcp::acceptor acceptor_;
  asio_tcp::socket client_;
  asio_tcp::socket server_;
  asio_tcp::endpoint target_;
  std::array<std::byte, 65536> up_{};
  std::array<std::byte, 65536> down_{};
  std::thread thread_;
  std::mutex mu_;
  std::condition_variable cv_; // guarded by mu_
  bytes recorded_;             // guarded by mu_
};

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

TEST(TcpAuthWireTest, HelloAndAuthRoundTripThroughTheirEncodingWithBoundedFields) {
  wire::hello h;
  h.rank = 3;
  h.size = 4;
  h.group_id = 9;
  h.epoch = 2;
  h.nonce = auth::random_bytes(32);
  h.auth_proof = bytes(32, std::byte{5});
  auto frame = wire::encode_hello(h);
  wire::hello back;
  ASSERT_EQ(wire::decode_hello(std::span(frame).subspan(wire::prefix_bytes), back), "");
  EXPECT_EQ(back.nonce, h.nonce);
  EXPECT_EQ(back.auth_proof, h.auth_proof);
  EXPECT_EQ(back.rank, 3u);

  wire::auth a;
  a.proof = bytes(32, std::byte{1});
  a.refusal = std::string(1000, 'r'); // truncated to max_refusal_bytes by the encoder
  frame = wire::encode_auth(a);
  wire::auth got;
  ASSERT_EQ(wire::decode_auth(std::span(frame).subspan(wire::prefix_bytes), got), "");
  EXPECT_EQ(got.proof, a.proof);
  EXPECT_EQ(got.refusal, std::string(wire::max_refusal_bytes, 'r'));

  h.nonce = bytes(wire::max_data_bytes + 1, std::byte{1});
  frame = wire::encode_hello(h);
  EXPECT_NE(wire::decode_hello(std::span(frame).subspan(wire::prefix_bytes), back)
                .find("its nonce has 65 bytes, at most 64"),
            std::string::npos);
}

// -- the mesh handshake --------------------------------------------------------------------------

TEST(TcpAuthTest, MatchingSecretsFormTheMeshAndCarryMessages) {
  constexpr int n = 4;
  std::vector<context_ptr> ctxs(n);
  std::vector<std::string> addresses(n);
  for (int r = 0; r < n; ++r) {
    ctxs[r] = listen_rank(mesh_options_for(r, n, test_secret));
    ASSERT_TRUE(ctxs[r]);
    addresses[r] = ctxs[r]->listen_address();
  }
  auto errors = connect_all(ctxs, addresses);
  for (int r = 0; r < n; ++r)
    ASSERT_FALSE(errors[r]) << "rank " << r << ": " << text_of(errors[r]);
  for (int a = 0; a < n; ++a)
    for (int b = 0; b < n; ++b)
      if (a != b)
        expect_message(*ctxs[a], *ctxs[b], static_cast<uint64_t>(a * n + b));
}

TEST(TcpAuthTest, AWrongSecretIsRefusedOnBothSidesWithAClearError) {
  log_capture log0, log1;
  auto o0 = mesh_options_for(0, 2, "right secret");
  o0.log = log0.sink();
  o0.connect_timeout = 500ms; // rank 1 refuses at once; rank 0 waits for it until then
  auto o1 = mesh_options_for(1, 2, "wrong secret");
  o1.log = log1.sink();
  auto r0 = listen_rank(o0);
  auto r1 = listen_rank(o1);
  ASSERT_TRUE(r0 && r1);
  auto errors = connect_all({r0, r1}, {r0->listen_address(), r1->listen_address()});
  // The connector finds the acceptor's proof wrong and fails at once, proving nothing itself.
  EXPECT_TRUE(has_error(errors[1], errc::peer_lost,
                        {"rank 1 cannot form its mesh", "rank 0 at " + r0->listen_address(),
                         "authentication failed", "proof of the shared secret does not match"}));
  // The acceptor logs why (the connector's refusal) and names it when its deadline passes.
  EXPECT_TRUE(log0.wait_for({"refused the connection from 127.0.0.1:", "authentication failed",
                             "rank 1 did not accept this rank's proof of the shared secret"}))
      << log0.all();
  EXPECT_TRUE(has_error(errors[0], errc::collective_timeout,
                        {"rank 1", "has not connected", "authentication failed"}));
}

TEST(TcpAuthTest, ASecretOnOneSideOnlyIsRefusedOnBothSides) {
  for (bool acceptor_has_it : {true, false}) {
    SCOPED_TRACE(acceptor_has_it ? "only the acceptor has a secret"
                                 : "only the connector has a secret");
    log_capture log0;
    auto o0 = mesh_options_for(0, 2, acceptor_has_it ? test_secret : "");
    o0.log = log0.sink();
    o0.connect_timeout = 500ms;
    auto r0 = listen_rank(o0);
    auto r1 = listen_rank(mesh_options_for(1, 2, acceptor_has_it ? "" : test_secret));
    ASSERT_TRUE(r0 && r1);
    auto errors = connect_all({r0, r1}, {r0->listen_address(), r1->listen_address()});
    auto connector_says = acceptor_has_it ? "rank 0 has a shared secret (its hello carries a "
                                            "nonce) but this rank has none"
                                          : "rank 0 has no shared secret (its hello carries no "
                                            "nonce), which this rank requires";
    auto acceptor_says = acceptor_has_it ? "rank 1 has no shared secret (its hello carries no "
                                           "nonce), which this rank requires"
                                         : "rank 1 has a shared secret (its hello carries a "
                                           "nonce) but this rank has none";
    EXPECT_TRUE(has_error(errors[1], errc::peer_lost, {"authentication failed", connector_says}));
    EXPECT_TRUE(log0.wait_for({"refused the connection", acceptor_says})) << log0.all();
    EXPECT_TRUE(has_error(errors[0], errc::collective_timeout, {"rank 1", acceptor_says}));
  }
}

TEST(TcpAuthTest, AReplayedHandshakeIsRefused) {
  log_capture log;
  auto o0 = mesh_options_for(0, 2, test_secret);
  o0.log = log.sink();
  auto r0 = listen_rank(o0);
  auto r1 = listen_rank(mesh_options_for(1, 2, test_secret));
  ASSERT_TRUE(r0 && r1);
  // Rank 1 reaches rank 0 through a proxy that records what rank 1 sends.
  recording_proxy proxy(r0->listen_address());
  auto errors = connect_all({r0, r1}, {proxy.address(), r1->listen_address()});
  ASSERT_FALSE(errors[0]) << text_of(errors[0]);
  ASSERT_FALSE(errors[1]) << text_of(errors[1]);
  expect_message(*r1, *r0, 1);
  auto handshake = proxy.recorded(2); // the hello and the authentication frame
  ASSERT_TRUE(handshake);
  wire::hello recorded_hello;
  ASSERT_EQ(wire::decode_hello(std::span((*handshake)[0]).subspan(4), recorded_hello), "");
  EXPECT_EQ(recorded_hello.nonce.size(), auth::nonce_bytes);

  // Replayed to the same acceptor, and to a fresh acceptor of the same group (rank 0 restarted,
  // with no rank 1 yet): the recorded proof was made for another acceptor nonce.
  log_capture fresh_log;
  auto fresh_opts = mesh_options_for(0, 2, test_secret);
  fresh_opts.log = fresh_log.sink();
  auto fresh = listen_rank(fresh_opts);
  ASSERT_TRUE(fresh);
  for (auto* target : {r0.get(), fresh.get()}) {
    auto& target_log = target == r0.get() ? log : fresh_log;
    mesh_stranger replay(target->listen_address());
    replay.write((*handshake)[0]);
    replay.write((*handshake)[1]);
    EXPECT_TRUE(replay.closed_by_peer());
    EXPECT_TRUE(target_log.wait_for(
        {"refused the connection from 127.0.0.1:" + std::to_string(replay.local_port()),
         "authentication failed: the proof of rank 1 does not match the shared secret"}))
        << target_log.all();
  }
  // The real connection is untouched.
  expect_message(*r0, *r1, 2);
}

TEST(TcpAuthTest, AnAcceptorsProofReflectedBackIsRefused) {
  log_capture log;
  auto o0 = mesh_options_for(0, 2, test_secret);
  o0.log = log.sink();
  auto r0 = listen_rank(o0);
  ASSERT_TRUE(r0);
  mesh_stranger stranger(r0->listen_address());
  stranger.hello(1, 2, auth::random_bytes(32));
  wire::hello reply;
  ASSERT_TRUE(stranger.read_hello(reply));
  ASSERT_EQ(reply.auth_proof.size(), auth::mac_bytes);
  stranger.send_auth(reply.auth_proof); // its own proof, as if it were the connector's
  EXPECT_TRUE(stranger.closed_by_peer());
  EXPECT_TRUE(log.wait_for(
      {"refused the connection from 127.0.0.1:" + std::to_string(stranger.local_port()),
       "the proof of rank 1 does not match"}))
      << log.all();
}

TEST(TcpAuthTest, AProofMadeForAnotherGroupDoesNotVerify) {
  // Rank 0 of group 7 and a rank 1 of group 8 share the secret. A relay rewrites the group in
  // both hellos, so that each side sees its own group: the proofs, which bind the group, fail.
  auto r0 = listen_rank(mesh_options_for(0, 2, test_secret));
  auto o1 = mesh_options_for(1, 2, test_secret);
  o1.group_id = 8;
  auto r1 = listen_rank(o1);
  ASSERT_TRUE(r0 && r1);
  asio::io_context io;
  asio_tcp::acceptor relay(io, {asio::ip::make_address("127.0.0.1"), 0});
  auto relay_address = "127.0.0.1:" + std::to_string(relay.local_endpoint().port());
  auto connected = std::async(std::launch::async, [&] {
    return r1->connect({relay_address, r1->listen_address()});
  });
  asio_tcp::socket from_r1(io);
  ASSERT_TRUE(accept_within(relay, from_r1, 10s));
  mesh_stranger to_r0(r0->listen_address());
  auto relay_hello = [](asio_tcp::socket& in, auto&& forward, uint64_t group) {
    std::array<std::byte, 4> prefix{};
    asio::read(in, asio::buffer(prefix));
    uint32_t length = 0;
    EXPECT_EQ(wire::decode_length(prefix, length), "");
    bytes body(length);
    asio::read(in, asio::buffer(body));
    wire::hello h;
    EXPECT_EQ(wire::decode_hello(body, h), "");
    h.group_id = group;
    forward(wire::encode_hello(h));
  };
  relay_hello(
      from_r1, [&](const bytes& frame) { to_r0.write(frame); }, test_group);
  wire::hello reply;
  ASSERT_TRUE(to_r0.read_hello(reply));
  reply.group_id = 8;
  asio::write(from_r1, asio::buffer(wire::encode_hello(reply)));
  EXPECT_TRUE(has_error(connected.get(), errc::peer_lost,
                        {"authentication failed", "proof of the shared secret does not match"}));
}

// -- strangers while a collective runs -----------------------------------------------------------

/// A cluster of `n` members formed with the secret (membership at the chief, then the mesh), as
/// multi_worker_mirrored_strategy forms it, in one process.
class AuthClusterTest : public ::testing::Test {
protected:
  static constexpr int n = 3;

  void SetUp() override {
    for (int r = 0; r < n; ++r) {
      auto opts = mesh_options_for(r, n, test_secret);
      opts.log = logs.sink();
      mesh.push_back(listen_rank(opts));
      ASSERT_TRUE(mesh.back());
    }
    for (int r = 0; r < n; ++r) {
      membership::options opts;
      for (int i = 0; i < n; ++i)
        opts.tasks.push_back({"worker", i});
      opts.rank = r;
      opts.chief_address = r == 0 ? "127.0.0.1:0" : members[0]->listen_address();
      opts.address = mesh[r]->listen_address();
      opts.devices = {{"CPU:0", false, 0}};
      opts.secret = test_secret;
      opts.rendezvous_timeout = 10s;
      opts.handshake_timeout = 2s;
      opts.log = logs.sink();
      auto svc = membership::service::start(opts);
      ASSERT_TRUE(svc) << text_of(svc.error());
      members.push_back(std::move(*svc));
    }
    std::vector<std::future<caf::expected<membership::view>>> views;
    for (auto& m : members)
      views.push_back(std::async(std::launch::async, [&m] { return m->rendezvous(); }));
    for (auto& f : views) {
      auto v = f.get();
      ASSERT_TRUE(v) << text_of(v.error()) << "\n" << logs.all();
      view = *v;
    }
    std::vector<std::string> addresses;
    for (const auto& m : view.members)
      addresses.push_back(m.address);
    auto errors = connect_all(mesh, addresses);
    for (int r = 0; r < n; ++r)
      ASSERT_FALSE(errors[r]) << "rank " << r << ": " << text_of(errors[r]);
  }

  /// Runs an all-reduce over the mesh: ranks 0..n-2 start it and wait in it for the last rank,
  /// `meanwhile` runs, then the last rank joins; every rank must get the right sums.
  void all_reduce_around(const std::function<void()>& meanwhile) {
    constexpr std::size_t count = 100000; // the ring, in several chunks
    std::vector<std::vector<float>> data(n);
    for (int r = 0; r < n; ++r)
      for (std::size_t i = 0; i < count; ++i)
        data[r].push_back(static_cast<float>((r + 1) * (i % 97)));
    transport::algorithm_options opts;
    opts.timeout = 30s;
    auto run = [&](int r) {
      return transport::all_reduce(mesh[r], data[r].data(), count, consort::dtype::float32,
                                   consort::reduce_op::sum, opts);
    };
    std::vector<std::future<caf::error>> early;
    for (int r = 0; r + 1 < n; ++r)
      early.push_back(std::async(std::launch::async, run, r));
    meanwhile();
    auto last = run(n - 1);
    EXPECT_FALSE(last) << text_of(last);
    for (auto& f : early) {
      auto err = f.get();
      EXPECT_FALSE(err) << text_of(err);
    }
    for (int r = 0; r < n; ++r)
      for (std::size_t i = 0; i < count; i += 997)
        ASSERT_EQ(data[r][i], static_cast<float>(6 * (i % 97))) << "rank " << r << " at " << i;
  }

  log_capture logs;
  std::vector<context_ptr> mesh;
  std::vector<std::unique_ptr<membership::service>> members;
  membership::view view;
};

TEST_F(AuthClusterTest, StrangersOnAMeshPortAreRefusedWhileACollectiveCompletes) {
  all_reduce_around([&] {
    auto port_of = [](const mesh_stranger& s) {
      return std::to_string(s.local_port());
    };
    {
      // Without the secret: a hello without a nonce.
      mesh_stranger s(mesh[0]->listen_address());
      s.hello(2, n, {});
      EXPECT_TRUE(s.closed_by_peer());
      EXPECT_TRUE(logs.wait_for({"refused the connection from 127.0.0.1:" + port_of(s),
                                 "authentication failed: rank 2 has no shared secret"}))
          << logs.all();
    }
    {
      // Without the secret, pretending: a nonce, then a proof it cannot make.
      mesh_stranger s(mesh[0]->listen_address());
      s.hello(2, n, auth::random_bytes(32));
      wire::hello reply;
      ASSERT_TRUE(s.read_hello(reply));
      s.send_auth(auth::random_bytes(32));
      EXPECT_TRUE(s.closed_by_peer());
      EXPECT_TRUE(logs.wait_for({"refused the connection from 127.0.0.1:" + port_of(s),
                                 "the proof of rank 2 does not match the shared secret"}))
          << logs.all();
    }
    {
      // With the secret: it proves it, and checks rank 1's proof, but rank 2 is connected.
      mesh_stranger s(mesh[1]->listen_address());
      auto nonce = auth::random_bytes(32);
      s.hello(2, n, nonce);
      wire::hello reply;
      ASSERT_TRUE(s.read_hello(reply));
      EXPECT_EQ(reply.auth_proof,
                mesh_proof(test_secret, "acceptor", test_group, 1, n, 2, 1, nonce, reply.nonce));
      s.send_auth(mesh_proof(test_secret, "connector", test_group, 1, n, 2, 1, nonce, reply.nonce));
      EXPECT_TRUE(s.closed_by_peer());
      EXPECT_TRUE(logs.wait_for({"refused the connection from 127.0.0.1:" + port_of(s),
                                 "its hello is of rank 2, which is already connected"}))
          << logs.all();
    }
  });
}

TEST_F(AuthClusterTest, StrangersOnTheMembershipPortAreRefusedWhileACollectiveCompletes) {
  all_reduce_around([&] {
    {
      // Without the secret: a Join with no proof.
      membership_stranger s(members[0]->listen_address());
      codec::message m;
      ASSERT_TRUE(s.read(m));
      ASSERT_TRUE(std::holds_alternative<codec::challenge>(m)) << codec::kind_of(m);
      codec::join j;
      j.task = {"worker", 1};
      j.address = "127.0.0.1:1";
      j.devices = {{"CPU:0", false, 0}};
      j.nonce = auth::random_bytes(32);
      s.write(codec::encode(j));
      ASSERT_TRUE(s.read(m));
      ASSERT_TRUE(std::holds_alternative<codec::refusal>(m)) << codec::kind_of(m);
      EXPECT_TRUE(s.closed_by_peer());
      EXPECT_TRUE(logs.wait_for(
          {"refused the Join of worker:1 from 127.0.0.1:" + std::to_string(s.local_port()),
           "presented no proof of the shared secret"}))
          << logs.all();
    }
    log_capture stranger_logs;
    for (const std::string& secret : {std::string("a guessed secret"), test_secret}) {
      // A real service, with a wrong secret and then with the right one (for a taken task).
      membership::options opts;
      for (int i = 0; i < n; ++i)
        opts.tasks.push_back({"worker", i});
      opts.rank = 2;
      opts.chief_address = members[0]->listen_address();
      opts.address = "127.0.0.1:2";
      opts.devices = {{"CPU:0", false, 0}};
      opts.secret = secret;
      opts.rendezvous_timeout = 5s;
      opts.log = stranger_logs.sink();
      auto stranger = membership::service::start(opts);
      ASSERT_TRUE(stranger) << text_of(stranger.error());
      auto refused = (*stranger)->rendezvous();
      ASSERT_FALSE(refused) << "the stranger joined";
      EXPECT_TRUE(has_error(refused.error(), errc::invalid_argument,
                            {"refused by the chief", secret == test_secret
                                                         ? "already a member of this cluster's view"
                                                         : "the shared secret does not match"}));
      EXPECT_TRUE(logs.wait_for(
          {"refused the Join of worker:2",
           secret == test_secret ? "already a member" : "the shared secret does not match"}))
          << logs.all();
    }
  });
}

TEST(MembershipAuthTest, AReplayedJoinIsRefused) {
  log_capture logs;
  auto options = [&](int rank, const std::string& chief) {
    membership::options opts;
    opts.tasks = {{"worker", 0}, {"worker", 1}, {"worker", 2}};
    opts.rank = rank;
    opts.chief_address = chief;
    opts.address = "127.0.0.1:" + std::to_string(21000 + rank);
    opts.devices = {{"CPU:0", false, 0}};
    opts.secret = test_secret;
    opts.rendezvous_timeout = 10s;
    opts.log = logs.sink();
    return opts;
  };
  auto chief = membership::service::start(options(0, "127.0.0.1:0"));
  ASSERT_TRUE(chief) << text_of(chief.error());
  // Worker 1 joins through a proxy that records its Join; worker 2 is not there yet.
  recording_proxy proxy((*chief)->listen_address());
  auto worker = membership::service::start(options(1, proxy.address()));
  ASSERT_TRUE(worker) << text_of(worker.error());
  auto worker_view = std::async(std::launch::async, [&] { return (*worker)->rendezvous(); });
  auto chief_view = std::async(std::launch::async, [&] { return (*chief)->rendezvous(); });
  ASSERT_TRUE(logs.wait_for({"worker:1 (rank 1) joined"})) << logs.all();
  auto recorded = proxy.recorded(1);
  ASSERT_TRUE(recorded);
  // The Join, recorded and replayed as task worker:1 and edited to claim the free worker:2.
  codec::message m;
  ASSERT_EQ(codec::decode(std::span((*recorded)[0]).subspan(codec::prefix_bytes), 1 << 20, m), "");
  ASSERT_TRUE(std::holds_alternative<codec::join>(m)) << codec::kind_of(m);
  auto edited = std::get<codec::join>(m);
  edited.task = {"worker", 2};
  for (const auto& frame : {(*recorded)[0], codec::encode(edited)}) {
    membership_stranger replay((*chief)->listen_address());
    codec::message challenge;
    ASSERT_TRUE(replay.read(challenge));
    replay.write(frame);
    codec::message reply;
    ASSERT_TRUE(replay.read(reply));
    ASSERT_TRUE(std::holds_alternative<codec::refusal>(reply)) << codec::kind_of(reply);
    EXPECT_NE(std::get<codec::refusal>(reply).reason.find(
                  "authentication failed: the shared secret does not match"),
              std::string::npos)
        << std::get<codec::refusal>(reply).reason;
  }
  // The real worker 2 still completes the view.
  auto last = membership::service::start(options(2, (*chief)->listen_address()));
  ASSERT_TRUE(last) << text_of(last.error());
  auto v = (*last)->rendezvous();
  ASSERT_TRUE(v) << text_of(v.error()) << "\n" << logs.all();
  auto cv = chief_view.get();
  ASSERT_TRUE(cv) << text_of(cv.error());
  auto wv = worker_view.get();
  ASSERT_TRUE(wv) << text_of(wv.error());
  EXPECT_EQ(*wv, *v);
}

} // namespace
