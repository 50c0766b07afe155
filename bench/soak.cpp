// Usage:
//   tools/consort-launch -n 4 -- ./build/bench/soak [--steps N] [--seconds S] [--seed K]
//                                                   [--max-elements E] [--check-rss PCT]
//
// A soak of multi_worker_mirrored_strategy: every step is one collective through the public API
// (`strategy.run` + `ctx.all_reduce` / `all_gather` / `broadcast`), its kind and size drawn from a
// seeded generator that every worker runs alike (all-reduce and broadcast of 1..E float32,
// ragged all-gathers of 0-2 rows per replica). Every result is checked element by element
// against values computed locally. Each worker reports its steps/s, and its resident memory, the
// bytes its heap holds for live allocations (glibc's malloc_info) and its open file descriptors
// after the warm-up (the first tenth of the steps, at least 10) and at the end, and for --steps
// runs also from half-way to the end; it exits non-zero on a wrong result, an error, a descriptor
// more at the end than after the warm-up, or (with --check-rss) more resident memory growth than
// PCT percent after the warm-up. The run ends with the strategy's destructor: the clean end of
// every worker is part of the soak.
//
// Output (lines per worker, prefixed by the launcher; bench/README.md has measured figures, X and
// N stand for them here):
//   [worker:0] # consort soak  workers=4 replicas=4 seed=1 steps=1000 ... max_elements=16384
//   [worker:0] soak worker 0: 1000 steps, X steps/s after the warm-up, 0 wrong, 0 errors;
//              rss X MiB -> X MiB (+X %), heap in use X MiB -> X MiB (+X %),
//              fds N -> N
//   [worker:0] soak worker 0: second half: rss ... heap in use ...

#include "common/cli.hpp"

#include <consort/consort.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <random>
#include <string>
#include <vector>

#include <malloc.h>
#include <unistd.h>

using namespace consort;

namespace {

struct options {
  long steps = 1000;
  double seconds = 0; // > 0: run until this many seconds have passed (steps is then a cap)
  uint64_t seed = 1;
  long max_elements = 16384;
  double check_rss = -1; // < 0: report only
};

options parse(int argc, char** argv) {
  options o;
  cli::parser cmd("soak", "Four worker processes, one collective per step through the public API, "
                          "every element checked; run it under tools/consort-launch.");
  cmd.value("steps", o.steps, "steps (a cap when --seconds is given)");
  cmd.value("seconds", o.seconds, "run until this many seconds have passed (0: --steps)");
  cmd.value("seed", o.seed, "seed of the collectives' kinds and sizes");
  cmd.value("max-elements", o.max_elements, "the largest all-reduce and broadcast, in elements");
  cmd.value("check-rss", o.check_rss, "fail when the resident set grew by more percent (<0: off)");
  cmd.parse(argc, argv);
  if (o.steps < 0 || o.seconds < 0 || o.max_elements < 1)
    cmd.fail("--steps and --seconds must be 0 or more, and --max-elements at least 1");
  return o;
}

/// Resident set size in bytes (/proc/self/statm).
double rss_bytes() {
  std::ifstream in("/proc/self/statm");
  long pages = 0, resident = 0;
  in >> pages >> resident;
  return static_cast<double>(resident) * static_cast<double>(sysconf(_SC_PAGESIZE));
}

/// Bytes the process's heap holds for live allocations, over every malloc arena: what glibc has
/// from the system (`<system type="current">`) less its free chunks (`<total type="fast|rest">`),
/// plus its mmapped chunks, read from the totals at the end of malloc_info(3). Unlike the resident
/// set, this does not move with fragmentation or with pages the allocator keeps: a leak shows here.
double heap_in_use() {
  char* buf = nullptr;
  size_t len = 0;
  FILE* out = open_memstream(&buf, &len);
  if (out == nullptr)
    return 0;
  malloc_info(0, out);
  std::fclose(out);
  std::string xml(buf, len);
  std::free(buf);
  // The last occurrence of each is the total over all arenas (each <heap> has its own before it).
  auto last = [&xml](const std::string& open) -> double {
    auto at = xml.rfind(open);
    if (at == std::string::npos)
      return 0;
    auto size = xml.find("size=\"", at);
    return size == std::string::npos ? 0 : std::strtod(xml.c_str() + size + 6, nullptr);
  };
  return last("<system type=\"current\"") - last("<total type=\"fast\"") -
         last("<total type=\"rest\"") + last("<total type=\"mmap\"");
}

/// Open file descriptors (/proc/self/fd, less the one the listing itself holds).
long open_fds() {
  long n = 0;
  for ([[maybe_unused]] const auto& entry : std::filesystem::directory_iterator("/proc/self/fd"))
    ++n;
  return n - 1;
}

/// What the process holds at one point of the run.
struct sample {
  double rss = 0, heap = 0;
  long fds = 0;
  static sample now() { return {rss_bytes(), heap_in_use(), open_fds()}; }
};

/// Growth from `before` to `after` in percent (0 when nothing was measured before).
double growth(double before, double after) {
  return before > 0 ? 100.0 * (after - before) / before : 0.0;
}

/// What step `step` does, the same on every worker.
struct plan {
  collective_kind kind;
  long elements; // all_reduce, broadcast
  int root;      // broadcast
};

plan plan_of(uint64_t seed, long step, long max_elements, int replicas) {
  std::mt19937_64 rng(seed * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(step));
  plan p{};
  p.kind = static_cast<collective_kind>(rng() % 3);
  // Log-uniform sizes: most calls small, some near the maximum.
  double bits = std::log2(static_cast<double>(max_elements));
  p.elements = std::max(1L, static_cast<long>(std::exp2(bits * (rng() % 1001) / 1000.0)));
  p.root = static_cast<int>(rng() % static_cast<uint64_t>(replicas));
  return p;
}

/// Replica r's value at element k of step s: small integers, exact in float32 sums.
float value(int r, long k, long s) {
  return static_cast<float>((r + 1) + (k % 7) + (s % 5));
}

/// Replica r's rows of a ragged all-gather at step s (0, 1 or 2 rows of 2).
int rows_of(int r, long s) {
  return static_cast<int>((r + s) % 3);
}

tensor input(const plan& p, int r, long s) {
  if (p.kind == collective_kind::all_gather) {
    int rows = rows_of(r, s);
    std::vector<float> v(static_cast<size_t>(rows * 2));
    for (size_t k = 0; k < v.size(); ++k)
      v[k] = value(r, static_cast<long>(k), s);
    return tensor::from<float>(v, {rows, 2});
  }
  std::vector<float> v(static_cast<size_t>(p.elements));
  for (long k = 0; k < p.elements; ++k)
    v[static_cast<size_t>(k)] = value(r, k, s);
  return tensor::from<float>(v);
}

/// Counts the wrong elements (or a wrong shape as one) of `got`.
long wrong(const plan& p, const tensor& got, int n, long s) {
  std::vector<float> want;
  std::vector<int64_t> shape;
  switch (p.kind) {
  case collective_kind::all_reduce:
    for (long k = 0; k < p.elements; ++k) {
      float sum = 0;
      for (int r = 0; r < n; ++r)
        sum += value(r, k, s);
      want.push_back(sum);
    }
    shape = {p.elements};
    break;
  case collective_kind::broadcast:
    for (long k = 0; k < p.elements; ++k)
      want.push_back(value(p.root, k, s));
    shape = {p.elements};
    break;
  case collective_kind::all_gather: {
    int64_t rows = 0;
    for (int r = 0; r < n; ++r) {
      rows += rows_of(r, s);
      for (long k = 0; k < rows_of(r, s) * 2; ++k)
        want.push_back(value(r, k, s));
    }
    shape = {rows, 2};
    break;
  }
  }
  if (got.shape() != shape || got.dtype() != dtype::float32)
    return 1;
  auto v = got.to_vector<float>();
  long bad = 0;
  for (size_t k = 0; k < v.size(); ++k)
    bad += v[k] != want[k];
  return bad;
}

} // namespace

int main(int argc, char** argv) {
  auto o = parse(argc, argv);
  long done = 0, bad = 0, errors = 0;
  double secs = 0;
  sample warm, mid, end; // after the warm-up, half-way (--steps runs), at the end
  int rank = 0;
  {
    multi_worker_mirrored_strategy mw;
    rank = mw.worker_rank();
    const int n = mw.num_replicas_in_sync();
    if (rank == 0)
      std::cout << "# consort soak  workers=" << mw.num_workers() << " replicas=" << n
                << " seed=" << o.seed << " steps=" << o.steps << " seconds=" << o.seconds
                << " max_elements=" << o.max_elements << std::endl;
    const long warmup = std::max(10L, o.steps / 10);
    auto start = std::chrono::steady_clock::now();
    auto measured_from = start;
    // With --seconds, worker 0 decides when to stop and every worker learns it in a collective,
    // so that all make the same calls.
    for (long s = 0; s < o.steps; ++s) {
      if (s == warmup) {
        warm = sample::now();
        measured_from = std::chrono::steady_clock::now();
      }
      if (s == o.steps / 2 && s > warmup && o.seconds <= 0)
        mid = sample::now();
      if (o.seconds > 0 && s % 100 == 0) {
        float stop =
            rank == 0 &&
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() >=
                o.seconds;
        auto verdict = mw.run(
            [stop](replica_context& ctx) { return ctx.broadcast(tensor::scalar<float>(stop), 0); });
        if (verdict.values().front().item<float>() != 0)
          break;
      }
      auto p = plan_of(o.seed, s, o.max_elements, n);
      try {
        auto out = mw.run([&p, s](replica_context& ctx) {
          auto x = input(p, ctx.replica_id_in_sync_group(), s);
          switch (p.kind) {
          case collective_kind::all_reduce:
            return ctx.all_reduce("SUM", x);
          case collective_kind::all_gather:
            return ctx.all_gather(x, 0);
          case collective_kind::broadcast:
            break;
          }
          return ctx.broadcast(x, p.root);
        });
        for (const auto& t : out.values())
          bad += wrong(p, t, n, s);
      } catch (const error& e) {
        ++errors;
        std::cout << "soak worker " << rank << ": step " << s << " (" << to_string(p.kind)
                  << "): " << e.what() << std::endl;
        break; // the group is broken: nothing later can succeed
      }
      ++done;
    }
    if (done <= warmup) {
      warm = sample::now();
      measured_from = start;
    }
    secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - measured_from).count();
    end = sample::now();
    auto measured = done > warmup ? done - warmup : done;
    constexpr double mib = 1 << 20;
    char line[640];
    std::snprintf(line, sizeof line,
                  "soak worker %d: %ld steps, %.0f steps/s after the warm-up, %ld wrong, %ld "
                  "errors; rss %.1f MiB -> %.1f MiB (%+.2f %%), heap in use %.2f MiB -> %.2f MiB "
                  "(%+.2f %%), fds %ld -> %ld",
                  rank, done, secs > 0 ? static_cast<double>(measured) / secs : 0.0, bad, errors,
                  warm.rss / mib, end.rss / mib, growth(warm.rss, end.rss), warm.heap / mib,
                  end.heap / mib, growth(warm.heap, end.heap), warm.fds, end.fds);
    std::cout << line << std::endl;
    if (mid.rss > 0) {
      std::snprintf(line, sizeof line,
                    "soak worker %d: second half: rss %.1f MiB -> %.1f MiB (%+.2f %%), heap in use "
                    "%.2f MiB -> %.2f MiB (%+.2f %%)",
                    rank, mid.rss / mib, end.rss / mib, growth(mid.rss, end.rss), mid.heap / mib,
                    end.heap / mib, growth(mid.heap, end.heap));
      std::cout << line << std::endl;
    }
  }
  bool ok = bad == 0 && errors == 0 && end.fds <= warm.fds;
  if (end.fds > warm.fds)
    std::cout << "soak worker " << rank << ": FAILED: " << end.fds - warm.fds
              << " more open descriptors at the end" << std::endl;
  if (o.check_rss >= 0 && growth(warm.rss, end.rss) > o.check_rss) {
    std::cout << "soak worker " << rank << ": FAILED: resident memory grew more than "
              << o.check_rss << " %" << std::endl;
    ok = false;
  }
  return ok ? 0 : 1;
}
