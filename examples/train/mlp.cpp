#include "mlp.hpp"
#include "mlp_checks.hpp"

#include <consort/error.hpp>

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <string>
#include <vector>

namespace consort::train {

namespace {

// -- deterministic arithmetic ---------------------------------------------------------------------

constexpr double pi = 3.14159265358979323846;

/// splitmix64 (Steele, Lea, Flood 2014): tiny, fast, and fully specified, so every standard
/// library produces the same stream (unlike `<random>` distributions).
class splitmix64 {
public:
  explicit splitmix64(uint64_t seed) : state_(seed) {}

  uint64_t next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }

  /// Uniform in [0, 1) with 53 random bits.
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }

  /// Uniform in [-limit, limit).
  double uniform(double limit) { return (2.0 * uniform() - 1.0) * limit; }

  /// Approximately standard normal: the Irwin-Hall sum of four uniforms, centred and scaled to
  /// unit variance. Needs no `log`/`cos`, whose last bit may differ between libm versions.
  double normal() {
    double sum = uniform() + uniform() + uniform() + uniform();
    return (sum - 2.0) * 1.7320508075688772; // sqrt(3): Var(sum) = 4/12.
  }

private:
  uint64_t state_;
};

/// sin(x) from +, *, / and floor only, which IEEE 754 rounds the same everywhere (libm's `sin`
/// need not). Reduces to [-pi/2, pi/2] and sums the Taylor series to degree 23 (error < 1e-16
/// there); ample for generating data.
double portable_sin(double x) {
  x -= 2.0 * pi * std::floor(x / (2.0 * pi) + 0.5); // now in [-pi, pi]
  if (x > pi / 2)
    x = pi - x;
  else if (x < -pi / 2)
    x = -pi - x;
  const double x2 = x * x;
  double term = x;
  double sum = x;
  for (int n = 1; n <= 11; ++n) {
    term *= -x2 / static_cast<double>((2 * n) * (2 * n + 1));
    sum += term;
  }
  return sum;
}

double portable_cos(double x) {
  return portable_sin(x + pi / 2);
}

} // namespace

namespace detail {

// -- validation -----------------------------------------------------------------------------------

namespace {

const tensor& param(const nest& params, const std::string& key, const char* what) {
  const auto& leaf = params.as_dict().at(key);
  if (!leaf.is_tensor() || !leaf.as_tensor().valid())
    throw_error(errc::structure_mismatch, std::string{what} + ": parameter \"" + key +
                                              "\" must be a tensor; got " +
                                              leaf.structure_string());
  const tensor& t = leaf.as_tensor();
  if (t.dtype() != dtype::float32)
    throw_error(errc::dtype_mismatch, std::string{what} + ": parameter \"" + key +
                                          "\" must be float32; got " + to_string(t.dtype()));
  return t;
}

} // namespace

mlp_shape checked_shape(const nest& params, const char* what) {
  // 2 (L + 1) keys: w1..w{L+1} and b1..b{L+1}.
  const std::string expected = "parameters must be a dict with exactly the keys w1..wN and "
                               "b1..bN for N >= 2 layers of weights (see init_params)";
  if (!params.is_dict())
    throw_error(errc::structure_mismatch,
                std::string{what} + ": " + expected + "; got " + params.structure_string());
  int weights = 0;
  for (const auto& [key, value] : params.as_dict())
    weights += key.rfind('w', 0) == 0 ? 1 : 0;
  for (int l = 1; l <= std::max(weights, 2); ++l)
    for (const auto& key : {weight_key(l), bias_key(l)})
      if (params.as_dict().count(key) == 0)
        throw_error(errc::structure_mismatch, std::string{what} + ": parameter \"" + key +
                                                  "\" is missing; " + expected + "; got " +
                                                  params.structure_string());
  if (params.size() != static_cast<size_t>(2 * weights))
    throw_error(errc::structure_mismatch, std::string{what} + ": unexpected keys; " + expected +
                                              "; got " + params.structure_string());
  std::string shapes;
  for (int l = 1; l <= weights; ++l)
    shapes += (l > 1 ? ", " : "") + weight_key(l) + " " +
              to_string(param(params, weight_key(l), what).shape()) + ", " + bias_key(l) + " " +
              to_string(param(params, bias_key(l), what).shape());
  int64_t fan_in = -1;
  for (int l = 1; l <= weights; ++l) {
    const tensor& w = param(params, weight_key(l), what);
    const tensor& b = param(params, bias_key(l), what);
    const bool agree = w.rank() == 2 && (fan_in < 0 || w.shape()[0] == fan_in) &&
                       b.shape() == shape_t{w.rank() == 2 ? w.shape()[1] : -1} &&
                       (l == 1 || l == weights || w.shape()[0] == w.shape()[1]) &&
                       w.shape()[0] >= 1 && w.shape()[1] >= 1;
    if (!agree)
      throw_error(errc::shape_mismatch,
                  std::string{what} +
                      ": parameter shapes do not agree; expected w1 [inputs, hidden], "
                      "w2..wL [hidden, hidden], w{L+1} [hidden, classes], each bl [columns of "
                      "wl], every extent >= 1; got " +
                      shapes);
    fan_in = w.shape()[1];
  }
  const tensor& first = params[weight_key(1)].as_tensor();
  return {static_cast<int>(first.shape()[0]), static_cast<int>(first.shape()[1]),
          static_cast<int>(fan_in), weights - 1};
}

namespace {

void check_features(const tensor& x, const mlp_shape& shape, const char* what) {
  if (!x.valid())
    throw_error(errc::invalid_argument, std::string{what} + ": x is a default-constructed tensor");
  if (x.dtype() != dtype::float32)
    throw_error(errc::dtype_mismatch,
                std::string{what} + ": x must be float32; got " + to_string(x.dtype()));
  if (x.rank() != 2 || x.shape()[1] != shape.inputs)
    throw_error(errc::shape_mismatch, std::string{what} + ": x must have shape [N, " +
                                          std::to_string(shape.inputs) + "] to match w1; got " +
                                          to_string(x.shape()));
}

} // namespace

void check_batch(const tensor& x, const tensor& y, const mlp_shape& shape, const char* what) {
  check_features(x, shape, what);
  if (!y.valid())
    throw_error(errc::invalid_argument, std::string{what} + ": y is a default-constructed tensor");
  if (y.dtype() != dtype::int32)
    throw_error(errc::dtype_mismatch,
                std::string{what} + ": y must be int32; got " + to_string(y.dtype()));
  const int64_t rows = x.shape()[0];
  if (y.shape() != shape_t{rows})
    throw_error(errc::shape_mismatch, std::string{what} + ": y must have shape [" +
                                          std::to_string(rows) + "] to match x " +
                                          to_string(x.shape()) + "; got " + to_string(y.shape()));
}

gradient_slot place_gradients(const gradient_slots_fn& slots, int layer, int64_t rows, int64_t cols,
                              const std::string& device, tensor& w, tensor& b, const char* what,
                              const char* memory) {
  if (slots) {
    gradient_slot slot = slots(layer);
    if (slot.w == nullptr || slot.b == nullptr)
      throw_error(errc::invalid_argument, std::string{what} + ": the gradient slot of layer " +
                                              std::to_string(layer) +
                                              " has a null pointer; expected " + memory + " for " +
                                              weight_key(layer) + " and " + bias_key(layer));
    return slot;
  }
  w = tensor::empty(dtype::float32, {rows, cols}, device);
  b = tensor::empty(dtype::float32, {cols}, device);
  return {w.mutable_data<float>(), b.mutable_data<float>()};
}

void check_update_pairs(const std::vector<tensor>& params, const std::vector<tensor>& grads,
                        const char* what) {
  for (size_t i = 0; i < params.size(); ++i) {
    const tensor& p = params[i];
    const tensor& g = grads[i];
    if (!p.valid() || !g.valid())
      throw_error(errc::invalid_argument, std::string{what} + ": leaf " + std::to_string(i) +
                                              " is a default-constructed tensor");
    if (p.dtype() != dtype::float32 || g.dtype() != dtype::float32)
      throw_error(errc::dtype_mismatch, std::string{what} + ": leaf " + std::to_string(i) +
                                            " must be float32 in both nests; got parameter " +
                                            to_string(p.dtype()) + ", gradient " +
                                            to_string(g.dtype()));
    if (p.shape() != g.shape())
      throw_error(errc::shape_mismatch, std::string{what} + ": leaf " + std::to_string(i) +
                                            " has parameter shape " + to_string(p.shape()) +
                                            " but gradient shape " + to_string(g.shape()));
  }
}

void hand_over(int layer, const tensor& w, const tensor& b, const gradient_slots_fn& slots,
               const layer_grads_fn& on_layer, nest::dict_type& grads) {
  if (!slots) {
    grads[weight_key(layer)] = w;
    grads[bias_key(layer)] = b;
  }
  if (on_layer)
    on_layer(layer, w, b);
}

nest skeleton_of(const nest& value) {
  return map_structure(value, [](const tensor&) { return tensor{}; });
}

} // namespace detail

using detail::check_features;
using detail::checked_shape;

namespace {

// -- float32 linear algebra ----------------------------------------------------------------------

using matrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using const_view = Eigen::Map<const matrix>;
using view = Eigen::Map<matrix>;

const_view view_of(const tensor& t) {
  return {t.data<float>(), t.shape()[0], t.rank() == 2 ? t.shape()[1] : 1};
}

const_view row_view_of(const tensor& b) {
  return {b.data<float>(), 1, b.shape()[0]};
}

/// The activations of a forward pass: acts[0] is x, acts[l] the output of hidden layer l, and
/// `logits` the output layer's.
struct forward_pass {
  std::vector<matrix> acts;
  matrix logits;
};

forward_pass run_forward(const nest& params, const mlp_shape& s, const tensor& x) {
  forward_pass f;
  f.acts.reserve(static_cast<size_t>(s.layers));
  const int64_t rows = x.shape()[0];
  const_view input = view_of(x);
  for (int l = 1; l <= s.layers + 1; ++l) {
    const_view w = view_of(params[weight_key(l)].as_tensor());
    const_view b = row_view_of(params[bias_key(l)].as_tensor());
    matrix out(rows, w.cols());
    if (l == 1)
      out.noalias() = input * w;
    else
      out.noalias() = f.acts.back() * w;
    out.rowwise() += b.row(0);
    if (l <= s.layers) {
      out = out.cwiseMax(0.0f);
      f.acts.push_back(std::move(out));
    } else {
      f.logits = std::move(out);
    }
  }
  return f;
}

/// Index of the highest logit of row `n`, the first one on ties.
int argmax(const matrix& logits, int64_t n) {
  int best = 0;
  for (int k = 1; k < logits.cols(); ++k)
    if (logits(n, k) > logits(n, best))
      best = k;
  return best;
}

tensor to_float32(const std::vector<double>& values, shape_t shape) {
  tensor out = tensor::empty(dtype::float32, std::move(shape));
  float* data = out.mutable_data<float>();
  for (size_t i = 0; i < values.size(); ++i)
    data[i] = static_cast<float>(values[i]);
  return out;
}

} // namespace

// -- synthetic data -------------------------------------------------------------------------------

dataset_tensors make_dataset(const synthetic_options& options) {
  if (options.examples < 0 || options.features < 2 || options.classes < 2)
    throw_error(errc::invalid_argument,
                "make_dataset: expected examples >= 0, features >= 2 and classes >= 2; got "
                "examples " +
                    std::to_string(options.examples) + ", features " +
                    std::to_string(options.features) + ", classes " +
                    std::to_string(options.classes));
  const auto rows = options.examples;
  const auto features = static_cast<size_t>(options.features);
  const auto classes = static_cast<uint64_t>(options.classes);
  splitmix64 rng(options.seed);

  // The embedding: feature f is a random direction (a[f][0], a[f][1]) of the warped latent plane.
  std::vector<double> embed(2 * features);
  for (auto& a : embed)
    a = rng.uniform(1.0);

  std::vector<float> x(static_cast<size_t>(rows) * features);
  std::vector<int32_t> y(static_cast<size_t>(rows));
  for (size_t n = 0; n < y.size(); ++n) {
    // Modulo bias is < classes / 2^64: irrelevant here.
    const auto label = static_cast<int32_t>(rng.next() % classes);
    // Position along the arm: radius grows from 0.3 to 1.3 while the angle turns by pi.
    const double t = rng.uniform();
    const double radius = 0.3 + t;
    const double angle = 2.0 * pi * label / static_cast<double>(classes) + pi * t;
    const double z0 = radius * portable_cos(angle) + 0.05 * rng.normal();
    const double z1 = radius * portable_sin(angle) + 0.05 * rng.normal();
    // A smooth nonlinear warp of the plane, so the class boundaries are not even spirals.
    const double w0 = z0 + 0.25 * portable_sin(2.0 * z1);
    const double w1 = z1 + 0.25 * portable_sin(2.0 * z0);
    for (size_t f = 0; f < features; ++f)
      x[n * features + f] =
          static_cast<float>(embed[2 * f] * w0 + embed[2 * f + 1] * w1 + 0.1 * rng.normal());
    y[n] = label;
  }
  return {tensor::from<float>(x, {rows, options.features}), tensor::from<int32_t>(y, {rows})};
}

// -- the model ------------------------------------------------------------------------------------

std::string weight_key(int layer) {
  // Appended, not `"w" + to_string(...)`, which trips GCC 12's -Wrestrict false positive.
  std::string key{"w"};
  key += std::to_string(layer);
  return key;
}

std::string bias_key(int layer) {
  std::string key{"b"};
  key += std::to_string(layer);
  return key;
}

nest init_params(const mlp_shape& shape, uint64_t seed) {
  if (shape.inputs < 1 || shape.hidden < 1 || shape.classes < 1 || shape.layers < 1)
    throw_error(errc::invalid_argument,
                "init_params: every layer needs at least one unit and there must be at least one "
                "hidden layer; got inputs " +
                    std::to_string(shape.inputs) + ", hidden " + std::to_string(shape.hidden) +
                    ", classes " + std::to_string(shape.classes) + ", layers " +
                    std::to_string(shape.layers));
  splitmix64 rng(seed);
  auto uniform = [&](int64_t rows, int64_t cols, double limit) {
    std::vector<double> values(static_cast<size_t>(rows * cols));
    for (auto& v : values)
      v = rng.uniform(limit);
    return to_float32(values, {rows, cols});
  };
  nest::dict_type params;
  for (int l = 1; l <= shape.layers + 1; ++l) {
    const int64_t fan_in = l == 1 ? shape.inputs : shape.hidden;
    const int64_t fan_out = l <= shape.layers ? shape.hidden : shape.classes;
    // He-uniform suits the hidden layers (a ReLU follows), Glorot-uniform the output (softmax).
    const double limit = l <= shape.layers ? std::sqrt(6.0 / static_cast<double>(fan_in))
                                           : std::sqrt(6.0 / static_cast<double>(fan_in + fan_out));
    params[weight_key(l)] = uniform(fan_in, fan_out, limit);
    params[bias_key(l)] = tensor::zeros(dtype::float32, {fan_out});
  }
  return nest::dict(std::move(params));
}

mlp_shape shape_of(const nest& params) {
  return checked_shape(params, "shape_of");
}

loss_and_grads forward_backward(const nest& params, const tensor& x, const tensor& y,
                                const layer_grads_fn& on_layer, const gradient_slots_fn& slots) {
  const char* what = "forward_backward";
  const mlp_shape s = checked_shape(params, what);
  detail::check_batch(x, y, s, what);
  const int64_t rows = x.shape()[0];
  const int32_t* labels = y.data<int32_t>();
  for (int64_t n = 0; n < rows; ++n)
    if (labels[n] < 0 || labels[n] >= s.classes)
      throw_error(errc::invalid_argument,
                  std::string{what} + ": label " + std::to_string(labels[n]) + " of row " +
                      std::to_string(n) + " is outside [0, " + std::to_string(s.classes) + ")");

  forward_pass f = run_forward(params, s, x);

  // The loss and d loss / d logits = softmax(logits) - one_hot(label), per row in float64.
  // Stable log-sum-exp: shifting by the largest logit keeps every exp() in (0, 1].
  matrix delta(rows, s.classes);
  std::vector<double> losses(static_cast<size_t>(rows));
  double loss_sum = 0.0;
  double correct = 0.0;
  for (int64_t n = 0; n < rows; ++n) {
    const int label = labels[n];
    const int top_index = argmax(f.logits, n);
    if (top_index == label)
      correct += 1.0;
    const double top = f.logits(n, top_index);
    double exp_sum = 0.0;
    for (int k = 0; k < s.classes; ++k)
      exp_sum += std::exp(static_cast<double>(f.logits(n, k)) - top);
    const double log_sum_exp = top + std::log(exp_sum);
    losses[static_cast<size_t>(n)] = log_sum_exp - f.logits(n, label);
    loss_sum += losses[static_cast<size_t>(n)];
    for (int k = 0; k < s.classes; ++k)
      delta(n, k) = static_cast<float>(std::exp(f.logits(n, k) - log_sum_exp) - (k == label));
  }

  // Backward, from the output layer down: the weight gradient is (layer input)^T · delta, the
  // bias gradient the column sums of delta; delta moves through w and the ReLU (gradient 0 where
  // the unit was not active, i.e. its output is 0).
  nest::dict_type grads;
  const_view input = view_of(x);
  for (int l = s.layers + 1; l >= 1; --l) {
    const_view w = view_of(params[weight_key(l)].as_tensor());
    // The GEMMs write straight into the gradient tensors, or into the caller's slots.
    tensor gw;
    tensor gb;
    const gradient_slot slot =
        detail::place_gradients(slots, l, w.rows(), w.cols(), "CPU:0", gw, gb, what, "memory");
    view w_grad(slot.w, w.rows(), w.cols());
    view b_grad(slot.b, 1, w.cols());
    if (l == 1)
      w_grad.noalias() = input.transpose() * delta;
    else
      w_grad.noalias() = f.acts[static_cast<size_t>(l - 2)].transpose() * delta;
    if (rows == 0)
      b_grad.setZero();
    else
      b_grad.noalias() = delta.colwise().sum();
    detail::hand_over(l, gw, gb, slots, on_layer, grads);
    if (l > 1) {
      const matrix& below = f.acts[static_cast<size_t>(l - 2)];
      matrix next(rows, w.rows());
      next.noalias() = delta * w.transpose();
      delta = next.cwiseProduct((below.array() > 0.0f).cast<float>().matrix());
    }
  }

  loss_and_grads out;
  out.loss_sum = tensor::scalar(static_cast<float>(loss_sum));
  out.correct = tensor::scalar(static_cast<float>(correct));
  out.per_example_loss = to_float32(losses, {rows});
  out.grads = nest::dict(std::move(grads));
  return out;
}

tensor predict(const nest& params, const tensor& x) {
  const char* what = "predict";
  const mlp_shape s = checked_shape(params, what);
  check_features(x, s, what);
  const int64_t rows = x.shape()[0];
  forward_pass f = run_forward(params, s, x);
  tensor out = tensor::zeros(dtype::int32, {rows});
  int32_t* predictions = out.mutable_data<int32_t>();
  for (int64_t n = 0; n < rows; ++n)
    predictions[n] = argmax(f.logits, n);
  return out;
}

void sgd_update(nest& params, const nest& grad_sums, double learning_rate, int64_t global_batch) {
  if (global_batch < 1)
    throw_error(errc::invalid_argument,
                "sgd_update: global_batch must be >= 1 (the number of examples the gradient sums "
                "cover); got " +
                    std::to_string(global_batch));
  assert_same_structure(params, grad_sums);
  auto leaves = flatten(params);
  const auto grads = flatten(grad_sums);
  // Every leaf is checked before any changes, so a bad pair leaves `params` as it was.
  detail::check_update_pairs(leaves, grads, "sgd_update");
  // The leaves are the only holders of their storage once `params` lets go of it, so the update
  // is in place; a leaf that someone else also holds (a snapshot, a replica's copy) is copied
  // first by mutable_data, so the holder keeps its values. (With `params` still holding them,
  // flatten's handles alone would make every leaf look shared and copy the whole model.)
  const nest structure = detail::skeleton_of(params);
  params = nest{};
  const double scale = learning_rate / static_cast<double>(global_batch);
  for (size_t i = 0; i < leaves.size(); ++i) {
    const float* gd = grads[i].data<float>();
    float* pd = leaves[i].mutable_data<float>();
    const int64_t n = leaves[i].num_elements();
    for (int64_t e = 0; e < n; ++e)
      pd[e] = static_cast<float>(pd[e] - scale * gd[e]);
  }
  params = pack_as(structure, leaves);
}

} // namespace consort::train
