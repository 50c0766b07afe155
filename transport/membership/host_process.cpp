// host_process.hpp: a silent member's process on this host, read from /proc.

#include "transport/membership/host_process.hpp"

#include <dirent.h>

#include <cstdio>
#include <cstring>
#include <string>

namespace consort::transport::membership {

namespace {

/// The state letter of a /proc stat file ("pid (comm) S ..."; comm may hold spaces and
/// parentheses, so the state follows the last ')'), or 0 when the file cannot be read.
char state_of(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "re");
  if (f == nullptr)
    return 0;
  char buf[512];
  const size_t n = std::fread(buf, 1, sizeof buf - 1, f);
  std::fclose(f);
  buf[n] = '\0';
  const char* close = std::strrchr(buf, ')');
  if (close == nullptr || close[1] != ' ' || close[2] == '\0')
    return 0;
  return close[2];
}

} // namespace

const char* to_string(host_process p) noexcept {
  switch (p) {
  case host_process::gone:
    return "gone";
  case host_process::stopped:
    return "stopped";
  case host_process::held_up:
    return "held up";
  case host_process::asleep:
    return "asleep";
  }
  return "unknown";
}

host_process probe_host_process(uint32_t pid) {
  if (pid == 0)
    return host_process::gone;
  const std::string base = "/proc/" + std::to_string(pid);
  const char process = state_of(base + "/stat");
  switch (process) {
  case 0:
  case 'Z':
  case 'X':
  case 'x':
    return host_process::gone;
  case 'T':
  case 't':
    return host_process::stopped;
  default:
    break;
  }
  // The heartbeats come from one thread of many: any thread runnable (R) or in an
  // uninterruptible wait (D) says the process is held up by the host.
  bool held = process == 'R' || process == 'D';
  if (DIR* tasks = ::opendir((base + "/task").c_str())) {
    while (const dirent* e = ::readdir(tasks)) {
      if (e->d_name[0] == '.')
        continue;
      const char s = state_of(base + "/task/" + e->d_name + "/stat");
      if (s == 'R' || s == 'D') {
        held = true;
        break;
      }
    }
    ::closedir(tasks);
  }
  return held ? host_process::held_up : host_process::asleep;
}

bool peer_on_this_host(const boost::asio::ip::tcp::socket& socket) {
  boost::system::error_code ec;
  const auto remote = socket.remote_endpoint(ec);
  if (ec)
    return false;
  const auto local = socket.local_endpoint(ec);
  if (ec)
    return false;
  return remote.address().is_loopback() || remote.address() == local.address();
}

} // namespace consort::transport::membership
