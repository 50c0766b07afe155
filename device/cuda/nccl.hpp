#pragma once

// NCCL communicators for GPU replicas: the unique id that travels in the membership view, one
// non-blocking `ncclComm_t` per local GPU, the collectives the runtime needs, and waits that always
// have a deadline. Private to consort (never installed, never included by a public header) and
// compiled only when CONSORT_WITH_CUDA is 1.
//
// What each error means for the caller:
// - errc::collective_timeout: init or an operation did not finish before its deadline. The
//   communicators involved were aborted; build new ones (init_group with a new unique_id).
// - errc::peer_lost: NCCL reported ncclRemoteError (a peer process died or the network failed).
//   The communicators were aborted; the group must be rebuilt through membership.
// - errc::device_error: any other NCCL or CUDA failure, with NCCL's own text. The communicator
//   was aborted unless the message says the failure came before NCCL was called.
// - errc::collective_aborted: the communicator was aborted earlier; it can never be used again.
// - errc::invalid_argument, errc::unknown_device, errc::dtype_mismatch: the call was refused
//   before NCCL saw it; the communicator is unchanged.
//
// Non-blocking communicators (ncclConfig_t::blocking = 0) are used throughout, so that no NCCL
// call can block the calling thread forever: NCCL returns ncclInProgress and this layer polls
// ncclCommGetAsyncError until ncclSuccess, an error, or the deadline, then aborts on failure.
//
// Failure recovery: nothing here is process-wide. After an abort, make a new unique_id (on the
// chief), distribute it and call init_group again; the aborted communicators are independent of
// the new ones.

#include <consort/error.hpp>
#include <consort/reduce_op.hpp>
#include <consort/tensor.hpp>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace consort::cuda::nccl {

// -- type and op mapping -------------------------------------------------------------------------

/// The NCCL type of a consort dtype: float32 -> ncclFloat32, float64 -> ncclFloat64, int32 ->
/// ncclInt32, int64 -> ncclInt64, uint8 -> ncclUint8.
/// @throws error(dtype_mismatch) for bool (NCCL has no boolean type; cast to uint8 first).
ncclDataType_t to_nccl(dtype t);

/// The NCCL reduction for `op` on tensors of `t`: SUM -> ncclSum, PROD -> ncclProd, MIN ->
/// ncclMin, MAX -> ncclMax, MEAN -> ncclAvg for float32 and float64.
/// @throws error(dtype_mismatch) for MEAN of an integer dtype: ncclAvg would divide inside NCCL
/// with its own integer rounding, while consort's runtime computes integer means itself (SUM
/// here, then its own division), so the wrapper refuses rather than silently differ. Also for
/// bool, as to_nccl(dtype).
ncclRedOp_t to_nccl(reduce_op op, dtype t);

/// Size of one element of `t` in bytes; 0 for a value that is not an NCCL type.
size_t size_of(ncclDataType_t t) noexcept;

/// nccl-tests' name of `t`: "int8", "uint8", "int32", "uint32", "int64", "uint64", "half",
/// "float", "double", "bfloat16", "f8e4m3", "f8e5m2"; "unknown" otherwise.
const char* to_string(ncclDataType_t t) noexcept;

/// nccl-tests' name of a built-in reduction: "sum", "prod", "max", "min", "avg".
const char* to_string(ncclRedOp_t op) noexcept;

/// The enumerator name of `r`, e.g. "ncclRemoteError".
const char* to_string(ncclResult_t r) noexcept;

/// The consort error code for a failed NCCL result: ncclRemoteError -> peer_lost (a peer is
/// gone), everything else -> device_error.
errc error_code(ncclResult_t r) noexcept;

// -- unique id -----------------------------------------------------------------------------------

/// The 128-byte NCCL bootstrap handle that every rank of one communicator must share. The chief
/// makes it; it travels as bytes in the Cap'n Proto membership view.
///
/// Thread safety: a value; distinct objects may be used from different threads.
class unique_id {
public:
  /// NCCL_UNIQUE_ID_BYTES.
  static constexpr size_t byte_count = NCCL_UNIQUE_ID_BYTES;

  /// All zero bytes: not an id NCCL made; init_group refuses it.
  unique_id() = default;

  /// A fresh id from ncclGetUniqueId (which also starts NCCL's bootstrap root in this process).
  /// Make a new one for every communicator that is built, including after an abort.
  /// @throws error(device_error) with NCCL's text when ncclGetUniqueId fails.
  static unique_id make();

  /// The id whose bytes are `bytes` (what to_bytes() returned on the chief).
  /// @throws error(invalid_argument) when `bytes` is not exactly byte_count long.
  static unique_id from_bytes(std::span<const uint8_t> bytes);

  /// The id's bytes, for the membership view.
  std::vector<uint8_t> to_bytes() const;

  /// The id's bytes without a copy.
  std::span<const uint8_t, byte_count> bytes() const noexcept { return bytes_; }

  /// True when every byte is zero (a default-constructed id).
  bool empty() const noexcept;

  /// The id as NCCL's type.
  ncclUniqueId get() const noexcept;

  friend bool operator==(const unique_id&, const unique_id&) = default;

private:
  std::array<uint8_t, byte_count> bytes_{};
};

class communicator;
class group;

// -- creation ------------------------------------------------------------------------------------

/// Creates the ranks `first_rank` .. `first_rank + devices.size() - 1` of an `nranks`-rank
/// communicator, rank `first_rank + i` on GPU `devices[i]`, all from one thread: non-blocking
/// ncclCommInitRankConfig calls inside ncclGroupStart/ncclGroupEnd, then polling until every
/// rank of the communicator has joined or `timeout` passes. Every rank (in every process) must
/// call this with the same `id` and `nranks`.
///
/// Returns one communicator per entry of `devices`, in the same order.
/// @pre `id` was made by unique_id::make() for this communicator and never used before.
/// @throws error(invalid_argument) when `nranks` < 1, `first_rank` < 0, `first_rank +
/// devices.size()` > `nranks`, `devices` is empty or names a GPU twice, `id` is empty or
/// `timeout` is not positive.
/// @throws error(unknown_device) when a device is not a GPU of this process; the message says
/// how many GPUs there are, or why there are none.
/// @throws error(collective_timeout) when some ranks did not join within `timeout`; the message
/// says how many ranks were expected. The local ranks were aborted.
/// @throws error(device_error) or error(peer_lost) with NCCL's text when init fails; the local
/// ranks were aborted.
std::vector<communicator> init_group(const unique_id& id, int nranks, int first_rank,
                                     const std::vector<int>& devices,
                                     std::chrono::milliseconds timeout);

// -- completion ----------------------------------------------------------------------------------

/// Waits until the work queued on every stream of `work` has finished, polling cudaStreamQuery
/// and ncclCommGetAsyncError (the thread yields, then sleeps up to 1 ms between polls). A null
/// communicator in an entry waits for its stream only.
///
/// On failure every communicator of `work` is aborted (aborted() becomes true) and:
/// @throws error(collective_timeout) naming `what`, `timeout` and the ranks still busy when the
/// deadline passes first.
/// @throws error(peer_lost) for ncclRemoteError and error(device_error) for any other NCCL
/// error or a failed stream, each with NCCL's or CUDA's text.
/// @throws error(collective_aborted) without waiting when a communicator was aborted before.
void wait(const std::vector<std::pair<communicator*, cudaStream_t>>& work,
          std::chrono::milliseconds timeout, const std::string& what);

/// Waits until every ncclCommAbort started by communicator::abort (or by the destructor of a
/// failed communicator) on its helper thread has returned, or `timeout` passes; returns whether
/// none is left. At exit the process waits for them the same way, at most 5 s (an abort held
/// by a kernel that never ends cannot keep the process from ending).
bool wait_for_aborts(std::chrono::milliseconds timeout);

// -- communicator --------------------------------------------------------------------------------

/// One rank of an NCCL communicator on one GPU, owning its non-blocking `ncclComm_t`.
///
/// Operations are queued on the caller's CUDA stream (which must belong to device()) and return
/// once NCCL has enqueued them; wait() (or cudaStream work after them) observes completion.
/// Counts are in elements. With several local ranks in one process, issue each operation for
/// every local communicator inside one `group`, as NCCL requires for one thread driving several
/// GPUs.
///
/// After abort() (by the caller, or by a failed wait, group or operation) the communicator is
/// dead: aborted() is true and every operation throws error(collective_aborted).
///
/// The destructor destroys a healthy communicator (ncclCommDestroy) and aborts one that saw an
/// error (ncclCommAbort); neither waits for peers, and both wait for this rank's operations
/// (abort stops a running one first), even for non-blocking communicators. Move-only.
///
/// Thread safety: not thread-safe. One thread at a time may use a communicator (NCCL's own rule
/// for a communicator); it must not be moved or destroyed while a `group` that used it is open.
class communicator {
public:
  // -- constructors, destructors, assignment operators ------------------------------------------

  /// An empty communicator; every operation on it throws error(invalid_argument).
  communicator() = default;
  ~communicator();
  communicator(communicator&& other) noexcept;
  communicator& operator=(communicator&& other) noexcept;
  communicator(const communicator&) = delete;
  communicator& operator=(const communicator&) = delete;

  // -- properties -------------------------------------------------------------------------------

  /// This rank in [0, size()).
  int rank() const noexcept { return rank_; }
  /// Number of ranks of the communicator.
  int size() const noexcept { return size_; }
  /// The GPU this rank runs on.
  int device() const noexcept { return device_; }
  /// True after abort(); the communicator can never be used again.
  bool aborted() const noexcept { return aborted_; }
  /// True when the communicator holds a live NCCL communicator.
  bool valid() const noexcept { return comm_ != nullptr && !aborted_; }
  /// The NCCL handle (nullptr when empty or aborted), for benchmarks that call NCCL directly.
  /// Calls made on it bypass this class's bookkeeping.
  ncclComm_t get() const noexcept { return comm_; }
  /// Deadline for NCCL to accept an operation (connection setup to peers happens then) and for
  /// a group to launch; the init timeout unless changed.
  std::chrono::milliseconds timeout() const noexcept { return timeout_; }
  void timeout(std::chrono::milliseconds value) noexcept { timeout_ = value; }
  /// "rank 0 of 2 on GPU:0", for messages.
  std::string describe() const;

  // -- collectives (consort types) ------------------------------------------------------------

  /// All-reduce of `count` elements of `send` into `recv` (in place when equal).
  /// @throws error(dtype_mismatch) as to_nccl(reduce_op, dtype); the errors listed above.
  void all_reduce(const void* send, void* recv, size_t count, dtype t, reduce_op op,
                  cudaStream_t stream);

  /// All-gather: every rank contributes `send_count` elements; rank i's land at `recv` +
  /// i * send_count (recv holds size() * send_count elements).
  void all_gather(const void* send, void* recv, size_t send_count, dtype t, cudaStream_t stream);

  /// Broadcast of `count` elements from rank `root`'s `send` into every rank's `recv` (`send` is
  /// read on the root only and may be null elsewhere).
  /// @throws error(invalid_argument) when `root` is not in [0, size()).
  void broadcast(const void* send, void* recv, size_t count, dtype t, int root,
                 cudaStream_t stream);

  /// Reduce of `count` elements into rank `root`'s `recv` (`recv` may be null elsewhere).
  /// @throws error(invalid_argument) when `root` is not in [0, size()).
  void reduce(const void* send, void* recv, size_t count, dtype t, reduce_op op, int root,
              cudaStream_t stream);

  /// All-gather with a different element count per rank: rank i contributes `counts[i]` elements
  /// (this rank's are read from `send`) and they land at `recv` + counts[0] + ... + counts[i-1].
  ///
  /// Implementation: this rank's own part is a cudaMemcpyAsync on `stream` (skipped when `send`
  /// already is that place in `recv`); the others come with one ncclSend/ncclRecv pair per peer
  /// in an NCCL group (ranks with count 0 send nothing). It moves exactly the bytes that
  /// are needed, with no padded buffer and no compaction copy, at the cost of n - 1 messages per
  /// rank instead of a ring's pipelining. Inside an open `group` the sends and receives join it.
  /// @throws error(invalid_argument) when counts.size() != size().
  void all_gather_ragged(const void* send, const std::vector<size_t>& counts, void* recv, dtype t,
                         cudaStream_t stream);

  /// Point-to-point: queues a send of `count` elements to rank `peer`, which must queue the
  /// matching recv. Pairs that must progress together belong in one `group`.
  /// @throws error(invalid_argument) when `peer` is not in [0, size()).
  void send(const void* buffer, size_t count, dtype t, int peer, cudaStream_t stream);
  void recv(void* buffer, size_t count, dtype t, int peer, cudaStream_t stream);

  // -- collectives (NCCL types, for benchmarks: ncclBfloat16, ncclFloat16, ...) -----------------

  void all_reduce(const void* send, void* recv, size_t count, ncclDataType_t t, ncclRedOp_t op,
                  cudaStream_t stream);
  void all_gather(const void* send, void* recv, size_t send_count, ncclDataType_t t,
                  cudaStream_t stream);
  void broadcast(const void* send, void* recv, size_t count, ncclDataType_t t, int root,
                 cudaStream_t stream);
  void reduce(const void* send, void* recv, size_t count, ncclDataType_t t, ncclRedOp_t op,
              int root, cudaStream_t stream);
  void all_gather_ragged(const void* send, const std::vector<size_t>& counts, void* recv,
                         ncclDataType_t t, cudaStream_t stream);
  void send(const void* buffer, size_t count, ncclDataType_t t, int peer, cudaStream_t stream);
  void recv(void* buffer, size_t count, ncclDataType_t t, int peer, cudaStream_t stream);

  // -- completion and failure -------------------------------------------------------------------

  /// wait({{this, stream}}, timeout, what).
  void wait(cudaStream_t stream, std::chrono::milliseconds timeout, const std::string& what);

  /// Asks NCCL once, without waiting, whether the communicator has failed asynchronously.
  /// @throws as wait() (after aborting) when it has.
  void check();

  /// Aborts the communicator (ncclCommAbort): operations still running on the GPU are stopped,
  /// and the peers' operations with this rank will fail or time out. Returns at once: NCCL's
  /// abort waits for the GPU work queued before the communicator's operations on their streams,
  /// which a stuck stream can hold for ever, so it runs on a helper thread (see
  /// wait_for_aborts); the communicator is dead (aborted()) when this returns. Device memory its
  /// operations used stays reserved as before (gpu::release orders reuse after the streams).
  /// Idempotent; never throws.
  void abort() noexcept;

private:
  friend std::vector<communicator> init_group(const unique_id&, int, int, const std::vector<int>&,
                                              std::chrono::milliseconds);
  friend void wait(const std::vector<std::pair<communicator*, cudaStream_t>>&,
                   std::chrono::milliseconds, const std::string&);
  friend class group;

  communicator(ncclComm_t comm, int rank, int size, int device, std::chrono::milliseconds timeout)
      : comm_(comm), rank_(rank), size_(size), device_(device), timeout_(timeout) {}

  /// Throws unless the communicator can take an operation named `call`.
  void require_usable(const char* call) const;
  /// Joins the open group, if any; returns whether there is one.
  bool join_group();
  /// Handles the result of NCCL call `call`: waits for ncclInProgress to settle (outside a
  /// group), or aborts and throws on an error.
  void after_call(ncclResult_t result, const char* call, bool in_group);
  /// Polls ncclCommGetAsyncError until it leaves ncclInProgress, within timeout().
  void settle(const char* call);
  /// "<call> on rank r of n on GPU:d failed: <NCCL text>", read before an abort frees the comm.
  std::string failure_text(const char* call, ncclResult_t result) const;

  ncclComm_t comm_ = nullptr;
  int rank_ = -1;
  int size_ = 0;
  int device_ = -1;
  std::chrono::milliseconds timeout_{0};
  bool aborted_ = false;
  // An NCCL call on this communicator failed: the destructor aborts instead of destroying.
  bool failed_ = false;
};

// -- group ---------------------------------------------------------------------------------------

/// An NCCL group (ncclGroupStart in the constructor, ncclGroupEnd in end()): every operation
/// issued by this thread on any communicator until end() is launched together. Needed when one
/// thread drives several local communicators (single-process multi-GPU) and for send/recv pairs
/// that must progress together. Groups nest; NCCL launches at the outermost end.
///
/// end() handles non-blocking communicators: ncclGroupEnd may return ncclInProgress, and end()
/// then polls every communicator used in the group until NCCL has launched the work, within the
/// largest timeout() among them. On failure it aborts all of them and throws as wait().
/// The destructor ends a group that was not ended, swallowing errors (after aborting).
///
/// Thread safety: a group belongs to the thread that made it (NCCL's groups are per thread);
/// create and end it on that thread, innermost first.
class group {
public:
  /// @throws error(device_error) when ncclGroupStart fails.
  group();
  ~group();
  group(const group&) = delete;
  group& operator=(const group&) = delete;

  /// Ends the group (once; later calls do nothing).
  /// @throws error(collective_timeout), error(peer_lost) or error(device_error) as described
  /// above, with the communicators aborted.
  void end();

private:
  friend class communicator;

  /// The innermost open group of this thread, or nullptr.
  static group*& current() noexcept;
  void join(communicator* member);

  group* outer_ = nullptr;
  std::vector<communicator*> members_;
  bool ended_ = false;
};

} // namespace consort::cuda::nccl
