// checkpoint_bench: the write and read speed of checkpoint files (include/consort/checkpoint.hpp)
// for the training demo's 3 x 1024 model, against dd writing and reading as many bytes on the same
// disk.
//
// Usage: ./build/bench/checkpoint_bench [--dir DIR] [--hidden N] [--layers N] [--iters N]
//   --dir     where the files go (default: the current directory; pick the disk to measure)
//   --hidden  units per hidden layer (1024), --layers hidden layers (3): the MLP 16 -> L x H -> 4
//   --iters   timed repetitions of each operation (10), after one untimed
//
// Expected output (the figures depend on the disk):
//   # consort checkpoint_bench  dir=. model=16->3x1024->4 tensors=8 bytes=8474640 iters=10
//   #  operation                         bytes     p50 (ms)   p99 (ms)   MB/s (p50)
//     checkpoint save (fsync, rename)    8475237      ...
//     dd write (conv=fsync)              ...
//     checkpoint load (verify CRC32C)    ...
//     dd read (page cache)               ...
//     dd start alone (count=0)           ...
//
// A save writes the file, fsyncs it, renames it into place and fsyncs the directory; a load reads
// it back and checks every tensor's CRC32C. dd writes the file's size rounded up to 1 MiB with
// `conv=fsync` (one fsync at the end, as the save) and reads it back; both reads are from the page
// cache, as a resume right after a save is. dd's times include starting a shell and dd (the last
// row). MB is 1e6 bytes.

#include "common/cli.hpp"

#include <consort/checkpoint.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <random>
#include <string>
#include <vector>

using namespace consort;
using steady = std::chrono::steady_clock;

namespace {

struct options {
  std::string dir = ".";
  int hidden = 1024;
  int layers = 3;
  int iters = 10;
};

options parse(int argc, char** argv) {
  options o;
  cli::parser cmd("checkpoint_bench", "Checkpoints of the training demo's model written and read, "
                                      "beside dd to the same disk.");
  cmd.value("dir", o.dir, "the directory to write in (on the disk to measure)");
  cmd.value("hidden", o.hidden, "units per hidden layer");
  cmd.value("layers", o.layers, "hidden layers");
  cmd.value("iters", o.iters, "writes and reads of each size");
  cmd.parse(argc, argv);
  for (int n : {o.hidden, o.layers, o.iters})
    if (n < 1 || n > 1 << 20)
      cmd.fail("--hidden, --layers and --iters must be counts from 1 to 1048576; got " +
               std::to_string(n));
  return o;
}

/// The demo's MLP parameters, 16 -> layers x hidden -> 4, with random float32 values.
std::vector<named_tensor> model(const options& o) {
  std::mt19937 gen(42);
  std::uniform_real_distribution<float> dist(-1, 1);
  auto random = [&](shape_t shape) {
    tensor t = tensor::zeros(dtype::float32, std::move(shape));
    auto* p = t.mutable_data<float>();
    for (int64_t i = 0; i < t.num_elements(); ++i)
      p[i] = dist(gen);
    return t;
  };
  std::vector<named_tensor> out;
  int64_t in = 16;
  for (int l = 1; l <= o.layers + 1; ++l) {
    const int64_t units = l == o.layers + 1 ? 4 : o.hidden;
    // Appended rather than "w" + std::to_string(l): GCC 12 warns (-Wrestrict) about the latter.
    std::string layer = std::to_string(l);
    out.push_back({std::string{"w"}.append(layer), random({in, units})});
    out.push_back({std::string{"b"}.append(layer), random({units})});
    in = units;
  }
  return out;
}

/// p50 and p99 of `iters` timed runs of `fn` (after one untimed), in milliseconds.
std::pair<double, double> time_ms(int iters, const std::function<void()>& fn) {
  fn();
  std::vector<double> ms;
  for (int i = 0; i < iters; ++i) {
    auto begin = steady::now();
    fn();
    ms.push_back(std::chrono::duration<double, std::milli>(steady::now() - begin).count());
  }
  std::sort(ms.begin(), ms.end());
  auto at = [&](double q) {
    return ms[std::min(ms.size() - 1, static_cast<size_t>(q * static_cast<double>(ms.size())))];
  };
  return {at(0.5), at(0.99)};
}

void run_shell(const std::string& command) {
  if (std::system(command.c_str()) != 0)
    throw std::runtime_error("failed: " + command);
}

void row(const char* name, uint64_t bytes, std::pair<double, double> ms) {
  std::printf("  %-34s %10llu %10.2f %10.2f %12.1f\n", name, static_cast<unsigned long long>(bytes),
              ms.first, ms.second, static_cast<double>(bytes) / 1e6 / (ms.first / 1e3));
}

} // namespace

int main(int argc, char** argv) {
  const options o = parse(argc, argv);
  try {
    std::filesystem::create_directories(o.dir);
    const auto tensors = model(o);
    uint64_t payload = 0;
    for (const auto& t : tensors)
      payload += t.value.num_bytes();
    const std::string file = o.dir + "/checkpoint_bench.safetensors";
    const std::string dd_file = o.dir + "/checkpoint_bench.dd";
    std::printf("# consort checkpoint_bench  dir=%s model=16->%dx%d->4 tensors=%zu bytes=%llu "
                "iters=%d\n",
                o.dir.c_str(), o.layers, o.hidden, tensors.size(),
                static_cast<unsigned long long>(payload), o.iters);
    std::printf("#  %-34s %10s %10s %10s %12s\n", "operation", "bytes", "p50 (ms)", "p99 (ms)",
                "MB/s (p50)");
    checkpoint_metadata meta;
    auto save = time_ms(o.iters, [&] { save_checkpoint(file, tensors, meta); });
    const auto bytes = static_cast<uint64_t>(std::filesystem::file_size(file));
    row("checkpoint save (fsync, rename)", bytes, save);
    // dd writes the file's size in 1 MiB blocks (rounded up), fsynced once at the end. Its times
    // include starting a shell and dd, shown alone on the last row.
    constexpr uint64_t mib = uint64_t{1} << 20;
    const uint64_t dd_bytes = (bytes + mib - 1) / mib * mib;
    auto dd_write = time_ms(o.iters, [&] {
      run_shell("dd if=/dev/zero of='" + dd_file +
                "' bs=1M count=" + std::to_string(dd_bytes / mib) + " conv=fsync status=none");
    });
    row("dd write (conv=fsync)", dd_bytes, dd_write);
    size_t checked = 0;
    auto load = time_ms(o.iters, [&] { checked = load_checkpoint(file).tensors.size(); });
    row("checkpoint load (verify CRC32C)", bytes, load);
    auto dd_read = time_ms(
        o.iters, [&] { run_shell("dd if='" + dd_file + "' of=/dev/null bs=1M status=none"); });
    row("dd read (page cache)", dd_bytes, dd_read);
    auto dd_start =
        time_ms(o.iters, [&] { run_shell("dd if=/dev/zero of=/dev/null count=0 status=none"); });
    std::printf("  %-34s %10d %10.2f %10.2f\n", "dd start alone (count=0)", 0, dd_start.first,
                dd_start.second);
    std::filesystem::remove(file);
    std::filesystem::remove(dd_file);
    std::printf("# loaded %zu of %zu tensors, every checksum verified\n", checked, tensors.size());
    std::printf("# save / dd write (p50): %.2f   load / dd read (p50): %.2f\n",
                save.first / dd_write.first, load.first / dd_read.first);
    return checked == tensors.size() ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "checkpoint_bench: %s\n", e.what());
    return 1;
  }
}
