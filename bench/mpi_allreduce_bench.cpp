// Open MPI's MPI_Allreduce timed as strategy_collective_bench times consort's ctx.all_reduce, so
// that bench/mpi_peer.sh puts the two side by side in one sitting: float32 sums from 4 B up,
// each call timed on rank 0 after a barrier, p50 and p99 over the iterations, every result checked.
//
//   mpirun -np 2 ./build/bench/mpi_allreduce_bench [--min-bytes 4] [--max-bytes 64M]
//                                                 [--iters 1000] [--warmup 100]
// Rank 0 prints one row per size: bytes, p50 (us), p99 (us), wrong elements.

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace {

std::size_t parse_bytes(const std::string& text) {
  char* end = nullptr;
  double v = std::strtod(text.c_str(), &end);
  std::string unit = end ? end : "";
  double scale = unit == "K" ? 1024.0 : unit == "M" ? 1024.0 * 1024 : unit == "G" ? 1 << 30 : 1.0;
  if (end == text.c_str() || v <= 0 || (!unit.empty() && scale == 1.0)) {
    std::fprintf(stderr, "mpi_allreduce_bench: bad size '%s'; expected e.g. 4, 64K, 1M\n",
                 text.c_str());
    std::exit(2);
  }
  return static_cast<std::size_t>(v * scale);
}

} // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0;
  int size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  std::size_t min_bytes = 4;
  std::size_t max_bytes = std::size_t{64} << 20;
  int iters = 1000;
  int warmup = 100;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string flag = argv[i];
    if (flag == "--min-bytes")
      min_bytes = parse_bytes(argv[i + 1]);
    else if (flag == "--max-bytes")
      max_bytes = parse_bytes(argv[i + 1]);
    else if (flag == "--iters")
      iters = std::max(1, std::atoi(argv[i + 1]));
    else if (flag == "--warmup")
      warmup = std::max(0, std::atoi(argv[i + 1]));
    else {
      if (rank == 0)
        std::fprintf(stderr, "mpi_allreduce_bench: unknown option '%s'\n", flag.c_str());
      MPI_Finalize();
      return 2;
    }
  }
  if (rank == 0) {
    std::printf("# mpi_allreduce_bench np=%d iters=%d warmup=%d dtype=float32 op=sum\n", size,
                iters, warmup);
    std::printf("# %10s %10s %10s %8s\n", "size (B)", "p50 (us)", "p99 (us)", "#wrong");
  }
  int failures = 0;
  for (std::size_t bytes = std::max<std::size_t>(4, min_bytes); bytes <= max_bytes; bytes *= 4) {
    const std::size_t n = bytes / sizeof(float);
    std::vector<float> in(n, static_cast<float>(rank + 1));
    std::vector<float> out(n);
    // Large sizes take fewer iterations, as strategy_collective_bench does.
    const int count = bytes >= (std::size_t{16} << 20) ? std::max(5, iters / 50) : iters;
    std::vector<double> times;
    times.reserve(static_cast<std::size_t>(count));
    for (int it = -warmup; it < count; ++it) {
      MPI_Barrier(MPI_COMM_WORLD);
      auto t0 = std::chrono::steady_clock::now();
      MPI_Allreduce(in.data(), out.data(), static_cast<int>(n), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
      auto t1 = std::chrono::steady_clock::now();
      if (it >= 0)
        times.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
    }
    const float expected = static_cast<float>(size * (size + 1) / 2);
    const auto wrong =
        std::count_if(out.begin(), out.end(), [&](float v) { return v != expected; });
    failures += wrong != 0;
    std::sort(times.begin(), times.end());
    if (rank == 0)
      std::printf("  %10zu %10.2f %10.2f %8ld\n", bytes, times[times.size() / 2],
                  times[std::min(times.size() - 1, times.size() * 99 / 100)],
                  static_cast<long>(wrong));
  }
  MPI_Finalize();
  return failures == 0 ? 0 : 1;
}
