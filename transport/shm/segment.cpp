// The shm transport's segment (segment.hpp): checking a group's options, creating and opening the
// POSIX shared-memory segment, and reading a process's status from /proc for the liveness check.

#include "transport/shm/segment.hpp"

#include <consort/caf_error.hpp>
#include <consort/error.hpp>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

namespace consort::transport::shm::impl {

std::string errno_text(int err) {
  return std::string{std::strerror(err)} + " (errno " + std::to_string(err) + ")";
}

caf::error check_options(const options& opts, int size) {
  if (size < 1)
    return make_caf_error(errc::invalid_argument,
                          "shm transport: a group needs at least 1 rank; got " +
                              std::to_string(size));
  const auto r = opts.ring_bytes;
  if (r < min_ring_bytes || (r & (r - 1)) != 0)
    return make_caf_error(errc::invalid_argument,
                          "shm transport: options.ring_bytes must be a power of two of at least " +
                              std::to_string(min_ring_bytes) + "; got " + std::to_string(r));
  if (opts.liveness_interval.count() <= 0)
    return make_caf_error(errc::invalid_argument,
                          "shm transport: options.liveness_interval must be positive; got " +
                              std::to_string(opts.liveness_interval.count()) + " ms");
  if (opts.spin.count() < 0 || opts.yield_spin.count() < 0)
    return make_caf_error(errc::invalid_argument,
                          "shm transport: options.spin and options.yield_spin must be 0 or more; "
                          "got " +
                              std::to_string(opts.spin.count()) + " and " +
                              std::to_string(opts.yield_spin.count()) + " us");
  return {};
}

caf::expected<segment_ptr> create_segment(const std::string& name, int ranks,
                                          std::size_t ring_bytes) {
  layout l(ranks, ring_bytes);
  int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0 && errno == EEXIST) {
    // A segment of a crashed run with the same name (names carry a fresh nonce: unlikely).
    shm_unlink(name.c_str());
    fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  }
  if (fd < 0)
    return make_caf_error(errc::peer_lost, "shm transport: cannot create shared memory \"" + name +
                                               "\": " + errno_text(errno));
  auto fail = [&](const std::string& what, int err) {
    close(fd);
    shm_unlink(name.c_str());
    return make_caf_error(errc::peer_lost, "shm transport: " + what + " of " +
                                               std::to_string(l.total) + " bytes for \"" + name +
                                               "\" failed: " + errno_text(err));
  };
  if (int err = posix_fallocate(fd, 0, static_cast<off_t>(l.total)); err != 0)
    return fail("reserving /dev/shm space", err);
  void* base = mmap(nullptr, l.total, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  if (base == MAP_FAILED)
    return fail("mapping", errno);
  close(fd);
  auto seg = std::make_shared<segment>(base, l.total, ranks, ring_bytes);
  // The memory is zero (a fresh file): every block is live, every ring empty.
  auto& h = seg->header();
  h.ranks = static_cast<uint32_t>(ranks);
  h.ring_bytes = ring_bytes;
  h.total_bytes = l.total;
  h.magic.store(segment_magic, std::memory_order_release);
  return seg;
}

caf::expected<segment_ptr> open_segment(const std::string& name, int ranks,
                                        std::size_t ring_bytes) {
  layout l(ranks, ring_bytes);
  int fd = shm_open(name.c_str(), O_RDWR, 0600);
  if (fd < 0)
    return make_caf_error(errc::peer_lost, "shm transport: cannot open shared memory \"" + name +
                                               "\": " + errno_text(errno) +
                                               " (are all ranks on one host?)");
  struct stat st {};
  if (fstat(fd, &st) != 0 || static_cast<std::size_t>(st.st_size) != l.total) {
    close(fd);
    return make_caf_error(errc::peer_lost, "shm transport: shared memory \"" + name + "\" has " +
                                               std::to_string(st.st_size) + " bytes; expected " +
                                               std::to_string(l.total));
  }
  void* base = mmap(nullptr, l.total, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  int err = errno;
  close(fd);
  if (base == MAP_FAILED)
    return make_caf_error(errc::peer_lost,
                          "shm transport: mapping \"" + name + "\" failed: " + errno_text(err));
  auto seg = std::make_shared<segment>(base, l.total, ranks, ring_bytes);
  auto& h = seg->header();
  if (h.magic.load(std::memory_order_acquire) != segment_magic ||
      h.ranks != static_cast<uint32_t>(ranks) || h.ring_bytes != ring_bytes)
    return make_caf_error(errc::peer_lost, "shm transport: shared memory \"" + name +
                                               "\" is not a segment of this group (" +
                                               std::to_string(h.ranks) + " ranks, rings of " +
                                               std::to_string(h.ring_bytes) + " bytes)");
  return seg;
}

process_status status_of(int pid) {
  process_status out;
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!in || !std::getline(in, line))
    return out;
  auto close_paren = line.rfind(')');
  if (close_paren == std::string::npos)
    return out;
  std::istringstream fields(line.substr(close_paren + 1));
  std::string state;
  fields >> state;
  // After the state: ppid pgrp session tty_nr tpgid flags minflt cminflt majflt cmajflt utime
  // stime cutime cstime priority nice num_threads itrealvalue starttime (fields 4..22).
  std::string skip;
  for (int i = 4; i < 22; ++i)
    fields >> skip;
  fields >> out.start_time;
  out.exists = true;
  out.zombie = state == "Z" || state == "X";
  return out;
}

} // namespace consort::transport::shm::impl
