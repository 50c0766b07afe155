#pragma once

// What a silent member's process is doing, when it runs on this host: the liveness check tells a
// process that waits for a CPU (a loaded machine) from one that is stopped or hung
// (docs/multi_worker.md, "Hung and stopped workers").

#include <boost/asio/ip/tcp.hpp>

#include <cstdint>

namespace consort::transport::membership {

/// The state of a process on this host, from /proc.
enum class host_process {
  /// No such process here (or a zombie): it is gone, or the pid is not this host's.
  gone,
  /// Stopped or traced (SIGSTOP, a debugger): it runs no more until someone continues it.
  stopped,
  /// Some thread of it is runnable or in an uninterruptible wait: it waits for a CPU (or the
  /// disk), held up by the host, not by itself.
  held_up,
  /// Every thread of it sleeps: it could send a heartbeat if it meant to.
  asleep,
};

const char* to_string(host_process p) noexcept;

/// Reads /proc/PID/task/*/stat (/proc/PID/stat when the tasks cannot be listed).
host_process probe_host_process(uint32_t pid);

/// Whether the peer of `socket` runs on this host, in this network namespace: it is connected
/// over loopback, or from this host's own address. False when the socket is closed.
bool peer_on_this_host(const boost::asio::ip::tcp::socket& socket);

} // namespace consort::transport::membership
