#pragma once

// The GPU side of the runtime as the rest of consort sees it: plain C++ with no CUDA header, so
// the actors and tensor code compile the same with and without CUDA. Private (never installed).
//
// In a build without CUDA (CONSORT_WITH_CUDA 0) every function that needs a GPU throws
// error(unsupported) saying that this build has no GPU support; count() is 0.
//
// Streams: each GPU replica thread binds one device and one stream (`replica_binding`), which
// becomes the thread's *current stream*; every copy, and every kernel on the replica's own GPU,
// that consort runs on that thread is queued on it, so a step's work is ordered on its replica's
// stream. Kernels on another GPU (a tensor of GPU:1 reduced on GPU:0's replica thread) run on that
// GPU's per-thread default stream and are finished before the call returns, as on every thread
// that has no binding (whose current stream is CUDA's per-thread default stream). Tensor
// operations that hand bytes to the host (to("CPU:0"), to_vector, item, ==) wait for the copy,
// with a deadline.

#include <consort/nest.hpp>
#include <consort/reduce_op.hpp>
#include <consort/tensor.hpp>

#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace consort::detail::gpu {

/// True when this build has CUDA support (whether or not a GPU is present).
bool built() noexcept;

/// Number of visible GPUs (0 without CUDA support, a driver or a device). Never throws.
int count() noexcept;

/// Why count() is 0 ("this build of consort has no CUDA support", or CUDA's reason).
std::string unavailable_reason();

/// @throws error(unsupported) in a build without CUDA; error(unknown_device) naming how many GPUs
/// there are (or why there are none) unless 0 <= `index` < count().
void require(int index);

/// Binds the calling thread to one GPU for its lifetime: sets the device, creates a non-blocking
/// stream and makes it the thread's current stream. Restores nothing: one per replica thread.
class replica_binding {
public:
  explicit replica_binding(int index);
  ~replica_binding();
  replica_binding(const replica_binding&) = delete;
  replica_binding& operator=(const replica_binding&) = delete;

  int device() const noexcept { return device_; }
  /// The stream as an opaque handle (a cudaStream_t).
  void* stream() const noexcept { return stream_; }
  /// Shares ownership of the stream (its get() is the handle): it is destroyed when the binding
  /// and every holder of this are gone, so another thread may still queue work on it or wait
  /// for it after the replica has stopped.
  std::shared_ptr<void> stream_owner() const noexcept { return owner_; }

  /// Runs the fence, then waits for the work queued on the stream (the end of a step), at most
  /// `timeout`.
  /// @throws what the fence throws; error(device_error) when queued work failed,
  /// error(step_timeout) naming `what`.
  void synchronize(std::chrono::milliseconds timeout, const std::string& what) const;

  /// Called on this thread before any copy on the stream that the thread then waits for (a host
  /// read of a tensor, `to` another device): work that other threads queued on the stream (NCCL
  /// calls) must be seen to have finished, not failed, first. Its exceptions reach the caller.
  void fence(std::function<void()> before_wait);

private:
  int device_ = -1;
  void* stream_ = nullptr;
  std::shared_ptr<void> owner_;
  std::function<void()> fence_;
};

/// Waits for the work queued on `stream` (an opaque cudaStream_t of GPU `device`, possibly
/// another thread's), at most `timeout`.
/// @throws error(device_error) when queued work failed, error(collective_timeout) naming `what`
/// when `timeout` passes first, error(unsupported) in a build without CUDA.
void synchronize_stream(void* stream, int device, std::chrono::milliseconds timeout,
                        const std::string& what);

/// The calling thread's current stream (opaque cudaStream_t; never null in a CUDA build).
void* current_stream() noexcept;

// -- device memory behind tensor storage ---------------------------------------------------------

/// `bytes` of device memory on GPU `index`, zero-filled when `zeroed`. @throws as require().
void* allocate(int index, size_t bytes, bool zeroed);
/// Gives memory back; later reuse waits for the work queued at the time of release on the stream
/// this thread uses for GPU `index` (the replica's stream for its own GPU, else the per-thread
/// default stream of `index`) and on every replica stream of that GPU, so that the thread which
/// happens to drop the last reference never matters.
void release(int index, void* pointer, size_t bytes) noexcept;

/// A copy of `bytes` between host (`device` -1) and GPU memory, ordered on the current stream;
/// returns once the bytes are in place (bounded wait). @throws error(device_error).
void copy(void* dst, int dst_device, const void* src, int src_device, size_t bytes);

// -- kernels on GPU tensors (all inputs on one GPU) ---------------------------------------------

tensor reduce_elementwise(reduce_op op, const std::vector<tensor>& inputs, double mean_divisor);
tensor reduce_axis(reduce_op op, const tensor& input, int64_t axis, bool divide);
tensor concat(const std::vector<tensor>& inputs, int64_t axis, const shape_t& out_shape);
/// Divides every element of a float32/float64 GPU tensor by `divisor` in place (copy-on-write).
void divide(tensor& t, double divisor);

/// `alpha * a + beta * b` element-wise, for floating tensors of one shape and dtype with `a` on
/// a GPU (`b` is copied there first when it is elsewhere), with the host's arithmetic bit for bit
/// (cuda::scaled_sum). On the replica thread of that GPU the kernel is queued on its stream.
tensor scaled_sum(const tensor& a, double alpha, const tensor& b, double beta);
/// `a += beta * b` in place on `a`'s GPU (copy-on-write: a tensor someone else holds is copied
/// first, so that holder keeps its values); as `scaled_sum` otherwise.
void add_scaled_in_place(tensor& a, const tensor& b, double beta);

/// `a[i] += beta * b[i]` for every i, as add_scaled_in_place, in one kernel launch per 16 tensors:
/// every `a[i]` a distinct floating tensor of one dtype on one GPU, each `b[i]` of its shape.
void add_scaled_in_place_many(const std::vector<tensor*>& a, const std::vector<tensor>& b,
                              double beta);

/// Index of the GPU of a canonical device string ("GPU:3" -> 3); -1 for anything else ("CPU:0").
int index_of(const std::string& device) noexcept;

} // namespace consort::detail::gpu
