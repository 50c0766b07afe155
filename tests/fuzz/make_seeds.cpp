// Writes the seed corpora of the fuzz targets: valid frames of every message kind, made by the
// real encoders, so that no binary corpus lives in the repository.
//
// Usage: make_seeds WIRE_DIR MEMBERSHIP_DIR
//   WIRE_DIR        gets frames for wire_fuzz (hellos and frame headers, prefix included);
//   MEMBERSHIP_DIR  gets frames for membership_codec_fuzz: one byte that picks the reader's
//                   max_message_bytes (see membership_codec_fuzz.cpp), then the framed message.
// Expected output: "make_seeds: N wire seeds, M membership seeds"; exit status 0.

#include "transport/membership/codec.hpp"
#include "transport/tcp/wire.hpp"

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

namespace wire = consort::transport::tcp::wire;
namespace codec = consort::transport::membership::codec;
namespace membership = consort::transport::membership;
namespace fs = std::filesystem;

using bytes = std::vector<std::byte>;

bytes pattern(std::size_t size, unsigned seed) {
  bytes out(size);
  for (std::size_t i = 0; i < size; ++i)
    out[i] = static_cast<std::byte>((i * 31 + seed * 7 + 1) & 0xff);
  return out;
}

class corpus {
public:
  explicit corpus(fs::path dir) : dir_(std::move(dir)) { fs::create_directories(dir_); }

  void add(const std::string& name, std::span<const std::byte> data) {
    std::ofstream out(dir_ / name, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(data.data()),
              static_cast<std::streamsize>(data.size()));
    if (!out)
      throw std::runtime_error("cannot write " + (dir_ / name).string());
    ++count_;
  }

  int count() const { return count_; }

private:
  fs::path dir_;
  int count_ = 0;
};

void wire_seeds(corpus& out) {
  wire::hello h;
  out.add("hello-default", wire::encode_hello(h));
  h.rank = 3;
  h.size = 8;
  h.group_id = 0x0123456789abcdefull;
  h.epoch = 2;
  out.add("hello-rank3-of8", wire::encode_hello(h));
  h.version = 0xffff;
  h.rank = h.size = 0xffffffffu;
  h.group_id = h.epoch = ~uint64_t{0};
  out.add("hello-max", wire::encode_hello(h));

  std::array<std::byte, wire::max_head_bytes> head{};
  auto add_header = [&](const std::string& name, const wire::header& hd) {
    auto n = wire::encode_header(hd, head);
    out.add(name, std::span<const std::byte>(head.data(), n));
  };
  add_header("header-default", wire::header{});
  add_header("header-small", wire::header{wire::protocol_version, 1, 7, 100});
  add_header("header-large",
             wire::header{wire::protocol_version, 5, uint64_t{1} << 40, uint64_t{1} << 30});
  add_header("header-max", wire::header{0xffff, 0xffffffffu, ~uint64_t{0}, ~uint64_t{0}});
  add_header("header-goodbye",
             wire::header{wire::protocol_version, 2, 0, 12, wire::frame_kind::goodbye});
  add_header("header-abort",
             wire::header{wire::protocol_version, 3, 0, 40, wire::frame_kind::abort});
}

void membership_seeds(corpus& out) {
  // The first byte picks the reader's limit: 3 is the 1 MiB default, 0 is 1 KiB.
  auto add = [&](const std::string& name, const codec::message& m, std::byte limit = std::byte{3}) {
    auto frame = codec::encode(m);
    frame.insert(frame.begin(), limit);
    out.add(name, frame);
  };
  codec::join j;
  j.task = {"worker", 3};
  j.address = "10.0.0.4:7000";
  j.devices = {{"GPU:0", true, uint64_t{80} << 30}, {"CPU:0", false, 0}};
  j.nonce = pattern(32, 1);
  j.auth_proof = pattern(32, 2);
  j.pid = 4242;
  add("join", j);
  add("join-small-limit", j, std::byte{0});
  add("join-empty", codec::join{});

  add("refusal", codec::refusal{{"worker", 1}, "it speaks membership protocol version 2"});

  codec::view_message v;
  v.view.epoch = 3;
  v.view.group_id = 99;
  for (int r = 0; r < 3; ++r) {
    membership::member m;
    m.rank = r;
    m.task = consort::task_id{r == 0 ? "chief" : "worker", r};
    m.address = "host" + std::to_string(r) + ":7000";
    for (int d = 0; d < r + 1; ++d)
      m.devices.push_back({"CPU:" + std::to_string(d), d % 2 == 1, static_cast<uint64_t>(d)});
    v.view.members.push_back(m);
  }
  v.view.nccl_unique_id = pattern(128, 4);
  v.auth_proof = pattern(32, 5);
  add("view", v);
  add("view-empty", codec::view_message{});

  add("heartbeat", codec::heartbeat{1, 2, 3});
  add("leave", codec::leave{1, 2, "shutdown"});
  add("abort", codec::abort{2, "worker:2 (rank 2) missed 5 heartbeats", {1, 2, 3}});
  add("challenge", codec::challenge{pattern(16, 6)});
}

} // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s WIRE_DIR MEMBERSHIP_DIR\n", argv[0]);
    return 2;
  }
  try {
    corpus wire_corpus(argv[1]), membership_corpus(argv[2]);
    wire_seeds(wire_corpus);
    membership_seeds(membership_corpus);
    std::printf("make_seeds: %d wire seeds, %d membership seeds\n", wire_corpus.count(),
                membership_corpus.count());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "make_seeds: %s\n", e.what());
    return 1;
  }
  return 0;
}
