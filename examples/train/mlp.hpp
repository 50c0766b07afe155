#pragma once

// The model core of the data-parallel training demo: a synthetic classification problem and a
// multi-layer perceptron (ReLU, softmax cross-entropy) with hand-written gradients on float32
// GEMMs.
//
// Everything here works on one replica's sub-batch and returns SUMS over that sub-batch (loss,
// correct predictions, gradients), never means. A driver all-reduces the sums with SUM and
// divides by the global batch size once, so replicas with partial or empty sub-batches weigh
// exactly as many examples as they saw. `forward_backward` is additive over rows: the result for
// a batch equals the sum of the results for any split of it into parts.

#include <consort/nest.hpp>
#include <consort/tensor.hpp>

#include <cstdint>
#include <functional>
#include <string>

namespace consort::train {

// -- synthetic data -------------------------------------------------------------------------------

/// Parameters of `make_dataset`.
struct synthetic_options {
  /// Number of examples (rows).
  int64_t examples = 4096;
  /// Number of features per example; at least 2.
  int features = 16;
  /// Number of classes; at least 2.
  int classes = 4;
  /// Seed of the generator; equal options give equal bytes on every machine.
  uint64_t seed = 42;
};

/// Features and labels of a classification problem, ready for `dataset::from_tensor_slices`.
struct dataset_tensors {
  /// float32 [examples, features].
  tensor x;
  /// int32 [examples], each in [0, classes).
  tensor y;

  /// `{"x": x, "y": y}`, the element structure the training demo batches.
  nest as_nest() const { return nest::dict({{"x", x}, {"y", y}}); }
};

/// A deterministic classification problem that a linear model solves poorly.
///
/// Each class is one arm of a spiral in a 2-D latent plane: class k starts at angle 2πk/classes
/// and winds half a turn outwards, so every arm wraps around its neighbours' and no straight line
/// separates two of them. The latent point is warped by a smooth nonlinear map, embedded into
/// `features` dimensions by a fixed random linear map, and perturbed by noise on every feature.
/// Labels are drawn uniformly at random.
///
/// The generator uses its own PRNG (splitmix64) and its own sine, with no `<random>`
/// distributions and no libm transcendental calls, so the same options give the same bytes with
/// every compiler, standard library and machine.
/// @throws error(invalid_argument) when examples < 0, features < 2 or classes < 2.
dataset_tensors make_dataset(const synthetic_options& options);

// -- the model ------------------------------------------------------------------------------------

/// Layer sizes of the perceptron: `inputs` -> `layers` ReLU layers of `hidden` units -> `classes`.
struct mlp_shape {
  /// Features per example.
  int inputs = 0;
  /// Units of each ReLU hidden layer.
  int hidden = 0;
  /// Number of classes (logits).
  int classes = 0;
  /// Number of hidden layers; at least 1.
  int layers = 1;
};

/// Fresh parameters: a dict of float32 tensors `w1` .. `w{L+1}` and `b1` .. `b{L+1}` for
/// L = `layers`: `w1` [inputs, hidden], `w2` .. `wL` [hidden, hidden], `w{L+1}` [hidden, classes],
/// each `bl` [columns of `wl`]. The hidden layers' weights are He-uniform (±sqrt(6 / fan_in),
/// suited to the ReLU after them), the output layer's Glorot-uniform (±sqrt(6 / (fan_in +
/// fan_out))), biases zero. One splitmix64 stream draws w1, w2, ... in order, row-major, so a
/// given seed gives the same bytes everywhere (examples/train/torch_ddp.py draws the same).
/// @throws error(invalid_argument) when a size is < 1.
nest init_params(const mlp_shape& shape, uint64_t seed);

/// The layer sizes of `params` after checking that it is a parameter dict as `init_params` makes
/// it (exactly the keys w1..w{L+1}, b1..b{L+1}, float32, with agreeing shapes).
/// @throws error(structure_mismatch) for missing or extra keys or a non-dict,
///         error(dtype_mismatch) for a non-float32 leaf, error(shape_mismatch) for bad shapes.
mlp_shape shape_of(const nest& params);

/// The per-batch sums `forward_backward` returns.
struct loss_and_grads {
  /// float32 scalar: the sum over the batch of each example's cross-entropy loss.
  tensor loss_sum;
  /// float32 [rows]: each example's cross-entropy loss (for `reduce(MEAN, axis=0)` reports).
  tensor per_example_loss;
  /// float32 scalar: the number of examples whose highest logit (first on ties) is the label.
  tensor correct;
  /// The gradient of `loss_sum` (the SUM, not the mean) with respect to each parameter: a dict
  /// with the keys and shapes of the parameters, float32.
  nest grads;
};

/// Called by `forward_backward` as soon as the backward pass has produced one layer's gradient
/// sums: `layer` is 1-based (`w{layer}`, `b{layer}`), and the calls come from the output layer
/// down to layer 1, as backpropagation produces them. Data-parallel drivers start the layer's
/// all-reduce here, while the earlier layers are still being computed (DDP's gradient hooks).
/// With `gradient_slots_fn`, the gradients are in the caller's memory and `w_grad` and `b_grad`
/// are default-constructed (invalid) tensors.
using layer_grads_fn = std::function<void(int layer, const tensor& w_grad, const tensor& b_grad)>;

/// Where `forward_backward` writes one layer's gradient sums instead of allocating tensors for
/// them: `w` points to rows x columns floats of `w{layer}`'s shape (row-major), `b` to columns
/// floats. Both must stay valid and untouched by others until the layer's `layer_grads_fn` call.
struct gradient_slot {
  float* w = nullptr;
  float* b = nullptr;
};

/// Asked once per layer, from the output layer down, just before the layer's gradients are
/// computed. Data-parallel drivers return pointers into their all-reduce buckets, so the gradients
/// are written where the collective reads them and need no copy into a bucket (DDP's
/// `gradient_as_bucket_view`).
using gradient_slots_fn = std::function<gradient_slot(int layer)>;

/// One forward and backward pass over a batch: h0 = x, hl = relu(h{l-1}·wl + bl) for each hidden
/// layer, logits = hL·w{L+1} + b{L+1}, loss = logsumexp(logits) - logits[label] (computed stably).
///
/// The matrix products are float32 GEMMs (Eigen, one thread: the caller's), as in any framework;
/// the loss and the softmax are computed in float64 per row. Results are sums over the batch, so
/// the result for a batch equals the sum of the results for its parts up to float32 rounding; a
/// batch of 0 rows gives zero loss, zero correct and zero gradients. The same inputs give the
/// same bytes on every call (no threads, no data-dependent order), with or without `slots`.
///
/// With `slots`, each layer's gradients are written where `slots(layer)` says and the returned
/// `grads` is an empty dict.
/// @pre `params` as `init_params` makes it (checked, see `shape_of`).
/// @throws error(shape_mismatch) unless x is [N, inputs] and y is [N],
///         error(dtype_mismatch) unless x is float32 and y int32,
///         error(invalid_argument) for a label outside [0, classes) or a default-constructed
///         x or y, or a slot with a null pointer, plus `shape_of`'s errors.
loss_and_grads forward_backward(const nest& params, const tensor& x, const tensor& y,
                                const layer_grads_fn& on_layer = {},
                                const gradient_slots_fn& slots = {});

/// The predicted class of each row of x: int32 [N], the index of the highest logit (first on
/// ties). @throws error(shape_mismatch | dtype_mismatch) as `forward_backward` does for x.
tensor predict(const nest& params, const tensor& x);

/// The key of layer `layer`'s weight ("w3") or bias ("b3") in a parameter dict.
std::string weight_key(int layer);
std::string bias_key(int layer);

/// One step of plain SGD from gradient sums: `p -= learning_rate * g / global_batch` for each
/// parameter p and its gradient sum g (float64 arithmetic, stored as float32). Works on any nest
/// of float32 tensors; leaves of `params` that are shared elsewhere are copied first
/// (copy-on-write), so published parameters never change. `train_on` updates its mirrored
/// variables with the library's `sgd` instead (in float32: `p + float(-lr / rows) * g`).
/// @pre `grad_sums` holds gradients of the loss summed over all `global_batch` examples of the
///      step (for example the SUM all-reduce of every replica's `forward_backward(...).grads`).
/// @throws error(invalid_argument) when global_batch < 1,
///         error(structure_mismatch) when the structures differ,
///         error(shape_mismatch | dtype_mismatch) when a pair of leaves differs in shape or is not
///         float32.
void sgd_update(nest& params, const nest& grad_sums, double learning_rate, int64_t global_batch);

// -- the model on a GPU ---------------------------------------------------------------------------

/// `forward_backward` on a GPU: the same model, loss and gradient sums, computed by the demo's CUDA
/// kernels (mlp_kernels.cu: tiled float32 GEMMs with the bias, ReLU and ReLU-mask fused, the loss
/// per row in float64) and queued on `current_cuda_stream()`, the calling GPU replica's stream.
/// It returns once everything is queued, without waiting for the GPU: the gradients and totals
/// are complete in stream order, so a collective or copy queued on the same stream after it
/// reads them (a GPU replica's `ctx.all_reduce` does).
///
/// `params`, `x` (float32 [N, inputs]) and `y` (int32 [N]) must all be on one GPU; `totals` points
/// to 3 floats of that GPU's memory, which receive {loss sum, correct predictions, N}. With
/// `slots` the gradients are written there (device pointers on the same GPU) and the result is an
/// empty dict; without, it is a dict of new GPU tensors. `on_layer` is called as each layer's
/// gradients are queued (`w_grad`/`b_grad` invalid with `slots`). Labels are not read on the host:
/// a label outside [0, classes) makes the totals' loss NaN and its row's gradient 0.
///
/// Results agree with `forward_backward` up to float32 rounding (another summation order and
/// fused multiply-adds in the GEMMs); for given inputs every call gives the same bytes.
/// @throws error(unsupported) in a build without CUDA, error(invalid_argument) when a tensor is not
///         on the GPU of `x`, `totals` or a slot is null, the shape and dtype errors of
///         `forward_backward`, and error(device_error) naming the kernel when a launch fails.
nest forward_backward_gpu(const nest& params, const tensor& x, const tensor& y, float* totals,
                          const gradient_slots_fn& slots = {}, const layer_grads_fn& on_layer = {});

/// Which GEMMs the GPU form runs: "cuBLAS (libcublas.so.13) where every extent is at least 64, the
/// tiled kernel below", "consort's tiled kernel (no cuBLAS: <why>)" (CONSORT_CUBLAS=off, or no
/// cuBLAS to load), or "none (built without CUDA)".
std::string gpu_gemm_backend();

} // namespace consort::train
