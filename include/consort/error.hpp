#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>

namespace consort {

/// Error codes of the consort runtime. Every error also carries a message that says what was
/// wrong and what was expected; the code is for programs, the message for people.
enum class errc : uint8_t {
  /// Not an error.
  none = 0,
  /// An argument is malformed: a bad axis, a bad destination, an empty device list.
  invalid_argument,
  /// Tensor shapes do not agree where they must (element-wise reduce, concatenation).
  shape_mismatch,
  /// Tensor dtypes do not agree, or a dtype does not support the operation.
  dtype_mismatch,
  /// Two nested structures differ (keys, lengths, or tensor-versus-container).
  structure_mismatch,
  /// A reduce op name is not one of sum, mean, min, max, prod.
  unknown_reduce_op,
  /// A device string does not name a device of this process.
  unknown_device,
  /// The operation is valid but not available in this build or strategy (for example GPU
  /// replicas in a build without CUDA, or SUM of a plain value under a multi-replica strategy).
  unsupported,
  /// Replicas called different collectives (kind, op, dtype, structure, axis or root) at the same
  /// (step, sequence) position. Every participating replica gets this error.
  collective_mismatch,
  /// A collective did not complete before its deadline; the message names who arrived and who
  /// did not.
  collective_timeout,
  /// A collective was abandoned because a peer replica failed or finished its step without
  /// making the call; the message names that replica and its reason.
  collective_aborted,
  /// The user's step function threw; the message names the replica and the exception text.
  step_failed,
  /// A replica did not finish its step before the strategy's step deadline.
  step_timeout,
  /// A worker of the cluster was lost (crash, kill, partition). The group must be rebuilt
  /// through membership before further collectives.
  peer_lost,
  /// The strategy (or its actor system) was shut down while the call was pending.
  shutdown,
  /// An index is outside its valid range.
  out_of_range,
  /// A wait on a future passed its deadline (the operation itself goes on).
  wait_timeout,
  /// A device call failed: a CUDA runtime or NCCL error (a GPU that is not there is
  /// unknown_device). The message names the call, the device and the library's own error text.
  device_error,
  /// A worker left the group cleanly (its strategy shut down) while this call still needed it:
  /// the call was never started there. The message names the worker and its reason. Calls it
  /// completed before leaving are complete on every worker; later calls need a new group.
  peer_left,
  /// The group of workers changed while the call was in flight (an elastic group lost or gained a
  /// member and re-formed in a new membership epoch): the call failed on every worker of the old
  /// group and never completes. The message names the epoch and the member lost or joined. A
  /// training loop catches it, rolls back to its last commit and goes on in the new group.
  membership_changed,
  /// Stored data failed its checks: a checkpoint file that is truncated, torn or corrupted (a
  /// checksum mismatch, a header that is not the format's). The message names the file, and the
  /// tensor where one is to blame, with what was expected and what was found.
  data_loss,
  /// The operating system refused a file operation (open, write, fsync, rename): a full disk, a
  /// missing directory, no permission. The message names the call, the path and the system's
  /// reason.
  io_error,
};

/// Returns the enumerator name of `code`, e.g. "collective_timeout".
const char* to_string(errc code) noexcept;

/// The exception thrown by consort's blocking calls and stored in its futures.
/// `what()` is the full message; `code()` classifies it.
class error : public std::runtime_error {
public:
  error(errc code, const std::string& message) : std::runtime_error(message), code_(code) {}

  /// The classification of this error.
  errc code() const noexcept { return code_; }

private:
  errc code_;
};

/// Throws `error(code, message)`. Kept out of line so that throwing sites stay small.
[[noreturn]] void throw_error(errc code, const std::string& message);

} // namespace consort
