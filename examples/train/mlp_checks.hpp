#pragma once

// Argument checks and gradient placement that the model's host form (mlp.cpp) and its GPU form
// (mlp_gpu.cpp) share, so that both refuse the same inputs with the same words. Internal to the
// demo's model library.

#include "mlp.hpp"

#include <consort/tensor.hpp>

#include <string>
#include <vector>

namespace consort::train::detail {

/// The shape of `params` (as shape_of), with `what` naming the caller in errors.
mlp_shape checked_shape(const nest& params, const char* what);

/// Checks a batch: x float32 [N, inputs], y int32 [N] (labels are not read: they may live on a
/// GPU). @throws as forward_backward documents.
void check_batch(const tensor& x, const tensor& y, const mlp_shape& shape, const char* what);

/// Where layer `layer`'s gradients go: the caller's slot (`slots` set; a null pointer is
/// error(invalid_argument) naming `memory`, e.g. "GPU memory"), else new tensors `w` [rows, cols]
/// and `b` [cols] on `device`.
gradient_slot place_gradients(const gradient_slots_fn& slots, int layer, int64_t rows, int64_t cols,
                              const std::string& device, tensor& w, tensor& b, const char* what,
                              const char* memory);

/// A layer's gradients are done: kept in `grads` (no `slots`) and announced to `on_layer`.
void hand_over(int layer, const tensor& w, const tensor& b, const gradient_slots_fn& slots,
               const layer_grads_fn& on_layer, nest::dict_type& grads);

/// Checks sgd_update's pairs of parameter and gradient leaves: valid, float32, equal shapes.
void check_update_pairs(const std::vector<tensor>& params, const std::vector<tensor>& grads,
                        const char* what);

/// A nest of `value`'s structure with default-constructed leaves: what an in-place update packs
/// its leaves back into after letting go of `value` (so that its own handles do not make every
/// leaf look shared).
nest skeleton_of(const nest& value);

} // namespace consort::train::detail
