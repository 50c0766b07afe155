// A user's MPI program that also uses consort: it calls MPI_Init, then builds a
// multi_worker_mirrored_strategy, which finds its cluster in the environment Open MPI's mpirun gave
// the process (no TF_CONFIG, no -x). Every collective's result is checked against MPI's own on the
// same values (MPI_Allreduce, MPI_Allgather, MPI_Bcast), so the two libraries must agree on ranks
// and data; then the strategy ends cleanly before MPI_Finalize.
//
// Usage: mpirun -np N mpi_user_job      (tests/multiworker/CMakeLists.txt,
// multiworker.mpi_user_job) Prints "rank R: consort agrees with MPI on K collectives" and exits 0,
// else names the mismatch.

#include <consort/consort.hpp>

#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <exception>
#include <iostream>
#include <string>
#include <vector>

namespace {

/// The values rank `rank` contributes: n floats that differ by rank and position.
std::vector<float> values_of(int rank, int n) {
  std::vector<float> v(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i)
    v[static_cast<size_t>(i)] = static_cast<float>(rank * 1000 + i) * 0.5f;
  return v;
}

int run(int rank, int size) {
  consort::multi_worker_mirrored_strategy strategy;
  int agreed = 0;
  auto expect = [&](bool ok, const std::string& what) {
    if (!ok) {
      std::cout << "rank " << rank << ": MISMATCH: " << what << std::endl;
      return false;
    }
    ++agreed;
    return true;
  };
  if (!expect(strategy.num_workers() == size && strategy.worker_rank() == rank,
              "consort sees worker " + std::to_string(strategy.worker_rank()) + " of " +
                  std::to_string(strategy.num_workers()) + ", MPI rank " + std::to_string(rank) +
                  " of " + std::to_string(size)))
    return 1;
  for (int n : {1, 1000, 100000}) {
    const auto mine = values_of(rank, n);
    std::vector<float> mpi_sum(mine.size());
    MPI_Allreduce(mine.data(), mpi_sum.data(), n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    std::vector<float> mpi_all(mine.size() * static_cast<size_t>(size));
    MPI_Allgather(mine.data(), n, MPI_FLOAT, mpi_all.data(), n, MPI_FLOAT, MPI_COMM_WORLD);
    std::vector<float> mpi_root = mine;
    MPI_Bcast(mpi_root.data(), n, MPI_FLOAT, size - 1, MPI_COMM_WORLD);

    auto out = strategy.run([&](consort::replica_context& ctx) {
      auto t = consort::tensor::from(mine);
      const int last = static_cast<int>(strategy.num_replicas_in_sync()) - 1;
      return consort::nest::dict({{"sum", ctx.all_reduce("SUM", t)},
                                  {"gathered", ctx.all_gather(t, 0)},
                                  {"root", ctx.broadcast(t, last)}});
    });
    const auto& r = out[0];
    const std::string at = " (" + std::to_string(n) + " floats)";
    // The sum's order may differ from MPI's: equal to float32 rounding.
    const auto sum = r["sum"].as_tensor().to_vector<float>();
    bool close = sum.size() == mpi_sum.size();
    for (size_t i = 0; close && i < sum.size(); ++i)
      close = std::abs(sum[i] - mpi_sum[i]) <= 1e-6f * std::max(1.0f, std::abs(mpi_sum[i]));
    if (!expect(close, "all_reduce SUM differs from MPI_Allreduce" + at) ||
        !expect(r["gathered"].as_tensor().to_vector<float>() == mpi_all,
                "all_gather differs from MPI_Allgather" + at) ||
        !expect(r["root"].as_tensor().to_vector<float>() == mpi_root,
                "broadcast from the last worker differs from MPI_Bcast" + at))
      return 1;
  }
  std::cout << "rank " << rank << ": consort agrees with MPI on " << agreed << " checks"
            << std::endl;
  return 0;
}

} // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0;
  int size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  int status = 1;
  try {
    status = run(rank, size);
  } catch (const std::exception& e) {
    std::cout << "rank " << rank << ": FAILED: " << e.what() << std::endl;
  }
  // Every rank's verdict, so that one rank's failure fails them all (mpirun passes on the first).
  int worst = 0;
  MPI_Allreduce(&status, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return worst;
}
