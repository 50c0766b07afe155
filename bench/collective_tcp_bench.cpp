// collective_tcp_bench: all_reduce, all_gather and broadcast between worker processes over the
// TCP transport, in nccl-tests columns, beside two limits measured in the same run between
// ranks 0 and 1 with plain blocking sockets: loopback TCP stream bandwidth and the 8-byte TCP
// ping-pong round trip.
//
// Usage (the cluster comes from TF_CONFIG, which the launcher sets for each worker):
//   tools/consort-launch -n 2 -- ./build/bench/collective_tcp_bench [--max-bytes 64M] [--iters 20]
//       [--large-bytes 16M --large-iters 5] [--ops all_reduce,all_gather,broadcast] [--limits 1]
//       [--json FILE]
// Only rank 0 prints (and writes the JSON, with every sample). An all_gather row of S bytes
// gathers max(1, S/4/N) floats from each of the N ranks. Targets (issue 3, 2 workers on loopback):
//   64 MiB all_reduce busbw >= 0.6 x TCP stream bandwidth; 4 B all_reduce p50 <= 2 x ping-pong.

#include "common.hpp"

#include <consort/caf_error.hpp>
#include <consort/cluster.hpp>
#include <consort/transport/algorithms.hpp>
#include <consort/transport/shm.hpp>
#include <consort/transport/tcp.hpp>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace {

using namespace std::chrono;
using namespace consort;
namespace tr = consort::transport;
using bench::micros;
using bench::summarize;

/// The workers' addresses in rank order: chief:0 (if any), then worker:0, worker:1, ...
std::vector<std::string> worker_addresses(const cluster_resolver& resolver) {
  std::vector<std::string> out;
  const auto spec = resolver.cluster_spec();
  for (const char* job : {"chief", "worker"}) {
    for (auto& name : spec.jobs()) {
      if (name != job)
        continue;
      for (int index : spec.task_indices(name))
        out.push_back(spec.task_address(name, index));
    }
  }
  return out;
}

std::string to_consort_error_text(const caf::error& err) {
  return consort::to_consort_error(err, "").what();
}

[[noreturn]] void die(const std::string& what) {
  std::fprintf(stderr, "collective_tcp_bench: %s\n", what.c_str());
  std::exit(1);
}

void check(const caf::error& err, const std::string& what) {
  if (err)
    die(what + ": " + to_consort_error_text(err));
}

// -- the raw-socket baseline between ranks 0 and 1 -----------------------------------------------

/// A plain TCP connection between ranks 0 and 1. Rank 0 listens on a port the kernel picks (a
/// fixed port could be taken by another program, as by a test running beside this one) and tells
/// rank 1 which one over the transport `ctx`, which both ranks already share.
int raw_connection(int rank, const std::string& rank0_address, tr::context& ctx) {
  auto colon = rank0_address.rfind(':');
  auto host = rank0_address.substr(0, colon);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  if (inet_pton(AF_INET, host == "localhost" ? "127.0.0.1" : host.c_str(), &addr.sin_addr) != 1)
    die("the raw baseline needs an IPv4 address for rank 0, got " + host);
  constexpr uint64_t port_tag = 0x7261770; // received before any collective starts
  const auto until = steady_clock::now() + seconds(30);
  uint16_t port = 0;
  int one = 1;
  if (rank == 0) {
    int listener = ::socket(AF_INET, SOCK_STREAM, 0);
    socklen_t len = sizeof(addr);
    if (::bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
        ::listen(listener, 1) != 0 ||
        ::getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len) != 0)
      die("cannot listen on " + host + " for the raw baseline: " + std::strerror(errno));
    port = ntohs(addr.sin_port);
    auto sent =
        ctx.to(1).send(port_tag, {{reinterpret_cast<const std::byte*>(&port), sizeof(port)}});
    check(sent->wait(until), "telling rank 1 the raw baseline's port");
    int fd = ::accept(listener, nullptr, nullptr);
    ::close(listener);
    if (fd < 0)
      die(std::string{"the raw baseline's accept failed: "} + std::strerror(errno));
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    return fd;
  }
  auto got = ctx.to(0).recv(port_tag, {reinterpret_cast<std::byte*>(&port), sizeof(port)});
  check(got->wait(until), "receiving the raw baseline's port from rank 0");
  addr.sin_port = htons(port);
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0)
    die("cannot connect to rank 0's raw baseline port " + std::to_string(port) + ": " +
        std::strerror(errno));
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  return fd;
}

void write_all(int fd, const void* data, size_t n) {
  auto* p = static_cast<const char*>(data);
  while (n > 0) {
    auto k = ::write(fd, p, n);
    if (k <= 0)
      die("raw baseline write failed");
    p += k;
    n -= static_cast<size_t>(k);
  }
}

void read_all(int fd, void* data, size_t n) {
  auto* p = static_cast<char*>(data);
  while (n > 0) {
    auto k = ::read(fd, p, n);
    if (k <= 0)
      die("raw baseline read failed");
    p += k;
    n -= static_cast<size_t>(k);
  }
}

struct limits {
  double stream_gbs = 0;  // best of several 64 MiB one-way transfers
  double pingpong_us = 0; // p50 round trip of 8 bytes
};

limits measure_limits(int rank, int fd) {
  limits out;
  std::vector<char> buf(size_t{64} << 20);
  char small[8] = {};
  // 8-byte ping-pong: 200 warm-up rounds, then 2000 timed ones.
  std::vector<double> rtts;
  for (int i = 0; i < 2200; ++i) {
    if (rank == 0) {
      auto t0 = steady_clock::now();
      write_all(fd, small, 8);
      read_all(fd, small, 8);
      if (i >= 200)
        rtts.push_back(micros(t0, steady_clock::now()));
    } else {
      read_all(fd, small, 8);
      write_all(fd, small, 8);
    }
  }
  out.pingpong_us = summarize(rtts).p50;
  for (int i = 0; i < 5; ++i) { // stream: rank 0 sends 64 MiB, rank 1 acknowledges with 1 byte
    if (rank == 0) {
      auto t0 = steady_clock::now();
      write_all(fd, buf.data(), buf.size());
      read_all(fd, small, 1);
      double gbs = static_cast<double>(buf.size()) / (micros(t0, steady_clock::now()) * 1e3);
      out.stream_gbs = std::max(out.stream_gbs, gbs);
    } else {
      read_all(fd, buf.data(), buf.size());
      write_all(fd, small, 1);
    }
  }
  return out;
}

} // namespace

int main(int argc, char** argv) {
  bench::options opts("collective_tcp_bench",
                      "all_reduce, all_gather and broadcast of float32 between worker processes "
                      "over TCP, beside raw TCP stream bandwidth and ping-pong latency.");
  opts.add("min-bytes", "4", "smallest size in bytes (suffix K, M, G allowed)");
  opts.add("max-bytes", "64M", "largest size in bytes");
  opts.add("factor", "4", "size multiplier between rows");
  opts.add("warmup", "3", "untimed iterations per size");
  opts.add("iters", "20", "timed iterations per size");
  opts.add("large-bytes", "16M", "sizes from this one on run --large-iters iterations");
  opts.add("large-iters", "0", "timed iterations per size from --large-bytes on (0: --iters)");
  opts.add("ops", "all_reduce,all_gather,broadcast", "collectives to time, comma-separated");
  opts.add("busy-poll", "0", "1: spin in every wait (lowest latency, a busy core per rank)");
  opts.add("chunk-bytes", "2M",
           "algorithm_options::chunk_bytes, the largest chunk of the pipelined algorithms");
  opts.add("window-bytes", "8M",
           "algorithm_options::window_bytes, the receives the ring all-reduce keeps posted ahead");
  opts.add("transport", "tcp",
           "tcp, or shm: shared memory between the ranks (one host), formed over the TCP mesh");
  opts.add("ring-bytes", "1M", "shm: the bytes of each ring");
  opts.add("spin-us", "50", "shm: how long a wait polls before it sleeps (microseconds)");
  opts.add("limits", "1", "1: measure TCP stream bandwidth and ping-pong first (ranks 0 and 1)");
  opts.add("json", "", "rank 0 also writes the results (with every sample) as JSON to this file");
  opts.parse(argc, argv);
  std::vector<std::string> colls;
  {
    std::stringstream in{opts.str("ops")};
    std::string item;
    while (std::getline(in, item, ',')) {
      if (item != "all_reduce" && item != "all_gather" && item != "broadcast")
        opts.fail("unknown collective '" + item + "' in --ops (all_reduce, all_gather, broadcast)");
      colls.push_back(item);
    }
    if (colls.empty())
      opts.fail("--ops is empty");
  }
  const bool with_limits = opts.integer("limits") != 0;

  tf_config_cluster_resolver resolver;
  if (resolver.is_local())
    die("no cluster: run it under tools/consort-launch -n N (which sets TF_CONFIG)");
  const int rank = resolver.worker_rank();
  const int size = resolver.num_workers();
  auto addresses = worker_addresses(resolver);

  tr::tcp::mesh_options mesh;
  mesh.rank = rank;
  mesh.size = size;
  mesh.addresses = addresses;
  mesh.group_id = 0xbe4c;
  mesh.busy_poll = opts.integer("busy-poll") != 0;
  auto made = tr::tcp::connect_mesh(mesh);
  if (!made)
    die("cannot form the TCP mesh: " + to_consort_error_text(made.error()));
  tr::context_ptr ctx = *made;
  const std::string transport = opts.str("transport");
  if (transport == "shm") {
    tr::shm::options shm_opts;
    shm_opts.group_id = mesh.group_id;
    shm_opts.ring_bytes = static_cast<size_t>(opts.bytes("ring-bytes"));
    shm_opts.spin = std::chrono::microseconds{opts.integer("spin-us")};
    auto shm_ctx = tr::shm::connect(*ctx, shm_opts);
    if (!shm_ctx)
      die("cannot form the shared-memory group: " + to_consort_error_text(shm_ctx.error()));
    ctx = *shm_ctx;
  } else if (transport != "tcp") {
    opts.fail("--transport must be tcp or shm; got '" + transport + "'");
  }

  limits lim;
  if (with_limits && size >= 2 && rank <= 1) {
    int fd = raw_connection(rank, addresses[0], *ctx);
    lim = measure_limits(rank, fd);
    ::close(fd);
  }
  uint64_t tag = 1;
  tr::algorithm_options aopts;
  aopts.timeout = seconds(120);
  if (opts.bytes("chunk-bytes") < 1)
    opts.fail("--chunk-bytes must be at least 1");
  aopts.chunk_bytes = static_cast<size_t>(opts.bytes("chunk-bytes"));
  aopts.window_bytes = static_cast<size_t>(opts.bytes("window-bytes"));
  auto barrier = [&] {
    float x = 0;
    aopts.tag = tag++;
    check(tr::all_reduce(ctx, &x, 1, dtype::float32, reduce_op::sum, aopts), "barrier");
  };
  barrier();

  if (rank == 0) {
    std::printf("# consort collective_tcp_bench  transport=%s ranks=%d warmup=%lld iters=%lld "
                "busy_poll=%d chunk_bytes=%zu window_bytes=%zu",
                transport.c_str(), size, static_cast<long long>(opts.integer("warmup")),
                static_cast<long long>(opts.integer("iters")), mesh.busy_poll ? 1 : 0,
                aopts.chunk_bytes, aopts.window_bytes);
    if (opts.integer("large-iters") > 0)
      std::printf(" large_bytes=%lld large_iters=%lld",
                  static_cast<long long>(opts.bytes("large-bytes")),
                  static_cast<long long>(opts.integer("large-iters")));
    std::printf("\n");
    std::printf("# machine: nproc=%u cpu=%s\n", bench::nproc(), bench::cpu_model().c_str());
    if (with_limits)
      std::printf("# limits (rank 0 <-> rank 1, plain blocking sockets, same run): TCP stream "
                  "%.2f GB/s, 8-byte ping-pong p50 %.1f us\n",
                  lim.stream_gbs, lim.pingpong_us);
    std::printf("# time: per iteration on rank 0 after a barrier; GB = 1e9 bytes\n#\n");
  }

  double ar_small_p50 = 0, ar_large_busbw = 0;
  double total_wrong = 0;
  const int64_t warmup = opts.integer("warmup"), iters = opts.integer("iters");
  const int64_t large_bytes = opts.bytes("large-bytes");
  const int64_t large_iters = opts.integer("large-iters") > 0 ? opts.integer("large-iters") : iters;
  std::vector<bench::json_object> json_rows;
  auto json_numbers = [](const std::vector<double>& values) {
    std::ostringstream out;
    out.precision(6);
    out << '[';
    for (size_t i = 0; i < values.size(); ++i)
      out << (i ? "," : "") << values[i];
    out << ']';
    return out.str();
  };
  for (const auto& coll_name : colls) {
    const char* coll = coll_name.c_str();
    if (rank == 0) {
      std::printf("# %s\n#%12s %12s %6s %6s %10s %7s %7s %7s %10s %10s\n", coll, "size", "count",
                  "type", "redop", "time", "algbw", "busbw", "#wrong", "p50", "p99");
      std::printf("#%12s %12s %6s %6s %10s %7s %7s %7s %10s %10s\n", "(B)", "(elements)", "", "",
                  "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(us)");
    }
    for (int64_t bytes = opts.bytes("min-bytes"); bytes <= opts.bytes("max-bytes");
         bytes *= opts.integer("factor")) {
      const auto count = static_cast<size_t>(bytes / 4);
      std::vector<float> buf(count);
      std::vector<std::byte> gathered;
      const size_t per_rank = std::max<size_t>(1, count / static_cast<size_t>(size));
      const int64_t row_iters = bytes >= large_bytes ? large_iters : iters;
      std::vector<double> times;
      int64_t wrong = 0;
      for (int64_t it = 0; it < warmup + row_iters; ++it) {
        std::fill(buf.begin(), buf.end(), static_cast<float>(rank + 1));
        barrier();
        aopts.tag = tag++;
        auto t0 = steady_clock::now();
        caf::error err;
        if (std::string(coll) == "all_reduce") {
          err = tr::all_reduce(ctx, buf.data(), count, dtype::float32, reduce_op::sum, aopts);
        } else if (std::string(coll) == "all_gather") {
          err = tr::all_gather(ctx, std::as_bytes(std::span(buf.data(), per_rank)), gathered,
                               nullptr, aopts);
        } else {
          err = tr::broadcast(ctx, std::as_writable_bytes(std::span(buf)), 0, aopts);
        }
        auto t1 = steady_clock::now();
        check(err, coll);
        if (it >= warmup)
          times.push_back(micros(t0, t1));
        // Check after the clock stopped.
        if (std::string(coll) == "all_reduce") {
          const float want = static_cast<float>(size * (size + 1) / 2);
          for (auto v : buf)
            wrong += v != want;
        } else if (std::string(coll) == "all_gather") {
          auto* f = reinterpret_cast<const float*>(gathered.data());
          for (size_t i = 0; i < per_rank * static_cast<size_t>(size); ++i)
            wrong += f[i] != static_cast<float>(i / std::max<size_t>(per_rank, 1) + 1);
        } else {
          for (auto v : buf)
            wrong += v != 1.0f;
        }
      }
      // Every rank's wrong count, summed on all.
      float w = static_cast<float>(wrong);
      aopts.tag = tag++;
      check(tr::all_reduce(ctx, &w, 1, dtype::float32, reduce_op::sum, aopts), "check");
      total_wrong += static_cast<double>(w);
      auto s = summarize(times);
      double algbw = static_cast<double>(bytes) / (s.avg * 1e3);
      double factor = std::string(coll) == "all_reduce"   ? 2.0 * (size - 1) / size
                      : std::string(coll) == "all_gather" ? double(size - 1) / size
                                                          : 1.0;
      if (std::string(coll) == "all_reduce") {
        if (bytes == opts.bytes("min-bytes"))
          ar_small_p50 = s.p50;
        ar_large_busbw = static_cast<double>(bytes) / (s.avg * 1e3) * factor;
      }
      if (rank == 0)
        std::printf(" %12lld %12zu %6s %6s %10.2f %7.2f %7.2f %7.0f %10.1f %10.1f\n",
                    static_cast<long long>(bytes), count, "float",
                    std::string(coll) == "all_reduce" ? "sum" : "none", s.avg, algbw,
                    algbw * factor, static_cast<double>(w), s.p50, s.p99);
      bench::json_object o;
      o.str("op", coll_name).num("size", bytes).num("count", static_cast<int64_t>(count));
      o.num("iters", row_iters).str("type", "float");
      o.str("redop", coll_name == "all_reduce" ? "sum" : "none");
      o.num("time_us", s.avg).num("algbw", algbw).num("busbw", algbw * factor);
      o.num("wrong", static_cast<int64_t>(w)).num("p50_us", s.p50).num("p99_us", s.p99);
      o.raw("samples_us", json_numbers(times));
      json_rows.push_back(o);
    }
  }
  const bool ran_all_reduce = std::find(colls.begin(), colls.end(), "all_reduce") != colls.end();
  if (rank == 0 && size >= 2 && with_limits && ran_all_reduce) {
    std::printf("#\n# Targets (issue 3, 2 workers on loopback):\n");
    std::printf("#   largest all_reduce busbw %.2f GB/s vs 0.6 x stream %.2f GB/s = %.2f: %s\n",
                ar_large_busbw, lim.stream_gbs, 0.6 * lim.stream_gbs,
                ar_large_busbw >= 0.6 * lim.stream_gbs ? "met" : "NOT MET");
    std::printf("#   smallest all_reduce p50 %.1f us vs 2 x ping-pong %.1f us = %.1f us: %s\n",
                ar_small_p50, lim.pingpong_us, 2 * lim.pingpong_us,
                ar_small_p50 <= 2 * lim.pingpong_us ? "met" : "NOT MET");
  }
  if (rank == 0)
    std::printf("# Out of bounds values : %.0f %s\n", total_wrong,
                total_wrong == 0 ? "OK" : "FAILED");
  bool json_ok = true;
  if (rank == 0 && !opts.str("json").empty()) {
    bench::json_object config;
    config.str("transport", transport).num("ranks", size).num("warmup", warmup).num("iters", iters);
    config.num("large_bytes", large_bytes).num("large_iters", large_iters);
    config.num("busy_poll", mesh.busy_poll ? 1 : 0);
    bench::json_object machine;
    machine.num("nproc", static_cast<int64_t>(bench::nproc())).str("cpu", bench::cpu_model());
    if (with_limits)
      machine.num("tcp_stream_gbs", lim.stream_gbs).num("pingpong_p50_us", lim.pingpong_us);
    bench::json_object doc;
    doc.str("benchmark", "collective_tcp_bench").obj("config", config).obj("machine", machine);
    doc.arr("results", json_rows).num("out_of_bounds", static_cast<int64_t>(total_wrong));
    json_ok = bench::write_json(opts.str("json"), doc);
  }
  barrier();
  // A wrong result anywhere fails the run, so the multi-process test can rely on the exit status.
  return total_wrong == 0 && json_ok ? 0 : 1;
}
