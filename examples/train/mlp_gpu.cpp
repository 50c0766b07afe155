// The training demo's model on a GPU: argument checks and buffers here, kernels in mlp_kernels.cu.

#include "mlp.hpp"
#include "mlp_checks.hpp"

#include <consort/config.hpp>
#include <consort/device.hpp>
#include <consort/error.hpp>

#if CONSORT_WITH_CUDA
#include "mlp_kernels.hpp"
#endif

#include <string>
#include <vector>

namespace consort::train {

namespace {

/// The GPU index of `t`, which must be a GPU tensor on `device` (or any GPU when `device` < 0).
int gpu_of(const tensor& t, const std::string& name, int device, const char* what) {
  if (!t.valid())
    throw_error(errc::invalid_argument,
                std::string{what} + ": " + name + " is a default-constructed tensor");
  const device_spec spec = parse_device(t.device());
  if (spec.kind != device_kind::gpu || (device >= 0 && spec.index != device))
    throw_error(errc::invalid_argument,
                std::string{what} + ": " + name + " is on " + t.device() + "; expected " +
                    (device >= 0 ? "GPU:" + std::to_string(device) : std::string{"a GPU"}) +
                    " (every tensor of the call on the GPU of x)");
  return spec.index;
}

#if !CONSORT_WITH_CUDA
[[noreturn]] void no_cuda(const char* what) {
  throw_error(errc::unsupported,
              std::string{what} + ": this build of the training demo has no CUDA support "
                                  "(configure with CONSORT_WITH_CUDA=ON where nvcc and NCCL are)");
}
#else
void launched(const char* error, const char* kernel, int device, const char* what) {
  if (error != nullptr)
    throw_error(errc::device_error, std::string{what} + ": launching " + kernel +
                                        " on GPU:" + std::to_string(device) + " failed: " + error);
}
#endif

} // namespace

nest forward_backward_gpu(const nest& params, const tensor& x, const tensor& y, float* totals,
                          const gradient_slots_fn& slots, const layer_grads_fn& on_layer) {
  const char* what = "forward_backward_gpu";
  const mlp_shape s = detail::checked_shape(params, what);
  detail::check_batch(x, y, s, what);
  const int device = gpu_of(x, "x", -1, what);
  gpu_of(y, "y", device, what);
  for (const auto& [key, value] : params.as_dict())
    gpu_of(value.as_tensor(), "parameter " + key, device, what);
  if (totals == nullptr)
    throw_error(errc::invalid_argument,
                std::string{what} + ": totals is null; expected 3 floats of GPU memory");
#if !CONSORT_WITH_CUDA
  (void)slots;
  (void)on_layer;
  no_cuda(what);
#else
  void* stream = current_cuda_stream();
  const int64_t rows = x.shape()[0];
  const std::string where = x.device();
  auto weight = [&](int l) {
    return params[weight_key(l)].as_tensor().data<float>();
  };
  auto bias = [&](int l) {
    return params[bias_key(l)].as_tensor().data<float>();
  };
  auto width = [&](int l) {
    return l <= s.layers ? int64_t{s.hidden} : int64_t{s.classes};
  };

  // Forward: acts[l - 1] = relu(acts[l - 2] . w_l + b_l) for the hidden layers (acts[-1] is x),
  // then the logits.
  std::vector<tensor> acts;
  for (int l = 1; l <= s.layers + 1; ++l) {
    const int64_t fan_in = l == 1 ? s.inputs : s.hidden;
    tensor out = tensor::empty(dtype::float32, {rows, width(l)}, where);
    const float* in = l == 1 ? x.data<float>() : acts.back().data<float>();
    launched(kernels::gemm(device, stream, false, false, rows, width(l), fan_in, in, weight(l),
                           out.mutable_data<float>(), bias(l), l <= s.layers, nullptr),
             "the forward GEMM", device, what);
    acts.push_back(std::move(out));
  }
  tensor logits = acts.back();
  acts.pop_back();

  // The loss and d loss / d logits, and the totals.
  tensor delta = tensor::empty(dtype::float32, {rows, s.classes}, where);
  tensor scratch = tensor::empty(dtype::float64, {2 * rows}, where);
  launched(kernels::softmax_cross_entropy(device, stream, rows, s.classes, logits.data<float>(),
                                          y.data<int32_t>(), delta.mutable_data<float>(),
                                          scratch.mutable_data<double>(), totals),
           "the softmax cross-entropy", device, what);

  // Backward, from the output layer down (as forward_backward).
  nest::dict_type grads;
  for (int l = s.layers + 1; l >= 1; --l) {
    const int64_t fan_in = l == 1 ? s.inputs : s.hidden;
    const int64_t fan_out = width(l);
    tensor gw;
    tensor gb;
    const gradient_slot slot =
        detail::place_gradients(slots, l, fan_in, fan_out, where, gw, gb, what, "GPU memory");
    const float* input = l == 1 ? x.data<float>() : acts[static_cast<size_t>(l - 2)].data<float>();
    // w_grad [fan_in, fan_out] = input^T . delta; b_grad = the column sums of delta.
    launched(kernels::gemm(device, stream, true, false, fan_in, fan_out, rows, input,
                           delta.data<float>(), slot.w, nullptr, false, nullptr),
             "the weight-gradient GEMM", device, what);
    launched(kernels::column_sums(device, stream, rows, fan_out, delta.data<float>(), slot.b),
             "the bias-gradient sums", device, what);
    detail::hand_over(l, gw, gb, slots, on_layer, grads);
    if (l > 1) {
      // delta [rows, fan_in] = (delta . w_l^T) where the layer's input unit was active.
      tensor next = tensor::empty(dtype::float32, {rows, fan_in}, where);
      launched(kernels::gemm(device, stream, false, true, rows, fan_in, fan_out,
                             delta.data<float>(), weight(l), next.mutable_data<float>(), nullptr,
                             false, input),
               "the backward GEMM", device, what);
      delta = std::move(next);
    }
  }
  return nest::dict(std::move(grads));
#endif
}

std::string gpu_gemm_backend() {
#if !CONSORT_WITH_CUDA
  return "none (built without CUDA)";
#else
  return kernels::gemm_backend();
#endif
}

} // namespace consort::train
